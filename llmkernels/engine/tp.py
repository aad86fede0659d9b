"""Tensor parallelism: one model split over several processes (one per GPU), as GGUF stores it.

Sharding never dequantizes: a weight is cut along whole rows (the output dim) or at block boundaries along K.
- Q, K, V, gate and up are column-parallel: each rank keeps the rows of its query heads, of the KV heads those
  heads read (whole heads; when the KV heads do not divide among the ranks, a rank keeps the one KV head its query
  heads share, so some ranks hold the same one), and of its share of the FFN.
- O and down are row-parallel: each rank keeps the K columns of its heads or FFN share (a multiple of the format's
  block: 256 weights for K-quants, 32 for the legacy formats, the group for MLX) and the partial products are summed
  across ranks (all-reduce).
- The embedding and output matrices are split by vocabulary rows: a rank looks up only the ids in its range (the
  others contribute zeros to the all-reduce), and each rank's slice of the logits is gathered.
- Norms are replicated; each rank's KV cache holds its own KV heads.
- Mixture-of-experts layers are expert-parallel: each rank holds whole experts (E / ranks of every stack, cut along
  the expert axis, so no format's block constrains the split), the router is replicated, and every rank routes every
  token; a rank computes the pairs of its own experts and the sum over ranks (the all-reduce after the FFN, as for
  down) adds the rest. Pairs of other ranks' experts still run, with weight 0 (``local_pairs``): the weights and
  the KV cache are split, the expert compute of one token is not.

Rank 0 runs the engine (scheduler, sampling) and sends each step's inputs; the other ranks (parallel.py) run the
same forward steps in lockstep, their collectives matching rank 0's one for one.
"""
from __future__ import annotations

import dataclasses

import torch

from ..quant.formats import GGUF_FORMATS
from ..quant.tensor import QuantizedTensor, cat_rows, dequantize
from .config import ModelConfig, ModelConfigError



@dataclasses.dataclass
class TPShard:
    """Which part of the model one rank holds."""
    rank: int
    world: int
    q_heads: tuple  # (first, stop) of the global query heads
    kv_heads: tuple  # (first, stop) of the global KV heads
    ffn: tuple  # (first, stop) of the FFN rows
    vocab: tuple  # (first, stop) of the vocabulary rows (stop - first = vocab_per_rank, the last padded)
    vocab_per_rank: int
    experts: tuple = (0, 0)  # (first, stop) of the experts of every MoE stack ((0, 0): a dense model)
    group: object = None  # the torch.distributed process group (None: the default group)
    allreduce: tuple = ("auto", "")  # (mode, note) of its all-reduces, as rank 0 decided (allreduce.engine_mode)

    @property
    def active(self) -> bool:
        return self.world > 1


def block_of(qt) -> int:
    """The K granularity a weight can be cut at: its format's block (or MLX group)."""
    if not isinstance(qt, QuantizedTensor):
        return 1
    if qt.format == "mlx":
        return qt.group_size
    return GGUF_FORMATS[qt.format].block_size


