"""Structured outputs and tool calling for the front ends: the request's fields -> one
`ConstraintSpec` (tprt.engine.constraints), tools -> the chat template's `tools` and the
constraint of a forced call, and generated text -> tool calls.

Protocol-neutral: each front end reads its own wire shape into a `ConstraintSpec`, `Tool`s
(`check_tool`) and a tool choice, and `Structured.build` puts them together (OpenAI's chat and
completions fields: serve/openai/structured.py; gRPC's: serve/grpc/validation.py; the Responses
and Anthropic Messages APIs: serve/openai/responses.py, serve/anthropic/). Every error is a
`ValidationError` whose field is the path the front end gave (its own spelling), so nothing is
renamed afterwards.

Tool calls are written in the model family's own syntax (`ToolSyntax`, chosen from its chat
template by `tool_syntax`): Llama 3.1's JSON tool calls, `{"name": ..., "parameters": {...}}`
(several, under "required" with parallel_tool_calls, as a JSON array of them; a leading
`<|python_tag|>` is allowed), Hermes-style calls, as Qwen2/2.5/3 templates ask,
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (several, one after another on
their own lines), or Mistral's, `[TOOL_CALLS]` (a control token, usually left out of the text)
and a JSON array of `{"name": ..., "arguments": {...}}`. A named function is called exactly once. With
`tool_choice` "required" or a
named function the output is constrained to that shape, each call's parameters to its function's
JSON Schema; with "auto" the model chooses, and text that is exactly such a call (or an array of
them) naming a known function is returned as tool calls; with "none" the tools are shown to the
template but the output is free text.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from tprt.engine.constraints import ConstraintSpec
from tprt.errors import ValidationError

MAX_TOOLS = 128
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
ToolMode = Literal["none", "auto", "required", "named"]
ToolSyntax = Literal["json", "hermes", "mistral"]  # Llama 3.1's JSON calls; <tool_call> blocks (Qwen); Mistral's
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1 may open a call with it
MISTRAL_ID_CHARS = 9  # Mistral's templates refuse tool call ids of any other length


def tool_syntax(chat_template: str | None) -> ToolSyntax:
    """The call syntax a chat template asks its model for: Hermes blocks when it names
    `<tool_call>` (Qwen2, Qwen2.5, Qwen3 and their derivatives), Mistral's when it names
    `[TOOL_CALLS]`, else Llama 3.1's JSON."""
    if chat_template and HERMES_OPEN in chat_template:
        return "hermes"
    return "mistral" if chat_template and MISTRAL_CALLS in chat_template else "json"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON Schema for the arguments object
    parameters_field: str = "parameters"  # where the request gave the schema (its compile errors name it)
    name_field: str = "name"  # where the request named it

    def as_template_tool(self) -> dict[str, Any]:
        """The HF chat-template convention for one tool."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI returns it


@dataclass(frozen=True)
class Structured:
    """What a request asks of its output's shape: a constraint (or None) and its tools."""

    constraint: ConstraintSpec | None
    tools: tuple[Tool, ...] = ()
    tool_mode: ToolMode = "none"
    parallel_tool_calls: bool = True
    syntax: ToolSyntax = "json"  # how calls are written (`with_syntax`: the model's)
    forced: tuple[Tool, ...] = ()  # the tools a forced call (required, named) chooses from
    choice_field: str = "tool_choice"  # where the request chose the tool (a forced call's constraint names it)

    def with_syntax(self, syntax: ToolSyntax) -> Structured:
        """The same request for a model that writes calls in `syntax` (a forced call's constraint
        rebuilt for it)."""
        if syntax == self.syntax:
            return self
        constraint = self.constraint
        if self.forced:
            constraint = _forced_call(self.forced, self.parallel_tool_calls and self.tool_mode == "required", syntax,
                                      self.choice_field)
        return replace(self, syntax=syntax, constraint=constraint)

    def starts_call(self, text: str) -> bool | None:
        """Under "auto": whether an answer beginning with `text` (leading space stripped) may be
        calls (held until its end), is text, or is not known yet (None)."""
        if not text:
            return None
        if self.syntax in ("json", "mistral"):  # [TOOL_CALLS] and <|python_tag|> open so too
            return text[0] in "[{" or (None if PYTHON_TAG.startswith(text) else text.startswith(PYTHON_TAG))
        if text.startswith(HERMES_OPEN):
            return True
        return None if HERMES_OPEN.startswith(text) else False

    @property
    def expects_tool_calls(self) -> bool:
        """The output is tool calls for sure (required or named), not maybe (auto)."""
        return self.tool_mode in ("required", "named")

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.as_template_tool() for t in self.tools] if self.tools and self.tool_mode != "none" else None

    @staticmethod
    def build(constraint: ConstraintSpec | None = None, tools: Sequence[Tool] = (), mode: ToolMode | None = None,
              named: str | None = None, parallel_tool_calls: bool = True,
              choice_field: str = "tool_choice", named_field: str | None = None) -> Structured:
        """A request's output constraint and tools, as a front end read them: `mode` None is
        "auto" with tools and "none" without; "named" calls the tool `named`. A forced call
        (required, named) is a constraint of its own, so it cannot go with another; errors name
        `choice_field` (the front end's spelling of its tool choice) or `named_field` (of the named
        tool; `choice_field`.name by default)."""
        if mode is None:
            mode = "auto" if tools else "none"
        if mode != "none" and not tools:
            what = f"calling {str(named)[:64]!r}" if mode == "named" else repr(mode)
            raise ValidationError(choice_field, f"{choice_field}: {what} needs tools")
        if mode == "named" and not any(t.name == named for t in tools):
            field = named_field or choice_field + ".name"
            raise ValidationError(field, f"{field}: {str(named)[:64]!r} is not one of the tools")
        for i, t in enumerate(tools):
            if any(u.name == t.name for u in tools[:i]):
                raise ValidationError(t.name_field, f"{t.name_field}: {t.name!r} is defined twice")
        if len(tools) > MAX_TOOLS:
            raise ValidationError("tools", f"tools: at most {MAX_TOOLS}, got {len(tools)}")
        forced: tuple[Tool, ...] = ()
        if mode in ("required", "named"):
            # A named function is called exactly once (as OpenAI does); "required" may call several.
            forced = tuple(t for t in tools if mode == "required" or t.name == named)
            if constraint is not None:
                raise ValidationError(choice_field, f"{choice_field}: only one output constraint per request, got "
                                                    f"several ({constraint.field.split('.')[0]}, {choice_field})")
            constraint = _forced_call(forced, parallel_tool_calls and mode == "required", "json", choice_field)
        return Structured(constraint, tuple(tools), mode, parallel_tool_calls, "json", forced, choice_field)

    def specs(self) -> list[ConstraintSpec]:
        """Every spec to compile (and so check) before the request is queued: the constraint and
        each tool's parameter schema (a tool whose parameters cannot be enforced is refused even
        under "auto", where it might be called)."""
        specs = [self.constraint] if self.constraint is not None else []
        return specs + [ConstraintSpec.json_schema(t.parameters, t.parameters_field) for t in self.tools]

    def tool_calls(self, text: str) -> list[ToolCall] | None:
        """The tool calls `text` is, or None when it is not tool calls (always None without tools)."""
        if self.tool_mode == "none" or not self.tools:
            return None
        names = {t.name for t in self.tools}
        if self.syntax == "hermes":
            return parse_hermes_calls(text, names)
        calls = parse_tool_calls(text, names)
        if calls is not None and self.syntax == "mistral":  # ids as its template takes them back
            calls = [replace(c, id=new_call_id("mistral")) for c in calls]
        return calls


