"""OpenAI request bodies -> the generation core's request, and our errors -> OpenAI's error shape.

Like serve/grpc/validation.py for gRPC, this module only reads and renames: a body becomes a
`GenerationRequest` (serve/core/generation.py), checked by the core's rules, and an error's
canonical field is renamed to the OpenAI parameter (`max_new_tokens` -> `max_tokens`,
`prompt_ids` -> `prompt`, `adapter_id` -> `model`); what only OpenAI's API has (`echo`, `suffix`,
penalties, content parts, the `developer` role) is refused or read here.
A JSON body is read by `parse_body`: UTF-8 JSON whose strings are valid Unicode (a lone
surrogate escape is refused naming its field), checked by the pydantic models in strict mode
(`"max_tokens": "5"` is a 400, as OpenAI answers it; an int for a float is fine), a refusal
naming the parameter as OpenAI spells it (`messages[0].content`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic import ValidationError as PydanticError

from serve.core.generation import (ChatPrompt, GenerationRequest, Prompt, TextPrompt, TokenPrompt, by_prefix,
                                   rename_field)
from serve.core.structured import Structured
from serve.openai.structured import read_structured
from serve.errors import InvalidArgument, ServeError, Status, is_disk_full, status_of
from tprt.engine.sampling import MAX_TOP_LOGPROBS
from tprt.errors import ValidationError

# The core's status (what every ServeError carries) -> HTTP status and OpenAI error type.
HTTP_STATUS = {
    Status.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Status.OUT_OF_RANGE: (400, "invalid_request_error"),
    Status.FAILED_PRECONDITION: (400, "invalid_request_error"),
    Status.UNAUTHENTICATED: (401, "authentication_error"),
    Status.NOT_FOUND: (404, "invalid_request_error"),
    Status.ALREADY_EXISTS: (409, "invalid_request_error"),
    Status.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Status.CANCELLED: (499, "invalid_request_error"),
    Status.UNAVAILABLE: (503, "server_error"),
    Status.DEADLINE_EXCEEDED: (504, "server_error"),
    Status.INTERNAL: (500, "server_error"),
}


class PayloadTooLarge(ServeError):
    """A request body over --max-message-bytes (HTTP 413)."""

    status = Status.RESOURCE_EXHAUSTED


def error_body(e: BaseException) -> tuple[int, dict[str, Any], str]:
    """(HTTP status, OpenAI error JSON, outcome name for the metrics) of an exception."""
    code, message, field = status_of(e)
    status, kind = HTTP_STATUS.get(code, (500, "server_error"))
    if isinstance(e, PayloadTooLarge):
        status, kind = 413, "invalid_request_error"
    elif is_disk_full(e):  # a write that does not fit: 507 Insufficient Storage
        status, kind = 507, "server_error"
    if isinstance(e, ParamError):
        field = e.param
    elif isinstance(e, ServeError) and e.field is not None:
        field = e.field
    error_code = {401: "invalid_api_key", 404: "not_found", 429: "rate_limit_exceeded"}.get(status)
    if code == Status.OUT_OF_RANGE:
        error_code = "context_length_exceeded"
    return status, {"error": {"message": message, "type": kind, "param": field, "code": error_code}}, code.outcome


class ParamError(InvalidArgument):
    """A bad parameter, named as the OpenAI API spells it."""

    def __init__(self, message: str, param: str, error: type[ServeError] = InvalidArgument) -> None:
        super().__init__(message if message.startswith(param) else f"{param}: {message}", param)
        self.param = param
        self.status = error.status  # type: ignore[misc]  # OUT_OF_RANGE for a context overflow


# ----------------------------------------------------------------- reading a body

Body = TypeVar("Body", bound=BaseModel)

# Elements of a pydantic error location that name a member of a union (`str`, `list[int]`,
# `ContentPart`) rather than a parameter: our parameters are lower_snake_case names.
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_type_tag(part: str) -> bool:
    return part in _TYPE_NAMES or not part[:1].islower() or any(c in part for c in "[](),-")


def param_path(loc: tuple[Any, ...] | list[Any]) -> tuple[str, list[str]]:
    """(OpenAI parameter path, union members tried) of a pydantic error location:
    ('messages', 0, 'content', 'str') -> ('messages[0].content', ['str'])."""
    path, tags = "", []
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif _is_type_tag(str(part)):
            tags.append(str(part))
        else:
            path += f".{part}" if path else str(part)
    return path or "body", tags


def invalid_param(errors: list[Any]) -> ParamError:
    """One ParamError for pydantic's errors: the deepest (the union member that got furthest);
    a value that fits no member of a union says which types were expected."""
    if not errors:
        return ParamError("invalid request body", "body")
    located = [(param_path(e.get("loc", ())), e) for e in errors]
    (param, _), first = max(located, key=lambda x: x[0][0].count(".") + x[0][0].count("["))
    tried = [tags[-1] for (p, tags), _ in located if p == param and tags]
    if len(tried) > 1:
        return ParamError(f"expected {' or '.join(tried)}", param)
    return ParamError(str(first.get("msg", "invalid value")), param)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _lone_surrogate(obj: Any) -> str | None:
    """The path of the first string (key or value) in `obj` that is not valid Unicode."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, value = stack.pop()
        items: Any = ()
        if isinstance(value, dict):
            items = [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
            for k in value:
                if not _is_text(k):
                    return f"{path}.{k!r:.40}" if path else f"{k!r:.40}"
        elif isinstance(value, list):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, str) and not _is_text(value):
            return path or "body"
        stack.extend(reversed(items))
    return None


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_body(raw: bytes, model: type[Body], ignore_unknown: bool = False) -> Body:
    """A JSON request body as `model` (see the module docstring); ParamError naming the parameter.
    A body (`KnownFields`) with a field the endpoint does not know is refused, as OpenAI's API
    refuses it, naming the field; `ignore_unknown` (serve --ignore-unknown-fields) drops such
    fields instead. CPU work in proportion to the body: the caller runs it off the event loop when
    it is large."""
    try:
        obj = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise ParamError(f"the request body is not UTF-8 text (byte {e.start})", "body") from None
    except json.JSONDecodeError as e:
        raise ParamError(f"the request body is not valid JSON (line {e.lineno} column {e.colno}: {e.msg})",
                         "body") from None
    except ValueError as e:  # NaN or Infinity
        raise ParamError(f"the request body is not valid JSON ({e})", "body") from None
    except RecursionError:
        raise ParamError("the request body is nested too deeply", "body") from None
    if not isinstance(obj, dict):
        raise ParamError(f"the request body must be a JSON object, not {type(obj).__name__}", "body")
    bad = _lone_surrogate(obj)
    if bad is not None:
        raise ParamError(f"{bad}: not valid Unicode text (a lone surrogate escape such as \\ud800)", bad)
    if issubclass(model, KnownFields):
        obj = _known_fields(obj, model, "", ignore_unknown)
        if issubclass(model, ChatBody) and isinstance(obj.get("messages"), list):
            obj["messages"] = [_known_fields(m, ChatMessageBody, f"messages[{i}].", ignore_unknown)
                               if isinstance(m, dict) else m for i, m in enumerate(obj["messages"])]
    try:
        body = model.model_validate(obj, strict=True)
    except PydanticError as e:
        raise invalid_param(e.errors()) from None
    if isinstance(body, KnownFields):
        body.refuse_unsupported()
    return body


