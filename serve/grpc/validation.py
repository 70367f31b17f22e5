"""Protobuf requests -> checked engine inputs; every mistake names its field.

The input (prompt, chat or prompt_ids) is read and checked here; the sampling fields are only
renamed (FIELD_PATHS) and resolved by `tprt.engine.request`, the resolver every front end shares.
INVALID_ARGUMENT for a bad value (the field path as the proto spells it, e.g. `sampling.top_p`),
OUT_OF_RANGE when the prompt, or prompt plus an explicit max_new_tokens, does not fit the
context (text too long to fit is refused by its size, before it is tokenized). Nothing here touches the engine: handlers call these before a request is queued, so a
client mistake never reaches the scheduler (and never becomes INTERNAL).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from serve.errors import InvalidArgument, OutOfRange, echo
from serve.core.structured import Structured, encode_tool_chat
from tprt.engine.constraints import ConstraintSpec
from tprt.engine.request import ContextLengthError, StopLimits, resolve_sampling
from tprt.engine.sampling import SamplingParams
from tprt.errors import ConfigError, ValidationError
from tprt.text.chat import NoChatTemplateError
from tprt.text.tokenizer import Tokenizer

STOP_LIMITS = StopLimits()  # requests come from the network: cap their stop conditions
MAX_CHAT_MESSAGES = 1024
ROLES = ("system", "user", "assistant", "tool")
# Canonical request field (tprt.engine.request) -> its path in a GenerateRequest, where that is not
# `sampling.<field>`: the one renaming between the wire and the resolver, both ways.
FIELD_PATHS = {"prompt": "prompt", "stop_strings": "sampling.stop"}


def field_path(field: str) -> str:
    """A canonical request field (tprt.engine.request) as its path in a GenerateRequest."""
    return FIELD_PATHS.get(field, f"sampling.{field}")


# A SamplingParams message's field name -> the canonical field it sets.
_FROM_WIRE = {field_path(f.name).removeprefix("sampling."): f.name for f in fields(SamplingParams)}


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
            raise InvalidArgument(f"role {echo(m.role)} is not one of {', '.join(ROLES)}", f"{field}.messages[{i}].role")
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in m.tool_calls]
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return out, add


def structured_of(request: Any) -> Structured:
    """A GenerateRequest's output constraint and its chat's tools (serve/core/structured.py), with
    errors renamed to the request's field paths; not yet compiled (see `check_structured`)."""
    fields: dict[str, Any] = {}
    if "constraint" in request.DESCRIPTOR.fields_by_name and request.HasField("constraint"):
        c = request.constraint
        kind = c.WhichOneof("kind")
        if kind is None:
            raise InvalidArgument("set one of json_schema, json_object, regex, choice, grammar", "constraint")
        if kind == "json_schema":
            fields["structured_outputs"] = {"json": _json_text(c.json_schema, "constraint.json_schema")}
        elif kind == "json_object":
            fields["response_format"] = {"type": "json_object" if c.json_object else "text"}
        elif kind == "choice":
            fields["structured_outputs"] = {"choice": list(c.choice.options)}
        else:
            fields["structured_outputs"] = {kind: getattr(c, kind)}
    if request.WhichOneof("input") == "chat":
        chat = request.chat
        if chat.tools:
            fields["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description,
                "parameters": _json_text(t.parameters_json, f"chat.tools[{i}].parameters_json")
                if t.parameters_json else None}} for i, t in enumerate(chat.tools)]
        if chat.HasField("tool_choice"):
            which = chat.tool_choice.WhichOneof("choice")
            if which == "mode":
                fields["tool_choice"] = chat.tool_choice.mode
            elif which == "function":
                fields["tool_choice"] = {"type": "function", "function": {"name": chat.tool_choice.function}}
        if chat.HasField("parallel_tool_calls"):
            fields["parallel_tool_calls"] = chat.parallel_tool_calls
    try:
        return Structured.from_fields(**fields)
    except ValidationError as e:
        path = _structured_path(e.field)
        raise InvalidArgument(path + str(e)[len(e.field):], path) from None


def check_structured(structured: Structured, compile: Callable[[ConstraintSpec], object] | None) -> None:
    """Compiles (so checks) every spec of `structured`; INVALID_ARGUMENT naming the field."""
    for spec in structured.specs():
        path = _structured_path(spec.field)
        if compile is None:
            raise InvalidArgument(f"{path}: output constraints need the model's tokenizer, which it does not have",
                                  path)
        try:
            compile(spec)
        except ValidationError as e:
            raise InvalidArgument(path + str(e)[len(e.field):], path) from None


