"""The scheduler, the page pool and the prefix cache, in pure Python (no model)."""
import random

import pytest

from llmkernels.engine.outputs import Detokenizer, TextStream, completion_text
from llmkernels.engine.pages import PagePool, chain_hashes, page_hash
from llmkernels.engine.sampler import SamplingParams
from llmkernels.engine.scheduler import Scheduler, Sequence


def test_scheduler_budget_chunks_and_preemption():
    pool = PagePool(6, 4, prefix_caching=False)
    sch = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=10)
    a, b = Sequence(list(range(9)), SamplingParams()), Sequence(list(range(7)), SamplingParams())
    sch.add(a)
    sch.add(b)
    step = sch.schedule()  # a takes 9 of the 10-token budget, b gets a 1-token chunk
    assert [(s is a, n) for s, n in step] == [(True, 9), (False, 1)]
    a.num_computed, b.num_computed = 9, 1
    a.out_ids.append(1)
    assert len(a.pages) == 3 and len(b.pages) == 1 and pool.num_free == 2
    step = sch.schedule()  # a decodes (its 10th token fits page 3); b's remaining 6 tokens need 1 more page
    assert [(s is a, n) for s, n in step] == [(True, 1), (False, 6)] and pool.num_free == 1
    a.num_computed, b.num_computed = 10, 7
    a.out_ids += [1] * 7  # 17 tokens need 5 pages, 2 more than a has: b (the later arrival) is preempted for them
    step = sch.schedule()
    assert [s for s, _ in step] == [a] and b.num_computed == 0 and b.pages == [] and sch.waiting[0] is b
    assert sch.num_preemptions == 1
    sch.finish(a)
    assert pool.num_free == 6 and pool.refs == [0] * 6


def test_page_hashes_chain():
    """A page's name depends on every token before it, not only its own."""
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, [])
    b = chain_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4, [])
    assert len(a) == 2 and len(b) == 2 and a[0] != b[0] and a[1] != b[1]
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, a[:1]) == a
    assert page_hash(None, [1, 2]) != page_hash(None, [2, 1]) and len(page_hash(None, [1])) == 16


def _run(sch, seqs_done=()):
    """Pretend to run one step: every scheduled token is computed, sequences at their end get token 7."""
    batch = sch.schedule()
    for s, n in batch:
        s.num_computed += n
        sch.computed(s)
    for s, n in batch:
        if s.num_computed == s.num_tokens:
            s.out_ids.append(7)
    return batch


def test_prefix_cache_hits_refcounts_and_eviction():
    pool = PagePool(8, 4)
    sch = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(100, 111))  # 11 tokens: 2 full pages + 3
    a = Sequence(list(prompt), SamplingParams())
    sch.add(a)
    assert _run(sch) == [(a, 11)]
    assert pool.num_cached == 2 and a.num_cached_tokens == 0
    # the same prompt while a still runs: its 2 full pages are shared, 3 tokens computed
    b = Sequence(list(prompt), SamplingParams())
    sch.add(b)
    batch = _run(sch)
    assert (b, 3) in batch and b.pages[:2] == a.pages[:2] and b.num_cached_tokens == 8
    assert pool.refs[a.pages[0]] == 2
    sch.finish(a)
    sch.finish(b)
    assert pool.num_used == 0 and pool.num_cached >= 2
    # a prompt whose length is a page multiple still computes its last token
    c = Sequence(prompt[:8], SamplingParams())
    sch.add(c)
    assert _run(sch) == [(c, 4)] and c.num_cached_tokens == 4
    sch.finish(c)
    # another prefix diverging in page 2 takes page 1 only
    d = Sequence(prompt[:4] + [1, 2, 3, 4, 5], SamplingParams())
    sch.add(d)
    assert _run(sch) == [(d, 5)]
    sch.finish(d)
    # memory pressure evicts idle named pages (least recently released first) instead of failing
    big = [Sequence(list(range(1000 + 40 * i, 1000 + 40 * i + 15)), SamplingParams()) for i in range(2)]
    for s in big:
        sch.add(s)
    _run(sch)
    assert all(len(s.pages) == 4 for s in big) and pool.num_free == 0
    assert pool.lookup(chain_hashes(prompt, 4, [])) == []  # evicted
    for s in big:
        sch.finish(s)
    assert pool.num_used == 0 and pool.num_free == 8


def test_prefix_cache_grows_along_a_conversation():
    """Each turn extends the last: the pages a request computes after its hit are named too, so the next turn hits
    all of them (multi-turn chat)."""
    pool = PagePool(16, 4)
    sch = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    convo = list(range(200, 230))
    for n, cached in ((6, 0), (13, 4), (22, 12), (30, 20)):
        s = Sequence(convo[:n], SamplingParams())
        sch.add(s)
        assert _run(sch) == [(s, n - cached)] and s.num_cached_tokens == cached
        assert pool.num_cached == n // 4  # every full page of the prompt is named now
        sch.finish(s)


