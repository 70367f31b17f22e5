"""Speculative decoding's parts alone: the proposers (prompt lookup, the suffix cache), adaptive k,
the configuration's checks, and the rejection rule's output distribution on a tiny vocabulary.

The engine's verification (greedy identical with and without speculation, TP 1 and 2 with
adapters, preemption, stop strings, logprobs, a draft model) is checked in tests/test_engine.py
(check_speculative); TP 3 on SmolLM2 in tests/test_smollm2.py."""

from __future__ import annotations

import pytest
import torch

from tprt.engine.sampling import SamplingParams, process_logits, sample
from tprt.engine.speculative import AdaptiveK, Context, SpeculativeConfig, Speculator, StepCosts, SuffixCache
from tprt.errors import ConfigError


class _Seq:
    def __init__(self, rid: str, prompt: list[int], output: list[int] | None = None, adapter: int = 0) -> None:
        self.request_id, self.prompt, self.output, self.adapter = rid, prompt, output or [], adapter


def test_prompt_lookup_prefers_the_longest_recent_match() -> None:
    c = Context(min_n=1, max_n=3)
    c.extend([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 3])
    # Last 3 tokens "6 7 3" never occurred before; "7 3" neither; "3" did, latest before the end at 6.
    assert c.lookup(2) == [5, 6]
    c.extend([4])  # "... 3 4" : the 2-gram "3 4" occurred at the start, followed by 9 2 3
    assert c.lookup(3) == [9, 2, 3]
    c.extend([9, 2])  # "3 4 9 2": the 3-gram "4 9 2" is followed by 3 5 6
    assert c.lookup(3) == [3, 5, 6]
    assert Context(min_n=2, max_n=3).lookup(4) == []
    short = Context(min_n=2, max_n=4)
    short.extend([8, 8])  # "8 8" has no earlier occurrence with a token after it
    assert short.lookup(3) == []
    short.extend([8])  # now "8 8" at the start is followed by 8
    assert short.lookup(3) == [8]


def test_context_sync_follows_prompt_and_output() -> None:
    c = Context(1, 2)
    c.sync([5, 6, 7], [])
    c.sync([5, 6, 7], [5, 6])
    assert c.tokens == [5, 6, 7, 5, 6] and c.lookup(4) == [7, 5, 6]


def test_suffix_cache_is_per_adapter_and_bounded() -> None:
    spec = Speculator(SpeculativeConfig("suffix", num_tokens=3, min_n=2, max_n=3, suffix_cache_tokens=12,
                                        adaptive=False))
    spec.finish(_Seq("a", [1], [10, 11, 12, 13, 14, 15], adapter=1), completed=True)
    spec.finish(_Seq("x", [1], [10, 11, 40, 41], adapter=2), completed=True)
    spec.finish(_Seq("c", [1], [70, 71, 72], adapter=1), completed=False)  # cancelled: not cached
    # A new request on adapter 1 whose context ends with "10 11": the cached output continues it.
    new = _Seq("b", [3, 10, 11])
    new.adapter = 1
    assert spec.propose([new], [5]) == [[12, 13, 14]]
    other = _Seq("d", [3, 10, 11], adapter=2)
    assert spec.propose([other], [5]) == [[40, 41]]
    assert spec.propose([_Seq("e", [3, 10, 11], adapter=3)], [5]) == [[]]
    # Its own context comes first: here "10 11" is followed by 99 in the prompt itself.
    assert spec.propose([_Seq("f", [10, 11, 99, 10, 11], adapter=1)], [2]) == [[99, 10]]
    assert spec.propose([new], [1]) == [[12]]  # room caps the draft

    # The hostile round's R9: the bound holds over all adapters together (6 + 4 tokens, then 5 more
    # on adapter 3 evict adapter 1's output, the oldest), and an adapter reloaded or dropped from
    # the pool (Engine.forget_prefixes) takes its outputs with it.
    spec.finish(_Seq("g", [1], [20, 21, 22, 23, 24], adapter=3), completed=True)
    assert spec.suffix_cache_tokens == 9
    assert spec.propose([_Seq("h", [3, 10, 11], adapter=1)], [5]) == [[]]
    assert spec.propose([_Seq("i", [3, 20, 21], adapter=3)], [5]) == [[22, 23, 24]]
    spec.forget(2)
    assert spec.propose([_Seq("j", [3, 10, 11], adapter=2)], [5]) == [[]] and spec.suffix_cache_tokens == 5

    cache = SuffixCache(2, 2, capacity=8)
    cache.add([1, 2, 3, 4, 5])
    cache.add([6, 7, 8, 9])  # 9 tokens > 8: the first output is evicted, with its index entries
    assert cache.tokens == 4 and cache.index_size == 2  # "6 7" and "7 8"
    ctx = Context(2, 2)
    ctx.extend([0, 1, 2])
    assert cache.lookup(ctx, 2) == []
    ctx.extend([6, 7])
    assert cache.lookup(ctx, 2) == [8, 9]


