"""serve/core/structured.py without a server: request fields -> one output constraint (each error naming
the OpenAI parameter), tools -> the forced call's constraint, generated text -> tool calls, and the
chat prompt with tools through a template that supports them and one that does not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from serve.core.structured import Structured, encode_tool_chat, parse_tool_calls, template_messages
from serve.openai.structured import read_structured
from tiny_chat import write_byte_tokenizer
from tprt.engine.constraints import StructuredOutputs
from tprt.errors import ValidationError
from tprt.text.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}


def test_constraints_from_openai_fields() -> None:
    assert read_structured().constraint is None
    assert read_structured(response_format={"type": "text"}).constraint is None
    c = read_structured(response_format={"type": "json_object"}).constraint
    assert c is not None and c.kind == "json_object"
    c = read_structured(response_format={"type": "json_schema", "json_schema": {
        "name": "person", "strict": True, "schema": {"type": "object"}}}).constraint
    assert c is not None and c.kind == "json_schema" and c.field == "response_format.json_schema.schema"
    for kind, value in (("regex", "[a-z]+"), ("choice", ["x", "y"]), ("grammar", 'start: "a"'),
                        ("json", {"type": "integer"}), ("json", '{"type": "integer"}')):
        c = read_structured(structured_outputs={kind: value}).constraint
        assert c is not None and c.field == f"structured_outputs.{kind}"


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"xpath": "a"}}, "structured_outputs.xpath"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x y"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_fields_name_the_parameter(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as info:
        read_structured(**fields)
    assert info.value.field == param and str(info.value).startswith(param + ":"), str(info.value)


def test_tool_modes_and_the_forced_call(tmp_path: Path) -> None:
    auto = read_structured(tools=[WEATHER, ADD])
    assert auto.tool_mode == "auto" and auto.constraint is None and not auto.expects_tool_calls
    assert [s.field for s in auto.specs()] == ["tools[0].function.parameters", "tools[1].function.parameters"]
    none = read_structured(tools=[WEATHER], tool_choice="none")
    assert none.template_tools() is None and none.tool_calls('{"name": "get_weather", "parameters": {}}') is None
    named = read_structured(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}})
    assert named.expects_tool_calls and named.constraint is not None
    schema = json.loads(named.constraint.source)
    jsonschema.validate({"name": "add", "parameters": {"a": 1, "b": 2}}, schema)
    for wrong in ({"name": "get_weather", "parameters": {"city": "Oslo"}},  # another function
                  [{"name": "add", "parameters": {"a": 1, "b": 2}}]):  # a named function is called once
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    required = read_structured(tools=[WEATHER, ADD], tool_choice="required")
    assert required.constraint is not None
    schema = json.loads(required.constraint.source)
    jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}},
                         {"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    # The forced call compiles, and so does every tool's parameter schema.
    write_byte_tokenizer(tmp_path)
    outputs = StructuredOutputs(Tokenizer.from_dir(tmp_path))
    for spec in required.specs():
        outputs.compile(spec)
    bad = read_structured(tools=[{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}])
    with pytest.raises(ValidationError) as info:
        for spec in bad.specs():
            outputs.compile(spec)
    assert info.value.field == "tools[0].function.parameters"


def test_parse_tool_calls() -> None:
    names = {"get_weather", "add"}
    calls = parse_tool_calls(' {"name": "add", "parameters": {"a": 1, "b": 2}}\n', names)
    assert calls is not None and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert calls[0].id.startswith("call_")
    calls = parse_tool_calls('[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", '
                             '"parameters": {"city": "Oslo"}}]', names)
    assert calls is not None and [c.name for c in calls] == ["add", "get_weather"]
    for text in ("The weather is fine.", '{"name": "unknown", "parameters": {}}', '{"name": "add", "parameters": 3}',
                 '{"name": "add"', "[]", ""):
        assert parse_tool_calls(text, names) is None, text


TOOL_TEMPLATE = (
    "{% if tools %}<s>tools\n{% for t in tools %}{{ t.function.name }};{% endfor %}</s>\n{% endif %}"
    "{% for m in messages %}<s>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "CALL {{ c.function.name }} {{ c.function.arguments.a }}{% endfor %}{% else %}{{ m.content }}{% endif %}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def test_chat_prompt_with_tools(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)  # tiny_chat's template: no tool support
    history = [{"role": "user", "content": "add 1 and 2"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    structured = read_structured(tools=[ADD])
    text = tok.decode(encode_tool_chat(tok, history, structured))
    assert text.startswith("<s>system\nYou can call these functions.") and '"name": "add"' in text
    assert '<s>assistant\n{"name": "add", "parameters": {"a": 1, "b": 2}}</s>' in text
    assert "<s>tool\n3</s>" in text
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TOOL_TEMPLATE}))
    tok = Tokenizer.from_dir(tmp_path)  # a template that reads `tools` and `tool_calls`
    text = tok.decode(encode_tool_chat(tok, history, structured))
    assert text.startswith("<s>tools\nadd;</s>") and "CALL add 1" in text
    with pytest.raises(ValidationError) as info:
        template_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{x"}}]}])
    assert info.value.field == "messages[0].tool_calls[0].function.arguments"


def test_tool_call_stream_yields_openai_deltas() -> None:
    from serve.core.structured import ToolCallStream

    text = ('[{"name":"add","parameters":{"a":1,"b":{"c":"}]\\"x"}}},'
            '{"name":"get_weather","parameters":{"city":"Oslo"}}]')
    for step in (1, 3, 7, len(text)):
        stream = ToolCallStream()
        deltas = [d for i in range(0, len(text), step) for d in stream.feed(text[i:i + step])]
        starts = [d for d in deltas if d.name is not None]
        assert [(d.index, d.name) for d in starts] == [(0, "add"), (1, "get_weather")]
        args = ["".join(d.arguments for d in deltas if d.index == i) for i in (0, 1)]
        assert [json.loads(a) for a in args] == [{"a": 1, "b": {"c": '}]"x'}}, {"city": "Oslo"}]


def test_a_constraint_that_fails_mid_output_is_an_error_finish_over_http() -> None:
    """R5: gRPC says stop_reason "constraint_error"; HTTP said finish_reason "stop" with the cut
    text, like a complete answer. It now says finish_reason "error", stop_reason beside it, whole
    and streamed, chat and completions (and never "tool_calls" for a forced call cut short)."""
    from serve.core.generation import ChoiceEvent, Prepared
    from serve.openai.reply import Reply
    from tprt.engine.sampling import SamplingParams
    from tprt.engine.sequence import Usage

    def prepared(structured: Structured) -> Prepared:
        return Prepared([[1, 2]], [(0, SamplingParams(max_new_tokens=4))], 1, structured, "", 0)

    cut = [ChoiceEvent(0, '{"a": '), ChoiceEvent(0, "", None, "stop", "constraint_error", Usage(2, 2, 0))]
    for kind in ("chat.completion", "text_completion"):
        reply = Reply(kind, "m", prepared(read_structured(response_format={"type": "json_object"})))
        for ev in cut:
            reply.add(ev)
        choice = reply.whole()["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("error", "constraint_error"), choice
        streamed = Reply(kind, "m", prepared(read_structured(response_format={"type": "json_object"})))
        chunks = [streamed.chunk(ev, include_usage=False) for ev in cut]
        last = chunks[-1]
        assert last is not None and last["choices"][0]["finish_reason"] == "error"
    forced = read_structured(tools=[WEATHER], tool_choice="required")
    reply = Reply("chat.completion", "m", prepared(forced))
    last = [reply.chunk(ev, include_usage=False) for ev in cut][-1]
    assert last is not None and last["choices"][0]["finish_reason"] == "error"
    whole = Reply("chat.completion", "m", prepared(forced))
    for ev in cut:
        whole.add(ev)
    assert whole.whole()["choices"][0]["finish_reason"] == "error"
    ok = Reply("chat.completion", "m", prepared(read_structured()))
    ok.add(ChoiceEvent(0, "hi", None, "stop", 2, Usage(2, 1, 0)))
    assert ok.whole()["choices"][0]["finish_reason"] == "stop" and "stop_reason" not in ok.whole()["choices"][0]


def test_tool_parameters_must_be_an_object_schema() -> None:
    """R4: a tool whose parameters are not an object schema (`{"type": "string"}`) was accepted,
    and its arguments then streamed as something other than JSON."""
    for parameters in ({"type": "string"}, {"type": "array", "items": {}}, {"type": ["object", "null"]}):
        tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
        with pytest.raises(ValidationError) as info:
            read_structured(tools=[tool])
        assert info.value.field == "tools[0].function.parameters" and "object schema" in str(info.value)
    for parameters in ({"type": "object"}, {"properties": {"a": {"type": "integer"}}}, None):
        read_structured(tools=[{"type": "function", "function": {"name": "f", "parameters": parameters}}])


def test_vllm_guided_fields_are_aliases_of_structured_outputs() -> None:
    """R6: guided_json, guided_regex, guided_choice and guided_grammar were ignored (free text, a
    200); they constrain the output as structured_outputs does, errors naming them."""
    from serve.openai.requests import ChatBody, CompletionBody, ParamError, chat_request, completion_request

    for kind, value, want in (("json", {"type": "integer"}, "json_schema"), ("json", '{"type": "integer"}', "json_schema"),
                              ("regex", "[ab]+", "regex"), ("choice", ["x", "y"], "choice"),
                              ("grammar", 'start: "a"', "grammar")):
        c = read_structured(guided={kind: value}).constraint
        assert c is not None and c.kind == want and c.field == f"guided_{kind}"
        body = CompletionBody(model="m", prompt="hi", **{f"guided_{kind}": value})
        c = completion_request(body, "").request.structured.constraint
        assert c is not None and c.kind == want
    chat = ChatBody(model="m", messages=[{"role": "user", "content": "hi"}], guided_choice=["a", "b"])
    c = chat_request(chat, "").request.structured.constraint
    assert c is not None and c.kind == "choice"
    for body, param in ((CompletionBody(model="m", prompt="hi", guided_regex="a", guided_choice=["b"]), "guided_choice"),
                        (CompletionBody(model="m", prompt="hi", guided_regex="a", structured_outputs={"regex": "b"}),
                         "guided_regex"),
                        (CompletionBody(model="m", prompt="hi", guided_json="{not json"), "guided_json"),
                        (CompletionBody(model="m", prompt="hi", guided_choice=[]), "guided_choice")):
        with pytest.raises(ParamError) as info:
            completion_request(body, "")
        assert info.value.param == param, (info.value.param, param)


def test_an_empty_grpc_constraint_is_named_constraint() -> None:
    """R7: an empty `constraint {}` was reported under sampling.constraint."""
    from serve.errors import InvalidArgument
    from serve.grpc.pb import generation_pb2 as gen_pb
    from serve.grpc.validation import grpc_field, structured_of

    request = gen_pb.GenerateRequest(prompt="hi")
    request.constraint.SetInParent()
    with pytest.raises(InvalidArgument) as info:
        structured_of(request)
    assert info.value.field == "constraint"
    assert grpc_field("constraint") == "constraint" and grpc_field("temperature") == "sampling.temperature"


HERMES_TEMPLATE = (  # the shape of Qwen's: tools listed in the system turn, calls in <tool_call> blocks
    "{% if tools %}<s>system\n{% for t in tools %}{{ t.function.name }};{% endfor %} answer with "
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call></s>\n{% endif %}"
    "{% for m in messages %}<s>{{ m.role }}\n{{ m.content }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def test_hermes_tool_calls_for_qwen_templates(tmp_path: Path) -> None:
    """A template that asks for <tool_call> blocks (Qwen2/2.5/3) gets them: the syntax is read from
    the template; a forced call is a grammar of blocks around each call's JSON (one for a named
    function, one or more for "required"), which the engine's matcher enforces; the blocks parse
    back into calls, and anything else in the text makes it text."""
    from serve.core.structured import parse_hermes_calls, tool_syntax

    assert tool_syntax(HERMES_TEMPLATE) == "hermes" and tool_syntax(TOOL_TEMPLATE) == tool_syntax(None) == "json"
    write_byte_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    outputs = StructuredOutputs(tok)
    one = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
    cases = {"required": (one, two), "named": (one,)}
    for choice, good in (("required", cases["required"]), ({"type": "function", "function": {"name": "add"}},
                                                           cases["named"])):
        structured = read_structured(tools=[WEATHER, ADD], tool_choice=choice).with_syntax("hermes")
        assert structured.syntax == "hermes" and structured.constraint is not None
        grammar = outputs.compile(structured.constraint)
        wrong = [two] if choice != "required" else []
        wrong += ['{"name":"add","arguments":{"a":1,"b":2}}',  # no tags
                  '<tool_call>\n{"name":"add","arguments":{"a":1}}\n</tool_call>']  # b missing
        for text, ok in [(t, True) for t in good] + [(t, False) for t in wrong]:
            ids = tok.encode(text, add_special_tokens=False)
            matcher = outputs.matcher(grammar)
            assert (matcher.accept_prefix(ids) == len(ids) and matcher.accepting) == ok, (choice, text)
        assert [c.name for c in structured.tool_calls(good[-1]) or []] == (["add", "get_weather"][: len(good)])
    names = {"add", "get_weather"}
    assert parse_hermes_calls(f"  {one}\n", names) is not None
    for text in (f"Sure. {one}", '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
                 '<tool_call>\n[{"name": "add", "arguments": {}}]\n</tool_call>', one[:-3], ""):
        assert parse_hermes_calls(text, names) is None, text
    auto = read_structured(tools=[ADD]).with_syntax("hermes")
    assert auto.constraint is None  # "auto": the model chooses
    assert [auto.starts_call(t) for t in ("<tool", "<tool_call>\n{", "Hi", "<b>")] == [None, True, False, False]


def test_hermes_calls_stream_and_auto_text_through_the_openai_reply() -> None:
    """OpenAI chat replies in the Hermes syntax: a forced call streams as call deltas without its
    tags; under "auto" a reply that opens with <tool_call> is held and becomes tool_calls, one
    that merely starts with "<" is text."""
    from serve.core.generation import ChoiceEvent, Prepared
    from serve.core.structured import ToolCallStream
    from serve.openai.reply import Reply
    from tprt.engine.sampling import SamplingParams
    from tprt.engine.sequence import Usage

    text = ('<tool_call>\n{"name":"add","arguments":{"a":1,"b":{"c":"</tool_call>"}}}\n</tool_call>\n'
            '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>')
    for step in (1, 5, len(text)):
        stream = ToolCallStream("hermes")
        deltas = [d for i in range(0, len(text), step) for d in stream.feed(text[i:i + step])]
        assert [d.name for d in deltas if d.name] == ["add", "get_weather"]
        args = ["".join(d.arguments for d in deltas if d.index == i) for i in (0, 1)]
        assert [json.loads(a) for a in args] == [{"a": 1, "b": {"c": "</tool_call>"}}, {"city": "Oslo"}]

    def reply(structured: Structured, pieces: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        prepared = Prepared([[1, 2]], [(0, SamplingParams(max_new_tokens=64))], 1, structured, "", 0)
        events = [ChoiceEvent(0, p) for p in pieces] + [ChoiceEvent(0, "", None, "stop", 2, Usage(2, 9, 0))]
        streamed, whole = Reply("chat.completion", "m", prepared), Reply("chat.completion", "m", prepared)
        chunks = [c for c in (streamed.chunk(ev, include_usage=False) for ev in events) if c is not None]
        for ev in events:
            whole.add(ev)
        return [c["choices"][0]["delta"] for c in chunks], whole.whole()["choices"][0]

    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    auto = read_structured(tools=[ADD]).with_syntax("hermes")
    deltas, choice = reply(auto, ["<to", "ol_call>\n", call[len("<tool_call>\n"):]])
    calls = [d for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0]["tool_calls"][0]["function"]["name"] == "add"
    assert not any(d.get("content") for d in deltas)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["function"]["name"] == "add"
    deltas, choice = reply(auto, ["<", "b>bold</b>"])
    assert "".join(d.get("content") or "" for d in deltas) == "<b>bold</b>" == choice["message"]["content"]
    forced = read_structured(tools=[ADD], tool_choice="required").with_syntax("hermes")
    compact = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'  # as the grammar writes it
    deltas, choice = reply(forced, [compact[:20], compact[20:]])
    streamed = [t for d in deltas for t in d.get("tool_calls", [])]
    assert streamed[0]["function"]["name"] == "add"
    assert json.loads("".join(t["function"]["arguments"] for t in streamed)) == {"a": 1, "b": 2}
    assert choice["finish_reason"] == "tool_calls"


MISTRAL_TEMPLATE = (  # the shape of Mistral v0.3's: tools before the last user turn, calls as [TOOL_CALLS] + an
    # array, results with their call's id, and ids of 9 alphanumerics or an error
    "{% for m in messages %}{% if m.role == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS]"
    "{% for t in tools %}{{ t.function.name }};{% endfor %}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    "{% if c.id is not string or c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric "
    "strings with length 9!') }}{% endif %}{\"name\": \"{{ c.function.name }}\", \"id\": \"{{ c.id }}\"}"
    "{% endfor %}]</s>{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }} {{ m.tool_call_id }}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}")


def test_mistral_tool_calls(tmp_path: Path) -> None:
    """A template that writes [TOOL_CALLS] (Mistral) gets Mistral's calls: a JSON array of
    {"name", "arguments"} objects, forced as such (one call for a named function, one or more
    for "required"), parsed back with or without the [TOOL_CALLS] control token in the text and
    streamed as call deltas; ids that the template takes (9 alphanumerics), and an earlier
    conversation's OpenAI ids mapped to such ids the same way for the call and its result."""
    from serve.core.structured import ToolCallStream, mistral_call_id, tool_syntax

    assert tool_syntax(MISTRAL_TEMPLATE) == "mistral"
    write_byte_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": MISTRAL_TEMPLATE}))
    tok = Tokenizer.from_dir(tmp_path)
    outputs = StructuredOutputs(tok)
    one = '[{"name":"add","arguments":{"a":1,"b":2}}]'
    two = '[{"name":"add","arguments":{"a":1,"b":2}},{"name":"get_weather","arguments":{"city":"Oslo"}}]'
    for choice, good, bad in (("required", (one, two), ()), ({"type": "function", "function": {"name": "add"}},
                                                             (one,), (two,))):
        structured = read_structured(tools=[WEATHER, ADD], tool_choice=choice).with_syntax("mistral")
        assert structured.constraint is not None
        grammar = outputs.compile(structured.constraint)
        wrong = list(bad) + ['{"name":"add","arguments":{"a":1,"b":2}}',  # not an array
                             '[{"name":"add","parameters":{"a":1,"b":2}}]', "[]"]
        for text, ok in [(t, True) for t in good] + [(t, False) for t in wrong]:
            ids = tok.encode(text, add_special_tokens=False)
            matcher = outputs.matcher(grammar)
            assert (matcher.accept_prefix(ids) == len(ids) and matcher.accepting) == ok, (choice, text)
        calls = structured.tool_calls(good[-1]) or []
        assert [c.name for c in calls] == ["add", "get_weather"][: len(good)]
        assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    auto = read_structured(tools=[WEATHER, ADD]).with_syntax("mistral")
    assert auto.constraint is None and [auto.starts_call(t) for t in ("[TOOL", "[{", "Hi")] == [True, True, False]
    for text in (f"[TOOL_CALLS]{two}", f" [TOOL_CALLS] {two}", two):
        assert [c.name for c in auto.tool_calls(text) or []] == ["add", "get_weather"], text
    assert auto.tool_calls("I would add them.") is None
    stream = ToolCallStream("mistral")
    deltas = [d for i in range(0, len(two), 4) for d in stream.feed(two[i:i + 4])]
    assert [d.name for d in deltas if d.name] == ["add", "get_weather"]
    assert all(len(d.id or "") == 9 for d in deltas if d.name)
    assert json.loads("".join(d.arguments for d in deltas if d.index == 1)) == {"city": "Oslo"}
    history = [{"role": "user", "content": "add 1 and 2"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_0123456789abcdef", "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "3"},
               {"role": "user", "content": "and 3?"}]
    text = tok.decode(encode_tool_chat(tok, history, auto))
    alias = mistral_call_id("call_0123456789abcdef")
    assert len(alias) == 9 and alias.isalnum() and mistral_call_id("abcDEF123") == "abcDEF123"
    assert f'"id": "{alias}"' in text and f"[TOOL_RESULTS]3 {alias}[/TOOL_RESULTS]" in text
    assert text.endswith("[AVAILABLE_TOOLS]get_weather;add;[/AVAILABLE_TOOLS][INST]and 3?[/INST]")


