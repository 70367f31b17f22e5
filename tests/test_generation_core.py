"""serve/core/generation.py on its own, over a fake engine loop: one error per mistake, named
canonically and renamed by each front end; seeds per choice; how a cancelled ticket ends (the
same error for both protocols); events reaching a thread and an asyncio task alike."""

from __future__ import annotations

import asyncio
import threading
import types
from typing import Any

import pytest

from serve.core.generation import (ChatPrompt, GenerationCore, GenerationRequest, TextPrompt, TokenPrompt,
                                   rename_field)
from serve.core.loop import Ticket
from serve.errors import Cancelled, DeadlineExceeded, InvalidArgument, NotFound, OutOfRange, ServeError
from serve.grpc.validation import grpc_error
from serve.openai.requests import ChatBody, CompletionBody, chat_request, completion_request
from serve.openai.structured import read_structured
from tprt.engine.sequence import TokenEvent, Usage

VOCAB = 100
CONTEXT = 32


class FakeLoop:
    """serve.core.loop.EngineLoop as the core sees it: tickets are kept for the test to answer."""

    adapters = None  # no pool: only registered adapters are served

    def __init__(self) -> None:
        self.tickets: list[Ticket] = []
        self.cancelled: list[tuple[str, str]] = []

    def submit(self, ticket: Ticket) -> None:
        self.tickets.append(ticket)

    def cancel(self, request_id: str, reason: str = "client") -> None:
        self.cancelled.append((request_id, reason))


class FakeRegistry:
    def get(self, adapter_id: str) -> Any:
        return types.SimpleNamespace(index=3) if adapter_id == "known" else None


def make_core() -> tuple[GenerationCore, FakeLoop]:
    loop = FakeLoop()
    facts = types.SimpleNamespace(name="base", context_length=CONTEXT, config=types.SimpleNamespace(vocab_size=VOCAB))
    return GenerationCore(loop, None, facts, FakeRegistry(), max_text_bytes=64), loop  # type: ignore[arg-type]


def refused(core: GenerationCore, request: GenerationRequest) -> ServeError:
    with pytest.raises(ServeError) as info:
        core.prepare(request)
    return info.value


# (request, canonical field, error, gRPC path, OpenAI /v1/completions parameter)
MISTAKES: list[tuple[GenerationRequest, str, type[ServeError], str, str]] = [
    (GenerationRequest([TokenPrompt([VOCAB])]), "prompt_ids", InvalidArgument, "prompt_ids.ids", "prompt"),
    (GenerationRequest([TokenPrompt([])]), "prompt_ids", InvalidArgument, "prompt_ids.ids", "prompt"),
    (GenerationRequest([TextPrompt("")]), "prompt", InvalidArgument, "prompt", "prompt"),
    (GenerationRequest([TextPrompt("x" * 65)]), "prompt", OutOfRange, "prompt", "prompt"),
    (GenerationRequest([TokenPrompt([1])], {"temperature": -1.0}), "temperature", InvalidArgument,
     "sampling.temperature", "temperature"),
    (GenerationRequest([TokenPrompt([1])], {"max_new_tokens": CONTEXT}), "max_new_tokens", OutOfRange,
     "sampling.max_new_tokens", "max_tokens"),
    (GenerationRequest([TokenPrompt([1])], {"stop_strings": ["x"]}), "stop_strings", InvalidArgument,
     "sampling.stop", "stop"),
    (GenerationRequest([TokenPrompt([1] * CONTEXT)]), "prompt", OutOfRange, "prompt", "prompt"),
    (GenerationRequest([TokenPrompt([1])], adapter_id="unknown"), "adapter_id", NotFound, "adapter_id", "model"),
    (GenerationRequest([TokenPrompt([1])], n=17), "n", InvalidArgument, "n", "n"),
    (GenerationRequest([ChatPrompt([{"role": "robot", "content": "hi"}])]), "messages[0].role", InvalidArgument,
     "chat.messages[0].role", "messages[0].role"),
]


@pytest.mark.parametrize("request_,field,error,path,param", MISTAKES, ids=[m[1] for m in MISTAKES])
def test_one_error_per_mistake_renamed_per_protocol(request_: GenerationRequest, field: str,
                                                    error: type[ServeError], path: str, param: str) -> None:
    core, loop = make_core()
    e = refused(core, request_)
    assert type(e) is error and e.field == field and str(e).startswith(field + ": "), (e, e.field)
    reason = str(e)[len(field) + 2:]
    g = grpc_error(e)
    assert type(g) is error and g.field == path and str(g) == f"{path}: {reason}"
    body = CompletionBody.model_validate({"model": "base", "prompt": [1]})
    h = completion_request(body, "").error(e)
    assert type(h) is error and h.field == param and str(h) == f"{param}: {reason}"
    assert not loop.tickets  # nothing is queued for a refused request


def test_chat_spells_the_prompt_and_output_length_its_own_way() -> None:
    core, _ = make_core()
    e = refused(core, GenerationRequest([ChatPrompt([{"role": "user", "content": "hi"}])]))
    assert e.field == "chat"  # no tokenizer, so no chat template
    chat = ChatBody.model_validate({"model": "base", "messages": [{"role": "user", "content": "hi"}],
                                    "max_completion_tokens": 5})
    assert chat_request(chat, "").error(e).field == "messages"
    assert grpc_error(e).field == "chat"
    long = refused(core, GenerationRequest([TokenPrompt([1])], {"max_new_tokens": CONTEXT}))
    assert chat_request(chat, "").error(long).field == "max_completion_tokens"
    assert rename_field(long, lambda f: f) is long