def check_tool(name: Any, description: Any, parameters: Any, fields: Mapping[str, str]) -> Tool:
    """One tool as a front end read it, checked: a name of 1-64 characters of a-z, A-Z, 0-9, _, -
    and .; a string description (None: ""); parameters an object's JSON Schema (None: no
    arguments). Errors name `fields["name"]`, `fields["description"]` or `fields["parameters"]`,
    the request's own paths."""
    if not isinstance(name, str) or not name or len(name) > 64 or not set(name) <= NAME_CHARS:
        raise ValidationError(fields["name"], f"{fields['name']}: expected 1-64 characters of a-z, A-Z, 0-9, _, - "
                                              "and .")
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise ValidationError(fields["description"], f"{fields['description']}: expected a string")
    where = fields["parameters"]
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping):
        raise ValidationError(where, f"{where}: expected a JSON Schema object")
    if parameters.get("type", "object") != "object":  # arguments are an object of named values
        raise ValidationError(where, f"{where}: expected an object schema ({{\"type\": \"object\", \"properties\": "
                                     f"...}}), got type {str(parameters['type'])[:40]!r}")
    ConstraintSpec.json_schema(parameters, where)  # plain JSON; compiled later
    return Tool(name, description, dict(parameters), where, fields["name"])


def _call_schema(tool: Tool, key: str = "parameters") -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool.name}, key: tool.parameters},
            "required": ["name", key], "additionalProperties": False}


def _calls_schema(tools: Sequence[Tool], parallel: bool) -> dict[str, Any]:
    """One call of any of `tools` (or, when parallel, also a non-empty array of calls)."""
    one = _call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [_call_schema(t) for t in tools]}
    return {"anyOf": [one, {"type": "array", "items": one, "minItems": 1}]} if parallel else one