def test_fork_shares_full_pages_and_copies_the_partial_one():
    pool = PagePool(10, 4, prefix_caching=False)
    sch = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    p = Sequence(list(range(10)), SamplingParams())
    c1, c2 = Sequence(list(range(10)), SamplingParams()), Sequence(list(range(10)), SamplingParams())
    sch.add(p)
    _run(sch)
    r1, r2 = sch.fork(p, c1), sch.fork(p, c2)
    assert r1 == (p.pages[2], c1.pages[2]) and r2 == (p.pages[2], c2.pages[2])
    assert c1.pages[:2] == p.pages[:2] == c2.pages[:2] and len({p.pages[2], c1.pages[2], c2.pages[2]}) == 3
    assert pool.refs[p.pages[0]] == 3 and c1.num_computed == 10 and sch.running == [p, c1, c2]
    for s in (p, c1, c2):
        sch.finish(s)
    assert pool.num_free == 10 and pool.refs == [0] * 10
    # no room among the running sequences: the child waits and computes its prompt itself
    sch = Scheduler(PagePool(10, 4), max_num_seqs=1, max_num_batched_tokens=64)
    p, c = Sequence(list(range(10)), SamplingParams()), Sequence(list(range(10)), SamplingParams())
    sch.add(p)
    _run(sch)
    assert sch.fork(p, c) is False and sch.waiting[0] is c


def test_scheduler_random_invariants():
    """Random arrivals, finishes and forks: pages are never lost or double counted, and every running sequence
    holds distinct pages except the named ones it shares."""
    rng = random.Random(0)
    pool = PagePool(24, 4)
    sch = Scheduler(pool, max_num_seqs=5, max_num_batched_tokens=16)
    prompts = [[rng.randrange(5) for _ in range(rng.randrange(1, 14))] for _ in range(6)]
    alive = []
    for _ in range(300):
        if rng.random() < 0.3 and len(alive) < 12:
            s = Sequence(list(rng.choice(prompts)), SamplingParams())
            sch.add(s)
            alive.append(s)
        _run(sch)
        for s in list(sch.running):
            if len(s.out_ids) > rng.randrange(1, 12):
                sch.finish(s)
                alive.remove(s)
        held = [p for s in sch.running for p in s.pages]
        refs = [0] * pool.num_pages
        for p in held:
            refs[p] += 1
        assert refs == pool.refs
        assert pool.num_used + pool.num_free == pool.num_pages
        for s in sch.running:
            assert len(s.pages) * 4 >= s.num_computed
    for s in alive:
        sch.finish(s)
    assert pool.num_used == 0


class _CharTok:
    """A tokenizer whose ids are characters, with a decoder that drops one leading space (as SentencePiece's does)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids).removeprefix(" ")


def test_detokenizer_keeps_the_first_space_and_streams_what_it_decodes():
    tok = _CharTok()
    prompt = [ord(c) for c in "Hi"]
    out = [ord(c) for c in " there, you"]
    assert completion_text(tok, prompt, out) == " there, you"
    d = Detokenizer(tok, prompt)
    assert "".join(d.push([t]) for t in out) + d.flush() == " there, you"
    s = TextStream(tok, prompt, stops=("re,",))
    pieces = [s.update([t], False) for t in out[:6]]  # " there" ... "re" held back: it may begin "re,"
    assert "".join(pieces) == " the"
    assert s.update([out[6]], True, stop_at=4) == "" and s.text == " the"


def test_sampling_params_n_and_logprobs_validated():
    assert SamplingParams(n=3, logprobs=5).n == 3
    for bad in (dict(n=0), dict(n=1.5), dict(n=5000), dict(logprobs=-1), dict(logprobs=21), dict(logprobs=True),
                dict(seed=2**64)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


@pytest.mark.parametrize("V", [1 << 16, 128256, 1000, 70000])
def test_greedy_ids_equal_argmax(V):
    """The two-pass greedy pick equals torch.argmax, ties (the first of equal maxima) and NaN rows included, for
    vocabularies it splits and ones it leaves to argmax."""
    import torch

    from llmkernels.engine.sampler import greedy_ids

    g = torch.Generator().manual_seed(V)
    x = torch.randn(5, V, generator=g)
    x[1, V // 3] = x[1, V - 1] = x[1].max() + 1  # a tie across chunks
    x[2, 7] = x[2, 9] = x[2].max() + 1  # a tie within a chunk
    x[3] = torch.randint(0, 3, (V,), generator=g).float()  # many ties
    x[4, V // 2] = float("nan")
    assert torch.equal(greedy_ids(x), torch.argmax(x, dim=-1))
    assert torch.equal(greedy_ids(x[:, : V // 2 * 2 : 2]), torch.argmax(x[:, : V // 2 * 2 : 2], dim=-1))


def test_sample_tokens_takes_the_steps_argmax():
    """sample_tokens with the argmax the step computed: every row greedy returns it as it is; a row that samples
    gets its own draw, the given tensor left unchanged."""
    import torch

    from llmkernels.engine.sampler import SamplingParams, make_generator, sample_tokens

    logits = torch.randn(2, 50)
    given = torch.tensor([3, 4])  # not the argmax: shows which one is used
    greedy = SamplingParams(temperature=0)
    assert sample_tokens(logits, [greedy, greedy], [None, None], given) is given
    hot = SamplingParams(temperature=1.0, seed=5)
    out = sample_tokens(logits, [greedy, hot], [None, make_generator(hot, "cpu")], given)
    want = sample_tokens(logits, [greedy, hot], [None, make_generator(hot, "cpu")])
    assert out[0] == 3 and out[1] == want[1] and given.tolist() == [3, 4]
