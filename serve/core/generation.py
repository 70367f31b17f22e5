"""One generation path for every front end: a request in neutral terms -> tickets -> typed events.

gRPC (serve/grpc/) and the OpenAI HTTP API (serve/openai/) read their own wire formats into a
`GenerationRequest` (a prompt, chat or token ids per choice group; sampling fields by their
canonical names, tprt.engine.request; output constraints and tools, serve/core/structured.py;
an adapter id) and hand it to `GenerationCore`. The core applies the one set of rules (prompt
checks, the tokenizer and chat template, sampling defaults and limits, constraint compilation,
the adapter lookup), queues one `Ticket` per sequence on the engine loop (serve/core/loop.py)
and returns a `Generation`: its events, in order, as `ChoiceEvent`s (a token and its text, or a
choice's end with its reason and usage), for a thread (`events`) or an asyncio task
(`aevents`, fed by the loop's thread without a thread of its own).

Errors are ServeErrors naming the request's field by its canonical name (`prompt`, `prompt_ids`,
`messages[2].role`, `max_new_tokens`, `structured_outputs.json`, `adapter_id`, ...); each front
end renames them to its own spelling (`rename_field`). How a generation ends early is decided here
too: a client's cancellation is CANCELLED, a passed deadline DEADLINE_EXCEEDED, whichever protocol
served it; a drain's cancellation is a "cancelled" finish (gRPC's FINISH_REASON_CANCELLED; OpenAI's
API, which has no such finish reason, answers it with 503).
"""

from __future__ import annotations

import asyncio
import json
import queue
from concurrent.futures import Future
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from serve.adapters.registry import AdapterRegistry
from serve.core.loop import Ticket, new_request_id
from serve.core.reasoning import (THINK_CLOSE, THINK_OPEN, prompt_closes_reasoning, prompt_opens_reasoning,
                                  thinks)
from serve.core.structured import Structured, encode_tool_chat, tool_syntax
from serve.errors import Cancelled, DeadlineExceeded, InvalidArgument, NotFound, OutOfRange, ServeError, echo
from serve.metrics import Metrics
from serve.ranks.commands import PromptLogprobs, PromptTokenLogprobs
from tprt.engine.constraints import ConstraintSpec
from tprt.engine.request import ContextLengthError, StopLimits, resolve_sampling
from tprt.engine.sampling import SamplingParams
from tprt.engine.sequence import TokenEvent, Usage
from tprt.engine.thinking import Thinking
from tprt.errors import ConfigError, ValidationError
from tprt.text.chat import CHAT_ROLES, NoChatTemplateError
from tprt.text.tokenizer import Tokenizer

STOP_LIMITS = StopLimits()  # requests come from the network: cap their stop conditions
MAX_CHAT_MESSAGES = 1024
MAX_CHOICES = 16  # sequences of one request (prompts times n); each is a sequence of its own
ROLES = CHAT_ROLES
_POLL_S = 0.5  # how often a waiting front end checks that its caller is still there

Compile = Callable[[ConstraintSpec], object]  # checks (compiles) a constraint; raises ValidationError


# ----------------------------------------------------------------- the request


@dataclass(frozen=True)
class TextPrompt:
    text: str


@dataclass(frozen=True)
class TokenPrompt:
    ids: list[int]


@dataclass(frozen=True)
class ChatPrompt:
    """Messages as the chat template takes them ({"role", "content"}, and "tool_calls" /
    "tool_call_id" / "name" where given)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # more variables for the template (enable_thinking)
    thinking_budget: int | None = None  # a reasoning model's thinking tokens at most (tprt.engine.thinking)


Prompt = TextPrompt | TokenPrompt | ChatPrompt


@dataclass(frozen=True)
class GenerationRequest:
    """A request as every front end reads it: prompts (each `n` times), sampling fields the caller
    set (canonical names; None: unset), output constraints and tools, and an adapter ("": base)."""

    prompts: list[Prompt]
    sampling: Mapping[str, Any] = field(default_factory=dict)
    structured: Structured = field(default_factory=lambda: Structured(None))
    adapter_id: str = ""
    n: int = 1


@dataclass(frozen=True)
class Prepared:
    """A request, checked: one prompt's ids per prompt, and the resolved sampling of each choice."""

    prompts: list[list[int]]
    choices: list[tuple[int, SamplingParams]]  # (index into prompts, params), in choice order
    n: int
    structured: Structured
    adapter_id: str
    adapter_index: int
    # A reasoning model's chat reply (serve/core/reasoning.py): whether its prompt opened the
    # <think> block; None: no reasoning to split off.
    reasoning: bool | None = None