def _forced_call(tools: Sequence[Tool], several: bool, syntax: ToolSyntax, field: str) -> ConstraintSpec:
    """The constraint of a forced call of one of `tools` (or, with `several`, one or more) in
    `syntax`: a JSON Schema (for Mistral an array of calls), or for Hermes a grammar of <tool_call>
    blocks around the call's JSON."""
    if syntax == "json":
        return ConstraintSpec.json_schema(_calls_schema(tools, several), field)
    if syntax == "mistral":
        one = [_call_schema(t, "arguments") for t in tools]
        array = {"type": "array", "items": one[0] if len(one) == 1 else {"anyOf": one}, "minItems": 1}
        return ConstraintSpec.json_schema(array if several else {**array, "maxItems": 1}, field)
    one = [_call_schema(t, "arguments") for t in tools]
    schema = json.dumps(one[0] if len(one) == 1 else {"anyOf": one}, ensure_ascii=False)
    calls = 'call ("\\n" call)*' if several else "call"
    return ConstraintSpec.grammar(f'start: {calls}\ncall: "{HERMES_OPEN}\\n" %json {schema} "\\n{HERMES_CLOSE}"\n',
                                  field)


def parse_tool_calls(text: str, names: set[str] | frozenset[str]) -> list[ToolCall] | None:
    """The calls `text` holds: a JSON call `{"name", "parameters"|"arguments"}` or an array of
    them (after a [TOOL_CALLS] or <|python_tag|> written out), each naming one of `names`, with an
    object of arguments; None otherwise."""
    stripped = text.strip().removeprefix(MISTRAL_CALLS).removeprefix(PYTHON_TAG).strip()
    if not stripped or stripped[0] not in "[{":
        return None
    try:
        value = json.loads(stripped)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        args = item.get("parameters", item.get("arguments", {}))
        if not isinstance(args, dict):
            return None
        # compact, as a forced call streams it (its constraint writes compact JSON)
        arguments = json.dumps(args, ensure_ascii=False, separators=(",", ":"))
        calls.append(ToolCall(new_call_id(), item["name"], arguments))
    return calls or None


_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.DOTALL)


def parse_hermes_calls(text: str, names: set[str] | frozenset[str]) -> list[ToolCall] | None:
    """The calls `text` holds as Hermes blocks (`<tool_call>` JSON `{"name", "arguments"}`
    `</tool_call>`, only whitespace around and between them), each naming one of `names`; None
    otherwise."""
    blocks = _HERMES_BLOCK.findall(text)
    if not blocks or _HERMES_BLOCK.sub("", text).strip():
        return None
    calls = []
    for block in blocks:
        one = parse_tool_calls(block, names)
        if one is None or len(one) != 1 or not block.strip().startswith("{"):
            return None
        calls += one
    return calls


def new_call_id(syntax: ToolSyntax = "json") -> str:
    """A fresh tool call id: OpenAI's shape, or Mistral's 9 alphanumerics."""
    return secrets.token_hex(8)[:MISTRAL_ID_CHARS] if syntax == "mistral" else "call_" + secrets.token_hex(12)


def mistral_call_id(call_id: Any) -> str:
    """A caller's tool call id as Mistral's templates take it (9 alphanumerics): itself when it is
    one, else a digest of it (the same for the assistant's call and the tool's answer)."""
    text = str(call_id)
    if len(text) == MISTRAL_ID_CHARS and text.isascii() and text.isalnum():
        return text
    return hashlib.sha256(text.encode()).hexdigest()[:MISTRAL_ID_CHARS]


