"""Pages, sequences and the continuous-batching scheduler.

Each step the scheduler fills a token budget: running sequences first (one token each when decoding, the next chunk
of their prompt when still prefilling), then waiting ones in arrival order. A sequence needs cache pages for every
token it has computed; when the free list cannot cover a step, the most recently arrived running sequence is
preempted: its pages are freed and it goes back to the front of the queue, to be recomputed (prompt plus the tokens
it already generated) when memory allows. Nothing crashes for lack of memory; a request that could never fit even
alone is refused when it is added.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools


class PageAllocator:
    """A free list over ``num_pages`` cache pages."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = collections.deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list:
        if n > len(self._free):
            raise MemoryError(f"{n} pages requested, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, pages) -> None:
        self._free.extend(pages)


_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Sequence:
    prompt_ids: list
    params: object  # SamplingParams
    request_index: int = 0
    out_ids: list = dataclasses.field(default_factory=list)
    pages: list = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    generator: object = None
    num_preemptions: int = 0
    stop_at: int | None = None  # where a stop string cut the text
    stop_scan: int = 0  # text length already searched for stop strings
    seq_id: int = dataclasses.field(default_factory=lambda: next(_ids))

    @property
    def tokens(self) -> list:
        return self.prompt_ids + self.out_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.out_ids)


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Scheduler:
    def __init__(self, allocator: PageAllocator, page_size: int, max_num_seqs: int, max_num_batched_tokens: int):
        self.alloc = allocator
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.waiting: collections.deque = collections.deque()
        self.running: list = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow(self, seq: Sequence, n_new: int) -> bool:
        need = pages_for(seq.num_computed + n_new, self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        if need > self.alloc.num_free:
            return False
        seq.pages += self.alloc.allocate(need)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's pages; it is recomputed from its tokens when it runs again."""
        self.running.remove(seq)
        self.alloc.free(seq.pages)
        seq.pages = []
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.alloc.free(seq.pages)
        seq.pages = []

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
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self._grow(seq, n):
                break
            self.waiting.popleft()
            self.running.append(seq)
            out.append((seq, n))
            budget -= n
        return out