def _known_fields(obj: dict[str, Any], model: type[BaseModel], where: str, ignore_unknown: bool) -> dict[str, Any]:
    """`obj` without the fields `model` does not know: a ParamError naming the first of them,
    unless `ignore_unknown`."""
    unknown = [k for k in obj if k not in model.model_fields]
    if unknown and not ignore_unknown:
        raise ParamError(f"Unrecognized request argument supplied: {where}{unknown[0]}", where + unknown[0])
    return {k: v for k, v in obj.items() if k in model.model_fields}


# ----------------------------------------------------------------- bodies


class StreamOptions(BaseModel):
    """`stream_options`: usage in a last chunk; obfuscation (random padding OpenAI adds to stream
    events against length side channels) is not added here, so asking for it is refused."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool | None = None

    @model_validator(mode="after")
    def _no_obfuscation(self) -> StreamOptions:
        if self.include_obfuscation:
            raise ValueError("stream obfuscation is not added by this server; ask with false or without it")
        return self


class KnownFields(BaseModel):
    """A body whose fields are all listed: `parse_body` refuses any other field, naming it (or
    drops it when the server ignores unknown fields), and a field of `REFUSED` that is set to
    anything but null or one of its harmless values, saying why."""

    model_config = ConfigDict(extra="ignore")
    # Documented fields this server cannot honour: name -> (why, values that ask for nothing)
    REFUSED: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = {}

    def refuse_unsupported(self) -> None:
        for name, (why, harmless) in self.REFUSED.items():
            value = getattr(self, name)
            if value is not None and value not in harmless:
                raise ParamError(why, name)


class _Common(KnownFields):
    """Fields both chat and completions take."""

    # SGLang's extras, which its model gateway (sglang-router) sends with every request it routes,
    # at their defaults: those defaults are what this server does; any other value is refused.
    REFUSED = {
        "no_stop_trim": ("the stop string is always left out of the text (OpenAI's behaviour)", (False,)),
        "skip_special_tokens": ("special tokens are always left out of the text", (True,)),
        "return_hidden_states": ("hidden states are not returned", (False,)),
    }

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # Fields that describe the caller, or hint at caching (prefixes are cached whatever they
    # say): accepted and not acted on, as OpenAI's API acts on them (not on the output).
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # Our extras (openai's `extra_body`), as vLLM spells them.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    speculate: bool | None = None  # speculative decoding for this request (false: off); the server's otherwise
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, rank and this many alternatives
    # Output constraints (serve/core/structured.py): OpenAI's, and vLLM's extra {json, regex, choice, grammar}
    response_format: Any = None
    structured_outputs: Any = None
    # vLLM's older spellings of structured_outputs' json, regex, choice and grammar
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    no_stop_trim: bool | None = None
    skip_special_tokens: bool | None = None
    return_hidden_states: bool | None = None


class CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None  # the n most likely alternatives per token (0..20)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None  # generate this many per prompt, return the n of highest logprob per token


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessageBody(BaseModel):
    """A message; a field not listed is refused by `parse_body` (or dropped, as for the body)."""

    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's answer to that call
    # What an earlier reply carried, as OpenAI's SDK sends it back: a refusal stands for the
    # content it replaced, a reasoning model's thinking goes to the template (which may show it);
    # annotations (citations) change nothing; audio and the deprecated function_call are refused.
    refusal: str | None = None
    reasoning_content: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None


class ChatBody(_Common):
    REFUSED = {
        **_Common.REFUSED,
        "continue_final_message": ("not supported: the reply is a new assistant message", (False,)),
        "separate_reasoning": ("a reasoning model's thinking is always separated (reasoning_content)", (True,)),
        "stream_reasoning": ("a reasoning model's thinking always streams as it comes", (True,)),
        "audio": ("audio output is not supported (text only)", ()),
        "modalities": ("only [\"text\"]", (["text"],)),
        "functions": ("the deprecated functions are not supported; send them as tools", ()),
        "function_call": ("the deprecated function_call is not supported; use tool_choice", ()),
        "prediction": ("predicted outputs are not supported (speculative decoding drafts by itself: speculate)",
                       ()),
        "web_search_options": ("web search is not supported", ()),
        "moderation": ("moderation is not supported", ()),
        "reasoning_effort": ("not supported: a reasoning model thinks as its template asks (thinking_budget bounds "
                             "it)", ()),
        "verbosity": ("only 'medium' (the model's own length)", ("medium",)),
    }

    messages: list[ChatMessageBody]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more template variables (enable_thinking)
    thinking_budget: int | None = None  # a reasoning model's thinking tokens at most; then it answers
    audio: Any = None
    modalities: Any = None
    functions: Any = None
    function_call: Any = None
    prediction: Any = None
    web_search_options: Any = None
    moderation: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    continue_final_message: bool | None = None  # SGLang's and vLLM's (see REFUSED)
    separate_reasoning: bool | None = None  # SGLang's
    stream_reasoning: bool | None = None  # SGLang's


# ----------------------------------------------------------------- bodies -> the core's request


def _structured(fields: dict[str, Any]) -> Structured:
    """The body's output constraint and tools (serve/openai/structured.py); the core compiles them."""
    try:
        return read_structured(**fields)
    except ValidationError as e:
        raise ParamError(str(e), e.field) from None


