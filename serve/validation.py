"""Protobuf requests -> checked engine inputs; every mistake names its field.

INVALID_ARGUMENT for a bad value (the field path as the proto spells it, e.g. `sampling.top_p`),
OUT_OF_RANGE when the prompt, or prompt plus an explicit max_new_tokens, does not fit the
context. Nothing here touches the engine: handlers call these before a request is queued, so a
client mistake never reaches the scheduler (and never becomes INTERNAL).
"""

from __future__ import annotations

from typing import Any

from serve.errors import InvalidArgument, OutOfRange, invalid
from tprt.text.chat import NoChatTemplateError
from tprt.errors import ConfigError, ValidationError
from tprt.engine.sampling import SamplingParams
from tprt.text.tokenizer import Tokenizer

DEFAULT_MAX_NEW_TOKENS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_IDS = 64
MAX_CHAT_MESSAGES = 1024
ROLES = ("system", "user", "assistant", "tool")
# SamplingParams field -> the proto's name for it, where they differ.
_PROTO_NAMES = {"stop_strings": "stop"}


def chat_messages(chat: Any, field: str = "chat") -> tuple[list[dict[str, str]], bool]:
    """(messages as dicts, add_generation_prompt) from a Chat message, checked."""
    msgs = list(chat.messages)
    if not msgs:
        raise InvalidArgument("at least one message is needed", f"{field}.messages")
    if len(msgs) > MAX_CHAT_MESSAGES:
        raise InvalidArgument(f"{len(msgs)} messages; at most {MAX_CHAT_MESSAGES}", f"{field}.messages")
    out = []
    for i, m in enumerate(msgs):
        if m.role not in ROLES:
            raise InvalidArgument(f"role {m.role!r} is not one of {', '.join(ROLES)}", f"{field}.messages[{i}].role")
        out.append({"role": m.role, "content": m.content})
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return out, add


def _encode_chat(tok: Tokenizer, chat: Any) -> list[int]:
    messages, add = chat_messages(chat)
    try:
        return tok.encode_chat(messages, add_generation_prompt=add)
    except NoChatTemplateError as e:
        raise InvalidArgument(f"the model has no chat template ({e}); send a plain prompt", "chat") from None
    except ValidationError as e:
        raise InvalidArgument(str(e), "chat.messages") from None
    except ConfigError as e:  # the template itself failed on these messages
        raise InvalidArgument(str(e), "chat.messages") from None


def _need_tokenizer(tok: Tokenizer | None, field: str) -> Tokenizer:
    if tok is None:
        raise InvalidArgument("the model directory has no tokenizer; send prompt_ids", field)
    return tok


def prompt_ids(request: Any, tok: Tokenizer | None, vocab_size: int, add_special_tokens: bool = True) -> list[int]:
    """The token ids of a request's `input` oneof (prompt, chat or prompt_ids)."""
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidArgument("set one of prompt, chat or prompt_ids", "input")
    if which == "prompt":
        if not request.prompt:
            raise InvalidArgument("the prompt is empty", "prompt")
        ids = _need_tokenizer(tok, "prompt").encode(request.prompt, add_special_tokens=add_special_tokens)
    elif which == "chat":
        ids = _encode_chat(_need_tokenizer(tok, "chat"), request.chat)
    else:
        ids = list(request.prompt_ids.ids)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size - 1}]",
                                  "prompt_ids.ids")
    if not ids:
        raise InvalidArgument("the prompt has no tokens", which if which != "prompt_ids" else "prompt_ids.ids")
    return ids


def _check_stops(pb: Any) -> None:
    if len(pb.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"{len(pb.stop)} stop strings; at most {MAX_STOP_STRINGS}", "sampling.stop")
    for s in pb.stop:
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidArgument(f"stop strings must have 1 to {MAX_STOP_CHARS} characters, got {s!r:.40}",
                                  "sampling.stop")
    if len(pb.stop_token_ids) > MAX_STOP_IDS:
        raise InvalidArgument(f"{len(pb.stop_token_ids)} stop ids; at most {MAX_STOP_IDS}", "sampling.stop_token_ids")


def sampling_params(pb: Any, prompt_len: int, context: int, vocab_size: int, has_tokenizer: bool) -> SamplingParams:
    """SamplingParams from the proto message (unset fields take their defaults), validated.

    An explicit max_new_tokens that does not fit after the prompt is OUT_OF_RANGE; an unset one
    is whatever the context has left, at most DEFAULT_MAX_NEW_TOKENS."""
    if prompt_len >= context:
        raise OutOfRange(f"the prompt has {prompt_len} tokens; the context holds {context}, prompt and output "
                         "together", "prompt")
    _check_stops(pb)
    if pb.stop and not has_tokenizer:
        raise InvalidArgument("stop strings need the model's tokenizer, which it does not have", "sampling.stop")
    kw: dict[str, Any] = {name: getattr(pb, name) for name in
                          ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "max_new_tokens")
                          if pb.HasField(name)}
    explicit = "max_new_tokens" in kw
    kw.setdefault("max_new_tokens", min(DEFAULT_MAX_NEW_TOKENS, context - prompt_len))
    try:
        params = SamplingParams(stop_token_ids=tuple(pb.stop_token_ids), stop_strings=tuple(pb.stop),
                                ignore_eos=pb.ignore_eos, logprobs=pb.logprobs, top_logprobs=pb.top_logprobs,
                                **kw).validate(vocab_size)
    except ValidationError as e:
        e.field = _PROTO_NAMES.get(e.field, e.field)
        raise invalid(e, "sampling.") from None
    if explicit and prompt_len + params.max_new_tokens > context:
        raise OutOfRange(f"max_new_tokens={params.max_new_tokens} with a prompt of {prompt_len} tokens exceeds the "
                         f"context of {context}; use at most {context - prompt_len}", "sampling.max_new_tokens")
    return params
