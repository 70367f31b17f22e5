"""OpenAI's Responses API (`POST /v1/responses`) on the generation core.

A body's `input` (text, or items: messages, function calls and their outputs, reasoning) and
`instructions` become a chat (`conversation_messages`), with the conversation of the response
named by `previous_response_id` in front of it (its input and output items, not its
instructions, as OpenAI's API carries them); function `tools`, `tool_choice`,
`parallel_tool_calls` and `text.format` become the core's tools and constraint
(serve/core/structured.py); the sampling fields keep their meaning. What the API documents but
this server cannot do (hosted tools, images and files, background runs, reasoning effort) is a
400 naming the field.

The reply is built from the chat deltas `serve.openai.reply.Reply` makes (`ResponseBuilder`):
text becomes a message item with an `output_text` part, tool calls `function_call` items, a
reasoning model's thinking a `reasoning` item; streamed, the builder emits the named events
(`response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ..., `response.completed`), each with its sequence
number. A stored response (`store`, true by default) is kept by serve/openai/response_store.py.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from serve.core.generation import ChatPrompt, GenerationRequest
from serve.core.structured import MAX_TOOLS, Structured, Tool, ToolMode, check_tool
from serve.openai.reply import json_logprob
from serve.openai.requests import KnownFields, ParamError, StreamOptions, logit_bias_pairs
from serve.openai.structured import json_schema_format
from tprt.engine.constraints import ConstraintSpec
from tprt.errors import ValidationError

MAX_ITEMS = 1024  # input items of one request, the previous responses' included

# Where the core's canonical field names differ from this API's parameters.
RESPONSES_PARAMS = {"max_new_tokens": "max_output_tokens", "prompt": "input", "chat": "input", "messages": "input",
                    "adapter_id": "model"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesBody(KnownFields):
    """`POST /v1/responses`; a field not listed is refused by `parse_body` (or dropped when the
    server ignores unknown fields), as are those of REFUSED when set."""

    REFUSED = {
        "background": ("background responses are not supported; ask without it (stream to watch a long one)",
                       (False,)),
        "background_options": ("background responses are not supported", ()),
        "conversation": ("conversations are not stored; chain responses with previous_response_id", ()),
        "prompt": ("stored prompt templates are not supported; send input and instructions", ()),
        "context_management": ("server-side compaction is not supported", ()),
        "max_tool_calls": ("not supported: only function tools are called, by the client", ()),
        "access_programs": ("not supported by this server", ()),
        "image": ("image generation is not supported", ()),
        "moderation": ("moderation is not supported", ()),
    }

    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    store: bool | None = True
    truncation: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    background_options: Any = None
    access_programs: Any = None
    image: Any = None
    moderation: Any = None
    # Fields that describe the caller or hint at caching (prefixes are cached whatever they say):
    # accepted, and they change nothing in the output, as in OpenAI's API.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # Our extras (openai's `extra_body`), as for chat.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    speculate: bool | None = None


INCLUDABLE = frozenset({"message.output_text.logprobs", "reasoning.encrypted_content"})


def _refuse_unsupported(body: ResponsesBody) -> None:
    """400 naming a documented field this server cannot honour in the value given (beyond
    REFUSED, which parse_body checks)."""
    if body.truncation not in (None, "disabled", "auto"):
        raise ParamError(f"{body.truncation!r:.40}; 'disabled' or 'auto'", "truncation")
    if body.truncation == "auto":
        raise ParamError("'auto' (dropping the oldest items to fit) is not supported; a conversation that does not "
                         "fit the context is refused", "truncation")
    if body.reasoning is not None:
        for key in ("effort", "summary", "generate_summary"):
            if getattr(body.reasoning, key) is not None:
                raise ParamError("not supported: a reasoning model's thinking is returned whole, as a reasoning "
                                 "item's reasoning_text", f"reasoning.{key}")
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise ParamError("only 'medium' (the model's own length)", "text.verbosity")
    for i, what in enumerate(body.include or ()):
        if what not in INCLUDABLE:
            raise ParamError(f"{what!r:.60} cannot be included; one of {', '.join(sorted(INCLUDABLE))}",
                             f"include[{i}]")


# ----------------------------------------------------------------- input items -> chat messages


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or parts of text (input_text, output_text, refusal)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ParamError("expected a string or a list of content parts", where)
    out = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, Mapping):
            raise ParamError("expected a content part object", at)
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            text = part.get("text")
        elif kind == "refusal":
            text = part.get("refusal")
        else:
            raise ParamError(f"content of type {str(kind)[:40]!r} is not supported (text only)", f"{at}.type")
        if not isinstance(text, str):
            raise ParamError("expected a string", f"{at}.{'refusal' if kind == 'refusal' else 'text'}")
        out.append(text)
    return "".join(out)


def _string(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise ParamError("expected a non-empty string", f"{where}.{key}")
    return value


def input_items(value: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The body's `input` as items ({type: message, role, content} for a text)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value)


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as a stored response lists them: each with an id (its own, or a new one)."""
    return [item if "id" in item else {"id": new_id(_ID_PREFIX.get(str(item.get("type", "message")), "item")), **item}
            for item in items]


