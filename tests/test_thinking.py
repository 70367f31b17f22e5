"""A reasoning model's thinking steered by the engine (tprt.engine.thinking): the opening forced
when the reply must open the block, the close forced once the budget is spent (or the model's
own close taken), and an output constraint that applies to the answer after it; the core builds
it from a chat's thinking_budget for templates that think, and refuses it for those that do not."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest

from serve.core.generation import ChatPrompt, GenerationCore, GenerationRequest
from serve.core.structured import Structured
from serve.errors import InvalidArgument
from test_generation_core import FakeLoop, FakeRegistry
from test_reasoning import THINKING_TEMPLATE
from tiny_chat import make_tiny_chat_model, write_byte_tokenizer
from tprt.checkpoint.loading import load_model
from tprt.distributed.context import TPContext
from tprt.engine.constraints import ConstraintSpec
from tprt.engine.core import Engine, EngineConfig, run_to_completion
from tprt.engine.sampling import SamplingParams
from tprt.engine.thinking import Thinking, ThinkingState
from tprt.errors import ValidationError
from tprt.text.tokenizer import Tokenizer

OPEN, CLOSE = (7, 8), (9,)


def test_the_state_forces_the_opening_then_the_close_at_the_budget() -> None:
    state = ThinkingState(Thinking(OPEN, CLOSE, budget=2))
    assert state.forced == [7, 8]
    assert [state.observe(t) for t in (7, 8, 50, 51)] == [False] * 4 and state.forced == [9]
    assert state.observe(9) and state.done and not state.observe(9)
    own = ThinkingState(Thinking((), (9, 10), budget=5))  # the prompt opened it; the model closes it itself
    assert [own.observe(t) for t in (50, 9, 10)] == [False, False, True] and own.forced == []
    none = ThinkingState(Thinking(OPEN, CLOSE, budget=0))  # no thinking at all: open and close at once
    assert none.forced == [7, 8, 9] and [none.observe(t) for t in (7, 8, 9)] == [False, False, True]
    with pytest.raises(ValidationError, match="^thinking_budget"):
        Thinking(OPEN, CLOSE, budget=-1).validate(100)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("thinking"), (1,))


def test_the_engine_forces_the_close_and_constrains_the_answer(model_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir / "hf")
    model = load_model(model_dir / "tp1", TPContext.single())
    think, close = (tuple(tok.encode(t, add_special_tokens=False)) for t in ("<think>", "</think>"))
    prompt = tok.encode("<s>user\nhow many?</s>\n<s>assistant\n", add_special_tokens=False)
    engine = Engine(model, tok, EngineConfig(max_batch=4, max_seq_len=96))
    regex = ConstraintSpec.regex("[0-9]{2,4}", "regex")
    runs = {"budget": SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True,
                                     thinking=Thinking(think, close, budget=5)),
            "constrained": SamplingParams(temperature=0.0, max_new_tokens=60, constraint=regex,
                                          thinking=Thinking(think, close, budget=3)),
            "sampled": SamplingParams(temperature=1.0, seed=3, max_new_tokens=40, ignore_eos=True, logprobs=True,
                                      thinking=Thinking((), close, budget=4))}
    for rid, params in runs.items():
        engine.add(prompt, params, rid)
    done = run_to_completion(engine)
    budget = done["budget"].token_ids
    n = len(think)
    assert tuple(budget[:n]) == think and tuple(budget[n + 5 : n + 5 + len(close)]) == close
    text = done["constrained"].text
    answer = text.split("</think>", 1)[1]
    assert text.startswith("<think>") and re.fullmatch("[0-9]{2,4}", answer), text
    sampled = done["sampled"]
    assert tuple(sampled.token_ids[4 : 4 + len(close)]) == close
    assert all(lp <= 0.0 and lp == lp for lp in sampled.logprobs)  # the forced ids' logprobs too, not NaN
    engine.close()


def test_the_core_builds_the_thinking_from_a_chat(tmp_path: Path) -> None:
    def core_for(template: str | None) -> GenerationCore:
        d = tmp_path / ("thinks" if template else "plain")
        d.mkdir()
        write_byte_tokenizer(d)
        if template is not None:
            cfg = json.loads((d / "tokenizer_config.json").read_text())
            (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
        facts = types.SimpleNamespace(name="base", context_length=512, config=types.SimpleNamespace(vocab_size=259))
        return GenerationCore(FakeLoop(), Tokenizer.from_dir(d), facts, FakeRegistry())  # type: ignore[arg-type]

    ask = [{"role": "user", "content": "2+2?"}]
    qwen3 = core_for(THINKING_TEMPLATE)
    prepared = qwen3.prepare(GenerationRequest([ChatPrompt(ask, thinking_budget=16)], {}))
    thinking = prepared.choices[0][1].thinking
    assert thinking is not None and thinking.budget == 16 and thinking.open_ids  # the reply opens the block
    free = qwen3.prepare(GenerationRequest([ChatPrompt(ask)], {}, Structured(None)))
    assert free.choices[0][1].thinking is None  # nothing to steer: the model thinks as it likes
    closed = qwen3.prepare(GenerationRequest([ChatPrompt(ask, template_kwargs={"enable_thinking": False}, thinking_budget=16)], {}))
    assert closed.choices[0][1].thinking is None  # the prompt closed the block: no thinking to budget
    with pytest.raises(InvalidArgument) as info:
        core_for(None).prepare(GenerationRequest([ChatPrompt(ask, thinking_budget=16)], {}))
    assert info.value.field == "thinking_budget"
    with pytest.raises(InvalidArgument) as info:
        qwen3.prepare(GenerationRequest([ChatPrompt(ask, thinking_budget=-2)], {}))
    assert info.value.field == "thinking_budget"
