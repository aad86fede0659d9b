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
        return QuantizedTensor(self.format, (n, k), getattr(self, stack)[first:first + n])


def _rows(m: QuantizedTensor) -> torch.Tensor:
    return m.data.reshape(m.shape[0], -1)


def _check(mats: dict, k: dict) -> str:
    """The one format of every matrix of ``mats`` ({stack: [(name, matrix)]}), each [N, K] with K its stack's;
    ValueError naming the first that is not."""
    fmt = None
    for stack, items in mats.items():
        for name, m in items:
            if not isinstance(m, QuantizedTensor) or m.gguf is None or len(m.shape) != 2:
                raise ValueError(f"{name}: the stacks hold 2-D GGUF matrices, got "
                                 f"{getattr(m, 'format', type(m).__name__)} of shape {tuple(getattr(m, 'shape', ()))}")
            fmt = fmt or m.format
            if m.format != fmt:
                raise ValueError(f"{name}: every matrix must be in one format ({fmt}), got {m.format}")
            if m.shape[1] != k[stack]:
                raise ValueError(f"{name}: K must be {k[stack]} (stack {stack!r}), got {m.shape[1]}")
            if m.scales is not None or m.biases is not None:
                raise ValueError(f"{name}: a GGUF matrix has no separate scales or biases")
    return fmt


def _fill(mats: dict, device) -> dict:
    """{stack: uint8 [rows, bytes per row]} holding ``mats``' rows in order."""
    out = {}
    for stack, items in mats.items():
        rows = [_rows(m) for _, m in items]
        width = rows[0].shape[1]
        buf = torch.empty(sum(r.shape[0] for r in rows), width, dtype=torch.uint8, device=device)
        r0 = 0
        for r in rows:
            buf[r0:r0 + r.shape[0]].copy_(r)
            r0 += r.shape[0]
        out[stack] = buf
    return out


def _table(cfg) -> torch.Tensor:
    D = cfg.head_dim
    nq = (cfg.n_heads + 2 * cfg.n_kv_heads) * D
    per = nq + 2 * cfg.ffn
    t = torch.zeros(cfg.n_layers + 1, 8, dtype=torch.int32)
    for li in range(cfg.n_layers):
        t[li, :5] = torch.tensor([li * per, li * per + nq, li * per + nq + cfg.ffn, li * cfg.hidden, li * cfg.hidden])
    t[cfg.n_layers, 0] = cfg.n_layers * per
    return t


def _dense_llama(cfg) -> None:
    if cfg.n_experts or cfg.fused:
        raise ValueError("the stacks hold dense layers with separate q/k/v and gate/up matrices, got "
                         + ("a mixture of experts" if cfg.n_experts else "fused attn_qkv / ffn_up tensors"))


def stack_tensors(cfg, tensors, device=None) -> WeightStacks:
    """The stacks of a GGUF's tensors (``name -> QuantizedTensor``), copied onto ``device`` (default: where the
    tensors are)."""
    _dense_llama(cfg)
    out = "output.weight" if "output.weight" in tensors.keys() else "token_embd.weight"
    mats = {"a": [(f"blk.{li}.{p}.weight", tensors[f"blk.{li}.{p}.weight"]) for li in range(cfg.n_layers)
                  for p in LAYER_PARTS] + [(out, tensors[out])],
            "o": [(f"blk.{li}.attn_output.weight", tensors[f"blk.{li}.attn_output.weight"])
                  for li in range(cfg.n_layers)],
            "d": [(f"blk.{li}.ffn_down.weight", tensors[f"blk.{li}.ffn_down.weight"]) for li in range(cfg.n_layers)]}
    fmt = _check(mats, {"a": cfg.hidden, "o": cfg.n_heads * cfg.head_dim, "d": cfg.ffn})
    device = device if device is not None else mats["a"][0][1].device
    s = _fill(mats, device)
    return WeightStacks(fmt, s["a"], s["o"], s["d"], _table(cfg).to(device))


def share_stacks(model) -> WeightStacks:
    """Move a loaded engine Model's matrices into the stacks and make each of its matrices a view of its rows: the
    model computes as before (Model.matrices_changed), and the stacks and the model share one copy. Needs one
    stack's bytes free while it is filled: the stacks are filled one at a time, and a stack's matrices give up
    their old storage once it is (unless something else still holds them). ValueError, with nothing changed,
    where the model does not fit the stacks: mixed formats (a q4_k_m file's q6_k matrices), experts, fused
    tensors, matrices padded at load. Call it before any CUDA graph is captured over the model: a captured graph
    keeps the old storage's addresses."""
    cfg = model.cfg
    _dense_llama(cfg)
    if model.padded or model.output_pad:
        raise ValueError("the model has matrices padded at load (unaligned q6_k rows); the stacks hold them as stored")
    for li, L in enumerate(model.layers):
        if len(L.qkv) != 1 or len(L.gate_up) != 1:
            raise ValueError(f"layer {li}: q/k/v and gate/up must each be one stacked matrix (one format), got "
                             f"{len(L.qkv)} and {len(L.gate_up)} pieces")
    mats = {"a": [(f"blk.{li}.{n}", m) for li, L in enumerate(model.layers)
                  for n, m in (("qkv", L.qkv[0]), ("gate_up", L.gate_up[0]))] + [("output", model.output)],
            "o": [(f"blk.{li}.attn_output", L.wo) for li, L in enumerate(model.layers)],
            "d": [(f"blk.{li}.ffn_down", L.down) for li, L in enumerate(model.layers)]}
    fmt = _check(mats, {"a": cfg.hidden, "o": cfg.n_heads * cfg.head_dim, "d": cfg.ffn})
    nq = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    for li, L in enumerate(model.layers):
        if L.qkv[0].shape[0] != nq or L.gate_up[0].shape[0] != 2 * cfg.ffn:
            raise ValueError(f"layer {li}: QKV rows {L.qkv[0].shape[0]} and gate/up rows {L.gate_up[0].shape[0]}, "
                             f"expected {nq} and {2 * cfg.ffn}")
    tied = model.tok_embd is model.output
    H, KO, F = cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.ffn
    table = _table(cfg)
    t = table.tolist()
    stacks = {}
    for stack in ("a", "o", "d"):  # one stack at a time; its matrices' old storage goes once it is filled
        stacks[stack] = _fill({stack: mats.pop(stack)}, model.device)[stack]
        view = WeightStacks(fmt, stacks.get("a"), stacks.get("o"), stacks.get("d"), table).rows
        for li, L in enumerate(model.layers):
            if stack == "a":
                L.qkv = [view("a", t[li][0], nq, H)]
                L.gate_up = [view("a", t[li][1], 2 * F, H)]
            elif stack == "o":
                L.wo = view("o", t[li][3], H, KO)
            else:
                L.down = view("d", t[li][4], H, F)
        if stack == "a":
            model.output = view("a", t[cfg.n_layers][0], model.output.shape[0], H)
            if tied:
                model.tok_embd = model.output
    model.matrices_changed()
    st = WeightStacks(fmt, stacks["a"], stacks["o"], stacks["d"], table.to(model.device))
    return st
