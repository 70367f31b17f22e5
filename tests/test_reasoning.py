"""Reasoning models' replies (serve/core/reasoning.py): the thinking split off into OpenAI's
`reasoning_content`, whole and streamed at any chunking, from a block the prompt opened or the
reply opens; `chat_template_kwargs` reaching the template (Qwen3's `enable_thinking`)."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest

from serve.core.generation import ChatPrompt, ChoiceEvent, GenerationCore, GenerationRequest, Prepared
from serve.core.reasoning import ReasoningSplit, prompt_opens_reasoning, split_reply, thinks
from serve.core.structured import Structured
from serve.errors import InvalidArgument
from serve.openai.reply import Reply
from test_generation_core import FakeLoop, FakeRegistry
from tiny_chat import write_byte_tokenizer
from tprt.engine.sampling import SamplingParams
from tprt.engine.sequence import Usage
from tprt.text.tokenizer import Tokenizer

# Qwen3's shape: thinking unless enable_thinking is false, when the prompt holds an empty block.
THINKING_TEMPLATE = (
    "{% for m in messages %}<s>{{ m.role }}\n{{ m.content }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}")
R1_TEMPLATE = THINKING_TEMPLATE.replace("<s>assistant\n{%", "<s>assistant\n<think>\n{%")  # the prompt opens it

REPLIES = [  # (reply, whether the prompt opened the block, reasoning, content)
    ("<think>\nTwo and two.\n</think>\n\nIt is 4.", False, "Two and two.", "It is 4."),
    ("Two and two.\n</think>\n\nIt is 4.", True, "Two and two.", "It is 4."),
    ("It is 4. <think> is a tag.", False, None, "It is 4. <think> is a tag."),
    ("<thin", False, None, "<thin"),
    ("<think>\nstill thinking when cut", False, "still thinking when cut", ""),
]


@pytest.mark.parametrize("reply,opened,reasoning,content", REPLIES)
def test_the_split_is_the_same_whole_and_streamed(reply: str, opened: bool, reasoning: str | None,
                                                    content: str) -> None:
    assert split_reply(reply, opened) == (reasoning, content)
    for step in (1, 2, 3, 5, len(reply)):
        split, got_r, got_c = ReasoningSplit(opened), "", ""
        pieces = [reply[i:i + step] for i in range(0, len(reply), step)]
        for k, piece in enumerate(pieces):
            r, c = split.feed(piece, final=k == len(pieces) - 1)
            got_r, got_c = got_r + r, got_c + c
        assert (got_r.strip() or None, got_c) == (reasoning, content), step


def test_the_openai_reply_carries_reasoning_content() -> None:
    def reply(opened: bool | None, pieces: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        prepared = Prepared([[1]], [(0, SamplingParams(max_new_tokens=64))], 1, Structured(None), "", 0, opened)
        events = [ChoiceEvent(0, p) for p in pieces] + [ChoiceEvent(0, "", None, "stop", 2, Usage(1, 9, 0))]
        streamed, whole = Reply("chat.completion", "m", prepared), Reply("chat.completion", "m", prepared)
        chunks = [c for c in (streamed.chunk(ev, include_usage=False) for ev in events) if c is not None]
        for ev in events:
            whole.add(ev)
        return [c["choices"][0]["delta"] for c in chunks], whole.whole()["choices"][0]["message"]

    text = "<think>\nTwo and two.\n</think>\n\nIt is 4."
    deltas, message = reply(False, [text[i:i + 4] for i in range(0, len(text), 4)])
    assert "".join(d.get("reasoning_content", "") for d in deltas).strip() == "Two and two."
    assert "".join(d.get("content") or "" for d in deltas) == "It is 4."
    assert message == {"role": "assistant", "content": "It is 4.", "reasoning_content": "Two and two."}
    _, message = reply(None, [text])  # not a reasoning model: the text as it came
    assert message == {"role": "assistant", "content": text}


def test_the_core_renders_template_kwargs_and_finds_the_open_block(tmp_path: Path) -> None:
    def core_for(template: str) -> GenerationCore:
        d = tmp_path / str(abs(hash(template)))
        d.mkdir()
        write_byte_tokenizer(d)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
        facts = types.SimpleNamespace(name="base", context_length=512, config=types.SimpleNamespace(vocab_size=259))
        return GenerationCore(FakeLoop(), Tokenizer.from_dir(d), facts, FakeRegistry())  # type: ignore[arg-type]

    ask = [{"role": "user", "content": "2+2?"}]

    def prepare(core: GenerationCore, **kwargs: Any) -> Prepared:
        return core.prepare(GenerationRequest([ChatPrompt(ask, template_kwargs=kwargs)], {}))

    qwen3, r1 = core_for(THINKING_TEMPLATE), core_for(R1_TEMPLATE)
    assert thinks(THINKING_TEMPLATE) and not thinks("{{ messages }}")
    thinking, direct = prepare(qwen3), prepare(qwen3, enable_thinking=False)
    assert thinking.reasoning is False  # a reasoning model whose reply opens the block itself
    assert qwen3.tokenizer is not None
    assert qwen3.tokenizer.decode(direct.prompts[0]).endswith("<think>\n\n</think>\n\n")
    assert prompt_opens_reasoning("<s>assistant\n<think>\n") and prepare(r1).reasoning is True
    for name in ("messages", "add_generation_prompt", "not a name"):
        with pytest.raises(InvalidArgument) as info:
            prepare(qwen3, **{name: 1})
        assert info.value.field == f"chat_template_kwargs.{name}"


def test_grpc_chats_carry_template_kwargs_as_json() -> None:
    """gRPC's Chat.chat_template_kwargs is a JSON object (the same variables as OpenAI's field);
    anything else is INVALID_ARGUMENT naming it. (Its replies' `reasoning` is the same split.)"""
    from serve.grpc.validation import prompt_of
    from serve.protos import load

    pb = load()["generation_pb2"]
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")], chat_template_kwargs='{"enable_thinking": false}')
    prompt = prompt_of(pb.GenerateRequest(chat=chat))
    assert isinstance(prompt, ChatPrompt) and prompt.template_kwargs == {"enable_thinking": False}
    assert prompt_of(pb.GenerateRequest(chat=pb.Chat(messages=chat.messages))).template_kwargs == {}  # type: ignore[attr-defined]
    for bad in ("{enable_thinking", "[1]"):
        with pytest.raises(InvalidArgument) as info:
            prompt_of(pb.GenerateRequest(chat=pb.Chat(messages=chat.messages, chat_template_kwargs=bad)))
        assert info.value.field == "chat_template_kwargs"
    assert "reasoning" in pb.GenerateResponse.DESCRIPTOR.fields_by_name
    assert "reasoning" in pb.CompleteResponse.DESCRIPTOR.fields_by_name
