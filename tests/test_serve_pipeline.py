"""`tprt serve --pp 2` (issue 44): a server whose ranks are two pipeline stages of a TP=2
checkpoint (four ranks) answers as the whole model does: concurrent requests batched together,
greedy tokens and their logprobs as transformers', a prompt's own logprobs (`echo`) scored across
the stages, a LoRA adapter loaded onto both stages and routed per request. Fine-tuning jobs stay
with replicas without stages: --pp without --no-jobs is refused before anything starts.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from servers import TOKEN, ServerProcess, data_dir, write_model_adapter
from tiny_chat import make_tiny_chat_model
from tprt.text.tokenizer import Tokenizer

PROMPTS = ("Hello there", "The quick brown fox", "Hi", "A much longer prompt, to be prefilled in chunks")
N_NEW = 6
ADAPTER = "data/adapters/pp-lora"  # under the server's --data-dir


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("serve-pp")
    make_tiny_chat_model(root / "model", (1, 2))
    write_model_adapter(root, root / ADAPTER, ("q", "v", "down"), 4, seed=3)
    (root / "token").write_text(TOKEN + "\n")
    return root


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[ServerProcess]:
    args = ["--model", str(root / "model" / "tp2"), "--pp", "2", "--no-jobs", "--port", "0", "--http-port", "0",
            "--metrics-port", "0", "--data-dir", str(data_dir(root, "data")), "--auth-token-file",
            str(root / "token"), "--max-batch-size", "4", "--threads", "1", "--collective-timeout", "30",
            "--token-budget", "16"]
    srv = ServerProcess(args, root / "server.log")
    try:
        yield srv
    finally:
        srv.kill()


def _reference(root: Path, ids: list[int], adapter: bool = False) -> tuple[list[int], list[float], list[float]]:
    """Greedy continuation, its logprobs and the prompt's logprobs from a single-process run of
    the whole model (TP 1; checked against transformers in tests/test_engine.py)."""
    from tprt.checkpoint.loading import load_model
    from tprt.distributed.context import TPContext

    ctx = TPContext.single()
    model = load_model(root / "model" / "tp1", ctx, "fp32")
    if adapter:
        from tprt.lora.attach import attach
        from tprt.lora.peft_io import read_adapter

        attach(model, read_adapter(model, root / ADAPTER, ctx))
    seq = list(ids)
    with torch.no_grad():
        for _ in range(N_NEW):
            seq.append(int(model.gather_logits(model(torch.tensor([seq])))[0, -1].argmax()))
        logprobs = torch.log_softmax(model.gather_logits(model(torch.tensor([seq])))[0].double(), -1)
    picked = logprobs[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0].tolist()
    return seq[len(ids):], picked[len(ids) - 1:], picked[: len(ids) - 1]


def _client(server: ServerProcess) -> Any:
    import openai

    m = re.search(r"OpenAI API (https?://[\d.]+:\d+/v1)", server.line)
    assert m and "TP 2 x PP 2" in server.line, server.line
    return openai.OpenAI(base_url=m.group(1), api_key=TOKEN, max_retries=0, timeout=120)


def test_concurrent_requests_over_stages_are_the_whole_models(root: Path, server: ServerProcess) -> None:
    client = _client(server)
    tok = Tokenizer.from_dir(root / "model" / "tp2")

    def complete(prompt: str) -> Any:
        return client.completions.create(model="tp2", prompt=tok.encode(prompt), max_tokens=N_NEW, temperature=0,
                                         logprobs=1, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # in flight together: batched in the same steps
        replies = list(pool.map(complete, PROMPTS))
    for prompt, reply in zip(PROMPTS, replies, strict=True):
        want, want_lp, _ = _reference(root, tok.encode(prompt))
        got = reply.choices[0]
        assert got.finish_reason == "length" and reply.usage.completion_tokens == N_NEW
        assert got.text == tok.decode(want), (prompt, got.text, tok.decode(want))
        torch.testing.assert_close(torch.tensor(got.logprobs.token_logprobs), torch.tensor(want_lp),
                                   atol=1e-4, rtol=0)


def test_echo_scores_the_prompt_across_stages(root: Path, server: ServerProcess) -> None:
    client = _client(server)
    tok = Tokenizer.from_dir(root / "model" / "tp2")
    ids = tok.encode(PROMPTS[3])
    reply = client.completions.create(model="tp2", prompt=ids, max_tokens=1, temperature=0, logprobs=0, echo=True)
    prompt_lp = reply.choices[0].logprobs.token_logprobs[: len(ids)]
    assert prompt_lp[0] is None
    torch.testing.assert_close(torch.tensor(prompt_lp[1:]), torch.tensor(_reference(root, ids)[2]), atol=1e-4, rtol=0)


def test_an_adapter_loads_onto_every_stage(root: Path, server: ServerProcess) -> None:
    with server.client() as c:
        c.load_adapter("pp-lora", path=ADAPTER.removeprefix("data/"))
    client = _client(server)
    tok = Tokenizer.from_dir(root / "model" / "tp2")
    ids = tok.encode(PROMPTS[1])
    got = {}
    for adapter in (True, False):  # the adapter's rows and the base model's
        reply = client.completions.create(model="pp-lora" if adapter else "tp2", prompt=ids, max_tokens=N_NEW,
                                          temperature=0, logprobs=1, extra_body={"ignore_eos": True})
        want, want_lp, _ = _reference(root, ids, adapter)
        assert reply.choices[0].text == tok.decode(want), adapter
        got[adapter] = torch.tensor(reply.choices[0].logprobs.token_logprobs)
        torch.testing.assert_close(got[adapter], torch.tensor(want_lp), atol=1e-4, rtol=0)
    assert (got[True] - got[False]).abs().max() > 1e-3  # the adapter changes the outputs


def test_pp_without_no_jobs_is_refused(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tprt.cli.main import main

    rc = main(["serve", "--model", str(root / "model" / "tp2"), "--pp", "2", "--data-dir", str(root / "d2")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--pp 2" in err[0] and "--no-jobs" in err[0], err
