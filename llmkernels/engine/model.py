"""The decoder of every family the engine runs (llama, mistral, qwen2/3, phi3, gemma2/3, MoE, gpt-oss) on
llmkernels' kernels.

Weights stay in their stored formats (GGUF blocks or MLX words) and are read by the quantized GEMV kernels; Q/K/V
rows are stacked into one matrix, and gate/up into another, when they share a format, so each layer makes one pass
per projection group. One forward call runs any mix of prefill chunks and decode tokens: every token's K/V goes into
the paged cache first, then ``paged_attention`` reads the cache, so chunked prefill and decode share one code path.
"""
from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import torch

from .._runtime import empty
from ..attention.paged import paged_attention
from ..qgemv.moe import moe_combine, moe_ffn, moe_pairs, moe_route, pair_groups
from ..qgemv.ops import embedding, route_table, run_route, table_route, tc_padding
from ..qgemv.tc import ROW_STRIDE_FORMATS
from ..quant.tensor import QuantizedTensor, cat_rows, dequantize, pad_k, pad_rows
from .allreduce import AllReduce
from .config import ModelConfig, ModelConfigError, rope_inv_freq
from .kernels import add_rmsnorm, rope_store, silu_mul, swiglu_oai
from .tp import local_pairs


@dataclasses.dataclass
class StepInputs:
    """One forward step's token batch, on the model's device.

    ids, positions: int32 [T]; slots: int64 [T] (cache slot of each token, -1 = don't store); page_table: int32
    [B, P]; seq_lens: int32 [B] (kv length after this step); cu_seqlens_q: int32 [B+1]; max_q: host int;
    logits_idx: int64 [S] (rows of T whose next-token logits are wanted).
    """
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_q: int
    logits_idx: torch.Tensor


@dataclasses.dataclass
class Layer:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    qkv: list  # q, k, v with neighbours of one format stacked: [qkv], or [qk, v] (a Q4_K_M file's q6_k attn_v), ...
    wo: QuantizedTensor
    gate_up: list  # [gate and up stacked], or [gate, up] when their formats differ (empty with experts)
    down: QuantizedTensor | None
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # gemma: RMSNorm of the attention output before the residual add
    post_ffn_norm: torch.Tensor | None = None  # gemma: the same for the FFN output
    moe: tuple | None = None  # (router [E, H], gate [E, F, H], up [E, F, H], down [E, H, F]) in place of gate_up/down
    moe_bias: tuple | None = None  # gpt-oss: float32 (router [E], gate [E, F], up [E, F], down [E, H]) biases
    o_bias: torch.Tensor | None = None  # gpt-oss: the attention output projection's bias
    sinks: torch.Tensor | None = None  # gpt-oss: float32 [heads], each head's sink logit
    window: int = -1  # left edge of the sliding window (-1: the whole context)
    rope: int = 0  # which RoPE table: 0 the model's, 1 the sliding-window layers' (gemma3)


class _Pairs(NamedTuple):
    """A mixture-of-experts FFN's output before its weighted sum: the pairs' products y [T * top_k, H] and their
    weights w float32 [T, top_k] (qgemv.moe.moe_ffn with combine=False); gpt-oss: the experts' down biases [E, H]
    and each pair's expert [T * top_k], added to the products as the sum loads them."""
    y: torch.Tensor
    w: torch.Tensor
    bias: torch.Tensor | None = None
    ids: torch.Tensor | None = None

    def combined(self) -> torch.Tensor:
        """The weighted sum [T, H] by a launch of its own."""
        y = self.y
        if self.bias is not None:
            y = (y.float() + self.bias.index_select(0, self.ids)).to(y.dtype)
        return moe_combine(y, self.w)


def stack_runs(qts: list) -> list:
    """qts with each run of neighbours of one format stacked (cat_rows): one GEMV launch per run."""
    out = [qts[0]]
    for q in qts[1:]:
        both = cat_rows([out[-1], q])
        if both is None:
            out.append(q)
        else:
            out[-1] = both
    return out


