"""The agent APIs' readers and stores without a server (issue 42): Responses input items and
Anthropic content blocks -> the chat messages the template renders, what each refuses, and the
bound on stored responses. The servers' side is in test_http_outputs.py and test_smollm2.py."""

from __future__ import annotations

from typing import Any

import pytest

from serve.anthropic.messages import MessagesBody, chat_messages, messages_request
from serve.openai.requests import ParamError, parse_body
from serve.openai.responses import ResponsesBody, conversation_messages, responses_request


def test_response_items_become_the_chat_an_agent_had() -> None:
    items: list[dict[str, Any]] = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                         {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny at noon."}]},
    ]
    assert conversation_messages(items, "Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "assistant", "content": "Sunny at noon."},
    ]
    # The previous response's conversation goes first; its instructions do not (OpenAI's rule).
    body = ResponsesBody(model="m", input="And tomorrow?", instructions="New rules.")
    req = responses_request(body, "", previous=items)
    messages = req.request.prompts[0].messages  # type: ignore[union-attr]
    assert messages[0] == {"role": "system", "content": "New rules."} and messages[-1]["content"] == "And tomorrow?"
    assert req.items[-1] == {"type": "message", "role": "user", "content": "And tomorrow?"}


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "message", "role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]},
     "input[0].arguments"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": "x", "include": ["code_interpreter_call.outputs"]}, "include[0]"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
])
def test_what_responses_cannot_honour_is_refused_naming_it(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ParamError) as info:
        responses_request(ResponsesBody(model="m", **body), "", None)
    assert info.value.param == param, (info.value.param, str(info.value))


def test_anthropic_blocks_become_the_chat_an_agent_had() -> None:
    body = MessagesBody(model="m", max_tokens=5, system=[{"type": "text", "text": "Be brief."}], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Call it.", "signature": ""},
                                          {"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "t1", "name": "weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "rain"}]},
                                     {"type": "tool_result", "tool_use_id": "t2", "content": "boom", "is_error": True},
                                     {"type": "text", "text": "Thanks", "cache_control": {"type": "ephemeral"}}]},
    ])
    assert chat_messages(body) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call it.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "rain"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: boom"},
        {"role": "user", "content": "Thanks"},
    ]
    req = messages_request(MessagesBody(model="m", max_tokens=7, messages=[{"role": "user", "content": "x"}],
                                        stop_sequences=["END"], tool_choice={"type": "any"},
                                        tools=[{"name": "f", "input_schema": {"type": "object"}}],
                                        thinking={"type": "enabled", "budget_tokens": 64}), "")
    assert req.request.sampling["max_new_tokens"] == 7 and req.request.sampling["stop_strings"] == ["END"]
    assert req.request.structured.tool_mode == "required"
    assert req.request.prompts[0].thinking_budget == 64  # type: ignore[union-attr]


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "bash_20250124", "name": "bash"}]},
     "tools[0].type"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool", "name": "f"}},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool", "name": "g"},
      "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tool_choice.name"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 0}},
     "thinking.budget_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "output_config": {"effort": "high"}}, "output_config.effort"),
])
def test_what_messages_cannot_honour_is_refused_naming_it(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ParamError) as info:
        messages_request(MessagesBody(model="m", max_tokens=4, **body), "")
    assert info.value.param == param, (info.value.param, str(info.value))


def test_documented_fields_refused_by_value_and_unknown_ones_by_name() -> None:
    """REFUSED fields are a 400 only with a value that asks for something; unknown fields by name."""
    ok = parse_body(b'{"model": "m", "max_tokens": 1, "messages": [], "speed": "standard"}', MessagesBody)
    assert ok.speed == "standard"
    for raw, param in ((b'{"model": "m", "max_tokens": 1, "messages": [], "speed": "fast"}', "speed"),
                       (b'{"model": "m", "max_tokens": 1, "messages": [], "mcp_servers": []}', "mcp_servers"),
                       (b'{"model": "m", "max_tokens": 1, "messages": [], "maxtokens": 1}', "maxtokens"),
                       (b'{"model": "m", "input": "x", "background": true}', "background")):
        model = ResponsesBody if b'"input"' in raw else MessagesBody
        with pytest.raises(ParamError) as info:
            parse_body(raw, model)  # type: ignore[type-var]
        assert info.value.param == param