def _guided(body: _Common) -> dict[str, Any]:
    return {"json": body.guided_json, "regex": body.guided_regex, "choice": body.guided_choice,
            "grammar": body.guided_grammar}


def _common_fields(body: _Common) -> dict[str, Any]:
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    return {"temperature": body.temperature, "top_p": body.top_p, "seed": body.seed, "top_k": body.top_k,
            "min_p": body.min_p, "repetition_penalty": body.repetition_penalty, "ignore_eos": body.ignore_eos,
            "stop_strings": stop, "stop_token_ids": body.stop_token_ids, "speculate": body.speculate,
            "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
            "logit_bias": logit_bias_pairs(body.logit_bias)}


def logit_bias_pairs(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's logit_bias (token ids as JSON keys) as the engine's (id, bias) pairs; the bounds
    are the engine's to check."""
    if not bias:
        return None
    pairs = []
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit():
            raise ParamError(f"logit_bias: keys must be token ids, got {key!r:.40}", "logit_bias")
        pairs.append((int(key), value))
    return tuple(pairs)


@dataclass(frozen=True)
class OpenAIRequest:
    """A body read: the core's request, and how the core's field names are spelled in this body."""

    request: GenerationRequest
    params: dict[str, str]  # canonical field -> OpenAI parameter, where they differ
    echo: bool = False  # completions: the prompt comes back before the output (with its logprobs, if asked)
    generate: bool = True  # False: max_tokens 0 with echo, the prompt alone is scored
    echo_logprobs: int | None = None  # echo's alternatives per prompt token (None: no logprobs)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: alternatives per prompt token
    keep: int | None = None  # best_of above n: the n choices to keep of each prompt's best_of
    show_logprobs: bool = True  # False: logprobs were asked only to choose the best (best_of)

    def error(self, e: ServeError) -> ServeError:
        return rename_field(e, by_prefix(self.params))


# Canonical field -> OpenAI parameter, per endpoint (where the name differs).
_COMPLETION_PARAMS = {"max_new_tokens": "max_tokens", "stop_strings": "stop", "top_logprobs": "logprobs",
                      "prompt_ids": "prompt", "adapter_id": "model"}
_CHAT_PARAMS = {"stop_strings": "stop", "prompt": "messages", "chat": "messages", "adapter_id": "model"}


def completion_request(body: CompletionBody, adapter_id: str) -> OpenAIRequest:
    """A /v1/completions body as the core's request; ParamError for what OpenAI's API alone has."""
    structured = _structured({"response_format": body.response_format, "structured_outputs": body.structured_outputs,
                              "guided": _guided(body)})
    if body.max_tokens == 0 and not body.echo:
        raise ParamError("must be at least 1 (0 only with echo: the prompt scored alone)", "max_tokens")
    if body.suffix:
        raise ParamError("suffix is not supported", "suffix")
    n = body.n if body.n is not None else 1
    best_of = body.best_of if body.best_of is not None else n
    if best_of < n:
        raise ParamError(f"must be at least n ({n})", "best_of")
    if best_of > n and (body.stream or body.echo):
        raise ParamError(f"best_of above n cannot go with {'stream' if body.stream else 'echo'} (the best are "
                         "chosen once all are done)", "best_of")
    raw = body.prompt
    items: list[str | list[int]]
    if isinstance(raw, str):
        items = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [list(raw)]  # type: ignore[arg-type]  # one tokenized prompt
    else:
        items = list(raw)  # type: ignore[arg-type]
    prompts: list[Prompt] = [TextPrompt(x) if isinstance(x, str) else TokenPrompt(x) for x in items]
    given = _common_fields(body)
    generate = body.max_tokens != 0
    given["max_new_tokens"] = body.max_tokens if generate else 1  # checked as one token; none is generated
    if body.logprobs is not None:
        given["logprobs"], given["top_logprobs"] = True, body.logprobs
    elif best_of > n:  # the sampled tokens' logprobs choose the best; not shown
        given["logprobs"], given["top_logprobs"] = True, 0
    params = {**_COMPLETION_PARAMS, "n": "best_of"} if best_of > n else _COMPLETION_PARAMS
    request = GenerationRequest(prompts, given, structured, adapter_id, best_of)
    return OpenAIRequest(request, params, bool(body.echo), generate, body.logprobs, _prompt_logprobs(body),
                         n if best_of > n else None, body.logprobs is not None)


def _prompt_logprobs(body: _Common) -> int | None:
    """vLLM's prompt_logprobs: alternatives per prompt token, 0 to MAX_TOP_LOGPROBS; not streamed."""
    k = body.prompt_logprobs
    if k is None:
        return None
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ParamError(f"must be in [0, {MAX_TOP_LOGPROBS}], got {k}", "prompt_logprobs")
    if body.stream:
        raise ParamError("prompt_logprobs with stream is not supported (ask without stream)", "prompt_logprobs")
    return k


def _content(message: ChatMessageBody, i: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for j, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise ParamError(f"content part of type {part.type!r:.40}; only text parts are supported",
                             f"messages[{i}].content[{j}]")
        parts.append(part.text)
    return "".join(parts)


def chat_request(body: ChatBody, adapter_id: str) -> OpenAIRequest:
    """A /v1/chat/completions body as the core's request (with tools, rendered by serve/core/structured.py)."""
    structured = _structured({"response_format": body.response_format, "structured_outputs": body.structured_outputs,
                              "guided": _guided(body), "tools": body.tools, "tool_choice": body.tool_choice,
                              "parallel_tool_calls": body.parallel_tool_calls})
    messages = []
    for i, m in enumerate(body.messages):
        for key in ("audio", "function_call"):
            if getattr(m, key) is not None:
                raise ParamError(f"not supported (use {'tool_calls' if key == 'function_call' else 'text content'})",
                                 f"messages[{i}].{key}")
        content = _content(m, i) if m.content is not None or m.refusal is None else m.refusal
        msg: dict[str, Any] = {"role": {"developer": "system"}.get(m.role, m.role),  # OpenAI's newer name
                               "content": content}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        messages.append(msg)
    given = _common_fields(body)
    given["max_new_tokens"] = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    given["logprobs"], given["top_logprobs"] = body.logprobs, body.top_logprobs
    params = {**_CHAT_PARAMS, "max_new_tokens": "max_completion_tokens" if body.max_completion_tokens is not None
              else "max_tokens"}
    n = body.n if body.n is not None else 1
    request = GenerationRequest([ChatPrompt(messages, template_kwargs=body.chat_template_kwargs or {},
                                            thinking_budget=body.thinking_budget)], given, structured, adapter_id, n)
    return OpenAIRequest(request, params, prompt_logprobs=_prompt_logprobs(body))


def renamed(e: ServeError, rename: dict[str, str]) -> ParamError:
    """A job-creation error with its field path replaced by the OpenAI parameter (serve/openai/jobs.py)."""
    field = e.field or "prompt"
    param = by_prefix(rename)(field)
    message = str(e)
    if message.startswith(field):
        message = param + message[len(field):]
    return ParamError(message, param, type(e))