def plan_shards(cfg: ModelConfig, world: int, tensors=None) -> list:
    """The TPShard of every rank, or ModelConfigError naming what does not split ``world`` ways."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {world!r}")
    E = cfg.n_experts
    if world > 1 and (cfg.attn_sinks or cfg.o_bias or cfg.moe_bias):
        raise ModelConfigError(f"tensor_parallel_size={world}: {cfg.arch} (attention sinks, O and expert biases) "
                               f"runs on one GPU only for now")
    if E and E % world:
        raise ModelConfigError(f"tensor_parallel_size={world} does not divide the {E} experts (each rank holds whole "
                               f"experts)")
    Hq, Hkv = cfg.n_heads, cfg.n_kv_heads
    if Hq % world:
        raise ModelConfigError(f"tensor_parallel_size={world} does not divide the {Hq} query heads")
    if Hkv % world and world % Hkv:
        raise ModelConfigError(f"tensor_parallel_size={world}: the {Hkv} KV heads neither divide among the ranks "
                               f"nor does the rank count divide by them")
    if not E and cfg.ffn % world:
        raise ModelConfigError(f"tensor_parallel_size={world} does not divide the FFN size {cfg.ffn}")
    q_per = Hq // world
    group = Hq // Hkv
    if tensors is not None:  # row-parallel K splits must fall on block boundaries
        for i in range(cfg.n_layers):
            for name, per in ((f"blk.{i}.attn_output.weight", q_per * cfg.head_dim),
                              *(() if E else ((f"blk.{i}.ffn_down.weight", cfg.ffn // world),))):
                b = block_of(tensors[name])
                if per % b:
                    raise ModelConfigError(f"tensor_parallel_size={world}: {name} would be cut every {per} weights "
                                           f"along K, not a multiple of its {tensors[name].format} block of {b}")
    v_per = -(-cfg.vocab_size // world)
    shards = []
    for r in range(world):
        q0, q1 = r * q_per, (r + 1) * q_per
        kv = (q0 // group, -(-q1 // group))
        ffn = (0, cfg.ffn) if E else (r * cfg.ffn // world, (r + 1) * cfg.ffn // world)
        shards.append(TPShard(r, world, (q0, q1), kv, ffn, (r * v_per, (r + 1) * v_per), v_per,
                              (r * E // world, (r + 1) * E // world)))
    return shards


def local_config(cfg: ModelConfig, shard: TPShard) -> ModelConfig:
    """The config one rank's model is built with: its heads and FFN share; vocab_size and n_experts stay the model's
    (the router scores every expert; the stacks hold the rank's, ``TPShard.experts``)."""
    return dataclasses.replace(cfg, n_heads=shard.q_heads[1] - shard.q_heads[0],
                               n_kv_heads=shard.kv_heads[1] - shard.kv_heads[0], ffn=shard.ffn[1] - shard.ffn[0])


def take_rows(t, start: int, stop: int, pad_to: int | None = None):
    """Rows [start, stop) of a weight (QuantizedTensor or tensor, rows = dim 0), zero rows appended up to ``pad_to``
    rows (all-zero blocks decode to 0 in every GGUF format and MLX)."""
    if not isinstance(t, QuantizedTensor):
        t = t[start:stop]
        if pad_to is not None and t.shape[0] < pad_to:
            t = torch.cat([t, t.new_zeros(pad_to - t.shape[0], *t.shape[1:])])
        return t
    rows = stop - start
    n = pad_to or rows
    pick = lambda a: None if a is None else _pad0(a[start:stop], n)  # noqa: E731
    return QuantizedTensor(t.format, (n, *t.shape[1:]), pick(t.data), pick(t.scales), pick(t.biases), t.bits,
                           t.group_size)


def _pad0(a: torch.Tensor, n: int) -> torch.Tensor:
    if a.shape[0] >= n:
        return a.contiguous()
    return torch.cat([a, a.new_zeros(n - a.shape[0], *a.shape[1:])])


def take_cols(qt, k0: int, k1: int):
    """Columns [k0, k1) of a weight [N, K] along K; with a QuantizedTensor both must be multiples of its block."""
    if not isinstance(qt, QuantizedTensor):
        return qt[:, k0:k1].contiguous()
    b = block_of(qt)
    if k0 % b or k1 % b:
        raise ValueError(f"columns [{k0}, {k1}) do not fall on {qt.format} block boundaries ({b})")
    if qt.format == "mlx":
        words = qt.bits * qt.group_size // 32  # uint32 words per group
        g0, g1 = k0 // qt.group_size, k1 // qt.group_size
        return QuantizedTensor("mlx", (qt.shape[0], k1 - k0), qt.data[:, g0 * words:g1 * words].contiguous(),
                               qt.scales[:, g0:g1].contiguous(), qt.biases[:, g0:g1].contiguous(), qt.bits,
                               qt.group_size)
    f = GGUF_FORMATS[qt.format]
    return QuantizedTensor(qt.format, (qt.shape[0], k1 - k0),
                           qt.data[:, k0 // b * f.block_bytes:k1 // b * f.block_bytes].contiguous())


def shard_tensors(tensors, cfg: ModelConfig, shard: TPShard) -> dict:
    """This rank's tensors under the same GGUF names (see the module docstring); norms are kept whole."""
    D = cfg.head_dim
    (q0, q1), (k0, k1), (f0, f1), (v0, v1) = shard.q_heads, shard.kv_heads, shard.ffn, shard.vocab
    out = {}
    for name in tensors.keys():
        t = tensors[name]
        if isinstance(t, QuantizedTensor) and len(t.shape) == 1:  # a bias or norm stored as a GGUF vector
            t = dequantize(t)
        base = name.rsplit(".", 1)[0].split(".")[-1] if name.startswith("blk.") else name.split(".")[0]
        if base == "attn_qkv":  # phi3: [q; k; v] stacked, each cut by heads
            Hq, Hkv = cfg.n_heads * D, cfg.n_kv_heads * D
            out[name] = _cat([take_rows(t, q0 * D, q1 * D), take_rows(t, Hq + k0 * D, Hq + k1 * D),
                              take_rows(t, Hq + Hkv + k0 * D, Hq + Hkv + k1 * D)])
        elif base == "ffn_up" and cfg.fused:  # phi3: [gate; up] stacked
            out[name] = _cat([take_rows(t, f0, f1), take_rows(t, cfg.ffn + f0, cfg.ffn + f1)])
        elif base == "attn_q":
            out[name] = take_rows(t, q0 * D, q1 * D)
        elif base in ("attn_k", "attn_v"):
            out[name] = take_rows(t, k0 * D, k1 * D)
        elif base in ("ffn_gate", "ffn_up"):
            out[name] = take_rows(t, f0, f1)
        elif base == "attn_output":
            out[name] = take_cols(t, q0 * D, q1 * D)
        elif base == "ffn_down":
            out[name] = take_cols(t, f0, f1)
        elif base in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):  # [E, N, K]: whole experts
            out[name] = take_rows(t, *shard.experts)
        elif base in ("token_embd", "output"):
            out[name] = take_rows(t, v0, min(v1, cfg.vocab_size), pad_to=shard.vocab_per_rank)
        else:
            out[name] = t
    return out


def local_pairs(weights: torch.Tensor, experts: torch.Tensor, first: int, stop: int):
    """A token's routed (weight, expert) pairs [T, k] as the rank holding experts [first, stop) computes them: ids
    relative to ``first``; another rank's pair gets weight 0 and the id of the token's first pair on this rank (or
    0), so that it reads no expert the token does not read here anyway. Torch ops only: no host sync, CUDA graphs
    capture it."""
    mine = (experts >= first) & (experts < stop)
    rel = (experts - first).to(experts.dtype)
    n = stop - first
    own = torch.where(mine, rel, n).amin(dim=1, keepdim=True)  # n: no pair of this token is here
    fill = torch.where(own == n, 0, own).to(experts.dtype)
    return torch.where(mine, weights, 0).to(weights.dtype), torch.where(mine, rel, fill).contiguous()


def _cat(parts: list):
    """Row pieces of one weight stacked back into one (QuantizedTensor or tensor)."""
    if isinstance(parts[0], QuantizedTensor):
        return cat_rows(parts)
    return torch.cat(parts)
