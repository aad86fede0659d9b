"""A decode step's matrices as three stacks of rows, one per reduction length K, so a kernel that streams them
needs three TMA descriptors and a small table, and so the engine's kernel-per-op path and a one-kernel step can
read one copy.

Stacks (uint8 [rows, bytes per row], each matrix's GGUF rows as stored; every matrix in one format):
- ``a``, K = hidden: per layer attn_q, attn_k, attn_v, ffn_gate, ffn_up; then the output matrix (or the tied
  embedding);
- ``o``, K = heads * head_dim: per layer attn_output;
- ``d``, K = ffn: per layer ffn_down.

``table`` int32 [layers + 1, 8]: per layer the first row of q (= the QKV block), of gate and of up in ``a``, of
the layer's rows in ``o`` and in ``d`` (fields 5-7 zero); the last row's field 0 is the output matrix's first row.
"""
import dataclasses

import torch

from ..quant.tensor import QuantizedTensor

LAYER_PARTS = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")


@dataclasses.dataclass
class WeightStacks:
    format: str
    a: torch.Tensor
    o: torch.Tensor
    d: torch.Tensor
    table: torch.Tensor

    def rows(self, stack: str, first: int, n: int, k: int) -> QuantizedTensor:
        """Rows [first, first + n) of stack ``stack`` as a [n, k] matrix (a view, no copy)."""
        return _view(self.format, getattr(self, stack), first, n, k)


def _view(fmt, buf, first, n, k) -> QuantizedTensor:
    return QuantizedTensor(fmt, (n, k), buf[first:first + n])


def _dense(cfg) -> None:
    if cfg.n_experts or cfg.fused:
        raise ValueError("the stacks hold dense layers with separate q/k/v and gate/up matrices, got "
                         + ("a mixture of experts" if cfg.n_experts else "fused attn_qkv / ffn_up tensors"))


def _layout(cfg, mats: dict) -> str:
    """The one format of ``mats`` ({stack: [(name, matrix, rows)]}, in the module's order; rows None: any), each
    matrix [rows, its stack's K]; ValueError naming the first that is not."""
    _dense(cfg)
    k = {"a": cfg.hidden, "o": cfg.n_heads * cfg.head_dim, "d": cfg.ffn}
    fmt = None
    for stack, items in mats.items():
        for name, m, rows in items:
            if not isinstance(m, QuantizedTensor) or m.gguf is None or len(m.shape) != 2:
                raise ValueError(f"{name}: the stacks hold 2-D GGUF matrices, got "
                                 f"{getattr(m, 'format', type(m).__name__)} of shape {tuple(getattr(m, 'shape', ()))}")
            fmt = fmt or m.format
            if m.format != fmt:
                raise ValueError(f"{name}: every matrix must be in one format ({fmt}), got {m.format}")
            want = (m.shape[0] if rows is None else rows, k[stack])
            if tuple(m.shape) != want:
                raise ValueError(f"{name}: expected shape {list(want)} (stack {stack!r}), got {list(m.shape)}")
    return fmt


def _fill(items: list, device) -> torch.Tensor:
    """uint8 [rows, bytes per row] holding the matrices' GGUF rows in order."""
    rows = [m.data.reshape(m.shape[0], -1) for _, m, _ in items]
    buf = torch.empty(sum(r.shape[0] for r in rows), rows[0].shape[1], dtype=torch.uint8, device=device)
    r0 = 0
    for r in rows:
        buf[r0:r0 + r.shape[0]].copy_(r)
        r0 += r.shape[0]
    return buf


def _table(cfg) -> torch.Tensor:
    D = cfg.head_dim
    nq = (cfg.n_heads + 2 * cfg.n_kv_heads) * D
    per = nq + 2 * cfg.ffn
    t = torch.zeros(cfg.n_layers + 1, 8, dtype=torch.int32)
    for li in range(cfg.n_layers):
        t[li, :5] = torch.tensor([li * per, li * per + nq, li * per + nq + cfg.ffn, li * cfg.hidden, li * cfg.hidden])
    t[cfg.n_layers, 0] = cfg.n_layers * per
    return t


