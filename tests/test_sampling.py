"""tprt.engine.sampling against transformers' logits processors, plus seeding, statistics and validation."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tprt.errors import ConfigError, ValidationError
from tprt.engine.sampling import SamplingParams, make_generator, process_logits, sample

VOCAB = 97


def hf_process(logits: torch.Tensor, history: list[int], p: SamplingParams) -> torch.Tensor:
    """The processors HF's generate() builds for these settings, in its order."""
    procs = LogitsProcessorList()
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if not p.greedy:
        if p.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(p.temperature))
        if p.top_k:
            procs.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1.0:
            procs.append(TopPLogitsWarper(p.top_p))
        if p.min_p:
            procs.append(MinPLogitsWarper(p.min_p))
    ids = torch.tensor([history], dtype=torch.long)
    return procs(ids, logits[None].clone())[0]  # type: ignore[arg-type]


MIXED = [
    SamplingParams(temperature=0.7, top_k=10),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=0.5, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.8, min_p=0.02, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, repetition_penalty=1.5),
    SamplingParams(),
    SamplingParams(temperature=2.0, top_p=0.5, repetition_penalty=0.8),
    SamplingParams(temperature=1.0, top_k=1),
]


def make_case(seed: int) -> tuple[torch.Tensor, list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(MIXED), VOCAB, generator=g) * 3
    lengths = torch.randint(1, 30, (len(MIXED),), generator=g).tolist()  # uneven histories
    history = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    return logits, history


@pytest.mark.parametrize("seed", range(4))
def test_filtered_distribution_matches_hf(seed: int) -> None:
    logits, history = make_case(seed)
    before = logits.clone()
    ours = process_logits(logits, MIXED, history)
    sample(logits, MIXED, [None] * len(MIXED), history)
    assert torch.equal(logits, before)  # the caller's logits are not modified
    for i, p in enumerate(MIXED):
        ref = hf_process(logits[i], history[i], p)
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref)), f"row {i}: different tokens kept"
        kept = ~torch.isinf(ref)
        assert torch.equal(ours[i][kept], ref[kept]), f"row {i}: different kept scores"


def test_filters_actually_filter() -> None:
    logits, history = make_case(0)
    kept = (~torch.isinf(process_logits(logits, MIXED, history))).sum(-1)
    assert kept[0] == 10 and kept[7] == 1 and kept[5] == VOCAB
    assert 1 < kept[1] < VOCAB and 1 < kept[2] < VOCAB


def test_half_precision_logits_are_processed_in_fp32() -> None:
    logits, history = make_case(1)
    ours = process_logits(logits.bfloat16(), MIXED, history)
    assert ours.dtype == torch.float32
    ref = process_logits(logits.bfloat16().float(), MIXED, history)
    assert torch.equal(ours, ref)


def test_greedy_is_argmax_of_penalised_logits() -> None:
    logits, history = make_case(2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=3.0)]
    # make row 1's argmax a token in its history so the penalty changes the answer
    hist1 = history[1] + [5]
    logits = logits[:2].clone()
    logits[1, 5] = logits[1].max() + 0.01
    res = sample(logits, params, [None, None], [history[0], hist1])
    assert res.token_ids[0] == logits[0].argmax()
    assert res.token_ids[1] == hf_process(logits[1], hist1, params[1]).argmax() != 5


def test_logprobs_are_raw_model_logprobs() -> None:
    logits, history = make_case(3)
    params = [SamplingParams(temperature=0.5, top_k=3, logprobs=True, top_logprobs=5),
              SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)]
    res = sample(logits[:2], params, [make_generator(1), None], history[:2])
    raw = torch.log_softmax(logits[:2], dim=-1)
    assert torch.allclose(res.logprobs, raw.gather(1, res.token_ids[:, None]).squeeze(1))
    assert res.top_ids.shape == (2, 5)
    assert torch.equal(res.top_ids, raw.topk(5).indices)
    assert torch.allclose(res.top_logprobs, raw.topk(5).values)
    none = sample(logits[:2], [SamplingParams(), SamplingParams()], [None, None], history[:2])
    assert none.top_ids.shape == (2, 0)


