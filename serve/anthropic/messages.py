"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the generation core.

A body's `system` and `messages` (content as text or blocks: text, tool_use, tool_result,
thinking) become a chat: an assistant's tool_use blocks its tool_calls, a user's tool_result
blocks tool messages (before the user's text), a thinking block the reasoning_content of its
message. `tools` (custom tools: name, description, input_schema), `tool_choice` (auto, any, tool,
none; disable_parallel_tool_use) and `output_config.format` become the core's tools and
constraint; `max_tokens`, `stop_sequences` and the sampling fields keep their meaning; `thinking`
with a budget is a reasoning model's thinking budget. What the API documents but this server
cannot do (server tools, images and documents, MCP servers, containers, effort) is a 400 naming
it. Cache-control marks are accepted: prompt prefixes are cached whatever they say.

The reply is built from the chat deltas `serve.openai.reply.Reply` makes (`MessageBuilder`):
text becomes text blocks, tool calls tool_use blocks (their input an object), a reasoning
model's thinking a thinking block; streamed, the builder emits Anthropic's events
(`message_start`, `content_block_start`, `content_block_delta` with text_delta,
input_json_delta or thinking_delta, `content_block_stop`, `message_delta`, `message_stop`).
The shared HTTP plumbing (body parsing, the chat reply) is the OpenAI app's (serve/openai/).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from serve.core.generation import ChatPrompt, ChoiceEvent, GenerationRequest
from serve.core.structured import MAX_TOOLS, Structured, Tool, ToolMode, check_tool
from serve.errors import ServeError, Status
from serve.openai.requests import KnownFields, ParamError
from tprt.engine.constraints import ConstraintSpec
from tprt.errors import ValidationError

# Where the core's canonical field names differ from this API's parameters.
MESSAGES_PARAMS = {"max_new_tokens": "max_tokens", "stop_strings": "stop_sequences", "prompt": "messages",
                   "chat": "messages", "adapter_id": "model", "thinking_budget": "thinking.budget_tokens"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {name: ("not supported by this server", ()) for name in ("container", "mcp_servers", "context_management",
                                                                    "diagnostics")}
_REFUSED["speed"] = ("only 'standard'", ("standard",))


class MessagesBody(KnownFields):
    """`POST /v1/messages`; a field not listed is refused by `parse_body` (or dropped when the
    server ignores unknown fields), as are those of REFUSED when set."""

    REFUSED = _REFUSED

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    # The sampling fields of the API's earlier versions, which its clients still send.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # What describes the caller or where it wants to run: accepted, the output is the same.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    # Documented, and refused when set (see `_refuse_unsupported`).
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    diagnostics: Any = None


class CountTokensBody(KnownFields):
    """`POST /v1/messages/count_tokens`: a message body without what only generation takes."""

    REFUSED = {k: v for k, v in _REFUSED.items() if k in ("mcp_servers", "context_management", "speed")}

    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    mcp_servers: Any = None
    context_management: Any = None


def _refuse_unsupported(body: MessagesBody | CountTokensBody) -> None:
    """What REFUSED cannot say (a member of an object)."""
    effort = (body.output_config or {}).get("effort")
    if effort is not None:
        raise ParamError("not supported: a reasoning model thinks as its template asks, within thinking.budget_tokens",
                         "output_config.effort")


# ----------------------------------------------------------------- content -> chat messages


def _text(value: Any, where: str) -> str:
    """Text content: a string, or text blocks."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ParamError("expected a string or a list of text blocks", where)
    out = []
    for j, block in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(block, Mapping) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, Mapping) else None
            raise ParamError(f"blocks of type {str(kind)[:40]!r} are not supported here (text blocks only)", at)
        out.append(block["text"])
    return "".join(out)


def system_message(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = _text(system, "system")
    return [{"role": "system", "content": text}] if text else []


def chat_messages(body: MessagesBody | CountTokensBody) -> list[dict[str, Any]]:
    """The system prompt and messages as chat messages (see the module docstring)."""
    out = system_message(body.system)
    for i, m in enumerate(body.messages):
        at = f"messages[{i}]"
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise ParamError(f"{str(role)[:40]!r}; user or assistant (the system prompt is `system`)", f"{at}.role")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ParamError("expected a string or a list of content blocks", f"{at}.content")
        text, calls, results, thinking = [], [], [], None
        for j, block in enumerate(content):
            where = f"{at}.content[{j}]"
            kind = block.get("type") if isinstance(block, Mapping) else None
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("input", {}), Mapping):
                    raise ParamError("expected an object of the tool's arguments", f"{where}.input")
                for key in ("id", "name"):
                    if not isinstance(block.get(key), str) or not block[key]:
                        raise ParamError("expected a non-empty string", f"{where}.{key}")
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
                    raise ParamError("expected a non-empty string", f"{where}.tool_use_id")
                result = _text(block.get("content", ""), f"{where}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
            elif kind == "thinking" and role == "assistant":
                if not isinstance(block.get("thinking"), str):
                    raise ParamError("expected a string", f"{where}.thinking")
                thinking = (thinking or "") + block["thinking"]
            else:
                why = "on a user's message" if kind in ("tool_use", "thinking") else (
                    "on an assistant's message" if kind == "tool_result" else "(text, tool_use, tool_result and "
                                                                              "thinking only)")
                raise ParamError(f"blocks of type {str(kind)[:40]!r} are not supported {why}", f"{where}.type")
        out += results  # a tool's answers come first: they follow the assistant's calls
        if text or calls or thinking is not None or not results:
            msg: dict[str, Any] = {"role": role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            if thinking is not None:
                msg["reasoning_content"] = thinking
            out.append(msg)
    if not body.messages:
        raise ParamError("at least one message is needed", "messages")
    return out


# ----------------------------------------------------------------- tools, format, thinking


def _tools(value: list[dict[str, Any]] | None) -> list[Tool]:
    tools = []
    for i, item in enumerate(value or ()):
        at = f"tools[{i}]"
        if not isinstance(item, Mapping):
            raise ParamError("expected a tool object", at)
        if item.get("type") not in (None, "custom"):
            raise ParamError(f"tools of type {str(item.get('type'))[:40]!r} are not supported (custom tools only: "
                             "the client runs them)", f"{at}.type")
        for key in ("allowed_callers", "input_examples"):
            if item.get(key):
                raise ParamError("not supported by this server", f"{at}.{key}")
        if item.get("defer_loading"):
            raise ParamError("not supported: every tool is shown to the model", f"{at}.defer_loading")
        try:
            tools.append(check_tool(item.get("name"), item.get("description"), item.get("input_schema"),
                                    {"name": f"{at}.name", "description": f"{at}.description",
                                     "parameters": f"{at}.input_schema"}))
        except ValidationError as e:
            raise ParamError(str(e), e.field) from None
    if len(tools) > MAX_TOOLS:
        raise ParamError(f"at most {MAX_TOOLS}, got {len(tools)}", "tools")
    return tools


def _tool_choice(value: dict[str, Any] | None) -> tuple[ToolMode | None, str | None, bool]:
    """(mode, the named tool, parallel calls allowed)."""
    if value is None:
        return None, None, True
    kind = value.get("type")
    parallel = not value.get("disable_parallel_tool_use", False)
    if kind == "auto":
        return "auto", None, parallel
    if kind == "any":
        return "required", None, parallel
    if kind == "none":
        return "none", None, parallel
    if kind == "tool":
        if not isinstance(value.get("name"), str):
            raise ParamError("expected the tool's name", "tool_choice.name")
        return "named", value["name"], parallel
    raise ParamError(f"{str(kind)[:40]!r}; auto, any, tool or none", "tool_choice.type")


def structured(body: MessagesBody | CountTokensBody) -> Structured:
    constraint = None
    fmt = (body.output_config or {}).get("format")
    if fmt is not None:
        if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema":
            raise ParamError("expected {type: json_schema, schema}", "output_config.format")
        constraint = ConstraintSpec.json_schema(fmt.get("schema", {}), "output_config.format.schema")
    mode, named, parallel = _tool_choice(body.tool_choice)
    try:
        return Structured.build(constraint, _tools(body.tools), mode, named, parallel, "tool_choice", "tool_choice.name")
    except ValidationError as e:
        raise ParamError(str(e), e.field) from None


def _thinking(value: dict[str, Any] | None) -> tuple[int | None, dict[str, Any]]:
    """(thinking budget, template variables) of `thinking`: enabled with budget_tokens is the
    budget; disabled asks the template not to think (Qwen3's enable_thinking); adaptive is the
    model's own way."""
    if value is None:
        return None, {}
    kind = value.get("type")
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise ParamError("expected a positive number of tokens", "thinking.budget_tokens")
        return budget, {}
    if kind == "disabled":
        return None, {"enable_thinking": False}
    if kind == "adaptive":
        return None, {}
    raise ParamError(f"{str(kind)[:40]!r}; enabled, disabled or adaptive", "thinking.type")


# ----------------------------------------------------------------- the request


@dataclass(frozen=True)
class MessagesRequest:
    request: GenerationRequest


def messages_request(body: MessagesBody | CountTokensBody, adapter_id: str) -> MessagesRequest:
    """A /v1/messages (or count_tokens) body as the core's request."""
    _refuse_unsupported(body)
    budget, kwargs = _thinking(body.thinking)
    prompt = ChatPrompt(chat_messages(body), template_kwargs=kwargs, thinking_budget=budget)
    sampling: dict[str, Any] = {}
    if isinstance(body, MessagesBody):
        sampling = {"max_new_tokens": body.max_tokens, "stop_strings": body.stop_sequences,
                    "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
    return MessagesRequest(GenerationRequest([prompt], sampling, structured(body), adapter_id))


# ----------------------------------------------------------------- the reply


class MessageBuilder:
    """One Message, built from the chat deltas of its single choice; `feed` returns the stream's
    events each step made (see the module docstring)."""

    def __init__(self, model: str, input_tokens: int) -> None:
        self.id = new_id("msg")
        self.model = model
        self.content: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the block being streamed
        self.partial_json = ""  # the open tool_use block's input so far
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage = {"input_tokens": input_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0}

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": list(self.content), "stop_reason": self.stop_reason,
                "stop_sequence": self.stop_sequence, "usage": dict(self.usage)}

    def opening(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": self.message()}, {"type": "ping"}]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self.content.append(block)
        self.open = block
        shown = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        return out + [{"type": "content_block_start", "index": len(self.content) - 1, "content_block": shown}]

    def _close(self) -> list[dict[str, Any]]:
        block, self.open = self.open, None
        if block is None:
            return []
        if block["type"] == "tool_use":
            block["input"] = _input_object(self.partial_json)
            self.partial_json = ""
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def feed(self, choice: dict[str, Any], ev: ChoiceEvent) -> list[dict[str, Any]]:
        """A chat chunk's choice ({delta, finish_reason}) and its event -> the stream's events."""
        delta, out = choice.get("delta") or {}, []
        index = len(self.content) - 1
        if delta.get("reasoning_content"):
            if self.open is None or self.open["type"] != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
                index = len(self.content) - 1
            self.open["thinking"] += delta["reasoning_content"]  # type: ignore[index]
            out.append({"type": "content_block_delta", "index": index,
                        "delta": {"type": "thinking_delta", "thinking": delta["reasoning_content"]}})
        if delta.get("content"):
            if self.open is None or self.open["type"] != "text":
                out += self._start({"type": "text", "text": ""})
                index = len(self.content) - 1
            self.open["text"] += delta["content"]  # type: ignore[index]
            out.append({"type": "content_block_delta", "index": index,
                        "delta": {"type": "text_delta", "text": delta["content"]}})
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            if call.get("id") is not None:
                out += self._start({"type": "tool_use", "id": new_id("toolu"), "name": fn.get("name", ""),
                                    "input": {}})
                index = len(self.content) - 1
            if fn.get("arguments") and self.open is not None:
                self.partial_json += fn["arguments"]
                out.append({"type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}})
        finish = choice.get("finish_reason")
        if finish is not None:
            out += self._close()
            if finish == "error":
                raise ConstraintBroken("the output constraint could not be kept (over a limit or its time budget); "
                                       "the output was cut")
            if finish == "length":  # first: a tool_use block cut short is not a call to make
                self.stop_reason = "max_tokens"
            elif any(b["type"] == "tool_use" for b in self.content):
                self.stop_reason = "tool_use"
            elif isinstance(ev.stop_reason, str):
                self.stop_reason, self.stop_sequence = "stop_sequence", ev.stop_reason
            else:
                self.stop_reason = "end_turn"
        return out

    def finish(self, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """The usage, and the stream's last events."""
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        self.usage.update(input_tokens=usage["prompt_tokens"] - cached, output_tokens=usage["completion_tokens"],
                          cache_read_input_tokens=cached)
        return [{"type": "message_delta", "delta": {"stop_reason": self.stop_reason,
                                                    "stop_sequence": self.stop_sequence},
                 "usage": {"output_tokens": self.usage["output_tokens"]}}, {"type": "message_stop"}]


def _input_object(partial_json: str) -> dict[str, Any]:
    """A tool_use block's input: its arguments' object, or {} where max_tokens cut them before
    they closed (the message then says max_tokens, as Anthropic's does; its stream already
    carried the cut text in input_json_delta events)."""
    try:
        value = json.loads(partial_json) if partial_json.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class ConstraintBroken(ServeError):
    """The output constraint failed mid-output (over a limit or its mask time budget): an
    api_error rather than a cut answer taken for a whole one."""

    status = Status.INTERNAL