def _vector(qt, device) -> torch.Tensor:
    if isinstance(qt, QuantizedTensor):
        return dequantize(qt.to(device), torch.float32).reshape(-1)
    return qt.to(device=device, dtype=torch.float32).reshape(-1)


def ffn_norm_name(cfg: ModelConfig) -> str:
    """The FFN's RMSNorm weight under blk.N. (gpt-oss files name it post_attention_norm, as llama.cpp does)."""
    return "post_attention_norm.weight" if cfg.arch == "gpt-oss" else "ffn_norm.weight"


def expect_shapes(cfg: ModelConfig, tensors, vocab_rows: int | None = None, experts: int | None = None) -> None:
    """ModelConfigError naming the first tensor ``cfg`` needs that ``tensors`` lacks or holds in another shape;
    ``vocab_rows``: the rows of the embedding and output matrices, ``experts``: the experts of each MoE stack, when
    they are a tensor-parallel shard's."""
    H, D = cfg.hidden, cfg.head_dim
    V = vocab_rows or cfg.vocab_size
    want = {"token_embd.weight": (V, H), "output_norm.weight": (H,)}
    if "output.weight" in tensors:
        want["output.weight"] = (V, H)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        want.update({p + "attn_norm.weight": (H,), p + ffn_norm_name(cfg): (H,),
                     p + "attn_output.weight": (H, cfg.n_heads * D)})
        if cfg.n_experts:
            E, F = experts or cfg.n_experts, cfg.expert_ffn
            want.update({p + "ffn_gate_inp.weight": (cfg.n_experts, H), p + "ffn_gate_exps.weight": (E, F, H),
                         p + "ffn_up_exps.weight": (E, F, H), p + "ffn_down_exps.weight": (E, H, F)})
            if cfg.moe_bias:
                want.update({p + "ffn_gate_inp.bias": (cfg.n_experts,), p + "ffn_gate_exps.bias": (E, F),
                             p + "ffn_up_exps.bias": (E, F), p + "ffn_down_exps.bias": (E, H)})
        else:
            want[p + "ffn_down.weight"] = (H, cfg.ffn)
        if cfg.o_bias:
            want[p + "attn_output.bias"] = (H,)
        if cfg.attn_sinks:
            want[p + "attn_sinks.weight"] = (cfg.n_heads,)
        if cfg.fused:
            want.update({p + "attn_qkv.weight": ((cfg.n_heads + 2 * cfg.n_kv_heads) * D, H),
                         p + "ffn_up.weight": (2 * cfg.ffn, H)})
        else:
            want.update({p + "attn_q.weight": (cfg.n_heads * D, H), p + "attn_k.weight": (cfg.n_kv_heads * D, H),
                         p + "attn_v.weight": (cfg.n_kv_heads * D, H)})
            if not cfg.n_experts:
                want.update({p + "ffn_gate.weight": (cfg.ffn, H), p + "ffn_up.weight": (cfg.ffn, H)})
        if cfg.post_norms:
            want.update({p + "post_attention_norm.weight": (H,), p + "post_ffw_norm.weight": (H,)})
        if cfg.qkv_bias:
            want.update({p + "attn_q.bias": (cfg.n_heads * D,), p + "attn_k.bias": (cfg.n_kv_heads * D,),
                         p + "attn_v.bias": (cfg.n_kv_heads * D,)})
        if cfg.qk_norm:
            want.update({p + "attn_q_norm.weight": (D,), p + "attn_k_norm.weight": (D,)})
    missing = [n for n in want if n not in tensors]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelConfigError(f"the model file lacks tensor(s) {', '.join(missing[:5])}{more} needed for a "
                               f"{cfg.arch} model with {cfg.n_layers} layers")
    for n, shape in want.items():
        got = tuple(tensors[n].shape)
        if got != shape and not (len(shape) == 1 and got in ((shape[0], 1), (1, shape[0]))):
            raise ModelConfigError(f"tensor {n!r} has shape {got}, the metadata implies {shape}")


