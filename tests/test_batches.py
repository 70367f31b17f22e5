"""OpenAI's Batch API on a real server (issue 42), through the official `openai` client: a JSONL
of chat, completions and responses requests runs behind interactive traffic (an interactive
request sent while the batch runs finishes before it), its results land in an output file and
its refused lines in an error file, a bad input file is refused naming its line, a batch can be
cancelled, and one stopped midway (SIGTERM) resumes after a restart and answers every request
exactly once.

The latency interactive requests keep while a batch runs is a benchmark's figure
(bench/serve_batch.py, docs/PERF.md), not asserted here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import openai
import pytest

from servers import ServerProcess, data_dir, wait_for
from tiny_chat import make_tiny_chat_model

CONTEXT = 256


def _start(root: Path) -> tuple[ServerProcess, openai.OpenAI]:
    args = ["--model", str(root / "model" / "tp1"), "--port", "0", "--http-port", "0", "--metrics-port", "0",
            "--data-dir", str(root / "data"), "--max-seq-len", str(CONTEXT), "--max-batch-size", "2",
            "--threads", "1"]
    srv = ServerProcess(args, root / "server.log")
    m = re.search(r"OpenAI API (https?://[\d.]+:\d+/v1)", srv.line)
    assert m, srv.line
    return srv, openai.OpenAI(base_url=m.group(1), api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("batches")
    make_tiny_chat_model(root / "model", (1,), max_positions=CONTEXT)
    data_dir(root, "data")
    return root


def _line(i: int, url: str, tokens: int = 6) -> dict[str, Any]:
    if url == "/v1/chat/completions":
        body: dict[str, Any] = {"messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": tokens}
    elif url == "/v1/completions":
        body = {"prompt": f"Count {i}", "max_tokens": tokens}
    else:
        body = {"input": f"Say {i}", "max_output_tokens": tokens}
    return {"custom_id": f"req-{i}", "method": "POST", "url": url,
            "body": {"model": "tp1", "temperature": 0, "ignore_eos": True, **body}}


def _upload(client: openai.OpenAI, lines: list[dict[str, Any]]) -> str:
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    return client.files.create(file=("requests.jsonl", data), purpose="batch").id


def _wait(client: openai.OpenAI, batch_id: str, until: tuple[str, ...] = ("completed", "failed", "cancelled",
                                                                            "expired")) -> Any:
    return wait_for(lambda: (b := client.batches.retrieve(batch_id)).status in until and b, 300, f"batch {until}")


def _results(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_a_batch_runs_behind_interactive_requests(root: Path) -> None:
    srv, client = _start(root)
    try:
        for url in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
            lines = [_line(i, url) for i in range(6)]
            bad = dict(lines[0], custom_id="bad", body={**lines[0]["body"], "temprature": 1})  # misspelt
            batch = client.batches.create(input_file_id=_upload(client, [*lines, bad]), endpoint=url,  # type: ignore[arg-type]
                                          completion_window="24h", metadata={"run": "1"})
            assert batch.status == "in_progress" and batch.request_counts and batch.request_counts.total == 7
            done = _wait(client, batch.id)
            assert done.status == "completed" and done.metadata == {"run": "1"}
            assert (done.request_counts.completed, done.request_counts.failed) == (6, 1)
            out, err = _results(client, done.output_file_id), _results(client, done.error_file_id)
            assert sorted(r["custom_id"] for r in out) == [f"req-{i}" for i in range(6)]
            assert [(r["custom_id"], r["response"]["status_code"]) for r in err] == [("bad", 400)]
            assert err[0]["response"]["body"]["error"]["param"] == "temprature"
            # A result is what the endpoint answers the same request.
            first = next(r for r in out if r["custom_id"] == "req-0")["response"]["body"]
            if url == "/v1/chat/completions":
                body = dict(lines[0]["body"])
                extra = {"ignore_eos": body.pop("ignore_eos")}
                direct = client.chat.completions.create(**body, extra_body=extra).model_dump()
                assert first["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
            assert done.usage is not None and done.usage.output_tokens == 6 * 6
        # Interactive requests go first: one sent while a long batch runs ends before the batch.
        long = [_line(i, "/v1/completions", tokens=48) for i in range(64)]  # far more than the test waits for
        batch = client.batches.create(input_file_id=_upload(client, long), endpoint="/v1/completions",
                                      completion_window="24h")
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, 300,  # type: ignore[union-attr]
                 "the batch to start")
        reply = client.chat.completions.create(model="tp1", messages=[{"role": "user", "content": "now"}],
                                               max_tokens=4)
        assert reply.choices[0].message.content is not None
        assert client.batches.retrieve(batch.id).status == "in_progress"
        cancelled = client.batches.cancel(batch.id)
        assert cancelled.status in ("cancelling", "cancelled")
        ended = _wait(client, batch.id)
        assert ended.status == "cancelled" and ended.request_counts.completed < 64  # type: ignore[union-attr]
        assert len(_results(client, ended.output_file_id)) == ended.request_counts.completed  # type: ignore[union-attr]
        with pytest.raises(openai.BadRequestError):
            client.batches.cancel(batch.id)
        listed = [b.id for b in client.batches.list(limit=2).data]
        assert listed[0] == batch.id and len(listed) == 2
        # Bad inputs are refused naming the line.
        for lines, why in (([_line(0, "/v1/completions"), _line(0, "/v1/completions")], "line 2: custom_id"),
                           ([_line(0, "/v1/chat/completions")], "line 1: url"),
                           ([{**_line(0, "/v1/completions"), "body": {"model": "nope", "prompt": "x"}}],
                            "line 1: model")):
            with pytest.raises(openai.BadRequestError) as info:
                client.batches.create(input_file_id=_upload(client, lines), endpoint="/v1/completions",
                                      completion_window="24h")
            assert info.value.param == "input_file_id" and why in info.value.message, info.value.message
    finally:
        srv.kill()


def test_a_batch_survives_a_restart(root: Path) -> None:
    srv, client = _start(root)
    lines = [_line(i, "/v1/chat/completions", tokens=40) for i in range(12)]
    batch = client.batches.create(input_file_id=_upload(client, lines), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    try:
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, 300,  # type: ignore[union-attr]
                 "some of the batch")
        assert srv.stop() == 0  # SIGTERM: a clean drain midway through the batch
    finally:
        srv.kill()
    before = sum(1 for _ in open(root / "data" / "batches" / batch.id / "output.jsonl"))
    assert 2 <= before < 12
    srv, client = _start(root)
    try:
        done = _wait(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 12  # type: ignore[union-attr]
        ids = [r["custom_id"] for r in _results(client, done.output_file_id)]
        assert sorted(ids) == sorted(x["custom_id"] for x in lines)  # each once: none lost, none run twice
        assert done.error_file_id is None
    finally:
        srv.kill()