def test_seeded_sampling_independent_of_batch_composition() -> None:
    logits, history = make_case(4)
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=123)
    first = int(sample(logits[3:4], [p], [make_generator(123)], history[3:4]).token_ids.item())
    g_alone, g_batched = make_generator(123), make_generator(123)
    seq_alone: list[int] = []
    seq_batched: list[int] = []
    for step in range(50):
        seq_alone.append(int(sample(logits[3:4], [p], [g_alone], history[3:4]).token_ids.item()))
        gens: list[torch.Generator | None] = [make_generator(step), None, g_batched, None, make_generator(9)]
        res = sample(logits[[0, 1, 3, 5, 6]], [MIXED[0], MIXED[1], p, MIXED[5], MIXED[6]], gens,
                     [history[i] for i in (0, 1, 3, 5, 6)])
        seq_batched.append(int(res.token_ids[2].item()))
    assert seq_alone == seq_batched
    assert seq_alone[0] == first
    assert len(set(seq_alone)) > 3  # it does sample


def test_different_seeds_differ_and_tp_ranks_agree() -> None:
    logits, history = make_case(5)
    p = SamplingParams(temperature=1.5)
    def run(seed: int) -> list[int]:
        g = make_generator(seed)
        return [int(sample(logits[:1], [p], [g], history[:1]).token_ids.item()) for _ in range(30)]
    assert run(7) == run(7)  # two "ranks" with identical logits and seeds
    assert run(7) != run(8)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    support = probs > 0
    expected = probs[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


def test_sampling_follows_filtered_distribution() -> None:
    """Chi-square goodness of fit over many draws (fixed seeds, so deterministic). The statistic's
    threshold is far above the 99.9% quantile; a sampler ignoring the filter or the temperature fails
    by orders of magnitude (checked below against the unfiltered distribution)."""
    torch.manual_seed(0)
    base = torch.randn(12) * 1.5
    p = SamplingParams(temperature=0.8, top_k=8, top_p=0.95, min_p=0.01)
    n = 20000
    logits = base.expand(n, -1)
    target = torch.softmax(process_logits(base[None], [p], [[]])[0], -1)
    res = sample(logits, [p] * n, [None] * n, [[]] * n)
    counts = torch.bincount(res.token_ids, minlength=12).double()
    assert counts[target == 0].sum() == 0  # never a filtered token
    stat, dof = chi_square(counts, target.double())
    assert stat < dof + 6 * math.sqrt(2 * dof) + 10, (stat, dof)
    unfiltered_stat, _ = chi_square(counts, torch.softmax(base.double(), -1))
    assert unfiltered_stat > 50 * stat


def test_per_row_generator_sequence_follows_distribution() -> None:
    base = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -4.0]])
    p = SamplingParams(temperature=1.0, seed=5)
    g = make_generator(5)
    draws = torch.tensor([sample(base, [p], [g], [[]]).token_ids.item() for _ in range(3000)])
    stat, dof = chi_square(torch.bincount(draws, minlength=6).double(), torch.softmax(base[0].double(), -1))
    assert stat < dof + 6 * math.sqrt(2 * dof) + 10, (stat, dof)