class Model:
    """Weights on the device plus the forward pass. Build with ``Model(cfg, tensors, device, dtype)``.

    ``tensors`` maps GGUF tensor names (``token_embd.weight``, ``blk.{i}.attn_q.weight``, ...) to QuantizedTensors
    (anywhere; they are moved to ``device`` once) or, for norms and biases, float tensors.
    """

    backend = "triton"  # the forward runs llmkernels' kernels (torch_model.TorchModel: plain torch)

    def __init__(self, cfg: ModelConfig, tensors: dict, device, dtype=torch.bfloat16, progress=None, tp=None):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        # tp.TPShard: this rank's part of the model; ``tensors`` and ``cfg`` are then its shard's (build.load_model)
        self.tp = tp if tp is not None and tp.active else None
        self._expect_shapes(tensors, vocab_rows=self.tp.vocab_per_rank if self.tp is not None else None,
                            experts=self.local_experts)
        D, Hq, Hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        it = progress if progress is not None else (lambda x, **k: x)
        self.weight_bytes = 0

        def mat(name):
            qt = tensors[name]
            if not isinstance(qt, QuantizedTensor):
                raise ModelConfigError(f"tensor {name!r} must be a QuantizedTensor, got {type(qt).__name__}")
            return qt.to(self.device)

        self.tok_embd = mat("token_embd.weight")
        self.output = mat("output.weight") if "output.weight" in tensors else self.tok_embd
        self.output_norm = _vector(tensors["output_norm.weight"], self.device)
        self.layers = []
        for i in it(range(cfg.n_layers), desc="loading layers", unit="layer"):
            p = f"blk.{i}."
            moe, down = None, None
            if cfg.fused:  # stored stacked already: [q; k; v] and [gate; up]
                qkv, gate_up = [mat(p + "attn_qkv.weight")], [mat(p + "ffn_up.weight")]
            else:
                qkv = stack_runs([mat(p + n + ".weight") for n in ("attn_q", "attn_k", "attn_v")])
                gate_up = [] if cfg.n_experts else stack_runs([mat(p + "ffn_gate.weight"), mat(p + "ffn_up.weight")])
            if cfg.n_experts:
                moe = tuple(mat(p + n + ".weight") for n in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
                                                             "ffn_down_exps"))
            else:
                down = mat(p + "ffn_down.weight")
            layer = Layer(attn_norm=_vector(tensors[p + "attn_norm.weight"], self.device),
                          ffn_norm=_vector(tensors[p + ffn_norm_name(cfg)], self.device), qkv=qkv,
                          wo=mat(p + "attn_output.weight"), gate_up=gate_up, down=down, moe=moe,
                          window=cfg.window(i), rope=int(bool(cfg.rope_theta_swa and cfg.window(i) >= 0)))
            if cfg.post_norms:
                layer.post_attn_norm = _vector(tensors[p + "post_attention_norm.weight"], self.device)
                layer.post_ffn_norm = _vector(tensors[p + "post_ffw_norm.weight"], self.device)
            if cfg.qkv_bias:
                layer.qkv_bias = torch.cat([_vector(tensors[p + n + ".bias"], self.device)
                                            for n in ("attn_q", "attn_k", "attn_v")])
            if cfg.qk_norm:
                layer.q_norm = _vector(tensors[p + "attn_q_norm.weight"], self.device)
                layer.k_norm = _vector(tensors[p + "attn_k_norm.weight"], self.device)
            if cfg.o_bias:
                layer.o_bias = _vector(tensors[p + "attn_output.bias"], self.device)
            if cfg.attn_sinks:
                layer.sinks = _vector(tensors[p + "attn_sinks.weight"], self.device)
            if cfg.moe_bias:
                E = self.local_experts
                stacks = [_vector(tensors[p + n + ".bias"], self.device).reshape(E, -1)
                          for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
                layer.moe_bias = (_vector(tensors[p + "ffn_gate_inp.bias"], self.device), *stacks)
            self.layers.append(layer)
        freqs = tensors.get("rope_freqs.weight")
        if isinstance(freqs, QuantizedTensor):
            freqs = dequantize(freqs)
        inv, self.rope_mscale = rope_inv_freq(cfg, freqs)
        self.inv_freq = inv.to(self.device)
        self.ropes = [(self.inv_freq, self.rope_mscale)]  # per Layer.rope: (inverse frequencies, cos/sin factor)
        if cfg.rope_theta_swa:  # gemma3's sliding-window layers: their own base, no scaling
            local = dataclasses.replace(cfg, rope_theta=cfg.rope_theta_swa, rope_scaling="none", rope_factor=1.0)
            inv_l, m_l = rope_inv_freq(local, None)
            self.ropes.append((inv_l.to(self.device), m_l))
        self.weight_bytes = self._stored_bytes()  # as stored in the file: the bandwidth bound counts these bytes
        self._stack_bytes = sum(m.nbytes for L in self.layers for m in L.moe[1:]) if cfg.n_experts else 0
        self._embed_row_bytes = self.tok_embd.nbytes // cfg.vocab_size
        self.output_pad = self._pad_output()
        self.padded = self._pad_layers()
        self._zero_tail = None  # (x, its zero-padded buffer) from the last _norm, for _gemv
        self.qkv_width = (Hq + 2 * Hkv) * D
        self.bind_routes()

    def _pad_output(self) -> int:
        """Zero blocks appended to the output matrix's rows where that lets batch-1 logits take the tensor-core
        kernel (q6_k rows are 16-byte aligned only for K a multiple of 2048: Gemma 2 and Qwen2's K = 3584 are not;
        the plain kernel reads them at a fraction of the bandwidth, bench/NOTES.md). A tied embedding shares the padded
        matrix. Returns the columns added."""
        out = self.output
        if self.backend != "triton" or out.gguf is None or len(out.shape) != 2:  # TorchModel reads it as stored
            return 0
        Kp = tc_padding(out, self.dtype)
        if Kp is None:
            return 0
        padded = pad_k(out, Kp)
        if self.tok_embd is out:
            self.tok_embd = padded
        self.output = padded
        return Kp - out.shape[1]

    def _pad_layers(self) -> dict:
        """The layers' matrices that ops.tc_padding pads (q6_k rows that are not 16-byte aligned: a Q4_K_M file's V
        and down where K is not a multiple of 2048, as Gemma 2's V, Qwen2-7B's down and a tensor-parallel rank's
        down), padded at load with zero blocks; _gemv pads their x to match. Returns {id of a padded matrix: its K
        as stored}."""
        padded = {}
        if self.backend != "triton":
            return padded

        def pad(m):
            if m is None or m.gguf is None or len(m.shape) != 2:
                return m
            Kp = tc_padding(m, self.dtype)
            if Kp is None:
                return m
            p = pad_k(m, Kp)
            padded[id(p)] = m.shape[1]
            return p

        for L in self.layers:
            L.qkv, L.gate_up = [pad(m) for m in L.qkv], [pad(m) for m in L.gate_up]
            L.wo, L.down = pad(L.wo), pad(L.down)
            if L.moe is not None:  # q6_k, iq4_nl, iq4_xs and mxfp4 expert stacks (Qwen3-MoE's q6_k downs, K = 768;
                # gpt-oss's mxfp4, K = 2880): rows padded to 16 bytes for the tensor cores (1.6% and 0.4% more
                # there); the MoE kernels read rows by their stride
                L.moe = L.moe[:1] + tuple(pad_rows(m) if m.format in ROW_STRIDE_FORMATS else m for m in L.moe[1:])
        return padded

    def bind_routes(self):
        """Choose every projection's GEMV route once (qgemv.route, for each M and both act_int8 settings); forward
        only looks them up. Called at load; call it again inside ``route.override`` to try other routes."""
        tables = {}  # matrices of one format, shape and memory facts share a table
        self._routes = {}
        mats = [self.output] + [m for L in self.layers for m in (*L.qkv, L.wo, *L.gate_up, L.down)
                                if m is not None]
        mats += [L.moe[0] for L in self.layers if L.moe is not None]  # the routers; experts route per call (moe.py)
        for m in mats:
            key = (m.format, tuple(m.shape), m.bits, m.group_size, m.data.data_ptr() % 16 == 0,
                   m.data.is_contiguous())
            if key not in tables:
                tables[key] = route_table(m, self.dtype)
            self._routes[id(m)] = tables[key]

    def matrices_changed(self):
        """Call after replacing matrices in place of others (``megakernel.weights.share_stacks``): what was chosen
        or cached per matrix object is chosen again."""
        self.bind_routes()

    def _expect_shapes(self, tensors, vocab_rows: int | None = None, experts: int | None = None):
        expect_shapes(self.cfg, tensors, vocab_rows, experts)

    @property
    def local_experts(self) -> int:
        """The experts of each MoE stack this model holds: all of them, or a tensor-parallel rank's share."""
        if self.tp is not None and self.cfg.n_experts:
            return self.tp.experts[1] - self.tp.experts[0]
        return self.cfg.n_experts


    def _stored_bytes(self) -> int:
        seen, total = set(), 0
        mats = [self.tok_embd, self.output] + [m for L in self.layers
                                               for m in (*L.qkv, L.wo, *L.gate_up, L.down, *(L.moe or ()))
                                               if m is not None]
        for m in mats:
            if id(m) not in seen:
                seen.add(id(m))
                total += m.nbytes
        return total

    def decode_bytes_per_token(self) -> int:
        """Weight bytes one decode step must read: every matrix once, plus one embedding row."""
        per_row = self._embed_row_bytes
        emb_full = self.tok_embd.nbytes if self.output is not self.tok_embd else 0
        idle = 0  # experts one token does not choose
        if self.cfg.n_experts:
            stacks = self._stack_bytes
            idle = stacks * (self.cfg.n_experts - self.cfg.n_experts_used) // self.cfg.n_experts
        return self.weight_bytes - emb_full + per_row - idle

    # --- forward --------------------------------------------------------------------------------------------------
    def _route(self, m, op: str, T: int, i8: bool):
        return table_route(self._routes[id(m)], op, T, i8)

    def _lanes(self, T: int, i8: bool, *mats) -> bool:
        """Whether the kernel producing these matrices' input should also write it in lane order: their routes read
        x in lane order (q4_k at batch 1, qgemv.m1.lane_pos)."""
        return all(self._route(m, "lanes", T, i8).kernel == "lanes" for m in mats)

    def _i8(self, T: int, i8: bool, *mats) -> bool:
        """Whether the RMSNorm producing these matrices' input should also round it to int8 in i8 lane order: their
        routes with act_int8 are the int8 lane kernels. LLMK_I8NORM=0 turns the fusion off (then the GEMV rounds x
        in a launch of its own; for A/B runs)."""
        if not i8 or os.environ.get("LLMK_I8NORM", "1") == "0":
            return False
        return all(self._route(m, "gemv", T, True).kernel == "i8_lanes" for m in mats)

    def _gemv(self, x, xl, m, i8: bool):
        """x @ m^T by m's route; ``xl``: x in lane order, or (q, ds) of x rounded to int8 in i8 lane order."""
        if id(m) in self.padded:  # padded along K at load (_pad_layers): x with zero columns to match
            z = self._zero_tail
            if z is not None and z[0] is x and z[1].shape[1] == m.shape[1]:
                x, xl = z[1], None  # _norm wrote x into a buffer of that width with zeros past H
            else:
                x, xl = torch.nn.functional.pad(x, (0, m.shape[1] - x.shape[1])), None
        op = "lanes" if xl is not None and not isinstance(xl, tuple) else "gemv"
        return run_route(self._route(m, op, x.shape[0], i8), op, x, m, xl)

    def _norm(self, T, i8, mats, x, *args, **kw):
        """add_rmsnorm, -> (x, x in lane order, or (q, ds) of x rounded to int8 in i8 lane order, or None). x may be
        a mixture-of-experts FFN's _Pairs, which the norm's kernel sums."""
        if isinstance(x, _Pairs):
            x, kw = x.y, dict(kw, x_weights=x.w, x_bias=x.bias, x_bias_ids=x.ids)
        if kw.get("peers") is not None and not kw["peers"].fits(x):  # shapes alike on every rank: all take this
            x, kw = self._reduce(x), dict(kw, peers=None)
        args = (x, *args)
        if self._i8(T, i8, *mats):
            return add_rmsnorm(*args, **kw, i8=True)
        # a matrix padded along K among them (a q6_k V): the norm writes x into a buffer that wide, zeros past H,
        # which _gemv hands to that matrix (two launches fewer than padding x there)
        wide = max((m.shape[1] for m in mats if id(m) in self.padded), default=0)
        if wide:
            kw = dict(kw, out=empty(T, wide, dtype=x.dtype, device=x.device))
        if self._lanes(T, i8, *mats):
            y, yl = add_rmsnorm(*args, **kw, lanes=True)
        else:
            y, yl = add_rmsnorm(*args, **kw), None
        self._zero_tail = (y, kw["out"]) if wide else None
        return y, yl

    def _stacked(self, x, xl, mats, i8: bool):
        """The product with matrices stored as one stack or as separate pieces (concatenated along N)."""
        if len(mats) == 1:
            return self._gemv(x, xl, mats[0], i8)
        return torch.cat([self._gemv(x, xl, m, i8) for m in mats], dim=1)

    def _qkv(self, x, xl, mats, i8: bool):
        """The QKV product -> (qkv, None), or (q and k, v) where V is a matrix of its own (a Q4_K_M file's q6_k V):
        rope_store then reads V apart, with no concatenation."""
        cfg, D = self.cfg, self.cfg.head_dim
        if (len(mats) != 2 or mats[0].shape[0] != (cfg.n_heads + cfg.n_kv_heads) * D
                or mats[1].shape[0] != cfg.n_kv_heads * D):
            return self._stacked(x, xl, mats, i8), None
        return self._gemv(x, xl, mats[0], i8), self._gemv(x, xl, mats[1], i8)

    def _moe(self, x, layer, combine: bool = True):
        """The mixture-of-experts FFN: route (softmax, top-k, renormalize), then qgemv.moe_ffn. On one rank with
        ``combine`` off, the pairs' products and weights (_Pairs) for the next add_rmsnorm to sum."""
        router, gate, up, down = layer.moe
        logits = self._gemv(x, None, router, False)
        bias = layer.moe_bias
        w, e = moe_route(logits, self.cfg.n_experts_used, self.cfg.expert_norm,
                         bias=bias[0] if bias is not None else None)
        if self.tp is not None:  # this rank's experts: the others' pairs weigh 0 here (tp.local_pairs)
            w, e = local_pairs(w, e, *self.tp.experts)
        if bias is not None:  # the down biases join the products where they are summed
            y, ex = self._moe_oss(x, e, layer)
            pairs = _Pairs(y, w.float().contiguous(), bias[3], ex)
            return pairs if self.tp is None and not combine else pairs.combined()
        if self.tp is not None or combine:
            return moe_ffn(x, w, e, gate, up, down, self.local_experts)
        return _Pairs(*moe_ffn(x, w, e, gate, up, down, self.local_experts, combine=False))

    def _moe_oss(self, x, e, layer):
        """gpt-oss's experts for the pairs of ``e`` [T, top_k]: gate and up products plus their biases, the clamped
        SwiGLU (kernels.swiglu_oai), the down product -> (products [T * top_k, H] in x's dtype, without the down
        bias; each pair's expert [T * top_k])."""
        _, gate, up, down = layer.moe
        _, bg, bu, _ = layer.moe_bias
        E = self.local_experts
        ex = e.reshape(-1).contiguous()  # token t's experts are pairs t * top_k ..
        groups = pair_groups(ex, E, one_token=e.shape[0] == 1)  # grouped once for both products
        gu = moe_pairs(x, gate, E, ex, e.shape[1], up=up, groups=groups)  # both stacks in one launch
        F = gu.shape[1] // 2
        a = swiglu_oai(gu[:, :F], gu[:, F:], ex, bg, bu)
        return moe_pairs(a, down, E, ex, groups=groups), ex

    def _mlp(self, x, layer, xl, i8: bool):
        if layer.moe is not None:  # on one rank the weighted sum is left to the next add_rmsnorm (a launch fewer)
            return self._moe(x, layer, combine=False)
        # gate and up as one stacked matrix: one GEMV (the fastest kernel of the format), then silu(g) * u
        gu = self._stacked(x, xl, layer.gate_up, i8)
        if self.cfg.act != "silu":  # GeGLU: the activation kernel (in lane order too where down reads that), then down
            if self._lanes(gu.shape[0], i8, layer.down):
                return self._gemv(*silu_mul(gu, lanes=True, act=self.cfg.act), layer.down, i8)
            return self._gemv(self._act(gu, layer.down), None, layer.down, i8)
        F = gu.shape[1] // 2
        r = self._route(layer.down, "silu_mul", gu.shape[0], i8)
        if i8 and r.kernel in ("i8", "i8_lanes") and id(layer.down) not in self.padded:
            # silu(g) * u formed by the activation-rounding kernel, written once as int8
            return run_route(r, "silu_mul", gu[:, :F], layer.down, gu[:, F:])
        # exact mode keeps the separate product: silu_mul_gemv's m1 path measured 28.7 us against 26.7 for the two
        # steps (q4_k 4096 x 14336, H100, file 20261122-204954); the engine's q4_k batch 1 ran 246.9 tok/s with it
        # there, 261.9 without in an earlier run on another machine (file 20261122-192031)
        if self._lanes(gu.shape[0], i8, layer.down):
            return self._gemv(*silu_mul(gu, lanes=True), layer.down, i8)
        return self._gemv(self._act(gu, layer.down), None, layer.down, i8)

    def _act(self, gu, down):
        """silu_mul (or GeGLU) of the gate/up product; for a down matrix padded along K, written into a buffer of its
        width with zeros past F, which _gemv hands to it."""
        if id(down) not in self.padded:
            return silu_mul(gu, act=self.cfg.act)
        out = empty(gu.shape[0], down.shape[1], dtype=gu.dtype, device=gu.device)
        y = silu_mul(gu, act=self.cfg.act, out=out)
        self._zero_tail = (y, out)
        return y

    def forward(self, inp: StepInputs, k_caches, v_caches, plan, *, kv_scales=(1.0, 1.0),
                act_int8: bool = False) -> torch.Tensor:
        """Run one step over ``inp``'s tokens; returns float32 logits [S, vocab] for ``inp.logits_idx``.
        ``act_int8``: the projections round their activations to int8 per block of 32 (gemv's act_int8)."""
        i8 = act_int8
        cfg = self.cfg
        T = inp.ids.shape[0]
        h = self._embed(inp.ids)  # the residual stream
        if cfg.embed_scale != 1.0:  # scaled by a factor rounded to the activation dtype, as the reference does
            h = h * torch.tensor(cfg.embed_scale, dtype=h.dtype)
        delta = None
        post = None  # the post-norm weight still to apply to delta (Gemma): fused into the next norm's kernel
        fused = self._fused_reduce(T)  # tensor parallel: the norms sum the row-parallel partials (else _reduce)
        reduce = (lambda d: d) if fused is not None else self._reduce  # noqa: E731
        for li, layer in enumerate(self.layers):
            x, xl = self._norm(T, i8, layer.qkv, delta if delta is not None else h, layer.attn_norm, cfg.rms_eps,
                               residual=h if delta is not None else None, pre_weight=post,
                               peers=fused if delta is not None else None)
            qkv, v = self._qkv(x, xl, layer.qkv, i8)
            inv_freq, mscale = self.ropes[layer.rope]
            q = rope_store(qkv, inp.positions, inp.slots, inv_freq, k_caches[li], v_caches[li],
                           n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, neox=cfg.rope_style == "neox",
                           mscale=mscale, bias=layer.qkv_bias, q_norm=layer.q_norm, k_norm=layer.k_norm,
                           eps=cfg.rms_eps, k_scale=kv_scales[0], v_scale=kv_scales[1], v=v)
            fp8 = k_caches[li].dtype != self.dtype
            o = paged_attention(q, k_caches[li], v_caches[li], inp.page_table, inp.seq_lens, inp.cu_seqlens_q,
                                inp.max_q, causal=True, plan=plan, validate=False, softmax_scale=cfg.attn_scale or None,
                                window_size=(layer.window, -1), softcap=cfg.attn_softcap, sinks=layer.sinks,
                                k_scale=kv_scales[0] if fp8 else None, v_scale=kv_scales[1] if fp8 else None)
            delta = reduce(self._gemv(o.reshape(T, cfg.n_heads * cfg.head_dim), None, layer.wo, i8))
            # gpt-oss's O bias joins delta in the norm's kernel
            x, xl = self._norm(T, i8, layer.gate_up or [layer.moe[0]], delta, layer.ffn_norm, cfg.rms_eps,
                               residual=h, pre_weight=layer.post_attn_norm, peers=fused, x_bias=layer.o_bias)
            delta = reduce(self._mlp(x, layer, xl, i8))
            post = layer.post_ffn_norm
        if fused is not None and delta is not None:  # the last layer's partials: no norm of theirs sums them
            delta = self._reduce(delta)
        self._zero_tail = None
        if inp.logits_idx.numel() == 0:  # a step of prompt chunks only: nothing to sample yet
            return torch.empty(0, cfg.vocab_size, dtype=torch.float32, device=h.device)
        if isinstance(delta, _Pairs):
            delta = delta.combined()
        hs, ds = h.index_select(0, inp.logits_idx), delta.index_select(0, inp.logits_idx)
        if self.output_pad:  # the output matrix padded with zero blocks along K (see _pad_output): x padded to match
            x = empty(hs.shape[0], self.output.shape[1], dtype=hs.dtype, device=hs.device)
            add_rmsnorm(ds, self.output_norm, cfg.rms_eps, residual=hs, out=x, pre_weight=post)  # zeros past H
            xl = None
        else:
            x, xl = self._norm(hs.shape[0], i8, [self.output], ds, self.output_norm, cfg.rms_eps, residual=hs,
                               pre_weight=post)
        return self._softcap(self._gather_logits(self._gemv(x, xl, self.output, i8).float()))

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.cfg.final_softcap
        return torch.tanh(logits / cap) * cap if cap > 0 else logits

    # --- tensor parallelism (identities on one rank) ---------------------------------------------------------------
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the embedding for ``ids``; split by vocabulary, each rank adds the rows it holds."""
        H = self.cfg.hidden
        if self.tp is None:
            e = embedding(ids, self.tok_embd, dtype=self.dtype)
            return e if e.shape[1] == H else e[:, :H].contiguous()  # a padded tied output matrix (_pad_output)
        local, valid = self._local_ids(ids)
        e = embedding(local, self.tok_embd, dtype=self.dtype)
        return self._reduce((e if e.shape[1] == H else e[:, :H]) * valid[:, None])

    def _local_ids(self, ids: torch.Tensor):
        v0 = self.tp.vocab[0]
        local = ids.long() - v0
        valid = (local >= 0) & (local < self.tp.vocab_per_rank)
        return local.clamp(0, self.tp.vocab_per_rank - 1).to(ids.dtype), valid.to(self.dtype)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a row-parallel product's partials."""
        if self.tp is not None:
            if getattr(self, "_all_reduce", None) is None:  # made at the first step, once the group exists
                self._all_reduce = AllReduce(self.tp.group, self.device, self.dtype, *self.tp.allreduce,
                                             hidden=self.cfg.hidden)
            return self._all_reduce(x)
        return x

    def _fused_reduce(self, T: int):
        """The FusedRows that add_rmsnorm sums a step's T rows of partials with (one launch for the all-reduce and
        the norm), or None: one rank, NCCL, or more rows than its buffer holds."""
        f = getattr(getattr(self, "_all_reduce", None), "fused", None) if self.tp is not None else None
        return f if f is not None and T <= f.rows and self.dtype == f.dtype else None

    def _gather_logits(self, y: torch.Tensor) -> torch.Tensor:
        """Every rank's vocabulary slice of the logits [S, V / ranks] side by side: [S, vocab_size]."""
        if self.tp is None:
            return y
        import torch.distributed as dist

        parts = [torch.empty_like(y) for _ in range(self.tp.world)]
        dist.all_gather(parts, y.contiguous(), group=self.tp.group)
        return torch.cat(parts, dim=1)[:, :self.cfg.vocab_size]