def template_messages(messages: Sequence[Mapping[str, Any]], syntax: ToolSyntax = "json") -> list[dict[str, Any]]:
    """OpenAI messages as chat templates expect them: an assistant's `tool_calls` with their
    arguments as objects (OpenAI sends JSON text), a tool message's `tool_call_id` and `name` kept
    (for Mistral, ids made 9 alphanumerics: `mistral_call_id`)."""
    out = []
    for i, m in enumerate(messages):
        msg = dict(m)
        if syntax == "mistral" and msg.get("tool_call_id") is not None:
            msg["tool_call_id"] = mistral_call_id(msg["tool_call_id"])
        calls = msg.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise ValidationError(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls: expected a list")
            converted = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, Mapping) else None
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                    raise ValidationError(f"messages[{i}].tool_calls[{j}]", f"messages[{i}].tool_calls[{j}]: expected "
                                          "{id, type: function, function: {name, arguments}}")
                args = fn.get("arguments", "{}")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except (ValueError, RecursionError):
                        raise ValidationError(f"messages[{i}].tool_calls[{j}].function.arguments",
                                              f"messages[{i}].tool_calls[{j}].function.arguments: not JSON") from None
                call_id = call.get("id")
                if syntax == "mistral" and call_id is not None:
                    call_id = mistral_call_id(call_id)
                converted.append({"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}})
            msg["tool_calls"] = converted
        out.append(msg)
    return out


def tools_system_prompt(tools: Sequence[Tool]) -> str:
    """For chat templates without tool support: the tools and the call format, as a system message
    (the wording of Llama 3.1's JSON tool-calling prompt, in our words)."""
    listing = "\n".join(json.dumps(t.as_template_tool(), ensure_ascii=False) for t in tools)
    return ("You can call these functions. To call one, answer with only a JSON object "
            '{"name": function name, "parameters": an object of its arguments}, and nothing else.\n' + listing)


def encode_tool_chat(tok: Any, messages: Sequence[Mapping[str, Any]], structured: Structured,
                     **template_kwargs: Any) -> list[int]:
    """The chat prompt's ids with the request's tools: through the template's own tool support
    when it has one (it reads `tools`), else as a system message (`tools_system_prompt`), with
    earlier calls written as the JSON the model is asked to produce."""
    converted = template_messages(messages, structured.syntax)
    tools = structured.template_tools()
    template = tok.chat_template or ""
    if "tool_use" in tok.chat_templates or "tools" in template:
        return list(tok.encode_chat(converted, tools=tools, **template_kwargs))
    plain = []
    for m in converted:
        calls = m.get("tool_calls")
        if calls:
            shown = [{"name": c["function"]["name"], "parameters": c["function"]["arguments"]} for c in calls]
            m = {**m, "content": json.dumps(shown[0] if len(shown) == 1 else shown, ensure_ascii=False)}
            m.pop("tool_calls")
        plain.append(m)
    if tools:
        prompt = tools_system_prompt(structured.tools)
        if plain and plain[0].get("role") == "system":
            plain[0] = {**plain[0], "content": f"{plain[0].get('content') or ''}\n\n{prompt}".lstrip()}
        else:
            plain.insert(0, {"role": "system", "content": prompt})
    return list(tok.encode_chat(plain, **template_kwargs))


@dataclass(frozen=True)
class CallDelta:
    """A piece of a streamed tool call: the call's start (`name` and `id` set, arguments "") or
    more of its arguments' JSON text."""

    index: int
    arguments: str
    name: str | None = None
    id: str | None = None


class ToolCallStream:
    """Turns the text of forced tool calls, as it streams, into OpenAI's tool-call deltas.

    The constraint makes the text compact JSON in a fixed shape, `{"name":"N","parameters":ARGS}`
    or an array of those (Hermes: `{"name":"N","arguments":ARGS}` in <tool_call> blocks; Mistral:
    an array of those), so each
    call starts once its name is complete and its arguments stream as they come (ARGS's own
    text); the wrapper's characters (brackets, tags) are never shown."""

    _START = '{"name":'

    def __init__(self, syntax: ToolSyntax = "json") -> None:
        self._marker = ',"parameters":' if syntax == "json" else ',"arguments":'  # the tags are never shown
        self._syntax = syntax
        self._text = ""
        self._pos = 0  # how far the text has been consumed
        self._index = -1  # the call being streamed
        self._in_args = False
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, delta: str) -> list[CallDelta]:
        self._text += delta
        out: list[CallDelta] = []
        while True:
            if not self._in_args:
                start = self._text.find(self._START, self._pos)
                if start < 0:
                    return out
                head = self._text[start:]
                # `{"name":"N","parameters":` with N a JSON string (names have no quotes or escapes)
                end_name = head.find('"', len(self._START) + 1)
                marker = self._marker
                if end_name < 0 or not head.startswith(marker, end_name + 1):
                    return out
                name = json.loads(head[len(self._START):end_name + 1])
                self._index += 1
                out.append(CallDelta(self._index, "", name=name, id=new_call_id(self._syntax)))
                self._pos = start + end_name + 1 + len(marker)
                self._in_args, self._depth, self._in_string, self._escaped = True, 0, False, False
                continue
            begin, i = self._pos, self._pos
            while i < len(self._text):
                c = self._text[i]
                i += 1
                if self._in_string:
                    if self._escaped:
                        self._escaped = False
                    elif c == "\\":
                        self._escaped = True
                    elif c == '"':
                        self._in_string = False
                elif c == '"':
                    self._in_string = True
                elif c in "{[":
                    self._depth += 1
                elif c in "}]":
                    self._depth -= 1
                    if self._depth == 0:
                        self._in_args = False
                        break
            if i > begin:
                out.append(CallDelta(self._index, self._text[begin:i]))
            self._pos = i
            if self._in_args:
                return out