def test_adaptive_k_turns_down_probes_and_recovers() -> None:
    k = AdaptiveK(max_k=5, cost=0.15, probe_every=4)
    assert k.next_k() >= 2  # the prior expects drafts to pay off
    for _ in range(10):
        k.observe(k.next_k() or 1, 0)  # nothing kept
    assert k.rate < 0.15
    ks = [k.next_k() for _ in range(8)]
    assert ks.count(0) >= 6 and 1 in ks, ks  # plain decoding, with a one-token probe now and then
    for _ in range(10):
        k.observe(4, 4)  # everything kept
    assert k.next_k() == 5
    fixed = AdaptiveK(max_k=3, cost=0.15, probe_every=4, adaptive=False)
    fixed.observe(3, 0)
    assert fixed.next_k() == 3


def test_step_costs_price_drafts_by_measured_steps() -> None:
    """Before any step the prior prices a drafted position; then measured averages, with a line
    through them for step widths not seen; k follows: all it may where wide steps cost what
    narrow ones do, fewer where they cost more."""
    costs = StepCosts(prior=0.15)
    assert costs.relative(1, 4) == pytest.approx(1.6)
    for _ in range(5):
        costs.observe(1, 0.010)
        costs.observe(3, 0.011)
    assert costs.seconds(1) == pytest.approx(0.010) and costs.seconds(3) == pytest.approx(0.011)
    assert costs.seconds(8) == pytest.approx(0.010 + 0.0005 * 7)  # on the line through (1, 10 ms), (3, 11 ms)
    assert costs.relative(1, 7) == pytest.approx(0.0135 / 0.010)
    costs.observe(0, 1.0)  # nothing to price: ignored
    costs.observe(2, float("nan"))
    assert costs.seconds(2) == pytest.approx(0.0105)
    k = AdaptiveK(max_k=7, cost=0.15, probe_every=4)
    for _ in range(10):
        k.observe(4, 1)  # one of four drafted tokens kept
    cheap = StepCosts(prior=0.15)
    for n in (1, 4, 8):
        cheap.observe(n, 0.010)
    dear = StepCosts(prior=0.15)
    for n in (1, 4, 8):
        dear.observe(n, 0.010 * n)
    assert k.next_k(lambda j: cheap.relative(1, j)) == 7
    assert k.next_k(lambda j: dear.relative(1, j)) == 0  # a step of k + 1 tokens costs k + 1 plain ones
    assert 1 <= k.next_k() < 7  # the prior alone: a few
    slower = StepCosts(prior=0.15)  # a step noisily cheaper when wider still costs at least a plain one
    slower.observe(1, 0.02)
    slower.observe(2, 0.01)
    assert slower.relative(1, 1) == 1.0


def test_config_errors_name_the_flag() -> None:
    for config, flag in ((SpeculativeConfig("beam"), "--speculative"),  # type: ignore[arg-type]
                         (SpeculativeConfig(num_tokens=0), "--num-speculative-tokens"),
                         (SpeculativeConfig(min_n=3, max_n=2), "--spec-min-n"),
                         (SpeculativeConfig("draft"), "--draft-model"),
                         (SpeculativeConfig("ngram", draft_model="x"), "--draft-model")):
        with pytest.raises(ConfigError, match=flag):
            config.validate()


