"""The one request resolver (tprt.engine.request): each field's default and bounds, the context
check, and the front ends' renamings (the CLI's flags, gRPC's field paths) of the same error."""

from __future__ import annotations

from typing import Any

import pytest

from serve.errors import InvalidArgument, OutOfRange, ServeError
from serve.grpc.pb import generation_pb2 as pb
from serve.grpc.validation import STOP_LIMITS, sampling_params
from tprt.cli.generate import flag_error
from tprt.engine.request import ContextLengthError, StopLimits, check_request, resolve_sampling
from tprt.engine.sampling import DEFAULT_MAX_NEW_TOKENS, SamplingParams
from tprt.errors import ValidationError

VOCAB = 100
CONTEXT = 64


def resolve(prompt_len: int = 4, context: int = CONTEXT, **given: Any) -> SamplingParams:
    return resolve_sampling(given, prompt_len, context, VOCAB, what="test context")


def refused(prompt_len: int = 4, **given: Any) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        resolve(prompt_len, **given)
    assert "\n" not in str(info.value)
    return info.value


def test_defaults() -> None:
    """Unset (absent or None) fields take SamplingParams' defaults; max_new_tokens is the one
    default, shrunk to what the context leaves after the prompt."""
    assert resolve(context=4096) == SamplingParams(max_new_tokens=DEFAULT_MAX_NEW_TOKENS)
    assert resolve(context=4096, temperature=None, seed=None) == resolve(context=4096)
    p = resolve()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.seed) == (1.0, 0, 1.0, 0.0, 1.0, None)
    assert (p.stop_strings, p.stop_token_ids, p.ignore_eos, p.logprobs, p.top_logprobs) == ((), (), False, False, 0)
    assert p.max_new_tokens == CONTEXT - 4
    assert resolve(prompt_len=CONTEXT - 1).max_new_tokens == 1
    assert resolve(max_new_tokens=7).max_new_tokens == 7  # explicit: kept as given


@pytest.mark.parametrize("field,good,bad", [
    ("temperature", [0.0, 2.5], [-0.1, float("inf"), float("nan"), "1"]),
    ("top_k", [0, VOCAB], [-1, VOCAB + 1, 2.5, True]),
    ("top_p", [1e-6, 1.0], [0.0, 1.01]),
    ("min_p", [0.0, 1.0], [-0.01, 1.5]),
    ("repetition_penalty", [1e-3, 9.0], [0.0, -1.0, float("inf")]),
    ("seed", [0, 2**64 - 1], [-1, 2**64, 1.0]),
    ("max_new_tokens", [1, CONTEXT - 4], [0, -5]),
    ("stop_token_ids", [(0, VOCAB - 1)], [(VOCAB,), (-1,)]),
    ("stop_strings", [("x", "yz")], [("",), (3,)]),
    ("top_logprobs", [0, 20], [21, -1]),
])
def test_bounds(field: str, good: list[Any], bad: list[Any]) -> None:
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    for value in good:
        assert getattr(resolve(**{field: value, **extra}), field) == value
    for value in bad:
        e = refused(**{field: value, **extra})
        assert e.field == field and str(e).startswith(field) and not isinstance(e, ContextLengthError)


def test_top_logprobs_needs_logprobs() -> None:
    assert refused(top_logprobs=2).field == "top_logprobs"


def test_context() -> None:
    """The prompt must leave room for one token; an explicit max_new_tokens must fit after it."""
    e = refused(prompt_len=CONTEXT)
    assert isinstance(e, ContextLengthError) and e.field == "prompt"
    assert str(e) == (f"prompt has {CONTEXT} tokens; the context holds {CONTEXT} (test context), "
                      "prompt and output together")
    e = refused(prompt_len=0)
    assert e.field == "prompt" and not isinstance(e, ContextLengthError)
    assert resolve(max_new_tokens=CONTEXT - 4).max_new_tokens == CONTEXT - 4  # exactly fills the context
    e = refused(max_new_tokens=CONTEXT - 3)
    assert isinstance(e, ContextLengthError) and e.field == "max_new_tokens"
    assert str(e).startswith(f"max_new_tokens={CONTEXT - 3} with a prompt of 4 tokens") and str(e).endswith(
        f"use at most {CONTEXT - 4}")