def _deltas() -> list[tuple[dict[str, Any], Any]]:
    """A reasoning model's reply with a tool call, as chat chunks' choices and their events."""
    from serve.core.generation import ChoiceEvent

    ev = ChoiceEvent(0, "")
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    return [({"delta": {"reasoning_content": "Let me "}}, ev), ({"delta": {"reasoning_content": "think."}}, ev),
            ({"delta": {"content": "Calling."}}, ev), ({"delta": {"tool_calls": [call]}}, ev),
            ({"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}}, ev),
            ({"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}}, ev),
            ({"delta": {}, "finish_reason": "tool_calls"}, ChoiceEvent(0, "", finish_reason="stop"))]


USAGE = {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22, "prompt_tokens_details": {"cached_tokens": 4}}


def test_a_reasoning_reply_with_a_call_as_response_items_and_events() -> None:
    from serve.openai.responses import ResponseBuilder

    body = ResponsesBody(model="m", input="x")
    builder = ResponseBuilder(body, responses_request(body, "", None))
    events = builder.opening()
    for choice, _ in _deltas():
        events += builder.feed(choice)
    events += builder.finish(USAGE)
    out = builder.response()
    assert [o["type"] for o in out["output"]] == ["reasoning", "message", "function_call"]
    assert out["output"][0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert out["output"][1]["content"][0]["text"] == "Calling."
    assert (out["output"][2]["call_id"], out["output"][2]["arguments"]) == ("call_1", '{"a": 1}')
    assert out["status"] == "completed" and out["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    # Its conversation continues with the same items after the input.
    assert builder.conversation()[-3:] == out["output"]


def test_a_reasoning_reply_with_a_call_as_anthropic_blocks_and_events() -> None:
    from serve.anthropic.messages import MessageBuilder

    builder = MessageBuilder("m", 10)
    events = builder.opening()
    for choice, ev in _deltas():
        events += builder.feed(choice, ev)
    events += builder.finish(USAGE)
    msg = builder.message()
    assert [b["type"] for b in msg["content"]] == ["thinking", "text", "tool_use"]
    assert msg["content"][0]["thinking"] == "Let me think." and msg["content"][2]["input"] == {"a": 1}
    assert msg["stop_reason"] == "tool_use"
    assert msg["usage"] == {"input_tokens": 6, "output_tokens": 12, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 4}
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert deltas == ["thinking_delta", "thinking_delta", "text_delta", "input_json_delta", "input_json_delta"]


def test_a_tool_use_cut_by_max_tokens_ends_the_message_as_max_tokens() -> None:
    """A forced tool call whose arguments max_tokens cut before they closed is no call to make:
    the message says max_tokens (not tool_use, and not a 500 from parsing half an object), the
    block keeps {} and its stream carried the cut text."""
    from serve.anthropic.messages import MessageBuilder
    from serve.core.generation import ChoiceEvent

    builder = MessageBuilder("m", 10)
    cut = [(choice, ev) for choice, ev in _deltas() if "finish_reason" not in choice][:-1]
    events = builder.opening()
    for choice, ev in cut:
        events += builder.feed(choice, ev)
    events += builder.feed({"delta": {}, "finish_reason": "length"}, ChoiceEvent(0, "", finish_reason="length"))
    msg = builder.message()
    assert msg["stop_reason"] == "max_tokens" and msg["content"][-1] == {
        "type": "tool_use", "id": msg["content"][-1]["id"], "name": "f", "input": {}}
    assert [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
            and e["delta"]["type"] == "input_json_delta"] == ['{"a": ']
