"""KV-cache pages: reference counts and the automatic prefix cache.

A page holds ``page_size`` consecutive tokens of one sequence. Sequences that begin with the same tokens can share
the pages of that prefix: a full page is named by a hash chain over its tokens (the hash of the page before it and
its own token ids; the model, dtype and page size are fixed per engine, so nothing else changes its contents), and
``PagePool`` keeps a table from those names to pages. When the last sequence using a named page lets it go, the page
keeps its contents and its name and joins an LRU list; a later request whose prompt starts with the same tokens takes
it back instead of computing it again. Free pages are handed out unnamed ones first, then named ones least recently
used first, so the cache only ever holds memory nobody else needs.
"""
from __future__ import annotations

import collections
import hashlib
import struct


def page_hash(parent: bytes | None, tokens) -> bytes:
    """The name of a full page: a 128-bit BLAKE2b digest of the previous page's name and this page's token ids (a
    cryptographic hash, so a prompt cannot be crafted to take another prompt's pages)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def chain_hashes(tokens, page_size: int, known: list) -> list:
    """``known`` (the names of the first pages of ``tokens``) extended to every full page of ``tokens``."""
    out = list(known)
    for i in range(len(out), len(tokens) // page_size):
        out.append(page_hash(out[-1] if out else None, tokens[i * page_size:(i + 1) * page_size]))
    return out


class PagePool:
    """``num_pages`` cache pages with reference counts; with ``prefix_caching`` full pages are kept by name."""

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True):
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self.refs = [0] * num_pages
        self._empty = collections.deque(range(num_pages))  # free pages without a name
        self._idle = collections.OrderedDict()  # free named pages, least recently released first
        self._name = {}  # page -> name
        self._page = {}  # name -> page

    @property
    def num_free(self) -> int:
        """Pages that ``allocate`` can hand out (idle named pages included: they are evicted on demand)."""
        return len(self._empty) + len(self._idle)

    @property
    def num_used(self) -> int:
        """Pages held by at least one sequence."""
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Named pages (in use or idle)."""
        return len(self._page)

    def allocate(self, n: int) -> list:
        if n > self.num_free:
            raise MemoryError(f"{n} pages requested, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._empty:
                p = self._empty.popleft()
            else:  # evict the least recently used named page
                p, _ = self._idle.popitem(last=False)
                del self._page[self._name.pop(p)]
            self.refs[p] = 1
            out.append(p)
        return out

    def release(self, pages) -> None:
        """Drop one reference to each page; the last one frees it (a named page stays findable until evicted).
        Pages are released last first, so a sequence's tail, the part least likely shared, is evicted first."""
        for p in reversed(pages):
            r = self.refs[p] - 1
            if r < 0:
                raise RuntimeError(f"page {p} released more often than taken (engine bug)")
            self.refs[p] = r
            if r == 0:
                if p in self._name:
                    self._idle[p] = None
                else:
                    self._empty.append(p)

    def share(self, pages) -> None:
        """Take one more reference to each page (a hit in the prefix cache, or a fork's shared prompt)."""
        for p in pages:
            if self.refs[p] == 0:
                del self._idle[p]
            self.refs[p] += 1

    def name(self, page: int, name: bytes) -> None:
        """Record that ``page`` holds the full page called ``name`` (first writer wins; a duplicate stays
        unnamed and is freed normally)."""
        if self.prefix_caching and name not in self._page and page not in self._name:
            self._page[name] = page
            self._name[page] = name

    def lookup(self, names) -> list:
        """The pages of the longest prefix of ``names`` that the cache holds."""
        out = []
        if self.prefix_caching:
            for h in names:
                p = self._page.get(h)
                if p is None:
                    break
                out.append(p)
        return out

    def num_idle(self, pages) -> int:
        """How many of ``pages`` are free now (sharing them takes them off the free list)."""
        return sum(1 for p in pages if self.refs[p] == 0)

    def reset_cache(self) -> None:
        """Forget every name (pages in use stay in use)."""
        for p in self._idle:
            self._empty.append(p)
        self._idle.clear()
        self._name.clear()
        self._page.clear()