@dataclass(frozen=True)
class ModelFacts:
    """What the front ends report of the served model and check requests against."""

    name: str
    config: Any  # tprt.model.config.ModelConfig
    tp_size: int
    context_length: int
    max_batch_size: int
    dtype: str
    eos_token_ids: tuple[int, ...]
    kv_cache_dtype: str = ""  # tprt.model.kv_cache.KVCache.format_name
    kv_cache_tokens: int = 0  # positions in each rank's KV pool


RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                     "raise_exception"})
MAX_TEMPLATE_KWARGS_BYTES = 16 << 10


def template_kwargs(given: Mapping[str, Any]) -> dict[str, Any]:
    """A chat request's extra template variables (`chat_template_kwargs`, e.g. Qwen3's
    `enable_thinking`): names the template does not already take from the request, small."""
    if not isinstance(given, Mapping):
        raise InvalidArgument("expected an object of template variables", "chat_template_kwargs")
    for name in given:
        if not isinstance(name, str) or not name.isidentifier() or name in RESERVED_TEMPLATE_NAMES:
            raise InvalidArgument(f"{echo(name)} cannot be set (a template variable name, not one of "
                                  f"{', '.join(sorted(RESERVED_TEMPLATE_NAMES))})", f"chat_template_kwargs.{name}")
    if len(json.dumps(dict(given), default=str)) > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidArgument(f"larger than {MAX_TEMPLATE_KWARGS_BYTES} bytes", "chat_template_kwargs")
    return dict(given)


def text_byte_limit(tok: Tokenizer, context: int) -> int:
    """The most UTF-8 bytes a text of `context` tokens can have: `context` times the longest
    vocabulary entry's bytes. A longer text cannot fit, so it is refused before it is tokenized:
    the work a request can ask of the tokenizer is bounded. A bound, not a guess, for tokenizers
    that never delete characters (Llama's byte-level BPE and sentencepiece): each spells the text
    of a token in its vocabulary entry, in at least as many bytes."""
    entries = (tok.id_to_token(i) or "" for i in range(tok.vocab_size))
    return context * max(1, max((len(e.encode("utf-8")) for e in entries), default=1))


# ----------------------------------------------------------------- the events


@dataclass(frozen=True)
class TokenText:
    """A token as both APIs show it: its id, its own text, its logprob and the likeliest others."""

    id: int
    text: str
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, str, float], ...] = ()  # (id, text, logprob), most likely first


@dataclass(frozen=True)
class ChoiceEvent:
    """One event of one choice: a token with its text delta, or the choice's end (finish_reason
    "stop", "length", or "cancelled" when the server cancelled it at a drain; stop_reason, usage)."""

    index: int
    text: str
    token: TokenText | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: Usage | None = None


class LoopLike(Protocol):
    """What the core uses of serve.core.loop.EngineLoop."""

    adapters: Any  # the adapter pool, or None (then only registered adapters are served)

    def submit(self, ticket: Ticket) -> None: ...

    def cancel(self, request_id: str, reason: str = "client") -> None: ...

    def call(self, fn: Callable[[Any], Any]) -> Future[Any]: ...


# ----------------------------------------------------------------- field names per front end


def by_prefix(table: Mapping[str, str]) -> Callable[[str], str]:
    """A renaming of canonical field paths: the first entry whose key is the path, or a prefix of
    it ending at '.' or '[', replaces that prefix; other paths stay."""

    def name(path: str) -> str:
        for ours, theirs in table.items():
            if path == ours or path.startswith(ours + ".") or path.startswith(ours + "["):
                return theirs + path[len(ours):]
        return path

    return name