def test_llama_calls_may_open_with_the_python_tag() -> None:
    """Llama 3.1 may write <|python_tag|> before a JSON call: held under "auto", then parsed."""
    auto = read_structured(tools=[ADD])
    assert [auto.starts_call(t) for t in ("<|py", "<|python_tag|>{", "<b>")] == [None, True, False]
    calls = auto.tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert calls is not None and calls[0].name == "add" and json.loads(calls[0].arguments) == {"a": 1, "b": 2}


def test_sglang_routers_extras_are_accepted_at_what_this_server_does() -> None:
    """sglang-router adds SGLang's fields to every request it routes, at their defaults (captured
    from sglang-router 0.3.2): accepted; any other value is a 400 naming the field."""
    from serve.openai.requests import ChatBody, CompletionBody, ParamError, parse_body

    chat = {"messages": [{"role": "user", "content": "hello"}], "model": "tp1", "logprobs": False,
            "max_completion_tokens": 4, "stream": False, "no_stop_trim": False, "ignore_eos": False,
            "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
            "stream_reasoning": True, "return_hidden_states": False}
    completion = {"model": "tp1", "prompt": "hello", "max_tokens": 4, "stream": False, "echo": False,
                  "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                  "return_hidden_states": False}
    parse_body(json.dumps(chat).encode(), ChatBody)
    parse_body(json.dumps(completion).encode(), CompletionBody)
    for body, model, field, value in ((chat, ChatBody, "continue_final_message", True),
                                      (chat, ChatBody, "stream_reasoning", False),
                                      (completion, CompletionBody, "no_stop_trim", True),
                                      (completion, CompletionBody, "skip_special_tokens", False)):
        with pytest.raises(ParamError) as info:
            parse_body(json.dumps({**body, field: value}).encode(), model)  # type: ignore[type-var]
        assert info.value.param == field


def test_unknown_fields_are_refused_unless_the_server_ignores_them() -> None:
    """OpenAI's "Unrecognized request argument supplied" for a chat or completions body with a field
    the endpoint does not know (the first one named), or the field dropped under
    --ignore-unknown-fields; fields that describe the caller are known; other bodies keep theirs."""
    from serve.openai.requests import ChatBody, CompletionBody, ParamError, parse_body

    raw = json.dumps({"model": "m", "prompt": "x", "user": "u", "metadata": {"k": "v"}, "store": True,
                      "service_tier": "auto", "temprature": 0.5, "logit_bias": {"5": 1}}).encode()
    with pytest.raises(ParamError) as info:
        parse_body(raw, CompletionBody)
    assert info.value.param == "temprature" and "Unrecognized request argument supplied: temprature" in str(info.value)
    body = parse_body(raw, CompletionBody, ignore_unknown=True)
    assert body.user == "u" and body.logit_bias == {"5": 1} and not hasattr(body, "temprature")
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"})
    with pytest.raises(ParamError) as info:
        parse_body(chat.encode(), ChatBody)
    assert info.value.param == "reasoning_effort"


def test_message_fields_are_honoured_or_refused() -> None:
    """A message's fields: what OpenAI's SDK sends back from an earlier reply is taken (null
    audio and function_call, annotations; a refusal in place of missing content; a reasoning
    model's thinking passed to the template); anything else is a 400 naming the message's field,
    or dropped under --ignore-unknown-fields; audio and function_call themselves are refused."""
    from serve.core.generation import ChatPrompt
    from serve.openai.requests import ChatBody, ParamError, chat_request, parse_body

    def body(*messages: dict[str, Any]) -> bytes:
        return json.dumps({"model": "m", "messages": list(messages)}).encode()

    earlier = {"role": "assistant", "content": None, "refusal": "I cannot.", "annotations": [], "audio": None,
               "function_call": None, "reasoning_content": "They asked for harm."}
    req = chat_request(parse_body(body({"role": "user", "content": "hi"}, earlier), ChatBody), "").request
    chat = req.prompts[0]
    assert isinstance(chat, ChatPrompt)
    assert chat.messages[1] == {"role": "assistant", "content": "I cannot.", "reasoning_content": "They asked for harm."}
    with pytest.raises(ParamError) as info:
        parse_body(body({"role": "user", "content": "hi", "mood": "curious"}), ChatBody)
    assert info.value.param == "messages[0].mood"
    assert parse_body(body({"role": "user", "content": "hi", "mood": "x"}), ChatBody, ignore_unknown=True).messages[0].role == "user"
    for key, value in (("audio", {"id": "a1"}), ("function_call", {"name": "f", "arguments": "{}"})):
        with pytest.raises(ParamError) as info:
            chat_request(parse_body(body({"role": "assistant", "content": "x", key: value}), ChatBody), "")
        assert info.value.param == f"messages[0].{key}"