def test_stop_strings_need_a_tokenizer_and_limits_apply_when_given() -> None:
    with pytest.raises(ValidationError) as info:
        resolve_sampling({"stop_strings": ["x"]}, 4, CONTEXT, VOCAB, what="c", has_tokenizer=False)
    assert info.value.field == "stop_strings"
    limits = StopLimits(strings=2, chars=3, ids=1)
    for given, field in [({"stop_strings": ["a", "b", "c"]}, "stop_strings"), ({"stop_strings": ["abcd"]}, "stop_strings"),
                         ({"stop_token_ids": [1, 2]}, "stop_token_ids")]:
        resolve_sampling(given, 4, CONTEXT, VOCAB, what="c")  # no limits: fine
        with pytest.raises(ValidationError) as info:
            resolve_sampling(given, 4, CONTEXT, VOCAB, what="c", limits=limits)
        assert info.value.field == field


def test_engine_check_is_the_resolver_check() -> None:
    """What the engine re-checks (check_request) refuses exactly what the resolver refuses."""
    params = SamplingParams(max_new_tokens=CONTEXT - 3)
    with pytest.raises(ContextLengthError) as a:
        check_request(params, 4, CONTEXT, VOCAB, what="test context")
    assert str(a.value) == str(refused(max_new_tokens=CONTEXT - 3))


# (canonical field, value, has_tokenizer, flag, gRPC field path, gRPC error)
RENAMED: list[tuple[str, Any, bool, str, str, type[ServeError]]] = [
    ("top_p", 2.0, True, "--top-p", "sampling.top_p", InvalidArgument),
    ("temperature", -1.0, True, "--temperature", "sampling.temperature", InvalidArgument),
    ("stop_token_ids", [VOCAB], True, "--stop-token-id", "sampling.stop_token_ids", InvalidArgument),
    ("stop_strings", ["x"], False, "--stop", "sampling.stop", InvalidArgument),
    ("max_new_tokens", CONTEXT, True, "--max-new-tokens", "sampling.max_new_tokens", OutOfRange),
]


@pytest.mark.parametrize("field,value,has_tok,flag,path,grpc_error", RENAMED, ids=[r[0] for r in RENAMED])
def test_front_ends_rename_the_same_error(field: str, value: Any, has_tok: bool, flag: str, path: str,
                                          grpc_error: type[ServeError]) -> None:
    with pytest.raises(ValidationError) as info:
        resolve_sampling({field: value}, 4, CONTEXT, VOCAB, what="context_length", has_tokenizer=has_tok)
    e = info.value
    assert e.field == field
    cli = str(flag_error(e))
    assert cli.startswith(flag) and field not in cli.replace(flag, "")
    assert cli.replace(flag, field, 1).replace(f"{field} {value}", f"{field}={value}", 1) == str(e)
    wire = pb.SamplingParams(**{path.removeprefix("sampling."): value})
    with pytest.raises(grpc_error) as grpc_info:
        sampling_params(wire, 4, CONTEXT, VOCAB, has_tok)
    assert grpc_info.value.field == path and str(grpc_info.value) == f"{path}: {e}"


def test_grpc_prompt_too_long_is_out_of_range_on_prompt() -> None:
    with pytest.raises(OutOfRange) as info:
        sampling_params(pb.SamplingParams(), CONTEXT, CONTEXT, VOCAB, True)
    assert info.value.field == "prompt"


def test_grpc_reads_unset_fields_as_defaults_and_applies_stop_limits() -> None:
    assert sampling_params(pb.SamplingParams(), 4, CONTEXT, VOCAB, True) == resolve()
    got = sampling_params(pb.SamplingParams(temperature=0.0, stop=["x"], logprobs=True, top_logprobs=3), 4,
                          CONTEXT, VOCAB, True)
    assert got == resolve(temperature=0.0, stop_strings=("x",), logprobs=True, top_logprobs=3)
    with pytest.raises(InvalidArgument) as info:
        sampling_params(pb.SamplingParams(stop=["x"] * (STOP_LIMITS.strings + 1)), 4, CONTEXT, VOCAB, True)
    assert info.value.field == "sampling.stop"