def stack_tensors(cfg, tensors, device=None) -> WeightStacks:
    """The stacks of a GGUF's tensors (``name -> QuantizedTensor``), copied onto ``device`` (default: where the
    tensors are)."""
    _dense(cfg)
    D, H, F = cfg.head_dim, cfg.hidden, cfg.ffn
    rows = {"attn_q": cfg.n_heads * D, "attn_k": cfg.n_kv_heads * D, "attn_v": cfg.n_kv_heads * D, "ffn_gate": F,
            "ffn_up": F}

    def get(name, n):
        if name not in tensors.keys():
            raise ValueError(f"{name}: missing from the tensors")
        return name, tensors[name], n

    out = "output.weight" if "output.weight" in tensors.keys() else "token_embd.weight"
    L = range(cfg.n_layers)
    mats = {"a": [get(f"blk.{li}.{p}.weight", rows[p]) for li in L for p in LAYER_PARTS] + [get(out, None)],
            "o": [get(f"blk.{li}.attn_output.weight", H) for li in L],
            "d": [get(f"blk.{li}.ffn_down.weight", H) for li in L]}
    fmt = _layout(cfg, mats)
    device = device if device is not None else mats["a"][0][1].device
    s = {stack: _fill(items, device) for stack, items in mats.items()}
    return WeightStacks(fmt, s["a"], s["o"], s["d"], _table(cfg).to(device))


def share_stacks(model) -> WeightStacks:
    """Move a loaded engine Model's matrices into the stacks and make each of its matrices a view of its rows: the
    model computes as before (Model.matrices_changed), and the stacks and the model share one copy. Needs one
    stack's bytes free while it is filled: the stacks are filled one at a time, and a stack's matrices give up
    their old storage once it is (unless something else still holds them). ValueError, with nothing changed,
    where the model does not fit the stacks: mixed formats (a q4_k_m file's q6_k matrices), experts, fused
    tensors, matrices padded at load. Call it before any CUDA graph is captured over the model: a captured graph
    keeps the old storage's addresses."""
    from ..engine.model import Model

    if not isinstance(model, Model):
        raise TypeError(f"model must be an engine Model (LLM.model), got {type(model).__name__}")
    cfg = model.cfg
    _dense(cfg)
    if model.padded or model.output_pad:
        raise ValueError("the model has matrices padded at load (unaligned q6_k rows); the stacks hold them as stored")
    for li, L in enumerate(model.layers):
        if len(L.qkv) != 1 or len(L.gate_up) != 1:
            raise ValueError(f"layer {li}: q/k/v and gate/up must each be one stacked matrix (one format), got "
                             f"{len(L.qkv)} and {len(L.gate_up)} pieces")
    H, KO, F = cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.ffn
    nq = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    mats = {"a": [(f"blk.{li}.{n}", m, r) for li, L in enumerate(model.layers)
                  for n, m, r in (("qkv", L.qkv[0], nq), ("gate_up", L.gate_up[0], 2 * F))]
            + [("output", model.output, None)],
            "o": [(f"blk.{li}.attn_output", L.wo, H) for li, L in enumerate(model.layers)],
            "d": [(f"blk.{li}.ffn_down", L.down, H) for li, L in enumerate(model.layers)]}
    fmt = _layout(cfg, mats)
    tied = model.tok_embd is model.output
    table = _table(cfg)
    t = table.tolist()
    stacks = {}
    for stack in ("a", "o", "d"):  # one stack at a time; its matrices' old storage goes once it is filled
        buf = stacks[stack] = _fill(mats.pop(stack), model.device)
        for li, L in enumerate(model.layers):
            if stack == "a":
                L.qkv = [_view(fmt, buf, t[li][0], nq, H)]
                L.gate_up = [_view(fmt, buf, t[li][1], 2 * F, H)]
            elif stack == "o":
                L.wo = _view(fmt, buf, t[li][3], H, KO)
            else:
                L.down = _view(fmt, buf, t[li][4], H, F)
        if stack == "a":
            model.output = _view(fmt, buf, t[cfg.n_layers][0], model.output.shape[0], H)
            if tied:
                model.tok_embd = model.output
    model.matrices_changed()
    return WeightStacks(fmt, stacks["a"], stacks["o"], stacks["d"], table.to(model.device))