# serve/core/structured.py's (OpenAI's) field names -> a GenerateRequest's, by prefix.
_STRUCTURED_PATHS = (("structured_outputs.json", "constraint.json_schema"), ("structured_outputs.choice",
                     "constraint.choice.options"), ("structured_outputs", "constraint"),
                     ("response_format", "constraint.json_object"), ("tool_choice.function.name",
                     "chat.tool_choice.function"), ("tool_choice", "chat.tool_choice"),
                     ("parallel_tool_calls", "chat.parallel_tool_calls"))


def _structured_path(field: str) -> str:
    if field.startswith("tools["):  # tools[i].function.parameters -> chat.tools[i].parameters_json
        head, _, rest = field.partition("].")
        rest = {"function.parameters": "parameters_json", "function.name": "name",
                "function.description": "description"}.get(rest, rest)
        return f"chat.{head}]" + (f".{rest}" if rest else "")
    if field == "tools":
        return "chat.tools"
    for ours, theirs in _STRUCTURED_PATHS:
        if field == ours or field.startswith(ours + "."):
            return theirs + field[len(ours):]
    return field


def _json_text(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InvalidArgument(f"{field}: not JSON ({str(e)[:100]})", field) from None


def _encode_chat(tok: Tokenizer, chat: Any, structured: Structured | None = None) -> list[int]:
    messages, add = chat_messages(chat)
    try:
        if structured is not None and (structured.tools or any("tool_calls" in m for m in messages)):
            return encode_tool_chat(tok, messages, structured)
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


def text_byte_limit(tok: Tokenizer, context: int) -> int:
    """The most UTF-8 bytes a text of `context` tokens can have: `context` times the longest
    vocabulary entry's bytes. A longer text cannot fit, so it is refused before it is tokenized:
    the work a request can ask of the tokenizer is bounded. A bound, not a guess, for tokenizers
    that never delete characters (Llama's byte-level BPE and sentencepiece): each spells the text
    of a token in its vocabulary entry, in at least as many bytes."""
    entries = (tok.id_to_token(i) or "" for i in range(tok.vocab_size))
    return context * max(1, max((len(e.encode("utf-8")) for e in entries), default=1))


def _check_text_size(size: int, limit: int | None, field: str) -> None:
    if limit is not None and size > limit:
        raise OutOfRange(f"{size} bytes of text cannot fit the context (at most {limit} bytes)", field)


def prompt_ids(request: Any, tok: Tokenizer | None, vocab_size: int, add_special_tokens: bool = True,
               max_text_bytes: int | None = None, structured: Structured | None = None) -> list[int]:
    """The token ids of a request's `input` oneof (prompt, chat or prompt_ids); text over
    `max_text_bytes` (text_byte_limit) is refused with OUT_OF_RANGE before it is tokenized."""
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidArgument("set one of prompt, chat or prompt_ids", "input")
    if which == "prompt":
        if not request.prompt:
            raise InvalidArgument("the prompt is empty", "prompt")
        _check_text_size(len(request.prompt.encode("utf-8")), max_text_bytes, "prompt")
        ids = _need_tokenizer(tok, "prompt").encode(request.prompt, add_special_tokens=add_special_tokens)
    elif which == "chat":
        size = sum(len(m.content.encode("utf-8")) + len(m.role.encode("utf-8")) for m in request.chat.messages)
        _check_text_size(size, max_text_bytes, "chat.messages")
        ids = _encode_chat(_need_tokenizer(tok, "chat"), request.chat, structured)
    else:
        ids = list(request.prompt_ids.ids)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size - 1}]",
                                  "prompt_ids.ids")
    if not ids:
        raise InvalidArgument("the prompt has no tokens", which if which != "prompt_ids" else "prompt_ids.ids")
    return ids


def sampling_params(pb: Any, prompt_len: int, context: int, vocab_size: int, has_tokenizer: bool,
                    constraint: ConstraintSpec | None = None) -> SamplingParams:
    """SamplingParams from the proto message (unset fields take their defaults) and the request's
    output constraint, resolved and checked by `tprt.engine.request.resolve_sampling` with the
    server's stop limits; errors are renamed to the proto's field paths (OUT_OF_RANGE when the
    context is too short)."""
    given = {_FROM_WIRE[fd.name]: value for fd, value in pb.ListFields()}
    given["constraint"] = constraint
    try:
        return resolve_sampling(given, prompt_len, context, vocab_size, what="context_length",
                                has_tokenizer=has_tokenizer, limits=STOP_LIMITS)
    except ValidationError as e:
        path = field_path(e.field)
        error = OutOfRange if isinstance(e, ContextLengthError) else InvalidArgument
        raise error(f"{path}: {e}", path) from None
