"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""
from __future__ import annotations

import dataclasses

import torch

MAX_LOGPROBS = 20
MAX_N = 1024  # completions per request; seeds of completions are seed + index


@dataclasses.dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature: 0 = greedy (argmax); top_k: keep the k most likely tokens (0 = all); top_p: keep the smallest set
    whose probability reaches p (1 = all); seed: a per-request seed: each request draws from its own generator, so
    the same batch replays exactly (across different batch sizes the logits may differ in the last bits, since the
    GEMV kernels take other paths, and a draw at a near-tie can change); max_tokens: tokens to generate at most;
    stop: strings that end generation at their first occurrence in the text, which is cut there (also when a stop
    string spans several tokens); stop_token_ids: extra ids that end generation (the model's EOS ids always do unless
    ignore_eos).
    """
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple = ()
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = no limit), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__}")
        if self.seed is not None and not -2**63 <= self.seed < 2**63 - MAX_N:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        stop = (self.stop,) if isinstance(self.stop, str) else (self.stop or ())
        if not isinstance(stop, (tuple, list)) or not all(isinstance(x, str) and x for x in stop):
            raise TypeError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = tuple(stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def make_generator(params: SamplingParams, device, index: int = 0) -> torch.Generator | None:
    """The random stream of completion ``index`` of a request (None when greedy)."""
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is not None:
        g.manual_seed(params.seed + index)
    else:
        g.seed()
    return g


def sample(logits: torch.Tensor, params: list, generators: list) -> list:
    """One token id per row of float32 ``logits`` [S, V], row i drawn with params[i] and generators[i]."""
    return sample_tokens(logits, params, generators).tolist()


ARGMAX_CHUNK = 256


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax over the last dim of [S, V] logits (the first of equal maxima), in two passes where V is a
    large multiple of ARGMAX_CHUNK: one reduction over a 128k vocabulary in a single row keeps few SMs busy (26 us
    against 11 on an H200, [1, 128256] float32)."""
    S, V = logits.shape
    if V < 1 << 16 or V % ARGMAX_CHUNK or not logits.is_contiguous():
        return torch.argmax(logits, dim=-1)
    vals, idx = logits.view(S, V // ARGMAX_CHUNK, ARGMAX_CHUNK).max(dim=-1)
    chunk = vals.argmax(dim=-1, keepdim=True)
    return (idx.gather(1, chunk) + chunk * ARGMAX_CHUNK).squeeze(1)


def sample_tokens(logits: torch.Tensor, params: list, generators: list,
                  greedy: torch.Tensor | None = None) -> torch.Tensor:
    """As ``sample``, the ids left on the logits' device (int64 [S]): no synchronisation with the host.
    ``greedy``: greedy_ids(logits) computed already (by the step that made the logits); when every row is
    greedy it is returned as it is."""
    S, V = logits.shape
    rows = [i for i, p in enumerate(params) if not p.greedy]
    out = greedy_ids(logits) if greedy is None else greedy.clone() if rows else greedy
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        temp = torch.tensor([params[i].temperature for i in rows], device=logits.device, dtype=torch.float32)
        lg = logits.index_select(0, idx) / temp[:, None]
        vals, order = lg.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=logits.device)[None, :]
        k = torch.tensor([params[i].top_k or V for i in rows], device=logits.device)[:, None]
        p = torch.tensor([params[i].top_p for i in rows], device=logits.device, dtype=torch.float32)[:, None]
        probs = torch.softmax(vals, dim=-1)
        # drop ranks past k, and tokens whose preceding mass already reaches p (the top token always stays)
        drop = (rank >= k) | ((probs.cumsum(-1) - probs) >= p)
        vals = vals.masked_fill(drop, float("-inf"))
        probs = torch.softmax(vals, dim=-1)
        # exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i; each row uses its own
        # generator so a seeded request's tokens do not depend on the rest of the batch
        noise = torch.empty_like(probs)
        for j, i in enumerate(rows):
            noise[j].exponential_(generator=generators[i])
        choice = torch.argmax(probs / noise, dim=-1)
        out[idx] = order.gather(1, choice[:, None]).squeeze(1)
    return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list, top: list) -> list:
    """[(logprob of tokens[r], [(id, logprob) of the top[i] most likely])] for each row r of ``rows``, from the raw
    float32 ``logits`` [S, V] (log-softmax in float32)."""
    idx = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
    chosen = lp.gather(1, tokens.index_select(0, idx)[:, None]).squeeze(1).tolist()
    k = max(top)
    vals, ids = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
    vals, ids = vals.tolist(), ids.tolist()
    return [(c, list(zip(i[:t], v[:t]))) for c, i, v, t in zip(chosen, ids, vals, top)]