def conversation_messages(items: list[dict[str, Any]], instructions: str | None,
                          where: str = "input") -> list[dict[str, Any]]:
    """Items as chat messages: messages by role (developer is system), function calls as an
    assistant's tool_calls (consecutive calls in one message), their outputs as tool messages, a
    reasoning item's text as the next assistant message's reasoning_content. `instructions` is
    the first, system, message."""
    if len(items) > MAX_ITEMS:
        raise ParamError(f"{len(items)} items; at most {MAX_ITEMS} (previous responses' included)", where)
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning: str | None = None
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, Mapping):
            raise ParamError("expected an item object", at)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ParamError(f"{str(role)[:40]!r}; user, assistant, system or developer", f"{at}.role")
            msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                   "content": _text_of(item.get("content"), f"{at}.content")}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            messages.append(msg)
        elif kind == "function_call":
            arguments = item.get("arguments", "")
            if not isinstance(arguments, str):
                raise ParamError("expected the arguments' JSON text", f"{at}.arguments")
            call = {"id": _string(item, "call_id", at), "type": "function",
                    "function": {"name": _string(item, "name", at), "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
                last["tool_calls"] = [call]  # the text an answer had before its calls
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                messages.append(msg)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", at),
                             "content": _text_of(output, f"{at}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise ParamError("expected a list of reasoning_text parts", f"{at}.content")
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, Mapping))
        elif kind == "item_reference":
            raise ParamError("item references are not supported; send the item, or continue with "
                             "previous_response_id", f"{at}.type")
        else:
            raise ParamError(f"items of type {str(kind)[:40]!r} are not supported (message, function_call, "
                             "function_call_output, reasoning)", f"{at}.type")
    if not messages:
        raise ParamError("at least one input item (or instructions) is needed", where)
    return messages


# ----------------------------------------------------------------- tools and format


def _tools(value: list[dict[str, Any]] | None) -> list[Tool]:
    tools = []
    for i, item in enumerate(value or ()):
        at = f"tools[{i}]"
        if not isinstance(item, Mapping):
            raise ParamError("expected a tool object", at)
        if item.get("type") != "function":
            raise ParamError(f"tools of type {str(item.get('type'))[:40]!r} are not supported (function tools "
                             "only: the client runs them)", f"{at}.type")
        if item.get("strict") is not None and not isinstance(item.get("strict"), bool):
            raise ParamError("expected true or false", f"{at}.strict")
        try:
            tools.append(check_tool(item.get("name"), item.get("description"), item.get("parameters"),
                                    {k: f"{at}.{k}" for k in ("name", "description", "parameters")}))
        except ValidationError as e:
            raise ParamError(str(e), e.field) from None
    if len(tools) > MAX_TOOLS:
        raise ParamError(f"at most {MAX_TOOLS}, got {len(tools)}", "tools")
    return tools


def _tool_choice(value: Any) -> tuple[ToolMode | None, str | None]:
    if value is None:
        return None, None
    if value in ("none", "auto", "required"):
        return value, None
    if isinstance(value, Mapping) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return "named", value["name"]
    raise ParamError("expected none, auto, required or {type: function, name}", "tool_choice")


def structured(body: ResponsesBody) -> Structured:
    """The body's tools, tool choice and `text.format` as the core's Structured."""
    constraint = None
    fmt = body.text.format if body.text is not None else None
    try:
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_schema":
                constraint = json_schema_format(fmt, "text.format")
            elif kind == "json_object":
                constraint = ConstraintSpec.json_object("text.format")
            elif kind != "text":
                raise ParamError(f"{str(kind)[:40]!r}; text, json_object or json_schema", "text.format.type")
        mode, named = _tool_choice(body.tool_choice)
        return Structured.build(constraint, _tools(body.tools), mode, named, body.parallel_tool_calls is not False,
                                "tool_choice", "tool_choice.name")
    except ValidationError as e:
        raise ParamError(str(e), e.field) from None


# ----------------------------------------------------------------- the request


@dataclass(frozen=True)
class ResponsesRequest:
    """A body read: the core's request, the full conversation's items (for storing), and what the
    response object repeats back."""

    request: GenerationRequest
    items: list[dict[str, Any]]  # the previous responses' items, then this body's input
    logprobs: bool


def responses_request(body: ResponsesBody, adapter_id: str, previous: list[dict[str, Any]] | None) -> ResponsesRequest:
    """A /v1/responses body as the core's request; `previous`: the conversation items of the
    response it continues."""
    _refuse_unsupported(body)
    items = (previous or []) + input_items(body.input)
    messages = conversation_messages(items, body.instructions)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    logprobs = body.top_logprobs is not None or "message.output_text.logprobs" in (body.include or ())
    sampling = {"temperature": body.temperature, "top_p": body.top_p, "max_new_tokens": body.max_output_tokens,
                "top_k": body.top_k, "min_p": body.min_p, "repetition_penalty": body.repetition_penalty,
                "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
                "logit_bias": logit_bias_pairs(body.logit_bias), "seed": body.seed, "stop_strings": stop,
                "logprobs": logprobs or None, "top_logprobs": body.top_logprobs if logprobs else None,
                "ignore_eos": body.ignore_eos, "stop_token_ids": body.stop_token_ids, "speculate": body.speculate}
    request = GenerationRequest([ChatPrompt(messages)], sampling, structured(body), adapter_id)
    return ResponsesRequest(request, items, logprobs)


# ----------------------------------------------------------------- the response


def _usage(usage: dict[str, Any] | None, reasoning_tokens: int) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage["total_tokens"]}


