"""OpenAI request bodies -> the engine's canonical inputs, and our errors -> OpenAI's error shape.

Like serve/validation.py for gRPC, this module only renames: the prompt goes through the same
`prompt_ids` checks (as the GenerateRequest it would have been), the sampling fields through
`tprt.engine.request.resolve_sampling`, and an error's field is renamed back to the OpenAI
parameter (`max_new_tokens` -> `max_tokens`, `chat.messages[2].role` -> `messages[2].role`).
The types of the fields are checked by the pydantic models (FastAPI answers a wrong type with a
400 naming the parameter, see serve/openai_app.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict

from serve.errors import InvalidArgument, OutOfRange, ServeError, is_disk_full, status_of
from serve.pb import generation_pb2 as pb
from serve.validation import STOP_LIMITS, prompt_ids
from tprt.engine.request import ContextLengthError, resolve_sampling
from tprt.engine.sampling import SamplingParams
from tprt.errors import ValidationError
from tprt.text.tokenizer import Tokenizer

MAX_CHOICES = 16  # n times the number of prompts; each is a sequence of its own

# gRPC status (what every ServeError carries) -> HTTP status and OpenAI error type.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "invalid_request_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
    grpc.StatusCode.INTERNAL: (500, "server_error"),
}


class PayloadTooLarge(ServeError):
    """A request body over --max-message-bytes (HTTP 413)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


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
    if code == grpc.StatusCode.OUT_OF_RANGE:
        error_code = "context_length_exceeded"
    return status, {"error": {"message": message, "type": kind, "param": field, "code": error_code}}, code.name.lower()


class ParamError(InvalidArgument):
    """A bad parameter, named as the OpenAI API spells it."""

    def __init__(self, message: str, param: str, error: type[ServeError] = InvalidArgument) -> None:
        super().__init__(message if message.startswith(param) else f"{param}: {message}", param)
        self.param = param
        self.code = error.code  # type: ignore[misc]  # OUT_OF_RANGE for a context overflow


# ----------------------------------------------------------------- bodies


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints take; unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore")

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
    # Our extras (openai's `extra_body`), as vLLM spells them.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None


class CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None  # the n most likely alternatives per token (0..20)
    echo: bool | None = False
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessageBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None


class ChatBody(_Common):
    messages: list[ChatMessageBody]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


# ----------------------------------------------------------------- resolving


@dataclass(frozen=True)
class Prepared:
    """One request, checked: one prompt per choice group, and the resolved sampling of each choice."""

    prompts: list[list[int]]
    choices: list[tuple[int, SamplingParams]]  # (index into prompts, params), in choice order
    n: int


# Canonical field -> OpenAI parameter, per endpoint (where the name differs).
_COMPLETION_PARAMS = {"max_new_tokens": "max_tokens", "stop_strings": "stop", "top_logprobs": "logprobs",
                      "logprobs": "logprobs", "prompt": "prompt"}
_CHAT_PARAMS = {"stop_strings": "stop", "prompt": "messages"}


def _common_fields(body: _Common) -> dict[str, Any]:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise ParamError("not supported by this server (use repetition_penalty)", name)
    if body.n is not None and not 1 <= body.n <= MAX_CHOICES:
        raise ParamError(f"must be in [1, {MAX_CHOICES}], got {body.n}", "n")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    return {"temperature": body.temperature, "top_p": body.top_p, "seed": body.seed, "top_k": body.top_k,
            "min_p": body.min_p, "repetition_penalty": body.repetition_penalty, "ignore_eos": body.ignore_eos,
            "stop_strings": stop, "stop_token_ids": body.stop_token_ids}


def _resolve(given: dict[str, Any], prompt: list[int], context: int, vocab: int, has_tok: bool,
             names: dict[str, str]) -> SamplingParams:
    try:
        return resolve_sampling(given, len(prompt), context, vocab, what="context_length", has_tokenizer=has_tok,
                                limits=STOP_LIMITS)
    except ValidationError as e:
        param = names.get(e.field, e.field)
        raise ParamError(f"{param}: {e}", param, OutOfRange if isinstance(e, ContextLengthError)
                         else InvalidArgument) from None