# ----------------------------------------------------------------------------- the rejection rule

N = 40_000
TOLERANCE = 0.015  # per-token frequency vs probability; a frequency's std is <= 0.0025 at N = 40k (6 sigma)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8)],
                         ids=["plain", "top_k", "top_p"])
def test_rejection_rule_keeps_the_target_distribution(params: SamplingParams) -> None:
    """A drafted token x is kept iff the sampler draws x at its position (the engine's rule):
    kept with probability p(x), the rejection rule's min(1, p(x)/q(x)) for a point-mass draft,
    and when it is not, the token is distributed as p without x, renormalised (the residual
    max(p - q, 0)). Checked on the emitted tokens of 40k seeded rows; a draft p filters out is
    never kept."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    p = torch.softmax(process_logits(logits, [params], [[]]), dim=-1)[0].double()
    gens = [torch.Generator().manual_seed(s) for s in range(N)]
    out = sample(logits.expand(N, -1), [params] * N, gens, [[]] * N).token_ids
    freq = torch.bincount(out, minlength=6).double() / N
    assert (freq - p).abs().max() < TOLERANCE, (freq, p)
    for draft in (0, 2, 5):
        kept = out == draft
        assert abs(kept.double().mean() - p[draft]) < TOLERANCE, (draft, p)
        if p[draft] == 0:
            assert not kept.any()
            continue
        residual = p.clone()
        residual[draft] = 0
        missed = torch.bincount(out[~kept], minlength=6).double() / max(int((~kept).sum()), 1)
        assert (missed - residual / residual.sum()).abs().max() < 2 * TOLERANCE, (draft, missed, residual)


def test_rejection_rule_greedy_and_mixed_rows() -> None:
    """Greedy rows take the argmax (a draft is kept iff it is the argmax); a seeded row draws one
    uniform per token, so it picks the same token beside any other rows."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0], [1.0, 0.0, 2.0]])
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1)
    out = sample(logits, [greedy, greedy, sampled], [None, None, torch.Generator().manual_seed(3)],
                 [[], [], []]).token_ids
    plain = sample(logits[2:], [sampled], [torch.Generator().manual_seed(3)], [[]]).token_ids
    assert out[:2].tolist() == [1, 1] and out[2] == plain[0]


def test_drafting_stops_where_the_batch_is_wide() -> None:
    """A decode batch pads every row to the widest: the engine drafts only while rows x (1 + k)
    stays within max_step_tokens (8 on CPU: the native decode stack's rows)."""
    assert SpeculativeConfig().step_tokens("cpu") == 8 and SpeculativeConfig().step_tokens("cuda") == 1024
    assert SpeculativeConfig(max_step_tokens=64).step_tokens("cpu") == 64
    with pytest.raises(ConfigError):
        SpeculativeConfig(max_step_tokens=1).validate()


def test_a_full_suffix_cache_stays_within_the_bytes_the_plan_counts() -> None:
    """R9: the plan reports suffix_cache_tokens x SUFFIX_BYTES_PER_TOKEN of host memory; a cache
    filled to its default bound with the default n-grams must not hold more."""
    import random
    import tracemalloc

    from tprt.engine.speculative import DEFAULT_SUFFIX_CACHE_TOKENS, SUFFIX_BYTES_PER_TOKEN

    config = SpeculativeConfig("suffix")
    rng = random.Random(0)
    tracemalloc.start()
    try:
        cache = SuffixCache(config.min_n, config.max_n, DEFAULT_SUFFIX_CACHE_TOKENS)
        for _ in range(DEFAULT_SUFFIX_CACHE_TOKENS // 256 + 4):  # past the bound: eviction runs too
            cache.add([rng.randrange(49152) for _ in range(256)])
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert DEFAULT_SUFFIX_CACHE_TOKENS - 256 < cache.tokens <= DEFAULT_SUFFIX_CACHE_TOKENS
    assert held <= DEFAULT_SUFFIX_CACHE_TOKENS * SUFFIX_BYTES_PER_TOKEN, held / cache.tokens
