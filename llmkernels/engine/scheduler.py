"""Sequences and the continuous-batching scheduler.

Each step the scheduler fills a token budget: running sequences first (one token each when decoding, the next chunk
of their prompt when still prefilling), then waiting ones in arrival order. A waiting sequence first takes the
longest prefix of its tokens that the prefix cache holds (``pages.PagePool``) and computes only the rest. A sequence
needs cache pages for every token it has computed; when the free list cannot cover a step, the most recently arrived
running sequence is preempted: its pages are released and it goes back to the front of the queue, to be recomputed
(prompt plus the tokens it already generated, mostly from the prefix cache) when memory allows. Nothing crashes for
lack of memory; a request that could never fit even alone is refused when it is added.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools

from .pages import PagePool, chain_hashes

_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Sequence:
    """One completion being generated: its tokens, its pages and where it stands."""
    prompt_ids: list
    params: object  # SamplingParams
    request_index: int = 0  # which completion of its request (0 .. n-1)
    out_ids: list = dataclasses.field(default_factory=list)
    pages: list = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    generator: object = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed
    logprobs: list | None = None  # per output token: (logprob, [(token id, logprob), ...top]) when asked for
    stop_ids: frozenset = frozenset()  # token ids that end it (EOS unless ignore_eos, and stop_token_ids)
    stop_at: int | None = None  # where a stop string cut the text
    stop_text: object = None  # the engine's incremental detokenizer, for requests with stop strings
    forks: list = dataclasses.field(default_factory=list)  # siblings that start from this one's prompt (n > 1)
    group: list = dataclasses.field(default_factory=list)  # every completion of the request, this one included
    hashes: list = dataclasses.field(default_factory=list)  # names of the full pages of tokens, in order
    num_named: int = 0  # leading pages recorded in the prefix cache
    seq_id: int = dataclasses.field(default_factory=lambda: next(_ids))

    @property
    def tokens(self) -> list:
        return self.prompt_ids + self.out_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.out_ids)

    def token_slice(self, a: int, b: int) -> list:
        """tokens[a:b] without building the whole list (decode steps read one token of long sequences)."""
        P = len(self.prompt_ids)
        if a >= P:
            return self.out_ids[a - P:b - P]
        if b <= P:
            return self.prompt_ids[a:b]
        return self.prompt_ids[a:] + self.out_ids[:b - P]


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Scheduler:
    def __init__(self, pool: PagePool, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.page_size = pool.page_size
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.waiting: collections.deque = collections.deque()
        self.running: list = []
        self.num_preemptions = 0
        self.cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.cache_hits = 0  # of those, tokens found

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow(self, seq: Sequence, n_new: int) -> bool:
        need = pages_for(seq.num_computed + n_new, self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        seq.pages += self.pool.allocate(need)
        return True

    def _release(self, seq: Sequence) -> None:
        self.pool.release(seq.pages)
        seq.pages = []
        seq.num_named = 0

    def preempt(self, seq: Sequence) -> None:
        """Release a running sequence's pages; it is recomputed from its tokens when it runs again."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        for f in seq.forks:  # siblings still waiting for this one's prompt start on their own
            self.waiting.appendleft(f)
        seq.forks = []

    def computed(self, seq: Sequence) -> None:
        """Name the pages that ``seq``'s computed tokens have filled since the last call (prefix cache)."""
        full = seq.num_computed // self.page_size
        if not self.pool.prefix_caching or full <= seq.num_named:
            return
        if len(seq.hashes) < full:
            seq.hashes = chain_hashes(seq.token_slice(0, full * self.page_size), self.page_size, seq.hashes)
        for i in range(seq.num_named, full):
            self.pool.name(seq.pages[i], seq.hashes[i])
        seq.num_named = full

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Give a waiting sequence its cached prefix and the pages of its first chunk; returns the chunk's tokens, or
        0 when memory is short (nothing taken)."""
        hit = []
        if self.pool.prefix_caching:
            # at least the last token is computed: its logits are what the step is for
            full = (seq.num_tokens - 1) // self.page_size
            if len(seq.hashes) < full:
                seq.hashes = chain_hashes(seq.token_slice(0, full * self.page_size), self.page_size, seq.hashes)
            hit = self.pool.lookup(seq.hashes[:full])
        start = len(hit) * self.page_size
        n = min(seq.num_tokens - start, budget)
        need = pages_for(start + n, self.page_size) - len(hit)
        if need > self.pool.num_free - self.pool.num_idle(hit):
            return 0
        self.pool.share(hit)
        seq.pages = hit + self.pool.allocate(need)
        seq.num_computed, seq.num_named = start, len(hit)
        if seq.out_ids == [] and seq.num_preemptions == 0:
            self.cache_queries += len(seq.prompt_ids)
            self.cache_hits += start
            seq.num_cached_tokens = start
        return n

    def fork(self, parent: Sequence, child: Sequence):
        """Start ``child`` from ``parent``'s computed prompt: the full pages are shared, the last partial page is
        copied. Returns the (source, destination) page pair to copy, or False when the child must wait and compute
        its prompt itself (no room for it among the running sequences, or no free page for the copy)."""
        ps = self.page_size
        full, part = divmod(parent.num_computed, ps)
        if len(self.running) >= self.max_num_seqs or (part and not self.pool.num_free):
            self.waiting.appendleft(child)
            return False
        self.pool.share(parent.pages[:full])
        child.pages = parent.pages[:full] + (self.pool.allocate(1) if part else [])
        child.num_computed = parent.num_computed
        child.hashes = list(parent.hashes[:full])
        child.num_named = min(parent.num_named, full)
        self.running.append(child)
        return (parent.pages[full], child.pages[full]) if part else None

    def schedule(self) -> list:
        """[(sequence, number of new tokens)] for the next step, in batch order."""
        budget = self.max_tokens
        out = []
        preempted_before = self.num_preemptions
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self._grow(seq, n):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                out.append((seq, n))
                budget -= n
        if self.num_preemptions != preempted_before:  # memory is short: admit nobody this step, or they thrash
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = self._admit(seq, budget)
            if n == 0:
                break
            self.waiting.popleft()
            self.running.append(seq)
            out.append((seq, n))
            budget -= n
        return out
