"""The model's forward pass in plain torch: the engine's fast path on machines without a GPU.

Under Triton's interpreter every kernel runs element by element in numpy (seconds per token even for a tiny model);
here each matrix is dequantized once to float64 and every step is a handful of torch ops, so the engine, and anything
built on it, runs in milliseconds per token on small models. The arithmetic follows the kernels' roundings (results
in the activation dtype) and attention is the reference of ``llmkernels.testing``, so logits agree with the kernel
path to the activation dtype's tolerance. Products and attention run in float64 so that a sequence's results do not
depend on what shares its batch: a float32 product's rounding changes with the number of rows, which flips greedy
near-ties between a request served alone and the same request among others. Select it with ``LLM(..., backend="torch")``
(the default on the CPU); the kernel path stays the reference on GPUs and for kernel tests.
"""
from __future__ import annotations

import torch

from ..kv_cache import FP8_DTYPES
from ..qgemv.moe import moe_route
from ..quant.tensor import dequantize
from ..testing.attention import paged_attention_ref
from .config import OSS_ALPHA, OSS_LIMIT
from .model import Model, StepInputs
from .tp import local_pairs


class TorchModel(Model):
    """``Model`` with a pure-torch forward (same weights, caches and inputs)."""

    backend = "torch"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._dense: dict = {}

    def matrices_changed(self):
        super().matrices_changed()
        self._dense.clear()  # keyed by id: a new matrix may take a freed one's id

    def _w(self, qt) -> torch.Tensor:
        """float64 [N, K] of a stored matrix, dequantized on first use."""
        w = self._dense.get(id(qt))
        if w is None:
            w = self._dense[id(qt)] = dequantize(qt, torch.float64)
        return w

    def _linear(self, x: torch.Tensor, mats: list, reduce: bool = False) -> torch.Tensor:
        """x @ W.T in float64, rounded to the activation dtype; ``reduce``: a row-parallel product, summed over the
        tensor-parallel ranks before the rounding."""
        y = torch.cat([(x.double() @ self._w(m).T) for m in mats], dim=1)
        return (self._reduce(y) if reduce else y).to(self.dtype)

    def _rmsnorm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_eps)).to(self.dtype).float() * w
        return y.to(self.dtype)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, which: int = 0) -> torch.Tensor:
        """Rotate float32 heads x [T, H, D] by their positions (interleaved pairs or neox halves) with RoPE table
        ``which`` (Layer.rope)."""
        D = x.shape[-1]
        inv_freq, mscale = self.ropes[which]
        ang = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, D/2]
        cos, sin = (torch.cos(ang) * mscale)[:, None, :], (torch.sin(ang) * mscale)[:, None, :]
        if self.cfg.rope_style == "neox":
            a, b = x[..., :D // 2], x[..., D // 2:]
            return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)

    def _qk_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_eps)).to(self.dtype).float() * w
        return y.to(self.dtype).float()

    def _moe(self, x: torch.Tensor, layer) -> torch.Tensor:
        """The mixture-of-experts FFN with the kernel path's roundings: silu(g) * u and each expert's output in
        the activation dtype, products and the weighted sum in float64."""
        router, gate, up, down = layer.moe
        logits = self._linear(x, [router])
        if layer.moe_bias is not None:
            logits = (logits.double() + layer.moe_bias[0].double()).to(self.dtype)
        w, e = moe_route(logits, self.cfg.n_experts_used, self.cfg.expert_norm)
        if self.tp is not None:  # this rank's experts (tp.local_pairs); the sum over ranks before the rounding
            w, e = local_pairs(w, e, *self.tp.experts)
        G, U, D = (self._w(m).reshape(self.local_experts, -1, m.shape[-1]) for m in (gate, up, down))
        xf, out = x.double(), torch.zeros(x.shape[0], D.shape[1], dtype=torch.float64, device=x.device)
        bias = layer.moe_bias
        for ex in e.unique().tolist():
            t, j = (e == ex).nonzero(as_tuple=True)
            g, u = xf[t] @ G[ex].T, xf[t] @ U[ex].T
            if bias is None:
                a = (torch.nn.functional.silu(g) * u).to(self.dtype).double()
                y = (a @ D[ex].T).to(self.dtype).double()
            else:  # gpt-oss: biases and the clamped SwiGLU (kernels.swiglu_oai)
                g = (g.to(self.dtype).double() + bias[1][ex].double()).clamp(max=OSS_LIMIT)
                u = (u.to(self.dtype).double() + bias[2][ex].double()).clamp(-OSS_LIMIT, OSS_LIMIT)
                a = ((u + 1) * g * torch.sigmoid(OSS_ALPHA * g)).to(self.dtype).double()
                y = ((a @ D[ex].T).to(self.dtype).double() + bias[3][ex].double()).to(self.dtype).double()
            out.index_add_(0, t, y * w[t, j, None].double())
        return self._reduce(out).to(self.dtype)

    def _store(self, cache: torch.Tensor, slots: torch.Tensor, vals: torch.Tensor, scale: float) -> None:
        keep = slots >= 0
        flat = cache.view(-1, *cache.shape[2:])
        if cache.dtype in FP8_DTYPES:
            top = torch.finfo(cache.dtype).max
            flat[slots[keep]] = (vals[keep] / scale).clamp(-top, top).to(cache.dtype)
        else:
            flat[slots[keep]] = vals[keep].to(self.dtype).to(cache.dtype)

    def forward(self, inp: StepInputs, k_caches, v_caches, plan, *, kv_scales=(1.0, 1.0),
                act_int8: bool = False) -> torch.Tensor:
        if act_int8:
            raise ValueError("act_int8=True needs the kernels (backend='triton'); the torch backend computes exactly")
        cfg = self.cfg
        T, Hq, Hkv, D = inp.ids.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        if self.tp is None:
            h = self._w(self.tok_embd)[inp.ids.long()].to(self.dtype)
        else:
            local, valid = self._local_ids(inp.ids)
            h = self._reduce(self._w(self.tok_embd)[local.long()] * valid.float()[:, None]).to(self.dtype)
        if cfg.embed_scale != 1.0:
            h = h * torch.tensor(cfg.embed_scale, dtype=h.dtype)
        for li, layer in enumerate(self.layers):
            qkv = self._linear(self._rmsnorm(h, layer.attn_norm), layer.qkv).float()
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            q = qkv[:, :Hq * D].view(T, Hq, D)
            k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
            v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
            if layer.q_norm is not None:
                q, k = self._qk_norm(q, layer.q_norm), self._qk_norm(k, layer.k_norm)
            q, k = self._rope(q, inp.positions, layer.rope), self._rope(k, inp.positions, layer.rope)
            self._store(k_caches[li], inp.slots, k, kv_scales[0])
            self._store(v_caches[li], inp.slots, v, kv_scales[1])
            fp8 = k_caches[li].dtype in FP8_DTYPES
            o, _ = paged_attention_ref(q.to(self.dtype), k_caches[li], v_caches[li], inp.page_table, inp.seq_lens,
                                       inp.cu_seqlens_q, softmax_scale=cfg.attn_scale or None,
                                       window_size=(layer.window, -1), softcap=cfg.attn_softcap, sinks=layer.sinks,
                                       k_scale=kv_scales[0] if fp8 else None, v_scale=kv_scales[1] if fp8 else None,
                                       dtype=torch.float64)
            delta = self._linear(o.to(self.dtype).reshape(T, Hq * D), [layer.wo], reduce=True)
            if layer.o_bias is not None:
                delta = (delta.double() + layer.o_bias.double()).to(self.dtype)
            if layer.post_attn_norm is not None:
                delta = self._rmsnorm(delta, layer.post_attn_norm)
            h = (h + delta).to(self.dtype)
            if layer.moe is not None:
                delta = self._moe(self._rmsnorm(h, layer.ffn_norm), layer)
            else:
                gu = self._linear(self._rmsnorm(h, layer.ffn_norm), layer.gate_up).float()
                F = gu.shape[1] // 2
                g = gu[:, :F]
                g = (torch.nn.functional.silu(g) if cfg.act == "silu" else
                     torch.nn.functional.gelu(g, approximate="tanh"))
                delta = self._linear((g * gu[:, F:]).to(self.dtype), [layer.down], reduce=True)
            if layer.post_ffn_norm is not None:
                delta = self._rmsnorm(delta, layer.post_ffn_norm)
            h = (h + delta).to(self.dtype)
        if inp.logits_idx.numel() == 0:
            return torch.empty(0, cfg.vocab_size, dtype=torch.float32, device=h.device)
        x = self._rmsnorm(h.index_select(0, inp.logits_idx), self.output_norm)
        return self._softcap(self._gather_logits(self._linear(x, [self.output]).float()))