def test_choices_get_seed_plus_index_and_a_known_adapter_its_index() -> None:
    core, loop = make_core()
    prepared = core.prepare(GenerationRequest([TokenPrompt([1, 2]), TokenPrompt([3])], {"seed": 7}, n=2,
                                              adapter_id="known"))
    assert [(p, params.seed) for p, params in prepared.choices] == [(0, 7), (0, 8), (1, 7), (1, 8)]
    assert (prepared.adapter_id, prepared.adapter_index) == ("known", 3)
    core.start(prepared)
    assert [(t.prompt, t.adapter_index) for t in loop.tickets] == [([1, 2], 3), ([1, 2], 3), ([3], 3), ([3], 3)]


def _finish(t: Ticket, reason: str = "length") -> None:
    t.events.put(TokenEvent(t.request_id, 5, "x"))
    t.events.put(TokenEvent(t.request_id, None, "", finish_reason=reason, usage=Usage(1, 1)))  # type: ignore[arg-type]


@pytest.mark.parametrize("reason,error", [("client", Cancelled), ("deadline", DeadlineExceeded), ("shutdown", None)])
def test_a_cancelled_ticket_ends_by_its_reason(reason: str, error: type[ServeError] | None) -> None:
    """The caller's cancellation or deadline is an error; the server's (a drain) a "cancelled" finish."""
    core, loop = make_core()
    generation = core.start(core.prepare(GenerationRequest([TokenPrompt([1])])))
    [ticket] = loop.tickets
    ticket.cancel_reason = reason
    _finish(ticket, "cancelled")
    events = generation.events()
    assert next(events).token is not None  # the token before the cancellation
    if error is None:
        assert next(events).finish_reason == "cancelled"
    else:
        with pytest.raises(error):
            next(events)
    assert loop.cancelled == []  # it had finished: nothing left to cancel


def test_a_caller_gone_cancels_the_unfinished_tickets() -> None:
    core, loop = make_core()
    generation = core.start(core.prepare(GenerationRequest([TokenPrompt([1])], n=2)))
    _finish(loop.tickets[0])
    with pytest.raises(DeadlineExceeded):
        list(generation.events(lambda: "deadline"))
    assert loop.cancelled == [(loop.tickets[1].request_id, "deadline")]


def test_an_asyncio_task_gets_events_put_by_another_thread() -> None:
    """No thread waits on the tickets: the loop's thread hands each event into the event loop."""
    core, loop = make_core()

    async def run() -> list[tuple[int, str, str | None]]:
        generation = core.start_async(core.prepare(GenerationRequest([TokenPrompt([1])], n=2)))
        threads = [threading.Thread(target=_finish, args=(t,)) for t in loop.tickets]
        for th in threads:
            th.start()
        got = [(ev.index, ev.text, ev.finish_reason) async for ev in generation.aevents()]
        for th in threads:
            th.join()
        return got

    before = set(threading.enumerate())  # (other tests' threads may end meanwhile: compare sets)
    got = asyncio.run(run())
    assert sorted(got) == [(0, "", "length"), (0, "x", None), (1, "", "length"), (1, "x", None)]
    assert set(threading.enumerate()) <= before and loop.cancelled == []


def test_openai_answers_a_drained_request_with_503() -> None:
    """OpenAI's API has no finish reason for a request the server cancelled: HTTP 503, as gRPC's
    stream ends with FINISH_REASON_CANCELLED."""
    from serve.core.generation import ChoiceEvent
    from serve.errors import Unavailable
    from serve.openai.reply import Reply
    from serve.openai.requests import error_body

    core, _ = make_core()
    reply = Reply("text_completion", "base", core.prepare(GenerationRequest([TokenPrompt([1])])))
    with pytest.raises(Unavailable) as info:
        reply.add(ChoiceEvent(0, "", finish_reason="cancelled"))
    assert error_body(info.value)[0] == 503


def test_a_hermes_template_makes_forced_calls_hermes(tmp_path: Any) -> None:
    """The core reads the call syntax from the model's chat template (Qwen's <tool_call> blocks)
    and prepares a request's tools in it: the forced call's constraint, the replies' parsing."""
    import json as _json

    from test_structured import ADD, HERMES_TEMPLATE
    from tiny_chat import write_byte_tokenizer
    from tprt.engine.constraints import StructuredOutputs
    from tprt.text.tokenizer import Tokenizer

    write_byte_tokenizer(tmp_path)
    cfg = _json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(_json.dumps({**cfg, "chat_template": HERMES_TEMPLATE}))
    tok = Tokenizer.from_dir(tmp_path)
    facts = types.SimpleNamespace(name="base", context_length=512, config=types.SimpleNamespace(vocab_size=259))
    core = GenerationCore(FakeLoop(), tok, facts, FakeRegistry(),  # type: ignore[arg-type]
                          compile_constraint=StructuredOutputs(tok).compile)
    structured = read_structured(tools=[ADD], tool_choice="required")
    prepared = core.prepare(GenerationRequest([ChatPrompt([{"role": "user", "content": "1+2?"}])], {},
                                              structured=structured))
    assert core.tool_syntax == "hermes" and prepared.structured.syntax == "hermes"
    assert prepared.structured.constraint is not None and prepared.structured.constraint.kind == "grammar"
    assert "<tool_call>" in tok.decode(prepared.prompts[0])  # the template saw the tools
