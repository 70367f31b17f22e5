"""One request resolver: what a generation request asks for, with defaults applied and checked.

Every front end (`tprt generate`, the gRPC handlers, an HTTP app) reads its own spelling of the
request into canonical field names (SamplingParams' fields, plus "prompt"), calls
`resolve_sampling`, and renames the field of any ValidationError back to its own spelling (a
flag, a protobuf field path). The engine re-checks what it is given through `check_request`, the
same code. So each default and each bound lives here once:

- an unset max_new_tokens becomes what the context has left after the prompt, at most
  DEFAULT_MAX_NEW_TOKENS; an explicit one that does not fit is a ContextLengthError;
- a prompt must have at least one token and leave room for one generated token;
- field bounds are `SamplingParams.validate`; stop strings need a tokenizer; a front end that
  takes requests from the network also caps the stop conditions (`StopLimits`).

A message starts with the canonical field name (or names the quantity at fault), so a front end
can substitute its own spelling without rewording it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tprt.engine.sampling import DEFAULT_MAX_NEW_TOKENS, SamplingParams
from tprt.errors import ValidationError


class ContextLengthError(ValidationError):
    """The prompt, or the prompt and its output, do not fit the context (field "prompt" or
    "max_new_tokens"); servers report it as out of range rather than invalid."""


@dataclass(frozen=True)
class StopLimits:
    """Caps on a request's stop conditions, for front ends that accept requests from the network."""

    strings: int = 16  # stop strings per request
    chars: int = 256  # characters per stop string
    ids: int = 64  # stop token ids per request

    def check(self, params: SamplingParams) -> None:
        if len(params.stop_strings) > self.strings:
            raise ValidationError("stop_strings", f"{len(params.stop_strings)} stop strings; at most {self.strings}")
        for s in params.stop_strings:
            if isinstance(s, str) and not 1 <= len(s) <= self.chars:  # other types: SamplingParams.validate
                raise ValidationError("stop_strings",
                                      f"stop strings must have 1 to {self.chars} characters, got {s!r:.40}")
        if len(params.stop_token_ids) > self.ids:
            raise ValidationError("stop_token_ids", f"{len(params.stop_token_ids)} stop ids; at most {self.ids}")


def resolve_sampling(given: Mapping[str, object], prompt_len: int, context: int, vocab_size: int, *, what: str,
                     has_tokenizer: bool = True, limits: StopLimits | None = None) -> SamplingParams:
    """SamplingParams from the fields a request set (canonical names; None = unset), defaults
    applied, checked by `check_request` (see there for the arguments)."""
    fields = {name: value for name, value in given.items() if value is not None}
    if "max_new_tokens" not in fields:
        fields["max_new_tokens"] = max(1, min(DEFAULT_MAX_NEW_TOKENS, context - prompt_len))
    params = SamplingParams(**fields)  # type: ignore[arg-type]  # the values are checked below
    return check_request(params, prompt_len, context, vocab_size, what=what, has_tokenizer=has_tokenizer,
                         limits=limits)


def check_request(params: SamplingParams, prompt_len: int, context: int, vocab_size: int, *, what: str,
                  has_tokenizer: bool = True, limits: StopLimits | None = None) -> SamplingParams:
    """Raises ValidationError naming the first field at fault; returns `params`.

    `context`: tokens per sequence, prompt and output together (`what` names where that number
    comes from in messages, e.g. "max_seq_len"). Checked in this order: the prompt's length, the
    stop limits, the tokenizer stop strings need, the fields' bounds, then the output's length."""
    if prompt_len < 1:
        raise ValidationError("prompt", "prompt is empty; at least one token is needed")
    if prompt_len >= context:
        raise ContextLengthError("prompt", f"prompt has {prompt_len} tokens; the context holds {context} ({what}), "
                                           "prompt and output together")
    if limits is not None:
        limits.check(params)
    if params.stop_strings and not has_tokenizer:
        raise ValidationError("stop_strings", "stop_strings need the model's tokenizer, which it does not have")
    params.validate(vocab_size)
    if prompt_len + params.max_new_tokens > context:
        raise ContextLengthError("max_new_tokens", f"max_new_tokens={params.max_new_tokens} with a prompt of "
                                 f"{prompt_len} tokens exceeds the context of {context} tokens ({what}); "
                                 f"use at most {context - prompt_len}")
    return params
