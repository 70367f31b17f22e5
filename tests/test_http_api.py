"""The OpenAI-compatible HTTP API of `tprt serve --http-port`: a real server at TP 2 on loopback
(one for the whole file, bearer token on), called with the official `openai` package, and with
raw httpx for the SSE framing and a disconnect mid-stream.

The server's batch and queue are small (MAX_BATCH, MAX_QUEUE) so that a full queue (429) takes
three long requests. Nothing waits for a guessed duration: a request that must still run is one
of LONG tokens, acted on once its first token has streamed, and cancelled afterwards.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from test_server import CONTEXT, TOKEN, ServerProcess, data_dir, metric, wait_for, wait_idle
from tiny_chat import make_tiny_chat_model

MAX_BATCH = 2
MAX_QUEUE = 1
MAX_BODY = 1 << 20
LONG = CONTEXT - 64
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]




class Api:
    """The running server, its OpenAI base URL and clients."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        m = re.search(r"OpenAI API (http://[\d.]+:\d+/v1)", server.line)
        assert m, server.line
        self.base_url = m.group(1)
        self.client = openai.OpenAI(base_url=self.base_url, api_key=TOKEN, max_retries=0, timeout=60)
        self.headers = {"Authorization": f"Bearer {TOKEN}"}
        models = self.client.models.list().data
        self.model = models[0].id


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    root = tmp_path_factory.mktemp("http")
    make_tiny_chat_model(root / "model", (2,), max_positions=CONTEXT)
    (root / "token").write_text(TOKEN + "\n")
    args = ["--model", str(root / "model" / "tp2"), "--port", "0", "--http-port", "0", "--metrics-port", "0",
            "--data-dir", str(data_dir(root, "data")), "--auth-token-file", str(root / "token"),
            "--max-batch-size", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE), "--max-seq-len", str(CONTEXT),
            "--threads", "1", "--collective-timeout", "30", "--max-message-bytes", str(MAX_BODY)]
    srv = ServerProcess(args, root / "server.log")
    try:
        yield Api(srv)
    finally:
        srv.kill()


def test_models_lists_the_base_model(api: Api) -> None:
    models = api.client.models.list().data
    assert [m.id for m in models] == ["tp2"]
    assert models[0].model_extra is not None and models[0].model_extra["parent"] is None


def test_streaming_chat_equals_grpc(api: Api) -> None:
    stream = api.client.chat.completions.create(
        model=api.model, messages=CHAT, max_tokens=12, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12 and not chunks[-1].choices
    with api.server.client() as grpc_client:
        ref = grpc_client.complete(chat=CHAT, max_new_tokens=12, temperature=0, ignore_eos=True)
    assert text == ref.text and len(ref.tokens) == 12
    assert usage.prompt_tokens == ref.usage.prompt_tokens
    # The same request again reuses the prompt's KV from the prefix cache.
    whole = api.client.chat.completions.create(model=api.model, messages=CHAT, max_tokens=12,  # type: ignore[arg-type]
                                               temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == ref.text
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
    assert whole.usage.prompt_tokens_details.cached_tokens is not None
    assert 0 < whole.usage.prompt_tokens_details.cached_tokens < whole.usage.prompt_tokens


def test_completions_with_logprobs(api: Api) -> None:
    out = api.client.completions.create(model=api.model, prompt="Hello there", max_tokens=6, temperature=0,
                                        logprobs=3, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == 6 and choice.finish_reason == "length"
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3 and max(top.values()) >= chosen - 1e-6
    assert out.usage is not None and out.usage.completion_tokens == 6
    with api.server.client() as grpc_client:
        ref = grpc_client.complete("Hello there", max_new_tokens=6, temperature=0, ignore_eos=True)
    assert choice.text == ref.text and lp.tokens == [t.text for t in ref.tokens]


def test_chat_logprobs_stop_and_several_prompts(api: Api) -> None:
    chat = api.client.chat.completions.create(model=api.model, messages=CHAT, max_tokens=4, temperature=0,  # type: ignore[arg-type]
                                              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    many = api.client.completions.create(model=api.model, prompt=["One", "Two"], max_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1] and many.usage is not None
    assert many.usage.completion_tokens == 6


def test_errors_are_typed(api: Api) -> None:
    c = api.client
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model=api.model, prompt="x", temperature=-1)
    assert bad.value.param == "temperature" and bad.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as long:
        c.completions.create(model=api.model, prompt="x", max_tokens=CONTEXT + 1)
    assert long.value.param == "max_tokens" and long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as role:
        c.chat.completions.create(model=api.model, messages=[{"role": "robot", "content": "hi"}])  # type: ignore[list-item, misc]
    assert role.value.param == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as typed:
        c.completions.create(model=api.model, prompt="x", max_tokens="many")  # type: ignore[arg-type]
    assert typed.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as n:
        c.completions.create(model=api.model, prompt="x", n=99)
    assert n.value.param == "n"
    with pytest.raises(openai.NotFoundError) as missing:
        c.chat.completions.create(model="no-such-model", messages=CHAT)  # type: ignore[arg-type]
    assert missing.value.param == "model"
    stranger = openai.OpenAI(base_url=api.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    big = httpx.post(f"{api.base_url}/completions", headers=api.headers, timeout=30,
                     content=json.dumps({"model": api.model, "prompt": "x" * (MAX_BODY + 1)}))
    assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"


def _first_event(lines: Iterator[str]) -> dict[str, Any]:
    for line in lines:
        if line.startswith("data: "):
            return dict(json.loads(line[len("data: "):]))
    raise AssertionError("the stream ended before its first event")


def test_sse_framing(api: Api) -> None:
    body = {"model": api.model, "prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{api.base_url}/completions", json=body, headers=api.headers, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert [p["choices"][0]["finish_reason"] for p in payloads] == [None, None, "length"]
    assert all(p["object"] == "text_completion" for p in payloads)


def test_disconnect_and_full_queue(api: Api) -> None:
    """Two long streams fill the batch, a third the queue: a fourth request gets 429. Closing the
    streams mid-way cancels their sequences: the server goes idle, the cancels are counted."""
    before = metric(api.server.metrics(), "tprt_requests_total", protocol="http", method="/v1/completions",
                    outcome="cancelled")
    body = {"model": api.model, "prompt": "Tell a long story", "max_tokens": LONG, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(headers=api.headers, timeout=60) as http:
        streams, readers = [], []  # a reader dropped early would close its connection
        try:
            for _ in range(MAX_BATCH):
                s = http.stream("POST", f"{api.base_url}/completions", json=body)
                readers.append(s.__enter__().iter_lines())
                streams.append(s)
                _first_event(readers[-1])
            queued = http.stream("POST", f"{api.base_url}/completions", json=body)
            queued.__enter__()
            streams.append(queued)
            wait_for(lambda: metric(api.server.metrics(), "tprt_waiting_requests") == 1, 30, "a queued request")
            assert metric(api.server.metrics(), "tprt_running_requests") == MAX_BATCH
            with pytest.raises(openai.RateLimitError):
                api.client.completions.create(model=api.model, prompt="x", max_tokens=2)
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    wait_idle(api.server)
    wait_for(lambda: metric(api.server.metrics(), "tprt_requests_total", protocol="http",
                            method="/v1/completions", outcome="cancelled") >= before + MAX_BATCH + 1,
             20, "the cancels to be counted")
    assert metric(api.server.metrics(), "tprt_requests_total", protocol="http", method="/v1/completions",
                  outcome="resource_exhausted") >= 1