def _tool_object(t: Tool) -> dict[str, Any]:
    return {"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
            "strict": True}


class ResponseBuilder:
    """One response object, built from the chat deltas of its single choice; `events` lists the
    streaming events each step made (see the module docstring)."""

    def __init__(self, body: ResponsesBody, req: ResponsesRequest) -> None:
        self.id = new_id("resp")
        self.body = body
        self.req = req
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.sequence = 0
        self.status = "in_progress"
        self.incomplete: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None
        self.reasoning_chars = 0

    # ----------------------------------------------------------------- the object

    def response(self) -> dict[str, Any]:
        b = self.body
        fmt = (b.text.format if b.text is not None and b.text.format is not None else {"type": "text"})
        structured = self.req.request.structured
        choice: Any = structured.tool_mode if structured.tool_mode != "named" else {
            "type": "function", "name": structured.forced[0].name}
        if b.tool_choice is None and not structured.tools:
            choice = "auto"
        return {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
                "background": False, "error": self.error, "incomplete_details": self.incomplete,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "max_tool_calls": None,
                "model": b.model, "output": list(self.output), "parallel_tool_calls": b.parallel_tool_calls is not False,
                "previous_response_id": b.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "service_tier": "default", "store": b.store is not False, "temperature": b.temperature,
                "text": {"format": fmt, "verbosity": "medium"}, "tool_choice": choice,
                "tools": [_tool_object(t) for t in structured.tools], "top_logprobs": b.top_logprobs,
                "top_p": b.top_p, "truncation": "disabled", "usage": self.usage, "user": b.user,
                "metadata": b.metadata or {}, "safety_identifier": b.safety_identifier,
                "prompt_cache_key": b.prompt_cache_key}

    def conversation(self) -> list[dict[str, Any]]:
        """The items a response continuing this one starts from: the input, then the output."""
        return self.req.items + self.output

    # ----------------------------------------------------------------- events

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self.output.append(item)
        self.open = item
        index = len(self.output) - 1
        out.append(self._event("response.output_item.added", output_index=index, item=_shown(item)))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=_shown(item["content"][0])))
        elif item["type"] == "reasoning":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=_shown(item["content"][0])))
        return out

    def _close(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output) - 1
        item["status"] = "completed"
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                text=part["text"], logprobs=part["logprobs"]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part)]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out += [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=part["text"]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part)]
            del item["status"]  # reasoning items have none
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def feed(self, choice: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat chunk's choice ({delta, logprobs, finish_reason}) -> the events it makes."""
        delta, out = choice.get("delta") or {}, []
        index = len(self.output) - 1
        if delta.get("reasoning_content"):
            if self.open is None or self.open["type"] != "reasoning":
                out += self._start({"id": new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                                    "content": [{"type": "reasoning_text", "text": ""}]})
                index = len(self.output) - 1
            text = delta["reasoning_content"]
            self.open["content"][0]["text"] += text  # type: ignore[index]
            self.reasoning_chars += len(text)
            out.append(self._event("response.reasoning_text.delta", item_id=self.open["id"],  # type: ignore[index]
                                   output_index=index, content_index=0, delta=text))
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                out += self._start({"id": new_id("msg"), "type": "message", "status": "in_progress",
                                    "role": "assistant", "content": [
                                        {"type": "output_text", "text": "", "annotations": [], "logprobs": []}]})
                index = len(self.output) - 1
            part = self.open["content"][0]  # type: ignore[index]
            part["text"] += delta["content"]
            logprobs = _logprobs(choice.get("logprobs")) if self.req.logprobs else []
            part["logprobs"] += logprobs
            out.append(self._event("response.output_text.delta", item_id=self.open["id"],  # type: ignore[index]
                                   output_index=index, content_index=0, delta=delta["content"], logprobs=logprobs))
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            if call.get("id") is not None:  # a new call
                out += self._start({"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                                    "call_id": call["id"], "name": fn.get("name", ""), "arguments": ""})
                index = len(self.output) - 1
            if fn.get("arguments") and self.open is not None:
                self.open["arguments"] += fn["arguments"]
                out.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                       output_index=index, delta=fn["arguments"]))
        if choice.get("finish_reason") is not None:
            out += self._close()
            if choice["finish_reason"] == "length":
                self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
            elif choice["finish_reason"] == "error":  # the output constraint failed mid-output
                self.status = "failed"
                self.error = {"code": "constraint_error", "message": "the output constraint could not be kept (over "
                              "a limit or its time budget); the output is cut"}
            else:
                self.status = "completed"
        return out

    def finish(self, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """The last event: response.completed, .incomplete or .failed."""
        self.usage = _usage(usage, self._reasoning_tokens(usage))
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(self.status,
                                                                                          "response.failed")
        return [self._event(kind, response=self.response())]

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """A stream's end after an error: the items so far, and the error."""
        self.status, self.error = "failed", {"code": error.get("code") or error.get("type") or "server_error",
                                             "message": error["message"]}
        return self._close() + [self._event("response.failed", response=self.response())]

    def _reasoning_tokens(self, usage: dict[str, Any]) -> int:
        """Output tokens that were thinking: in proportion of characters (the split is by text)."""
        chars = self.reasoning_chars + sum(len(p.get("text", "")) for it in self.output if it["type"] == "message"
                                           for p in it["content"]) + sum(len(it.get("arguments", ""))
                                                                         for it in self.output)
        if not self.reasoning_chars or not chars:
            return 0
        return round(usage["completion_tokens"] * self.reasoning_chars / chars)


def _shown(obj: dict[str, Any]) -> dict[str, Any]:
    """A copy of an item or part as it stands (the stream's events must not change later)."""
    return json.loads(json.dumps(obj))


def _logprobs(chunk: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A chat chunk's logprobs as the Responses API's (token, logprob, bytes, top_logprobs)."""
    if not chunk:
        return []
    return [{"token": e["token"], "logprob": json_logprob(e["logprob"]) if e["logprob"] is not None else None,
             "bytes": e.get("bytes", list(e["token"].encode())),
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes", [])}
                              for t in e.get("top_logprobs", [])]} for e in chunk.get("content", [])]
