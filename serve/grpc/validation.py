"""A gRPC request -> the generation core's request (serve/core/generation.py), and the core's
field names -> the proto's field paths.

The input (prompt, chat or prompt_ids), the sampling fields, the output constraint and the chat's
tools are only read here; the core checks them by the rules every front end shares. Its errors
name canonical fields, renamed here to the paths a GenerateRequest spells (`grpc_field`: e.g.
`max_new_tokens` -> `sampling.max_new_tokens`, `messages[2].role` -> `chat.messages[2].role`).
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from serve.core.generation import (STOP_LIMITS, ChatPrompt, GenerationRequest, Prompt, TextPrompt, TokenPrompt,
                                   by_prefix, rename_field, resolve)
from serve.core.structured import MAX_TOOLS, Structured, ToolMode, check_tool
from serve.errors import InvalidArgument, ServeError, echo
from tprt.engine.constraints import ConstraintSpec
from tprt.engine.sampling import SamplingParams
from tprt.errors import ValidationError

__all__ = ["STOP_LIMITS", "field_path", "generation_request", "grpc_error", "grpc_field", "prompt_of",
           "sampling_params", "structured_of"]  # STOP_LIMITS: the core's, as gRPC applies them

# Canonical request field (tprt.engine.request) -> its path in a GenerateRequest, where that is not
# `sampling.<field>`: the one renaming between the wire and the resolver, both ways.
FIELD_PATHS = {"prompt": "prompt", "stop_strings": "sampling.stop"}
_SAMPLING = frozenset(f.name for f in fields(SamplingParams))


def field_path(field: str) -> str:
    """A canonical sampling field (tprt.engine.request) as its path in a GenerateRequest."""
    return FIELD_PATHS.get(field, f"sampling.{field}")


# A SamplingParams message's field name -> the canonical field it sets.
_FROM_WIRE = {field_path(f).removeprefix("sampling."): f for f in _SAMPLING}
_INPUT_PATHS = by_prefix({"prompt_ids": "prompt_ids.ids", "messages": "chat.messages"})


def grpc_field(field: str) -> str:
    """A canonical field of the core's errors as the proto's path."""
    if field == "constraint" or field.startswith("constraint."):  # a GenerateRequest's own, not sampling's
        return field
    if field in _SAMPLING or field in FIELD_PATHS:
        return field_path(field)
    return _INPUT_PATHS(field)


def grpc_error(e: ServeError) -> ServeError:
    """A core error as gRPC reports it: the field (and the message's first word) as the proto's path."""
    return rename_field(e, grpc_field)


def sampling_params(message: Any, prompt_len: int, context: int, vocab_size: int, has_tokenizer: bool,
                    constraint: ConstraintSpec | None = None) -> SamplingParams:
    """A SamplingParams message resolved by the core's rules (unset fields take their defaults);
    errors name the proto's field paths."""
    try:
        return resolve(_sampling_fields(message), prompt_len, context, vocab_size, has_tokenizer, constraint)
    except ServeError as e:
        raise grpc_error(e) from None


def _sampling_fields(message: Any) -> dict[str, Any]:
    fields = {_FROM_WIRE[fd.name]: value for fd, value in message.ListFields()}
    if "logit_bias" in fields:  # a protobuf map: the engine's (id, bias) pairs
        fields["logit_bias"] = tuple(sorted(fields["logit_bias"].items()))
    return fields


def prompt_of(request: Any) -> Prompt:
    """The request's `input` oneof (prompt, chat or prompt_ids) as the core's prompt."""
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidArgument("set one of prompt, chat or prompt_ids", "input")
    if which == "prompt":
        return TextPrompt(request.prompt)
    if which == "prompt_ids":
        return TokenPrompt(list(request.prompt_ids.ids))
    chat = request.chat
    messages = []
    for m in chat.messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    kwargs: Any = {}
    if chat.chat_template_kwargs:
        try:
            kwargs = json.loads(chat.chat_template_kwargs)
        except ValueError as e:
            raise InvalidArgument(f"not JSON ({e})", "chat_template_kwargs") from None
        if not isinstance(kwargs, dict):
            raise InvalidArgument("expected a JSON object of template variables", "chat_template_kwargs")
    budget = chat.thinking_budget if chat.HasField("thinking_budget") else None
    return ChatPrompt(messages, add, kwargs, budget)


def generation_request(request: Any) -> GenerationRequest:
    """A GenerateRequest as the core's request (nothing checked yet but what only the proto shows)."""
    structured = structured_of(request)
    return GenerationRequest([prompt_of(request)], _sampling_fields(request.sampling), structured, request.adapter_id)


def structured_of(request: Any) -> Structured:
    """A GenerateRequest's output constraint and its chat's tools (serve/core/structured.py), errors
    naming the request's field paths; compiled (so checked) by the generation core."""
    try:
        return _structured(request)
    except ValidationError as e:
        raise InvalidArgument(str(e), e.field) from None


def _structured(request: Any) -> Structured:
    constraint = None
    if "constraint" in request.DESCRIPTOR.fields_by_name and request.HasField("constraint"):
        constraint = _constraint(request.constraint)
    if request.WhichOneof("input") != "chat":
        return Structured.build(constraint)
    chat = request.chat
    tools = [check_tool(t.name, t.description,
                        _json_text(t.parameters_json, f"chat.tools[{i}].parameters_json") if t.parameters_json else None,
                        {"name": f"chat.tools[{i}].name", "description": f"chat.tools[{i}].description",
                         "parameters": f"chat.tools[{i}].parameters_json"}) for i, t in enumerate(chat.tools)]
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"at most {MAX_TOOLS}, got {len(tools)}", "chat.tools")
    mode: ToolMode | None = None
    named = None
    if chat.HasField("tool_choice"):
        which = chat.tool_choice.WhichOneof("choice")
        if which == "mode":
            if chat.tool_choice.mode not in ("none", "auto", "required"):
                raise InvalidArgument(f"{echo(chat.tool_choice.mode)}; none, auto or required", "chat.tool_choice.mode")
            mode = chat.tool_choice.mode
        elif which == "function":
            mode, named = "named", chat.tool_choice.function
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
    return Structured.build(constraint, tools, mode, named, parallel, "chat.tool_choice", "chat.tool_choice.function")


def _constraint(c: Any) -> ConstraintSpec | None:
    """A Constraint message as the engine's spec (json_object false: none)."""
    kind = c.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument("set one of json_schema, json_object, regex, choice, grammar", "constraint")
    if kind == "json_schema":
        return ConstraintSpec.json_schema(_json_text(c.json_schema, "constraint.json_schema"), "constraint.json_schema")
    if kind == "json_object":
        return ConstraintSpec.json_object("constraint.json_object") if c.json_object else None
    if kind == "choice":
        return ConstraintSpec.choice(list(c.choice.options), "constraint.choice.options")
    if kind == "regex":
        return ConstraintSpec.regex(c.regex, "constraint.regex")
    return ConstraintSpec.grammar(c.grammar, "constraint.grammar")


def _json_text(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InvalidArgument(f"{field}: not JSON ({str(e)[:100]})", field) from None