def renamed(e: ServeError, rename: dict[str, str]) -> ParamError:
    """A prompt_ids error with its GenerateRequest field path replaced by the OpenAI parameter."""
    field = e.field or "prompt"
    param = field
    for path, name in rename.items():
        if field == path or field.startswith(path + ".") or field.startswith(path + "["):
            param = name + field[len(path):]
            break
    message = str(e)
    if message.startswith(field):
        message = param + message[len(field):]
    return ParamError(message, param, type(e))


def _choices(prompts: list[list[int]], n: int, given: dict[str, Any], context: int, vocab: int, has_tok: bool,
             names: dict[str, str]) -> Prepared:
    if len(prompts) * n > MAX_CHOICES:
        raise ParamError(f"{len(prompts)} prompts times n={n} is more than {MAX_CHOICES} sequences", "n")
    choices = []
    for p, ids in enumerate(prompts):
        for i in range(n):
            seed = given.get("seed")
            params = _resolve({**given, "seed": seed + i if seed is not None else None}, ids, context, vocab,
                              has_tok, names)
            choices.append((p, params))
    return Prepared(prompts, choices, n)


def prepare_completion(body: CompletionBody, tok: Tokenizer | None, context: int, vocab: int,
                       max_text_bytes: int | None) -> Prepared:
    """A /v1/completions body as prompts and sampling; ParamError naming the OpenAI parameter."""
    if body.echo:
        raise ParamError("echo is not supported", "echo")
    if body.suffix:
        raise ParamError("suffix is not supported", "suffix")
    raw = body.prompt
    items: list[str | list[int]]
    if isinstance(raw, str):
        items = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [list(raw)]  # type: ignore[arg-type]  # one tokenized prompt
    else:
        items = list(raw)  # type: ignore[arg-type]
    if not items:
        raise ParamError("at least one prompt is needed", "prompt")
    prompts = []
    for item in items:
        request = pb.GenerateRequest(prompt=item) if isinstance(item, str) else \
            pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=item))
        try:
            prompts.append(prompt_ids(request, tok, vocab, max_text_bytes=max_text_bytes))
        except ServeError as e:
            raise renamed(e, {"prompt_ids.ids": "prompt", "prompt": "prompt"}) from None
    given = _common_fields(body)
    given["max_new_tokens"] = body.max_tokens
    if body.logprobs is not None:
        given["logprobs"], given["top_logprobs"] = True, body.logprobs
    return _choices(prompts, body.n or 1, given, context, vocab, tok is not None, _COMPLETION_PARAMS)


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


def prepare_chat(body: ChatBody, tok: Tokenizer | None, context: int, vocab: int,
                 max_text_bytes: int | None) -> Prepared:
    """A /v1/chat/completions body as the chat template's prompt and sampling."""
    roles = {"developer": "system"}  # OpenAI's newer name for the system role
    chat = pb.Chat(messages=[pb.ChatMessage(role=roles.get(m.role, m.role), content=_content(m, i))
                             for i, m in enumerate(body.messages)])
    try:
        ids = prompt_ids(pb.GenerateRequest(chat=chat), tok, vocab, max_text_bytes=max_text_bytes)
    except ServeError as e:
        raise renamed(e, {"chat.messages": "messages", "chat": "messages"}) from None
    given = _common_fields(body)
    given["max_new_tokens"] = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    given["logprobs"], given["top_logprobs"] = body.logprobs, body.top_logprobs
    names = {**_CHAT_PARAMS, "max_new_tokens": "max_completion_tokens" if body.max_completion_tokens is not None
             else "max_tokens"}
    return _choices([ids], body.n or 1, given, context, vocab, tok is not None, names)
