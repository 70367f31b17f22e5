"""The OpenAI HTTP API's outputs on one real TP=2 server (bearer token on, small limits):

- structured outputs and tool calls through the official `openai` client: `response_format`
  json_schema and json_object, vLLM-style `structured_outputs` on completions and chats, tools
  with tool_choice required, named and auto, whole and streamed (argument deltas), a tool
  result fed back; each output validated (jsonschema), and bad specs refused with a 400 naming
  the parameter; the tprt_structured_* metrics counted;
- the Responses API (stored, continued, streamed with its named events) and Anthropic's
  Messages API (through the official `anthropic` client, `x-api-key`), tool calls valid in both;
- random requests (tests/fuzz_http.py), a derandomized bounded run (bench/serve_fuzz.py runs
  many more): no 5xx other than a 503/507 the server means, every body well formed (an error in
  OpenAI's shape, no bare NaN anywhere, SSE events JSON to the end), health SERVING, and a greedy
  control request keeps its exact output before and after.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

import jsonschema
import openai

from fuzz_http import HttpCall, assert_acceptable, cancel_jobs, http_calls, send_http
from servers import TOKEN, ServerProcess, data_dir, metric
from tiny_chat import make_tiny_chat_model
from tprt.engine.constraints import MAX_SPEC_BYTES

CONTEXT = 1536  # room for a tools system prompt in the byte-level tokenizer (one token a byte)
FUZZ_EXAMPLES = 80  # bounded for CI (each call has a deadline); bench/serve_fuzz.py --http runs many more
CONTROL = {"model": "tp2", "prompt": "The control request", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("http-fuzz")
    make_tiny_chat_model(root / "model", (2,), max_positions=CONTEXT)
    (root / "token").write_text(TOKEN + "\n")
    args = ["--model", str(root / "model" / "tp2"), "--port", "0", "--http-port", "0", "--metrics-port", "0",
            "--data-dir", str(data_dir(root, "data")), "--auth-token-file", str(root / "token"),
            "--max-batch-size", "4", "--max-queue", "8", "--max-seq-len", str(CONTEXT), "--threads", "1",
            "--collective-timeout", "30", "--max-message-bytes", str(256 << 10), "--max-dataset-bytes", "4096",
            "--max-queued-jobs", "2", "--max-loras", "2", "--max-lora-rank", "8",
            "--sequence-parallel", "8"]  # prefill steps of 8 tokens or more split over the two ranks
    srv = ServerProcess(args, root / "server.log")
    try:
        yield srv
    finally:
        srv.kill()


def _base_url(server: ServerProcess) -> str:
    import re

    m = re.search(r"OpenAI API (https?://[\d.]+:\d+/v1)", server.line)
    assert m, server.line
    return m.group(1)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                              "b": {"type": "integer", "minimum": -99, "maximum": 99}},
             "required": ["a", "b"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "Tell me"}]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=_base_url(server), api_key=TOKEN, max_retries=0, timeout=60) as c:
        yield c


def _check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_json_schema_json_object_regex_and_choice(server: ServerProcess, client: openai.OpenAI) -> None:
    for seed in range(3):
        r = client.chat.completions.create(
            model="tp2", messages=ASK, temperature=1.0, seed=seed, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), PERSON)
    # Free-form keys from a random model may run past max_tokens ("length"); what ends is an object.
    r2 = client.completions.create(model="tp2", prompt="JSON:", max_tokens=300, temperature=0.8, seed=1, n=3,
                                   extra_body={"response_format": {"type": "json_object"}})
    for choice in r2.choices:
        assert choice.text.startswith("{"), choice.text
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict), choice.text
        else:
            assert choice.finish_reason == "length"
    r2 = client.completions.create(model="tp2", prompt="Code:", max_tokens=20, temperature=0.9, seed=2,
                                   extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", r2.choices[0].text), r2.choices[0].text
    r = client.chat.completions.create(model="tp2", messages=ASK, max_tokens=20,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe not"]}})
    assert r.choices[0].message.content in ("yes", "no", "maybe not")
    text = server.metrics()
    assert metric(text, "tprt_structured_requests_total", kind="json_schema") >= 3
    assert metric(text, "tprt_structured_requests_total", kind="regex") >= 1
    assert metric(text, "tprt_structured_compile_seconds_count") >= 4
    assert metric(text, "tprt_structured_mask_seconds_count") > 0


def test_hostile_constraints_neither_kill_the_server_nor_get_a_5xx(client: openai.OpenAI) -> None:
    """Issue 38: the longest rule chain a request may send (it overflowed the compiling thread's
    stack and killed rank 0 at 3,000 rules), the ambiguous grammar whose masks grow with the
    output, and the regex whose lexer is costly, over HTTP, old vLLM spellings included: each
    answered (200, a bounded finish), and a plain request keeps its exact output after them."""
    from helpers import rule_chain

    control = client.completions.create(**CONTROL)
    chain, _ = rule_chain(MAX_SPEC_BYTES)
    r = client.completions.create(model="tp2", prompt="x", max_tokens=4, extra_body={"guided_grammar": chain})
    assert r.choices[0].text == "x" and r.choices[0].finish_reason == "stop"
    for extra in ({"structured_outputs": {"grammar": 'start: s\ns: s s | s s s | "a" | "b"'}},
                  {"guided_regex": "((a{1000}){1000}){1000}"}):
        r = client.completions.create(model="tp2", prompt="ab", max_tokens=24, temperature=1.0, seed=3, n=2,
                                      extra_body=extra)
        for choice in r.choices:
            assert choice.finish_reason in ("stop", "length", "error"), choice
            assert set(choice.text) <= set("ab"), choice.text
    again = client.completions.create(**CONTROL)
    assert again.choices[0].text == control.choices[0].text


def test_tool_calls_required_named_streamed_and_fed_back(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tp2", messages=ASK, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=4, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls or [], {"get_weather", "add"})
    r = client.chat.completions.create(model="tp2", messages=ASK, tools=TOOLS, max_tokens=200,
                                       tool_choice={"type": "function", "function": {"name": "add"}},
                                       parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "add"
    _check_calls(calls, {"add"})
    # Streamed: the first piece of a call names it, the rest add arguments; they join to a whole call.
    stream = client.chat.completions.create(model="tp2", messages=ASK, tools=TOOLS, tool_choice="required",
                                            temperature=1.0, seed=7, max_tokens=200, stream=True)
    parts: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in stream:
        for piece in chunk.choices[0].delta.tool_calls or []:
            if piece.id is not None:
                assert piece.index not in parts and piece.function.name
                parts[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            parts[piece.index]["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and parts
    for p in parts.values():
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == p["name"])
        jsonschema.validate(json.loads(p["arguments"]), schema)
    # The call and its result go back through the chat template; "auto" may answer in text.
    call = calls[0]
    history: list[Any] = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "add", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    r = client.chat.completions.create(model="tp2", messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    streamed = client.chat.completions.create(model="tp2", messages=history, tools=TOOLS, max_tokens=8,
                                              temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    if r.choices[0].message.tool_calls is None:
        assert text == r.choices[0].message.content


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: missing"}}, "structured_outputs.grammar"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strng"}}}]},
     "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_constraints_are_400_naming_the_parameter(client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tp2", messages=ASK, max_tokens=4, extra_body=extra)
    body = info.value.body
    assert isinstance(body, dict) and body.get("param") == param, body


RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's flat shape
MESSAGE_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                  "input_schema": t["function"]["parameters"]} for t in TOOLS]  # Anthropic's


def _schema(name: str) -> Any:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_responses_tool_calls_stored_continued_and_streamed(client: openai.OpenAI) -> None:
    """The Responses API (issue 42): a forced call is a valid function_call item; its output, fed
    back with previous_response_id, continues the stored conversation (the same prompt as sending
    the whole conversation again); streamed, the named events rebuild the same response the
    non-streamed request returns; stored responses are read, listed and deleted."""
    first = client.responses.create(model="tp2", input="Tell me", tools=RESPONSE_TOOLS,  # type: ignore[arg-type]
                                    tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                    max_output_tokens=200)
    assert first.status == "completed" and first.output and first.store
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and all(c.status == "completed" and c.call_id.startswith("call_") for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), _schema(c.name))
    answers = [{"type": "function_call_output", "call_id": c.call_id, "output": "42"} for c in calls]
    second = client.responses.create(model="tp2", previous_response_id=first.id, input=answers,  # type: ignore[arg-type]
                                     tools=RESPONSE_TOOLS, max_output_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    whole = [{"type": "message", "role": "user", "content": "Tell me"},
             *[c.model_dump(exclude_none=True) for c in calls], *answers]
    again = client.responses.create(model="tp2", input=whole, tools=RESPONSE_TOOLS,  # type: ignore[arg-type]
                                    max_output_tokens=6, temperature=0, store=False)
    assert again.usage and second.usage and again.usage.input_tokens == second.usage.input_tokens
    assert again.output_text == second.output_text
    # Streamed with the SDK's own accumulator: the events rebuild the response.
    with client.responses.stream(model="tp2", input="Tell me", tools=RESPONSE_TOOLS,  # type: ignore[arg-type]
                                 tool_choice={"type": "function", "name": "add"}, temperature=0,
                                 max_output_tokens=200) as stream:
        kinds = [ev.type for ev in stream]
        streamed = stream.get_final_response()
    plain = client.responses.create(model="tp2", input="Tell me", tools=RESPONSE_TOOLS,  # type: ignore[arg-type]
                                    tool_choice={"type": "function", "name": "add"}, temperature=0,
                                    max_output_tokens=200)
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds and "response.output_item.done" in kinds
    assert [(o.name, o.arguments) for o in streamed.output] == [(o.name, o.arguments) for o in plain.output]  # type: ignore[union-attr]
    text = client.responses.create(model="tp2", input="Hi", instructions="Be brief.", temperature=0,
                                   max_output_tokens=5, stream=True)
    deltas, done = "", None
    for ev in text:
        if ev.type == "response.output_text.delta":
            deltas += ev.delta
        elif ev.type == "response.incomplete":
            done = ev.response
    assert done is not None and done.incomplete_details and done.incomplete_details.reason == "max_output_tokens"
    assert done.output_text == deltas
    # Stored: read back, its input listed, deleted; then it is gone for a continuation too.
    assert client.responses.retrieve(second.id).output_text == second.output_text
    listed = client.responses.input_items.list(second.id, order="asc").data
    assert [i.type for i in listed] == ["function_call_output"] * len(calls)
    client.responses.delete(second.id)
    for gone in (lambda: client.responses.retrieve(second.id),
                 lambda: client.responses.create(model="tp2", input="x", previous_response_id=second.id)):
        with pytest.raises(openai.NotFoundError):
            gone()
    assert client.responses.input_tokens.count(model="tp2", input="Tell me").input_tokens == \
        client.chat.completions.create(model="tp2", messages=ASK, max_tokens=1).usage.prompt_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": {}}}}},
     "text.format.schema"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
    ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens"),
])
def test_bad_responses_are_400_naming_the_parameter(client: openai.OpenAI, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tp2", **body)
    assert isinstance(info.value.body, dict) and info.value.body.get("param") == param, info.value.body


def test_anthropic_messages_tool_use_streamed_and_errors(server: ServerProcess) -> None:
    """Anthropic's Messages API (issue 42) through the official `anthropic` client, authenticated
    with x-api-key: a forced tool_use block is valid, its tool_result goes back through the chat
    template, streaming rebuilds the same message, stop sequences and max_tokens end it as
    Anthropic says, count_tokens counts the prompt, and errors come in Anthropic's shape."""
    import anthropic

    url = _base_url(server).removesuffix("/v1")
    c = anthropic.Anthropic(base_url=url, api_key=TOKEN, max_retries=0, timeout=60)
    ask = [{"role": "user", "content": "Tell me"}]
    first = c.messages.create(model="tp2", max_tokens=200, messages=ask, tools=MESSAGE_TOOLS,  # type: ignore[arg-type]
                              tool_choice={"type": "any", "disable_parallel_tool_use": True},
                              extra_body={"temperature": 1.0})  # one call: an array of them sampled at 1.0 can outrun max_tokens
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses
    for u in uses:
        jsonschema.validate(u.input, _schema(u.name))
    follow = [*ask, {"role": "assistant", "content": [u.model_dump() for u in uses]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "42"} for u in uses]}]
    answer = c.messages.create(model="tp2", max_tokens=6, messages=follow, tools=MESSAGE_TOOLS,  # type: ignore[arg-type]
                               extra_body={"temperature": 0})
    assert answer.stop_reason in ("max_tokens", "end_turn", "tool_use")
    counted = c.messages.count_tokens(model="tp2", messages=follow, tools=MESSAGE_TOOLS)  # type: ignore[arg-type]
    assert counted.input_tokens == answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)
    with c.messages.stream(model="tp2", max_tokens=200, messages=ask, tools=MESSAGE_TOOLS,  # type: ignore[arg-type]
                           tool_choice={"type": "tool", "name": "add"}, extra_body={"temperature": 0}) as stream:
        kinds = {ev.type for ev in stream}
        streamed = stream.get_final_message()
    plain = c.messages.create(model="tp2", max_tokens=200, messages=ask, tools=MESSAGE_TOOLS,  # type: ignore[arg-type]
                              tool_choice={"type": "tool", "name": "add"}, extra_body={"temperature": 0})
    assert {"message_start", "content_block_start", "content_block_delta", "message_stop"} <= kinds
    assert [(b.name, b.input) for b in streamed.content] == [(b.name, b.input) for b in plain.content]  # type: ignore[union-attr]
    said = c.messages.create(model="tp2", max_tokens=24, messages=[{"role": "user", "content": "abc"}],
                             system="Be brief.", extra_body={"temperature": 0, "top_k": 40})
    assert said.stop_reason == "max_tokens" and said.usage.output_tokens == 24
    words = said.content[0].text  # type: ignore[union-attr]
    stop = words[len(words) // 2:][:2]
    cut = c.messages.create(model="tp2", max_tokens=24, messages=[{"role": "user", "content": "abc"}],
                            system="Be brief.", stop_sequences=[stop], extra_body={"temperature": 0, "top_k": 40})
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == words[:words.index(stop)]  # type: ignore[union-attr]
    for call, error, status in (
            (lambda: c.messages.create(model="tp2", max_tokens=4, messages=[
                {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]),
             anthropic.BadRequestError, 400),
            (lambda: c.messages.create(model="nope", max_tokens=4, messages=ask), anthropic.NotFoundError, 404),
            (lambda: anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
                model="tp2", max_tokens=4, messages=ask), anthropic.AuthenticationError, 401)):
        with pytest.raises(error) as info:
            call()
        assert info.value.status_code == status
        body = info.value.body
        assert isinstance(body, dict) and body["type"] == "error" and body["error"]["message"], body


def test_grpc_takes_the_same_constraints_and_tools(server: ServerProcess, client: openai.OpenAI) -> None:
    """gRPC's constraint and tool fields give what HTTP gives for the same request (same seed,
    same tokens), and refuse the same mistakes naming their own field paths."""
    import grpc

    from serve.client import field_of
    from serve.grpc.pb import generation_pb2 as pb

    schema = json.dumps(PERSON)
    http = client.chat.completions.create(
        model="tp2", messages=ASK, temperature=1.0, seed=11, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    with server.client() as c:
        out = c.complete(chat=ASK, temperature=1.0, seed=11, max_new_tokens=120,
                         constraint=pb.OutputConstraint(json_schema=schema))
        assert out.text == http.choices[0].message.content and out.finish_reason == pb.FINISH_REASON_STOP
        jsonschema.validate(json.loads(out.text), PERSON)
        streamed = list(c.generate("Code:", max_new_tokens=20, temperature=0,
                                   constraint=pb.OutputConstraint(choice=pb.ChoiceList(options=["on", "off"]))))
        assert "".join(m.text for m in streamed) in ("on", "off")
        tools = [pb.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                         parameters_json=json.dumps(t["function"]["parameters"])) for t in TOOLS]
        out = c.complete(chat=ASK, tools=tools, tool_choice=pb.ToolChoice(function="get_weather"), max_new_tokens=200)
        assert out.finish_reason == pb.FINISH_REASON_TOOL_CALLS and [t.name for t in out.tool_calls] == ["get_weather"]
        jsonschema.validate(json.loads(out.tool_calls[0].arguments), TOOLS[0]["function"]["parameters"])
        final = list(c.generate(chat=ASK, tools=tools, tool_choice=pb.ToolChoice(mode="required"),
                                parallel_tool_calls=False, max_new_tokens=200))[-1]
        assert final.finish_reason == pb.FINISH_REASON_TOOL_CALLS and final.tool_calls
        bad = [
            ({"constraint": pb.OutputConstraint(regex="(unclosed")}, "constraint.regex"),
            ({"constraint": pb.OutputConstraint(json_schema="{nope")}, "constraint.json_schema"),
            ({"constraint": pb.OutputConstraint(json_schema='{"not": {}}')}, "constraint.json_schema"),
            ({"chat": ASK, "tools": tools, "tool_choice": pb.ToolChoice(function="nope")}, "chat.tool_choice.function"),
            ({"chat": ASK, "tools": [pb.Tool(name="f", parameters_json='{"type": "strng"}')]},
             "chat.tools[0].parameters_json"),
            ({"constraint": pb.OutputConstraint(regex="[ab]+"), "ignore_eos": True}, "sampling.ignore_eos"),
        ]
        for kw, path in bad:
            if "chat" not in kw:
                kw = {"prompt": "x", **kw}
            with pytest.raises(grpc.RpcError) as info:
                c.complete(max_new_tokens=4, **kw)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_of(info.value) == path, \
                (path, info.value.details())


def test_random_http_requests_get_no_500_and_well_formed_answers(server: ServerProcess) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=_base_url(server)) as http:
        def control() -> list[str]:
            r = http.post("/completions", json=CONTROL, headers=auth, timeout=60)
            assert r.status_code == 200, r.text
            return [c["text"] for c in r.json()["choices"]]

        expected = control()
        chats = "".join(json.dumps({"messages": [{"role": "user", "content": f"Q{i}"},
                                                 {"role": "assistant", "content": "hi"}]}) + "\n" for i in range(4))
        up = http.post("/files", files={"file": ("t.jsonl", chats.encode())}, data={"purpose": "fine-tune"},
                       headers=auth, timeout=60)
        assert up.status_code == 200, up.text
        made: list[str] = []
        seen: dict[int, int] = {}

        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(call=http_calls(["tp2"], [up.json()["id"]]))
        def one(call: HttpCall) -> None:
            out = send_http(http, TOKEN, call)
            made.extend(out.job_ids)
            seen[out.status] = seen.get(out.status, 0) + 1
            assert_acceptable(call, out)

        try:
            one()
        finally:
            cancel_jobs(http, TOKEN, made)
        assert sum(n for s, n in seen.items() if s < 300) > 0  # some calls did succeed
        assert control() == expected
        health = httpx.get(f"http://{server.metrics_addr}/metrics", timeout=10)
        assert health.status_code == 200
    assert server.proc.poll() is None
    with server.client() as c:
        assert c.health_check() == "SERVING"


def test_a_request_answered_before_its_body_keeps_its_answer(server: ServerProcess) -> None:
    """The server answers (here 405) without reading a large body, and closes; the client is still
    sending it. The close lingers, so the unread bytes do not reset the connection and the answer
    is read (an immediate close makes the kernel reset it, and the answer is lost)."""
    import socket
    import threading
    from urllib.parse import urlparse

    url = urlparse(_base_url(server))
    body = b"x" * 250_000  # under --max-message-bytes (a 413 would come first)
    for _ in range(3):
        with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
            sock.sendall(b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")

            def send_body() -> None:
                try:
                    sock.sendall(body)
                except OSError:  # the server may stop reading: what matters is the answer
                    pass

            sender = threading.Thread(target=send_body, daemon=True)
            sender.start()
            answer = b""
            try:
                while chunk := sock.recv(65536):
                    answer += chunk
            except ConnectionResetError as e:
                raise AssertionError(f"the connection was reset after {len(answer)} bytes of the answer") from e
            sender.join(30)
        assert answer.startswith(b"HTTP/1.1 405"), answer[:200]