def rename_field(e: ServeError, name: Callable[[str], str]) -> ServeError:
    """`e` with its field (and the message's leading field) in a front end's spelling."""
    if e.field is None:
        return e
    new = name(e.field)
    if new == e.field:
        return e
    message = str(e)
    if message.startswith(e.field):
        message = new + message[len(e.field):]
    return type(e)(message, new)


# ----------------------------------------------------------------- the core


def resolve(given: Mapping[str, Any], prompt_len: int, context: int, vocab_size: int, has_tokenizer: bool,
            constraint: ConstraintSpec | None = None) -> SamplingParams:
    """SamplingParams from the fields a request set (canonical names), by tprt.engine.request's
    rules and the server's stop limits; INVALID_ARGUMENT naming the field, OUT_OF_RANGE when the
    context is too short."""
    try:
        return resolve_sampling({**given, "constraint": constraint}, prompt_len, context, vocab_size,
                                what="context_length", has_tokenizer=has_tokenizer, limits=STOP_LIMITS)
    except ValidationError as e:
        error = OutOfRange if isinstance(e, ContextLengthError) else InvalidArgument
        raise error(f"{e.field}: {e}", e.field) from None


class GenerationCore:
    """The rules and the queueing shared by the front ends (see the module docstring)."""

    def __init__(self, loop: LoopLike, tokenizer: Tokenizer | None, facts: ModelFacts, adapters: AdapterRegistry,
                 metrics: Metrics | None = None, compile_constraint: Compile | None = None,
                 max_text_bytes: int | None = None) -> None:
        self.loop = loop
        self.tokenizer = tokenizer
        self.facts = facts
        self.adapters = adapters
        self.metrics = metrics
        self.compile_constraint = compile_constraint  # the engine's StructuredOutputs.compile; None: no tokenizer
        self.max_text_bytes = max_text_bytes  # text_byte_limit; None: unbounded
        # How the model writes tool calls, and whether it reasons first, from its chat template.
        template = tokenizer.chat_template if tokenizer is not None else None
        self.tool_syntax = tool_syntax(template)
        self.reasons = thinks(template)

    # ----------------------------------------------------------------- checks

    def prepare(self, request: GenerationRequest) -> Prepared:
        """The request checked and resolved; a ServeError naming the canonical field. CPU work
        (tokenizing, templates, compiling constraints): async front ends run it off their loop."""
        structured = request.structured.with_syntax(self.tool_syntax)  # calls as the model writes them
        self.check_structured(structured)
        adapter_id, index = self.adapter(request.adapter_id)
        if not request.prompts:
            raise InvalidArgument("at least one prompt is needed", "prompt")
        if not 1 <= request.n <= MAX_CHOICES:
            raise InvalidArgument(f"must be in [1, {MAX_CHOICES}], got {request.n}", "n")
        if len(request.prompts) * request.n > MAX_CHOICES:
            raise InvalidArgument(f"{len(request.prompts)} prompts times n={request.n} is more than {MAX_CHOICES} "
                                  "sequences", "n")
        prompts = [self.prompt_ids(p, structured) for p in request.prompts]
        choices = []
        seed = request.sampling.get("seed")
        for p, ids in enumerate(prompts):
            for i in range(request.n):  # choice i of a seeded request samples with seed + i
                given = {**request.sampling, "seed": seed + i if seed is not None else None}
                choices.append((p, self.sampling(given, len(ids), structured.constraint)))
        reasoning = None
        chat = request.prompts[0] if isinstance(request.prompts[0], ChatPrompt) else None
        if chat is not None and chat.thinking_budget is not None and not self.reasons:
            raise InvalidArgument("the model does not think (its chat template writes no </think>)",
                                  "thinking_budget")
        if self.reasons and self.tokenizer is not None and chat is not None:
            tail = self.tokenizer.decode(prompts[0][-32:], skip_special_tokens=False)  # the tags, even byte by byte
            reasoning = prompt_opens_reasoning(tail)
            if (chat.thinking_budget is not None or structured.constraint is not None) \
                    and not prompt_closes_reasoning(tail):  # the engine steers the thinking
                thinking = self.thinking(reasoning, chat.thinking_budget)
                choices = [(p, replace(params, thinking=thinking)) for p, params in choices]
        return Prepared(prompts, choices, request.n, structured, adapter_id, index, reasoning)

    def thinking(self, opened: bool, budget: int | None) -> Thinking:
        """The engine's view of a reply's thinking block: its ids (the opening forced first unless
        the prompt opened it) and the budget; INVALID_ARGUMENT naming thinking_budget."""
        assert self.tokenizer is not None
        tok = self.tokenizer
        thinking = Thinking(() if opened else tuple(tok.encode(THINK_OPEN, add_special_tokens=False)),
                            tuple(tok.encode(THINK_CLOSE, add_special_tokens=False)), budget)
        try:
            return thinking.validate(self.facts.config.vocab_size)
        except ValidationError as e:
            raise InvalidArgument(str(e), e.field) from None

    def check_structured(self, structured: Structured) -> None:
        """Compiles (so checks) every output constraint; INVALID_ARGUMENT naming its field."""
        for spec in structured.specs():
            if self.compile_constraint is None:
                raise InvalidArgument(f"{spec.field}: output constraints need the model's tokenizer, which it does "
                                      "not have", spec.field)
            try:
                self.compile_constraint(spec)
            except ValidationError as e:
                raise InvalidArgument(str(e), e.field) from None

    def adapter(self, adapter_id: str) -> tuple[str, int]:
        """(id, device index) of the adapter a request names ("", 0: the base model). With an
        adapter pool, an id not yet registered goes on to the loop, whose pool loads it from
        --data-dir/adapters/<id>/ or refuses it (NOT_FOUND)."""
        if not adapter_id:
            return "", 0
        adapter = self.adapters.get(adapter_id)
        if adapter is None and self.loop.adapters is None:
            raise NotFound(f"no adapter {echo(adapter_id)} is loaded", "adapter_id")
        return adapter_id, adapter.index if adapter is not None else 0

    def sampling(self, given: Mapping[str, Any], prompt_len: int,
                 constraint: ConstraintSpec | None = None) -> SamplingParams:
        """`resolve` against the served model's context and vocabulary."""
        return resolve(given, prompt_len, self.facts.context_length, self.facts.config.vocab_size,
                       self.tokenizer is not None, constraint)

    def prompt_ids(self, prompt: Prompt, structured: Structured | None = None,
                   add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids; text over max_text_bytes is refused (OUT_OF_RANGE) before it is tokenized."""
        if isinstance(prompt, TextPrompt):
            if not prompt.text:
                raise InvalidArgument("the prompt is empty", "prompt")
            self._check_size(len(prompt.text.encode("utf-8")), "prompt")
            ids = self._need_tokenizer("prompt").encode(prompt.text, add_special_tokens=add_special_tokens)
            where = "prompt"
        elif isinstance(prompt, ChatPrompt):
            ids = self._chat_ids(prompt, structured or Structured(None))
            where = "messages"
        else:
            vocab = self.facts.config.vocab_size
            bad = [t for t in prompt.ids if not 0 <= t < vocab]
            if bad:
                raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary [0, {vocab - 1}]", "prompt_ids")
            ids, where = list(prompt.ids), "prompt_ids"
        if not ids:
            raise InvalidArgument("the prompt has no tokens", where)
        return ids

    def _chat_ids(self, chat: ChatPrompt, structured: Structured) -> list[int]:
        messages = chat.messages
        if not messages:
            raise InvalidArgument("at least one message is needed", "messages")
        if len(messages) > MAX_CHAT_MESSAGES:
            raise InvalidArgument(f"{len(messages)} messages; at most {MAX_CHAT_MESSAGES}", "messages")
        for i, m in enumerate(messages):
            if m["role"] not in ROLES:
                raise InvalidArgument(f"role {echo(m['role'])} is not one of {', '.join(ROLES)}",
                                      f"messages[{i}].role")
        tools = bool(structured.tools) or any("tool_calls" in m or m["role"] == "tool" for m in messages)
        if tools:  # the calls, answers and tools are rendered into the prompt too
            size = len(json.dumps(messages, ensure_ascii=False).encode("utf-8", "replace"))
            size += sum(len(json.dumps(t.parameters)) + len(t.description) for t in structured.tools)
        else:
            size = sum(len(m["content"].encode("utf-8", "replace")) + len(m["role"].encode("utf-8"))
                       for m in messages)
        self._check_size(size, "messages")
        kwargs = template_kwargs(chat.template_kwargs)
        tok = self._need_tokenizer("chat")
        try:
            if tools:
                return encode_tool_chat(tok, messages, structured, **kwargs)
            return tok.encode_chat(messages, add_generation_prompt=chat.add_generation_prompt, **kwargs)
        except NoChatTemplateError as e:
            raise InvalidArgument(f"the model has no chat template ({e}); send a plain prompt", "chat") from None
        except ValidationError as e:
            where = e.field if e.field.startswith("messages") else "messages"
            raise InvalidArgument(str(e), where) from None
        except ConfigError as e:  # the template itself failed on these messages
            raise InvalidArgument(str(e), "messages") from None

    def _need_tokenizer(self, field: str) -> Tokenizer:
        if self.tokenizer is None:
            raise InvalidArgument("the model directory has no tokenizer; send prompt token ids", field)
        return self.tokenizer

    def _check_size(self, size: int, field: str) -> None:
        if self.max_text_bytes is not None and size > self.max_text_bytes:
            raise OutOfRange(f"{size} bytes of text cannot fit the context (at most {self.max_text_bytes} bytes)",
                             field)

    # ----------------------------------------------------------------- running

    def start(self, prepared: Prepared, deadline: float | None = None, priority: int = 0) -> Generation:
        """Queues one ticket per choice, for a thread to read (`Generation.events`); RESOURCE_EXHAUSTED,
        UNAVAILABLE or NOT_FOUND (the pool's) as the loop refuses. `priority`: 0 interactive,
        serve.core.loop.BACKGROUND for a batch's requests."""
        inbox: queue.SimpleQueue[tuple[int, TokenEvent | BaseException]] = queue.SimpleQueue()
        return self._start(prepared, deadline, inbox, inbox.put, priority)

    def start_async(self, prepared: Prepared, deadline: float | None = None) -> Generation:
        """`start` for an asyncio task, on its event loop (`Generation.aevents`): the loop's thread
        hands each event into the event loop; no thread waits on the tickets."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[int, TokenEvent | BaseException]] = asyncio.Queue()

        def put(item: tuple[int, TokenEvent | BaseException]) -> None:
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, item)
            except RuntimeError:  # the event loop has closed: the server is stopping
                pass

        return self._start(prepared, deadline, inbox, put)

    def _start(self, prepared: Prepared, deadline: float | None, inbox: Any,
               put: Callable[[tuple[int, TokenEvent | BaseException]], None], priority: int = 0) -> Generation:
        tickets: list[Ticket] = []
        try:
            for i, (p, params) in enumerate(prepared.choices):
                ticket = Ticket(new_request_id(), prepared.prompts[p], params, prepared.adapter_id,
                                prepared.adapter_index, deadline, events=_Tagged(put, i), priority=priority)
                self.loop.submit(ticket)
                tickets.append(ticket)
        except BaseException:
            for t in tickets:
                self.loop.cancel(t.request_id, "client")
            raise
        constraint = prepared.structured.constraint
        if constraint is not None and self.metrics is not None:
            self.metrics.structured_requests.labels(kind=constraint.kind).inc()
        return Generation(self, tickets, inbox)

    def score_prompt(self, ids: list[int], top: int) -> Future[PromptTokenLogprobs]:
        """The base model's log-probability of each of a prompt's tokens after the first (and the
        `top` likeliest alternatives), from one uncached forward pass on every rank between engine
        steps (completions' `echo`)."""
        command = PromptLogprobs(tuple(ids), top)
        return self.loop.call(lambda ranks: ranks.run(command))

    def token(self, ev: TokenEvent) -> TokenText | None:
        """An event's token, with texts decoded one token at a time (as logprobs show them)."""
        if ev.token_id is None:
            return None
        return TokenText(ev.token_id, self._text(ev.token_id), ev.logprob,
                         tuple((t, self._text(t), lp) for t, lp in ev.top_logprobs))

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""


class _Tagged:
    """A ticket's event sink: puts (choice index, event) into its request's inbox."""

    def __init__(self, put: Callable[[tuple[int, TokenEvent | BaseException]], None], index: int) -> None:
        self._put, self._index = put, index

    def put(self, item: TokenEvent | BaseException) -> None:
        self._put((self._index, item))


class Generation:
    """A queued request: its choices' events, in order per choice; its unfinished tickets are
    cancelled when it is left early (`close`)."""

    def __init__(self, core: GenerationCore, tickets: list[Ticket], inbox: Any) -> None:
        self.core = core
        self.tickets = tickets
        self.request_id = tickets[0].request_id if tickets else ""
        self._inbox = inbox  # queue.SimpleQueue (start) or asyncio.Queue (start_async)
        self._pending = len(tickets)

    def _event(self, index: int, item: TokenEvent | BaseException) -> ChoiceEvent:
        """One ticket's item as a ChoiceEvent; raises the ticket's error, or the error that says why
        the loop cancelled it."""
        ticket = self.tickets[index]
        if isinstance(item, BaseException):
            ticket.done = True
            raise item
        if item.finish_reason is not None:
            ticket.done = True
            self._pending -= 1
            if item.finish_reason == "cancelled" and ticket.cancel_reason != "shutdown":
                raise _cancelled(ticket.cancel_reason)
        return ChoiceEvent(index, item.text, self.core.token(item), item.finish_reason, item.stop_reason, item.usage)

    def events(self, gone: Callable[[], str | None] = lambda: None) -> Iterator[ChoiceEvent]:
        """For a thread: the events until every choice has finished. `gone()` says, while it
        waits, why the caller has gone ("client", "deadline"; None: still there): the tickets are
        then cancelled and the matching error raised."""
        try:
            while self._pending:
                try:
                    index, item = self._inbox.get(timeout=_POLL_S)
                except queue.Empty:
                    reason = gone()
                    if reason is not None:
                        self.close(reason)
                        raise _cancelled(reason) from None
                    continue
                yield self._event(index, item)
        finally:
            self.close()

    async def aevents(self, disconnected: Callable[[], Awaitable[bool]] | None = None,
                      ) -> AsyncGenerator[ChoiceEvent, None]:
        """For an asyncio task (started by `start_async`): the events until every choice has
        finished; while it waits, `disconnected()` is polled (True: CANCELLED)."""
        try:
            while self._pending:
                try:
                    index, item = await asyncio.wait_for(self._inbox.get(), _POLL_S)
                except asyncio.TimeoutError:
                    if disconnected is not None and await disconnected():
                        raise Cancelled("the client disconnected") from None
                    continue
                yield self._event(index, item)
        finally:
            self.close()

    def close(self, reason: str = "client") -> None:
        """Cancels the tickets that have not finished (their sequences leave the batch at the next step)."""
        for t in self.tickets:
            if not t.done:
                t.done = True
                self.core.loop.cancel(t.request_id, reason)


def _cancelled(reason: str) -> ServeError:
    """The error of a request cancelled on its caller's side ("client", "deadline"); one the server
    cancelled (a drain) ends with a "cancelled" event instead."""
    if reason == "deadline":
        return DeadlineExceeded("the request's deadline passed")
    return Cancelled("the client cancelled the request")