def test_batch_length_mismatch() -> None:
    with pytest.raises(ValueError, match="2 logits rows"):
        sample(torch.zeros(2, 5), [SamplingParams()], [None], [[]])


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan), ("temperature", "1"),
    ("top_k", -1), ("top_k", VOCAB + 1), ("top_k", 2.5), ("top_k", True),
    ("top_p", 0.0), ("top_p", 1.01),
    ("min_p", -0.01), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("seed", -1), ("seed", 2**64), ("seed", 1.0),
    ("max_new_tokens", 0), ("max_new_tokens", -5),
    ("stop_token_ids", (VOCAB,)), ("stop_token_ids", (-1,)),
    ("stop_strings", ("",)), ("stop_strings", (3,)),
    ("ignore_eos", 1), ("logprobs", "yes"),
    ("top_logprobs", 21), ("top_logprobs", -1),
])
def test_validation_names_the_field(field: str, value: object) -> None:
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    p = SamplingParams(**{field: value, **extra})  # type: ignore[arg-type]
    with pytest.raises(ValidationError) as e:
        p.validate(VOCAB)
    assert e.value.field == field
    assert isinstance(e.value, ConfigError)
    msg = str(e.value)
    shown = value[0] if isinstance(value, tuple) else value
    assert msg.startswith(field) and "\n" not in msg and repr(shown) in msg


def test_top_logprobs_needs_logprobs() -> None:
    with pytest.raises(ValidationError, match="requires logprobs") as e:
        SamplingParams(top_logprobs=3).validate(VOCAB)
    assert e.value.field == "top_logprobs"


def test_valid_params_pass_and_lists_become_tuples() -> None:
    lists: dict[str, Any] = {"stop_token_ids": [1, 2], "stop_strings": ["x"]}
    p = SamplingParams(temperature=0, top_k=VOCAB, top_p=1.0, min_p=1.0, seed=2**64 - 1, logprobs=True,
                       top_logprobs=20, **lists)
    assert p.validate(VOCAB) is p
    assert p.stop_token_ids == (1, 2) and p.stop_strings == ("x",)
    hash(p)


def test_openai_logit_bias_and_output_penalties() -> None:
    """OpenAI's logit_bias (added first), and its presence and frequency penalties over the output
    alone (the prompt's ids do not count): score - frequency x count - presence x (count > 0),
    written out here; a bias of +100 makes a token the greedy choice, -100 bans it; rows without
    them are untouched, and the reported logprobs stay the model's."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, VOCAB, generator=g) * 3
    prompt = [5, 5, 6]
    output = [7, 7, 7, 8, 5]
    history = [prompt + output] * 3
    starts = [len(prompt)] * 3
    penal = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=1.5)
    biased = SamplingParams(temperature=0.0, logit_bias=((11, 100.0), (int(logits[1].argmax()), -100.0)))
    plain = SamplingParams(temperature=0.0)
    scores = process_logits(logits, [penal, biased, plain], history, starts)
    want = logits[0].clone()
    for token, count in ((7, 3), (8, 1), (5, 1)):  # 5 and 6 are in the prompt too; only output counts
        want[token] -= 1.5 * count + 0.5
    assert torch.allclose(scores[0], want) and torch.equal(scores[2], logits[2])
    bias = torch.zeros(VOCAB)
    bias[11], bias[int(logits[1].argmax())] = 100.0, -100.0
    assert torch.allclose(scores[1], logits[1] + bias)
    res = sample(logits, [penal, biased, SamplingParams(temperature=0.0, logprobs=True)], [None] * 3, history,
                 output_starts=starts)
    assert res.token_ids[1] == 11 and res.token_ids[0] == int(want.argmax())
    assert penal.reads_history and biased.shapes_logits and not biased.reads_history and not plain.shapes_logits
    assert math.isclose(float(res.logprobs[2]), float(torch.log_softmax(logits[2], -1).max()), rel_tol=1e-6)


@pytest.mark.parametrize("fields,field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"logit_bias": ((VOCAB, 1.0),)}, "logit_bias"), ({"logit_bias": ((3, 101.0),)}, "logit_bias"),
    ({"logit_bias": ((3,),)}, "logit_bias"),
])
def test_openai_fields_out_of_range(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        SamplingParams(**fields).validate(VOCAB)
    assert e.value.field == field and str(e.value).startswith(field)
