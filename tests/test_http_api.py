"""The OpenAI-compatible HTTP API of `tprt serve --http-port`: a real server at TP 2 on loopback
(one for the whole file, bearer token on, TLS with a self-signed certificate when openssl is
there, as gRPC's TLS test does), called with the official `openai` package, and with raw httpx
for the SSE framing and a disconnect mid-stream. Files and fine-tuning jobs go through the same
server (one job queue slot, so a second waiting job is a 429); draining and a broken world (503)
are checked on the app in-process, where a job manager can be put in that state without a
second server.

The server's batch and queue are small (MAX_BATCH, MAX_QUEUE) so that a full queue (429) takes
three long requests. It runs under a low file descriptor limit (FD_LIMIT) with few HTTP
connections allowed, so that silent connections past that limit show whether they can take
the server's descriptors. Nothing waits for a guessed duration: a request that must still run is one
of LONG tokens, acted on once its first token has streamed, and cancelled afterwards.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import ssl
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from servers import CONTEXT, TOKEN, ServerProcess, data_dir, metric, self_signed_cert, wait_for, wait_idle
from tiny_chat import make_tiny_chat_model

MAX_BATCH = 2
MAX_QUEUE = 1
MAX_BODY = 1 << 20
MAX_DATASET = 64 << 10  # --max-dataset-bytes: an upload one byte over is a 413
LONG = CONTEXT - 64
FD_LIMIT = 384  # of the server's processes: its usual ~40, 64 HTTP connections, serve/openai/http_server.py's reserve
MAX_HTTP_CONNECTIONS = 64
# `python -m tprt.cli` under FD_LIMIT descriptors (ServerProcess appends "serve" and the flags).
LIMITED_LAUNCHER = (sys.executable, "-c", "import resource, runpy, sys; "
                    f"resource.setrlimit(resource.RLIMIT_NOFILE, ({FD_LIMIT}, {FD_LIMIT})); sys.argv[0] = 'tprt'; "
                    "runpy.run_module('tprt.cli', run_name='__main__', alter_sys=True)")
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]




class Api:
    """The running server, its OpenAI base URL and clients."""

    def __init__(self, server: ServerProcess, root: Path) -> None:
        self.server = server
        self.root = root
        m = re.search(r"OpenAI API (https?://[\d.]+:\d+/v1)", server.line)
        assert m, server.line
        self.base_url = m.group(1)
        # The server's own certificate is the one to trust (TLS), else the system's (plain HTTP).
        self.verify = ssl.create_default_context(cafile=str(server.tls_ca)) if server.tls_ca else True
        self.client = self.openai(TOKEN)
        self.headers = {"Authorization": f"Bearer {TOKEN}"}
        models = self.client.models.list().data
        self.model = models[0].id

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=60,
                             http_client=httpx.Client(verify=self.verify))

    def http(self, **kw: Any) -> httpx.Client:
        return httpx.Client(verify=self.verify, headers=self.headers, **kw)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    root = tmp_path_factory.mktemp("http")
    make_tiny_chat_model(root / "model", (2,), max_positions=CONTEXT)
    (root / "token").write_text(TOKEN + "\n")
    tls = self_signed_cert(root)
    args = ["--model", str(root / "model" / "tp2"), "--port", "0", "--http-port", "0", "--metrics-port", "0",
            "--data-dir", str(data_dir(root, "data")), "--auth-token-file", str(root / "token"),
            "--max-batch-size", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE), "--max-seq-len", str(CONTEXT),
            "--threads", "1", "--collective-timeout", "30", "--max-message-bytes", str(MAX_BODY),
            "--max-dataset-bytes", str(MAX_DATASET), "--max-queued-jobs", "1",
            "--http-max-connections", str(MAX_HTTP_CONNECTIONS), "--http-max-unauthenticated", "16",
            "--speculative", "suffix", "--num-speculative-tokens", "3", "--spec-min-n", "1"]  # every request drafts
    args += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])] if tls else []
    srv = ServerProcess(args, root / "server.log", tls[0] if tls else None, launcher=LIMITED_LAUNCHER)
    try:
        yield Api(srv, root)
    finally:
        srv.kill()


def test_models_lists_the_base_model(api: Api) -> None:
    models = api.client.models.list().data
    assert [m.id for m in models] == ["tp2"]
    assert api.base_url.startswith("https://") == (api.server.tls_ca is not None)  # TLS as gRPC has it
    assert models[0].model_extra is not None and models[0].model_extra["parent"] is None


def test_probes_and_the_routers_metrics_need_no_token(api: Api) -> None:
    """/health and /ready answer Kubernetes' probes and /metrics a router's scrape without the
    token; the metrics hold the routers' names (vLLM's and SGLang's, issue 43) beside tprt's, with
    the same values: a running request counted, the KV pool's block size and blocks."""
    base = api.base_url.removesuffix("/v1")
    with httpx.Client(verify=api.verify, timeout=30) as bare:
        assert bare.get(f"{base}/health").json() == {"status": "ok"}
        assert bare.get(f"{base}/ready").json() == {"status": "ready"}
        assert bare.get(f"{api.base_url}/models").status_code == 401  # everything else still needs it
        # Scrape as a router does while a long stream runs. On two busy cores the stream can end
        # before a scrape lands (its ranks take the CPU), so an attempt that misses it is retried.
        for _attempt in range(3):
            text = _scrape_during_a_stream(api, bare, f"{base}/metrics")
            if text is not None:
                break
        assert text is not None, "no scrape saw the running stream in 3 attempts"
    assert metric(text, "vllm:num_requests_running", model_name="tp2") >= 1
    assert metric(text, "sglang:num_running_reqs", model_name="tp2") >= 1
    assert metric(text, "vllm:num_requests_waiting", model_name="tp2") == metric(text, "sglang:num_queue_reqs",
                                                                                model_name="tp2")
    assert 0 < metric(text, "vllm:kv_cache_usage_perc", model_name="tp2") <= 1
    config = re.search(r'vllm:cache_config_info\{([^}]*)\} 1\.0', text)
    assert config and 'block_size="' in config.group(1) and 'num_gpu_blocks="' in config.group(1), text
    assert re.search(r'vllm:lora_requests_info\{max_lora="8",running_lora_adapters="[^"]*",'
                     r'waiting_lora_adapters="[^"]*"\} \d', text), text
    assert "tprt_running_requests" in text


def _scrape_during_a_stream(api: Api, bare: httpx.Client, url: str) -> str | None:
    """/metrics scraped while a long completion streams: the first scrape that counts it as
    running with its KV blocks held (as of a step after its prefill); None when the stream ended
    first. The stream is closed once seen (the server cancels it)."""
    ended, seen = threading.Event(), threading.Event()

    def stream() -> None:
        try:
            with api.http(timeout=120) as http, http.stream(
                    "POST", f"{api.base_url}/completions",
                    json={"model": api.model, "prompt": "x", "max_tokens": LONG, "stream": True,
                          "ignore_eos": True, "speculate": False}) as r:
                for _ in r.iter_lines():
                    if seen.is_set():
                        break
        finally:
            ended.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    try:
        while not ended.is_set():
            text = bare.get(url).text
            if metric(text, "vllm:num_requests_running", model_name="tp2") >= 1 and \
                    metric(text, "vllm:kv_cache_usage_perc", model_name="tp2") > 0:
                seen.set()
                return text
            time.sleep(0.02)
        return None
    finally:
        reader.join(120)


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


def test_speculation_switch_and_metrics(api: Api) -> None:
    """The server drafts (--speculative suffix): a request that turns it off (HTTP extra body,
    gRPC field) gets the same greedy text as one that keeps it; the drafted, accepted and emitted
    counters move; a speculate that is not a boolean is a 400 naming it."""
    prompt = "ab ab ab ab ab ab ab ab"
    before = metric(api.server.metrics(), "tprt_spec_drafted_tokens_total")
    texts = [api.client.completions.create(model=api.model, prompt=prompt, max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True, **extra}).choices[0].text
             for extra in ({}, {"speculate": False}, {"speculate": True})]
    with api.server.client() as grpc_client:
        off = grpc_client.complete(prompt, max_new_tokens=16, temperature=0, ignore_eos=True, speculate=False)
    assert texts[0] == texts[1] == texts[2] == off.text, texts
    m = api.server.metrics()
    drafted = metric(m, "tprt_spec_drafted_tokens_total") - before
    assert drafted > 0 and metric(m, "tprt_spec_emitted_tokens_total") > 0, m
    assert 0 <= metric(m, "tprt_spec_accepted_tokens_total") <= metric(m, "tprt_spec_drafted_tokens_total")
    assert 'tprt_spec_acceptance_ratio{position="0"}' in m
    bad = api.http().post(f"{api.base_url}/completions", json={"model": api.model, "prompt": "x", "speculate": 3})
    assert bad.status_code == 400 and "speculate" in bad.text, bad.text


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


def test_echo_scores_the_prompt_like_transformers(api: Api) -> None:
    """Completions' echo with logprobs (what lm-eval's local-completions model asks: max_tokens 0,
    the prompt's token logprobs, the first null): each prompt token's logprob is transformers'
    log-softmax of the same weights at that position, within 1e-4; with max_tokens > 0 the output
    follows the echoed prompt, streamed or not; max_tokens 0 without echo is a 400."""
    from transformers import AutoModelForCausalLM

    c = api.client
    ids = [5, 17, 40, 23, 9, 61, 12]
    scored = c.completions.create(model=api.model, prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0)
    choice = scored.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None and lp.tokens is not None
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert choice.finish_reason == "length" and choice.text == "".join(lp.tokens)
    assert scored.usage is not None and (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (len(ids), 0)
    hf = AutoModelForCausalLM.from_pretrained(api.root / "model" / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    for j in range(1, len(ids)):
        assert abs(lp.token_logprobs[j] - float(want[j - 1, ids[j]])) <= 1e-4, j
        assert max(lp.top_logprobs[j].values()) == pytest.approx(float(want[j - 1].max()), abs=1e-4)
    more = c.completions.create(model=api.model, prompt=ids, max_tokens=3, echo=True, logprobs=0, temperature=0,
                                extra_body={"ignore_eos": True})
    plain = c.completions.create(model=api.model, prompt=ids, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert more.choices[0].text == choice.text + plain.choices[0].text
    more_lp = more.choices[0].logprobs
    assert more_lp is not None and more_lp.token_logprobs is not None and len(more_lp.token_logprobs) == len(ids) + 3
    assert more_lp.token_logprobs[: len(ids)] == lp.token_logprobs
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model=api.model, prompt=ids, max_tokens=0)
    assert bad.value.param == "max_tokens"
    # Streamed, the prompt comes first, with the same entries and offsets; max_tokens 0 ends there.
    for tokens, whole in ((3, more), (0, scored)):
        chunks = [ch for ch in c.completions.create(model=api.model, prompt=ids, max_tokens=tokens, echo=True,
                                                    logprobs=0, temperature=0, stream=True,
                                                    extra_body={"ignore_eos": True}) if ch.choices]
        expect = whole.choices[0]
        assert "".join(ch.choices[0].text for ch in chunks) == expect.text
        got = [(t, lp, off) for ch in chunks if ch.choices[0].logprobs is not None
               for t, lp, off in zip(ch.choices[0].logprobs.tokens, ch.choices[0].logprobs.token_logprobs,
                                     ch.choices[0].logprobs.text_offset)]
        assert expect.logprobs is not None
        assert got == list(zip(expect.logprobs.tokens, expect.logprobs.token_logprobs, expect.logprobs.text_offset))
        assert chunks[-1].choices[0].finish_reason == "length"
    # vLLM's prompt_logprobs: each prompt token's logprob and rank among the vocabulary, with the
    # likeliest alternatives; on the choice for completions, on the response for chat.
    listed = c.completions.create(model=api.model, prompt=ids, max_tokens=1,
                                  extra_body={"prompt_logprobs": 2}).model_dump()["choices"][0]["prompt_logprobs"]
    assert listed[0] is None and len(listed) == len(ids)
    for j in range(1, len(ids)):
        mine = listed[j][str(ids[j])]
        assert abs(mine["logprob"] - float(want[j - 1, ids[j]])) <= 1e-4
        assert mine["rank"] == int((want[j - 1] > want[j - 1, ids[j]]).sum()) + 1
        ranks = sorted(e["rank"] for k, e in listed[j].items() if k != str(ids[j]) or mine["rank"] <= 2)
        assert ranks[:2] == [1, 2]
    chat = c.chat.completions.create(model=api.model, messages=CHAT, max_tokens=1,  # type: ignore[arg-type]
                                     extra_body={"prompt_logprobs": 0}).model_dump()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_best_of_returns_the_likeliest_choices(api: Api) -> None:
    """best_of above n (completions): best_of choices are generated per prompt and the n with the
    highest log-probability per token come back, most likely first; usage counts every token.
    (Three sequences: this server's batch and queue hold no more.)"""
    c = api.client
    out = c.completions.create(model=api.model, prompt="Hello", max_tokens=6, temperature=1.5, seed=3,
                               n=2, best_of=3, logprobs=0, extra_body={"ignore_eos": True})
    assert [ch.index for ch in out.choices] == [0, 1]
    assert out.usage is not None and out.usage.completion_tokens == 3 * 6
    every = c.completions.create(model=api.model, prompt="Hello", max_tokens=6, temperature=1.5, seed=3,
                                 n=3, logprobs=0, extra_body={"ignore_eos": True})

    def mean(ch: Any) -> float:
        return sum(ch.logprobs.token_logprobs) / len(ch.logprobs.token_logprobs)

    best = sorted((mean(ch) for ch in every.choices), reverse=True)[:2]  # the same seeds: the same three
    assert [mean(ch) for ch in out.choices] == pytest.approx(best)
    assert {ch.text for ch in out.choices} <= {ch.text for ch in every.choices}
    hidden = c.completions.create(model=api.model, prompt="Hello", max_tokens=4, best_of=3, temperature=1.0)
    assert len(hidden.choices) == 1 and hidden.choices[0].logprobs is None


def test_fields_are_honoured_or_refused(api: Api) -> None:
    """A field the endpoint does not know is a 400 naming it, as OpenAI's API answers; the fields
    that describe the caller are accepted; logit_bias steers the choice (+100 on a token makes
    every greedy token that token), the penalties are taken and checked, best_of other than n is
    refused rather than ignored, and gRPC takes the same (issue 42)."""
    from tprt.text.tokenizer import Tokenizer

    c = api.client
    for make in (lambda: c.chat.completions.create(model=api.model, messages=CHAT, max_tokens=2,  # type: ignore[arg-type]
                                                   extra_body={"temprature": 0.5}),
                 lambda: c.completions.create(model=api.model, prompt="x", max_tokens=2, extra_body={"temprature": 0.5})):
        with pytest.raises(openai.BadRequestError) as unknown:
            make()
        assert unknown.value.param == "temprature" and "Unrecognized request argument supplied" in str(unknown.value)
    out = c.chat.completions.create(model=api.model, messages=CHAT, max_tokens=2, user="u-1",  # type: ignore[arg-type]
                                    metadata={"run": "7"}, store=False, service_tier="auto")
    assert out.choices[0].message is not None
    tok = Tokenizer.from_dir(api.root / "model" / "tp2")
    forced = tok.encode("q", add_special_tokens=False)[0]
    for bias in (100, 10):
        biased = c.completions.create(model=api.model, prompt="Hello there", max_tokens=8, temperature=0,
                                      logit_bias={str(forced): bias}, extra_body={"ignore_eos": True})
        assert biased.choices[0].text == "q" * 8
    # Each "q" in the output costs it 2 (frequency) and, once there, 2 (presence): by the 6th its
    # +10 is gone and then some, and the small model's own logits do not bridge that.
    penalised = c.completions.create(model=api.model, prompt="Hello there", max_tokens=8, temperature=0,
                                     logit_bias={str(forced): 10}, frequency_penalty=2.0, presence_penalty=2.0,
                                     extra_body={"ignore_eos": True})
    assert penalised.choices[0].text.startswith("q") and penalised.choices[0].text.count("q") < 8
    with api.server.client() as grpc_client:  # the same fields over gRPC, with the same meaning
        same = grpc_client.complete("Hello there", max_new_tokens=8, temperature=0, ignore_eos=True,
                                    logit_bias={forced: 10}, frequency_penalty=2.0, presence_penalty=2.0)
    assert same.text == penalised.choices[0].text
    for make, param in ((lambda: c.completions.create(model=api.model, prompt="x", presence_penalty=3), "presence_penalty"),
                        (lambda: c.completions.create(model=api.model, prompt="x", logit_bias={"no": 1}), "logit_bias"),
                        (lambda: c.completions.create(model=api.model, prompt="x", logit_bias={"3": 101}), "logit_bias"),
                        (lambda: c.completions.create(model=api.model, prompt="x", n=2, best_of=1), "best_of"),
                        (lambda: c.completions.create(model=api.model, prompt="x", best_of=2, stream=True), "best_of")):
        with pytest.raises(openai.BadRequestError) as bad:
            make()
        assert bad.value.param == param


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
    with pytest.raises(openai.AuthenticationError):
        api.openai("wrong").models.list()
    with api.http(timeout=30) as http:
        big = http.post(f"{api.base_url}/completions",
                        content=json.dumps({"model": api.model, "prompt": "x" * (MAX_BODY + 1)}))
    assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"


def test_an_empty_model_is_no_model(api: Api) -> None:
    """"model": "" names neither the base model nor an adapter: a 400 naming `model`, never the base model."""
    with api.http(timeout=30) as http:
        for path, body in (("chat/completions", {"messages": CHAT}), ("completions", {"prompt": "x"})):
            r = http.post(f"{api.base_url}/{path}", json={"model": "", "max_tokens": 1, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text


def test_logprobs_are_always_valid_json() -> None:
    """JSON has no NaN or Infinity: a probability of zero is OpenAI's -9999, a NaN (never from a
    sound adapter: those are refused at load) is null."""
    from serve.openai.reply import MIN_LOGPROB, json_logprob

    values = [json_logprob(v) for v in (-math.inf, math.inf, math.nan, -1e30, -0.5, 0.0)]
    assert values == [MIN_LOGPROB, 0.0, None, MIN_LOGPROB, -0.5, 0.0]
    json.dumps(values, allow_nan=False)


def _first_event(lines: Iterator[str]) -> dict[str, Any]:
    for line in lines:
        if line.startswith("data: "):
            return dict(json.loads(line[len("data: "):]))
    raise AssertionError("the stream ended before its first event")


def test_sse_framing(api: Api) -> None:
    body = {"model": api.model, "prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with api.http(timeout=30) as http, http.stream("POST", f"{api.base_url}/completions", json=body) as r:
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
    with api.http(timeout=60) as http:
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


# ----------------------------------------------------------------- one generation path for both protocols

PARITY_ADAPTER = "parity-lora"
# gRPC status -> the HTTP status the same refusal has (serve/openai/requests.py HTTP_STATUS).
SAME_STATUS = {"INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429}
# Counters that move by what a request does, whichever front end served it.
PARITY_COUNTERS = [("tprt_generated_tokens_total", {}), ("tprt_prompt_tokens_total", {}),
                   ("tprt_structured_requests_total", {"kind": "choice"}),
                   ("tprt_adapter_requests_total", {"adapter": PARITY_ADAPTER}),
                   ("tprt_adapter_generated_tokens_total", {"adapter": PARITY_ADAPTER})]
OUTCOMES = ("ok", "invalid_argument", "out_of_range", "not_found")


def _parity_counts(api: Api, protocol: str) -> dict[str, float]:
    m = api.server.metrics()
    counts = {f"{name}{labels}": metric(m, name, **labels) for name, labels in PARITY_COUNTERS}
    counts.update({f"requests {o}": metric(m, "tprt_requests_total", protocol=protocol, outcome=o) for o in OUTCOMES})
    return counts


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def test_grpc_and_http_share_one_generation_path(api: Api) -> None:
    """The same requests through gRPC and the OpenAI API of one server (serve/core/generation.py):
    the same tokens (greedy, seeded sampling, with an adapter, under an output constraint), the
    same refusals of the same mistakes (the status mapped per protocol, the message the same
    but for the field's spelling), and the same counters moved by the same amounts."""
    from serve.grpc.pb import generation_pb2 as gen_pb
    from servers import rpc_error
    from tiny_chat import VOCAB
    from tprt.model.config import ModelConfig
    from train_fixtures import write_random_adapter

    config = ModelConfig.from_dict(json.loads((api.root / "model" / "hf" / "config.json").read_text()))
    write_random_adapter(api.root / "data" / "adapters" / PARITY_ADAPTER, config, ("q", "v"), 2, 3, 0.5)
    with api.server.client() as g:
        ids = list(g.tokenize("Parity: one path").ids)
    base: dict[str, Any] = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    # (HTTP body, gRPC keywords) of the same request
    same = [
        ({**base}, {}),
        ({**base, "temperature": 0.9, "top_k": 40, "seed": 11}, {"temperature": 0.9, "top_k": 40, "seed": 11}),
        ({**base, "model": PARITY_ADAPTER}, {"adapter_id": PARITY_ADAPTER}),
        ({**base, "max_tokens": 12, "ignore_eos": False, "structured_outputs": {"choice": ["alpha", "beta"]}},
         {"max_new_tokens": 12, "ignore_eos": False,
          "constraint": gen_pb.OutputConstraint(choice=gen_pb.ChoiceList(options=["alpha", "beta"]))}),
    ]
    mistakes = [
        ({"temperature": -1.0}, {"temperature": -1.0}),
        ({"max_tokens": CONTEXT}, {"max_new_tokens": CONTEXT}),
        ({"prompt": [VOCAB + 5]}, {"prompt_ids": [VOCAB + 5]}),
        ({"stop_token_ids": [VOCAB]}, {"stop_token_ids": [VOCAB]}),
        ({"logprobs": 21}, {"logprobs": True, "top_logprobs": 21}),
        ({"model": "parity-never-saved"}, {"adapter_id": "parity-never-saved"}),
    ]
    wait_idle(api.server)
    before = _parity_counts(api, "grpc")
    answers, refusals = [], []
    with api.server.client() as g:
        for _, kw in same:
            kw = {"prompt_ids": ids, "max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True,
                  **kw}
            out = g.complete(**kw)
            answers.append((out.text, [t.text for t in out.tokens], [t.logprob for t in out.tokens]))
        for _, kw in mistakes:
            kw = {"prompt_ids": ids, "max_new_tokens": 2, **kw}
            err = rpc_error(lambda: g.complete(**kw))
            refusals.append((err.code().name, err.details().split(": ", 1)[1]))
    wait_idle(api.server)
    grpc_counts = _delta(_parity_counts(api, "grpc"), before)
    before = _parity_counts(api, "http")
    with api.http(timeout=60) as http:
        for i, (body, _) in enumerate(same):
            r = http.post(f"{api.base_url}/completions", json={"model": api.model, "prompt": ids, "logprobs": 0,
                                                                **body})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            text, tokens, logprobs = answers[i]
            assert choice["text"] == text and choice["logprobs"]["tokens"] == tokens, (body, choice, answers[i])
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=1e-4), body
        for i, (body, _) in enumerate(mistakes):
            r = http.post(f"{api.base_url}/completions", json={"model": api.model, "prompt": ids, "max_tokens": 2,
                                                                **body})
            code, message = refusals[i]
            error = r.json()["error"]
            assert r.status_code == SAME_STATUS[code], (body, code, r.text)
            assert error["message"].split(": ", 1)[1] == message, (body, error, message)
    wait_idle(api.server)
    http_counts = _delta(_parity_counts(api, "http"), before)
    assert grpc_counts == http_counts
    assert grpc_counts["requests ok"] == len(same)
    assert grpc_counts["tprt_structured_requests_total{'kind': 'choice'}"] == 1
    assert answers[2][2] != answers[0][2]  # the adapter is in effect
    assert answers[3][0] in ("alpha", "beta")  # the constraint is in effect
    # A full queue refuses the same way: two long streams fill the batch, a third waits.
    long = {"model": api.model, "prompt": "Tell a long story", "max_tokens": LONG, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with api.http(timeout=60) as http:
        streams, readers = [], []  # a reader dropped early would close its connection
        try:
            for i in range(MAX_BATCH + 1):
                s = http.stream("POST", f"{api.base_url}/completions", json=long)
                readers.append(s.__enter__().iter_lines())
                streams.append(s)
                if i < MAX_BATCH:
                    _first_event(readers[-1])
            wait_for(lambda: metric(api.server.metrics(), "tprt_waiting_requests") == 1, 30, "a queued request")
            with api.server.client() as g:
                err = rpc_error(lambda: g.complete(prompt_ids=ids, max_new_tokens=2))
            r = http.post(f"{api.base_url}/completions", json={"model": api.model, "prompt": ids, "max_tokens": 2})
            assert err.code().name == "RESOURCE_EXHAUSTED" and r.status_code == SAME_STATUS[err.code().name], r.text
            assert r.json()["error"]["message"] == err.details()
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    wait_idle(api.server)


# ----------------------------------------------------------------- files and fine-tuning jobs

SEQ_LEN = 64


def _chat_jsonl(n: int) -> bytes:
    """OpenAI's chat fine-tuning format, n examples."""
    return "".join(json.dumps({"messages": [{"role": "user", "content": f"Q{i}: say hi"},
                                            {"role": "assistant", "content": "hi there"}]}) + "\n"
                   for i in range(n)).encode()


@pytest.fixture(scope="module")
def training_file(api: Api) -> str:
    return api.client.files.create(file=("train.jsonl", _chat_jsonl(8)), purpose="fine-tune").id


def _wait_job(api: Api, job_id: str, status: str) -> Any:
    return wait_for(lambda: (j := api.client.fine_tuning.jobs.retrieve(job_id)).status == status and j, 120,
                    f"job {job_id} to be {status}")


def test_fine_tuning_flow(api: Api, training_file: str) -> None:
    """Upload, create (n_epochs and a learning-rate multiplier mapped onto steps and a rate, a
    validation file), poll to succeeded, events, checkpoints; the fine_tuned_model is listed and
    answers as gRPC's adapter does."""
    from tprt.text.tokenizer import Tokenizer
    from tprt.train.data import prepare_data

    c = api.client
    uploaded = c.files.retrieve(training_file)
    assert (uploaded.object, uploaded.purpose, uploaded.status, uploaded.filename) == \
        ("file", "fine-tune", "processed", "train.jsonl")
    assert uploaded.bytes == len(_chat_jsonl(8)) and c.files.content(training_file).content == _chat_jsonl(8)
    assert training_file in [f.id for f in c.files.list(purpose="fine-tune").data]
    held_out = c.files.create(file=("valid.jsonl", _chat_jsonl(3)), purpose="fine-tune").id
    hp: Any = {"n_epochs": 1, "batch_size": 4, "learning_rate_multiplier": 50, "max_seq_len": SEQ_LEN, "lora_rank": 4}
    job = c.fine_tuning.jobs.create(model=api.model, training_file=training_file, suffix="tiny", seed=3,
                                    validation_file=held_out,
                                    method={"type": "supervised", "supervised": {"hyperparameters": hp}})
    assert job.id.startswith("ftjob-") and job.status == "queued" and job.training_file == training_file
    assert job.validation_file == held_out
    ours = (job.model_extra or {})["tprt"]
    # batch_size counts examples and n_epochs passes over them, as OpenAI's API means them
    assert ours["hyperparameters"]["steps"] == math.ceil(8 / 4) and ours["hyperparameters"]["seed"] == 3
    assert ours["hyperparameters"]["learning_rate"] == pytest.approx(50 * 1e-3)
    data = prepare_data(api.root / "data" / f"files/{training_file}.jsonl",
                        Tokenizer.from_dir(api.root / "model" / "tp2"), SEQ_LEN, 3, per_example=True)
    assert len(data.train) == 8 and data.train.lengths is not None
    with api.server.client() as grpc_client:  # one job store: gRPC sees the HTTP job
        assert grpc_client.get_job(ours["job_id"]).hyperparameters.steps == ours["hyperparameters"]["steps"]
        done = _wait_job(api, job.id, "succeeded")
        tuned = done.fine_tuned_model
        assert tuned is not None and tuned.startswith("tiny-") and done.user_provided_suffix == "tiny"
        assert done.trained_tokens == int(data.train.lengths.sum()) and done.finished_at  # one epoch, no padding
        assert done.hyperparameters.n_epochs == 1 and done.hyperparameters.batch_size == 4
        events = c.fine_tuning.jobs.list_events(job.id, limit=100).data
        assert events[0].message == "The job has successfully completed"
        assert events[-1].message == "Created fine-tuning job"
        metrics = [e.data for e in events if e.type == "metrics"]
        assert [m["step"] for m in metrics] == list(range(ours["hyperparameters"]["steps"], 0, -1))  # type: ignore[index]
        # The validation file is evaluated after the last step only; its loss is reported three ways.
        valid_loss = metrics[0]["full_valid_loss"]  # type: ignore[index]
        assert math.isfinite(valid_loss) and valid_loss > 0
        assert not any("full_valid_loss" in m for m in metrics[1:])  # type: ignore[operator]
        assert grpc_client.get_job(ours["job_id"]).eval_loss == pytest.approx(valid_loss)
        older = c.fine_tuning.jobs.list_events(job.id, after=events[0].id, limit=1)
        assert [e.id for e in older.data] == [events[1].id] and older.has_more
        [checkpoint] = c.fine_tuning.jobs.checkpoints.list(job.id).data
        assert checkpoint.fine_tuned_model_checkpoint == tuned and checkpoint.fine_tuning_job_id == job.id
        assert checkpoint.metrics.full_valid_loss == pytest.approx(valid_loss)
        listed = {m.id: m for m in c.models.list().data}
        assert (listed[tuned].model_extra or {})["parent"] == api.model
        chat = c.chat.completions.create(model=tuned, messages=CHAT, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                                         extra_body={"ignore_eos": True})
        greedy: dict[str, Any] = {"chat": CHAT, "max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": True}
        ref = grpc_client.complete(**greedy, adapter_id=tuned)
        base = grpc_client.complete(**greedy)
    assert chat.choices[0].message.content == ref.text and chat.model == tuned
    assert [t.logprob for t in ref.tokens] != [t.logprob for t in base.tokens]  # the adapter is in effect
    # An adapter directory under --data-dir/adapters/ is loaded on demand by a request naming it.
    data = api.root / "data"
    shutil.copytree(data / done.model_extra["tprt"]["output_path"], data / "adapters" / "copied-tiny")  # type: ignore[index]
    copied = c.chat.completions.create(model="copied-tiny", messages=CHAT, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                                       extra_body={"ignore_eos": True})
    assert copied.choices[0].message.content == ref.text and copied.model == "copied-tiny"
    with pytest.raises(openai.NotFoundError) as unknown:
        c.chat.completions.create(model="never-saved", messages=CHAT, max_tokens=1)  # type: ignore[arg-type]
    assert unknown.value.param == "model"
    m = api.server.metrics()
    for route in ("/v1/files", "/v1/fine_tuning/jobs", "/v1/fine_tuning/jobs/{job_id}/events"):
        assert metric(m, "tprt_requests_total", protocol="http", method=route, outcome="ok") >= 1, route


def _pairs_jsonl(n: int, start: int = 0) -> bytes:
    """OpenAI's DPO format: "hi there" preferred over "go away"."""
    return "".join(json.dumps({"input": {"messages": [{"role": "user", "content": f"Q{i}: say hi"}]},
                               "preferred_output": [{"role": "assistant", "content": "hi there"}],
                               "non_preferred_output": [{"role": "assistant", "content": "go away"}]}) + "\n"
                   for i in range(start, start + n)).encode()


def test_sft_then_dpo_on_its_adapter(api: Api, training_file: str) -> None:
    """A supervised job, then a DPO job naming its fine-tuned model: method "dpo" with beta and our
    rpo_alpha, the reward metrics and the held-out reward accuracy in its events, its adapter served
    at once."""
    c = api.client
    sft = c.fine_tuning.jobs.create(model=api.model, training_file=training_file, suffix="sft", hyperparameters={
        "n_epochs": 1, "batch_size": 4, "max_seq_len": SEQ_LEN, "lora_rank": 4})
    sft_model = _wait_job(api, sft.id, "succeeded").fine_tuned_model
    pairs = c.files.create(file=("prefs.jsonl", _pairs_jsonl(8)), purpose="fine-tune").id
    held_out = c.files.create(file=("held.jsonl", _pairs_jsonl(3, start=8)), purpose="fine-tune").id
    hp: Any = {"beta": 0.5, "n_epochs": 1, "batch_size": 4, "learning_rate_multiplier": 30, "max_seq_len": SEQ_LEN,
               "rpo_alpha": 0.5}
    job = c.fine_tuning.jobs.create(model=sft_model, training_file=pairs, validation_file=held_out, suffix="dpo",
                                    method={"type": "dpo", "dpo": {"hyperparameters": hp}})
    ours = (job.model_extra or {})["tprt"]
    assert job.method is not None and job.method.type == "dpo" and job.method.dpo is not None
    assert job.method.dpo.hyperparameters is not None and job.method.dpo.hyperparameters.beta == 0.5
    assert (job.method.dpo.hyperparameters.model_extra or {})["rpo_alpha"] == 0.5 == ours["hyperparameters"]["rpo_alpha"]
    with api.server.client() as grpc_client:  # the same job over gRPC
        assert grpc_client.get_job(ours["job_id"]).hyperparameters.rpo_alpha == 0.5
    assert ours["init_adapter"] and ours["hyperparameters"]["lora_rank"] == 4  # the SFT adapter's rank
    done = _wait_job(api, job.id, "succeeded")
    events = c.fine_tuning.jobs.list_events(job.id, limit=100).data
    metrics = [e.data for e in events if e.type == "metrics"]
    assert [m["step"] for m in metrics] == [2, 1]  # type: ignore[index]
    assert all(0.0 <= m["reward_accuracy"] <= 1.0 and "reward_margin" in m for m in metrics)  # type: ignore[index,operator]
    assert 0.0 <= metrics[0]["eval_reward_accuracy"] <= 1.0  # type: ignore[index]
    assert "reward accuracy=" in events[1].message
    chat = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "logprobs": True, "extra_body": {"ignore_eos": True}}
    tuned = c.chat.completions.create(model=done.fine_tuned_model, **chat)  # type: ignore[arg-type]
    before = c.chat.completions.create(model=sft_model, **chat)  # type: ignore[arg-type]
    assert tuned.model == done.fine_tuned_model
    lp = [[t.logprob for t in (r.choices[0].logprobs.content or [])] for r in (tuned, before)]  # type: ignore[union-attr]
    assert lp[0] != lp[1]  # DPO moved the SFT model
    assert metric(api.server.metrics(), "tprt_finetune_preference", metric="reward_accuracy") >= 0.0
    # An adapter on disk under --data-dir/adapters/, never loaded, starts a job as gRPC's
    # init_adapter takes it (it was a 404 over HTTP).
    shutil.copytree(api.root / "data" / ours["init_adapter"], api.root / "data" / "adapters" / "sft-on-disk")
    again = c.fine_tuning.jobs.create(model="sft-on-disk", training_file=pairs, suffix="again",
                                      method={"type": "dpo", "dpo": {"hyperparameters": {**hp, "n_epochs": 1}}})
    assert (again.model_extra or {})["tprt"]["init_adapter"] == "adapters/sft-on-disk"
    _wait_job(api, again.id, "succeeded")


def test_jobs_paging_queue_limit_cancel_across_protocols(api: Api, training_file: str) -> None:
    c = api.client
    endless: dict[str, Any] = {"inline_jsonl": '{"text": "hello hello hello"}\n', "steps": 100000, "batch_size": 1,
               "max_seq_len": 16, "lora_rank": 2}
    with api.server.client() as grpc_client:
        running = grpc_client.create_job(**endless)  # over gRPC, seen over HTTP
        running_id = "ft" + running.id
        _wait_job(api, running_id, "running")
        hp: Any = {"steps": 5, "batch_size": 1, "max_seq_len": SEQ_LEN, "lora_rank": 2}
        queued = c.fine_tuning.jobs.create(model=api.model, training_file=training_file, hyperparameters=hp)
        with pytest.raises(openai.RateLimitError):  # --max-queued-jobs 1
            c.fine_tuning.jobs.create(model=api.model, training_file=training_file, hyperparameters=hp)
        first = c.fine_tuning.jobs.list(limit=1)
        assert [j.id for j in first.data] == [queued.id] and first.has_more
        second = c.fine_tuning.jobs.list(limit=1, after=queued.id)
        assert [j.id for j in second.data] == [running_id] and second.data[0].training_file == running.dataset
        with pytest.raises(openai.BadRequestError) as busy:  # a queued job will read it
            c.files.delete(training_file)
        assert busy.value.param == "file_id"
        assert c.fine_tuning.jobs.cancel(queued.id).status == "cancelled"  # at once
        assert c.fine_tuning.jobs.cancel(running_id).status == "running"  # at its next step
        _wait_job(api, running_id, "cancelled")
        assert grpc_client.get_job(queued.id.removeprefix("ft")).state == grpc_client.get_job(running.id).state
    assert c.fine_tuning.jobs.list_events(running_id).data[0].message == "The job was cancelled"
    assert c.fine_tuning.jobs.checkpoints.list(running_id).data == []
    spare = c.files.create(file=("spare.jsonl", _chat_jsonl(1)), purpose="fine-tune")
    assert c.files.delete(spare.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(spare.id)


def test_file_and_job_errors_are_typed(api: Api, training_file: str) -> None:
    c = api.client

    def bad(call: Any, **kw: Any) -> openai.APIStatusError:
        with pytest.raises(openai.APIStatusError) as info:
            call(**kw)
        return info.value

    create = c.fine_tuning.jobs.create
    cases: list[tuple[Any, dict[str, Any], type[openai.APIStatusError], str | None]] = [
        (c.files.create, {"file": ("a.jsonl", _chat_jsonl(1)), "purpose": "assistants"}, openai.BadRequestError,
         "purpose"),
        (c.files.create, {"file": ("a.jsonl", b'{"messages": []}\n'), "purpose": "fine-tune"},
         openai.BadRequestError, "file"),
        (c.files.retrieve, {"file_id": "file-" + "0" * 24}, openai.NotFoundError, "file_id"),
        (create, {"model": api.model, "training_file": "file-" + "0" * 24}, openai.NotFoundError, "training_file"),
        (create, {"model": "gpt-4o-mini", "training_file": training_file}, openai.NotFoundError, "model"),
        (create, {"model": api.model, "training_file": training_file, "hyperparameters": {"batch_size": 0}},
         openai.BadRequestError, "hyperparameters.batch_size"),
        (create, {"model": api.model, "training_file": training_file,
                  "method": {"type": "supervised", "supervised": {"hyperparameters": {"epochs": 2}}}},
         openai.BadRequestError, "method.supervised.hyperparameters.epochs"),
        (create, {"model": api.model, "training_file": training_file,
                  "hyperparameters": {"learning_rate_multiplier": 1e5}}, openai.BadRequestError,
         "hyperparameters.learning_rate_multiplier"),
        (create, {"model": api.model, "training_file": training_file, "method": {"type": "reinforcement"}},
         openai.BadRequestError, "method.type"),
        (create, {"model": api.model, "training_file": training_file, "method": {"type": "dpo"}},
         openai.BadRequestError, "training_file"),  # chats, not preference pairs: line 1 is refused
        (create, {"model": api.model, "training_file": training_file,  # a block the method would ignore
                  "method": {"type": "dpo", "supervised": {"hyperparameters": {"n_epochs": 2}}}},
         openai.BadRequestError, "method.supervised"),
        (create, {"model": api.model, "training_file": training_file,
                  "method": {"type": "supervised", "supervised": {"hyperparameters": {"beta": 0.1}}}},
         openai.BadRequestError, "method.supervised.hyperparameters.beta"),
        (create, {"model": api.model, "training_file": training_file, "validation_file": "file-" + "1" * 24},
         openai.NotFoundError, "validation_file"),
        (create, {"model": api.model, "training_file": training_file, "suffix": "no spaces"},
         openai.BadRequestError, "suffix"),
        (create, {"model": api.model, "training_file": training_file, "hyperparameters": {"n_epochs": 10**30}},
         openai.BadRequestError, "hyperparameters.n_epochs"),
        (create, {"model": api.model, "training_file": training_file, "hyperparameters": {"batch_size": 2**70}},
         openai.BadRequestError, "hyperparameters.batch_size"),
        (create, {"model": api.model, "training_file": training_file, "hyperparameters": {"steps": 2**40}},
         openai.BadRequestError, "hyperparameters.steps"),
        (create, {"model": api.model, "training_file": training_file, "seed": -1}, openai.BadRequestError, "seed"),
        (create, {"model": api.model, "training_file": training_file, "seed": 2**64}, openai.BadRequestError, "seed"),
        (create, {"model": api.model, "training_file": training_file,
                  "hyperparameters": {"learning_rate_multiplier": -2}}, openai.BadRequestError,
         "hyperparameters.learning_rate_multiplier"),
        (create, {"model": api.model, "training_file": training_file,
                  "metadata": {f"k{i}": "v" for i in range(17)}}, openai.BadRequestError, "metadata"),
        (create, {"model": api.model, "training_file": training_file, "metadata": {"k" * 65: "v"}},
         openai.BadRequestError, "metadata"),
        (create, {"model": api.model, "training_file": training_file, "metadata": {"k": "v" * 513}},
         openai.BadRequestError, "metadata.k"),
        (c.fine_tuning.jobs.retrieve, {"fine_tuning_job_id": "ftjob-nope"}, openai.NotFoundError, "job_id"),
        (c.fine_tuning.jobs.list, {"limit": 0}, openai.BadRequestError, "limit"),
    ]
    for call, kw, kind, param in cases:
        e = bad(call, **kw)
        assert type(e) is kind and e.param == param, (kw, e)
    assert "(the files endpoint lists them)" in bad(c.files.retrieve, file_id="file-x").message  # not redacted away
    line = bad(c.files.create, file=("mine.jsonl", _chat_jsonl(1) + b"{oops\n"), purpose="fine-tune")
    assert "'mine.jsonl':2: not valid JSON" in line.message and str(api.root) not in line.message
    big = bad(c.files.create, file=("big.jsonl", b"x" * (MAX_DATASET + 1)), purpose="fine-tune")
    assert big.status_code == 413 and "--max-dataset-bytes" in big.message
    huge = bad(c.files.create, file=("huge.jsonl", b"x" * (2 * MAX_DATASET)), purpose="fine-tune")
    assert huge.status_code == 413  # refused by its Content-Length, before the body is read
    # Not JSON numbers, yet Python's parser takes them: NaN and Infinity are refused as a body that
    # is not JSON, 1e400 (infinite as a float) by the field's range.
    for raw, param in ((b'{"learning_rate_multiplier": NaN}', "body"), (b'{"learning_rate_multiplier": Infinity}', "body"),
                       (b'{"learning_rate_multiplier": 1e400}', "hyperparameters.learning_rate_multiplier")):
        body = b'{"model": "%s", "training_file": "%s", "hyperparameters": %s}' % (
            api.model.encode(), training_file.encode(), raw)
        with api.http() as http:
            r = http.post(f"{api.base_url}/fine_tuning/jobs", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"].endswith(param.split(".")[-1]), (raw, r.text)
    # our rpo_alpha (RPO): method "dpo" only, in [0, 100] (1e400 parses as inf)
    for kind, value, message in (("supervised", b"1.0", "applies to method 'dpo' only"),
                                 ("dpo", b"100.5", "must be a number in [0.0, 100.0], got 100.5"),
                                 ("dpo", b"1e400", "must be a finite number")):
        body = b'{"model": "%s", "training_file": "%s", "method": {"type": "%s", "%s": {"hyperparameters": ' \
               b'{"rpo_alpha": %s}}}}' % (api.model.encode(), training_file.encode(), kind.encode(), kind.encode(), value)
        with api.http() as http:
            r = http.post(f"{api.base_url}/fine_tuning/jobs", content=body, headers={"content-type": "application/json"})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == f"method.{kind}.hyperparameters.rpo_alpha", (value, r.text)
        assert message in error["message"], (value, r.text)
    with pytest.raises(openai.AuthenticationError):
        api.openai("wrong").files.list()
    assert not any(f.filename in ("a.jsonl", "mine.jsonl", "big.jsonl") for f in c.files.list().data)


def test_uploads_that_are_not_utf8_text_are_400_naming_the_file(api: Api) -> None:
    """Issue 30 #7: UTF-16, invalid UTF-8 and binary uploads are refused naming the file and line."""
    c = api.client
    for name, data in (("utf16.jsonl", '{"text": "hi"}\n'.encode("utf-16")),
                       ("latin1.jsonl", '{"text": "caf\u00e9"}\n'.encode("latin-1")),
                       ("blob.png", b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)):
        with pytest.raises(openai.BadRequestError) as info:
            c.files.create(file=(name, data), purpose="fine-tune")
        assert info.value.param == "file" and f"'{name}':1: not UTF-8 text" in info.value.message, info.value.message


def test_a_chunked_upload_over_the_limit_is_413(api: Api) -> None:
    """A body without Content-Length is counted as it streams in: over the limit it is a 413, as
    one announced too large is."""
    boundary = "tprt-boundary"
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n").encode()

    def body() -> Iterator[bytes]:
        yield head
        for _ in range(4 * MAX_DATASET // 4096):
            yield b"x" * 4096
        yield f"\r\n--{boundary}--\r\n".encode()

    with api.http(timeout=30) as http:
        r = http.post(f"{api.base_url}/files", content=body(),
                      headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_silent_connections_cannot_take_the_servers_descriptors(api: Api) -> None:
    """Issue 30 #2 on the real server: more silent connections than the process has descriptors
    (FD_LIMIT) leave HTTP (TLS included), gRPC, health and /metrics serving; the connections
    past the caps are closed at once."""
    host, port = re.search(r"//([\d.]+):(\d+)/", api.base_url).groups()  # type: ignore[union-attr]
    silent = []
    try:
        for _ in range(FD_LIMIT + 100):
            silent.append(socket.create_connection((host, int(port)), timeout=30))
        assert [m.id for m in api.client.models.list().data][0] == api.model
        out = api.client.completions.create(model=api.model, prompt="Hi", max_tokens=2, temperature=0,
                                            extra_body={"ignore_eos": True})
        assert out.usage is not None and out.usage.completion_tokens == 2
        assert metric(api.server.metrics(), "tprt_serving") == 1
        with api.server.client() as grpc_client:
            assert grpc_client.health_check() == "SERVING"
            assert len(grpc_client.complete("Hi", max_new_tokens=2, temperature=0).tokens) == 2
    finally:
        for s in silent:
            s.close()
    log = api.server.tail()
    assert "Traceback" not in log and "out of system resource" not in log, log


def test_draining_and_broken_ranks_are_503(tmp_path: Path) -> None:
    """The app in-process (its real routes, job manager and store, called with the openai package
    through Starlette's test client): a draining server, then one whose world broke, refuses new
    jobs with 503; a scheduler that refuses work refuses completions the same way."""
    from starlette.testclient import TestClient

    from serve.adapters.registry import AdapterRegistry
    from serve.errors import Redactor, Unavailable
    from serve.jobs.manager import JobManager
    from serve.jobs.store import JobStore
    from serve.metrics import Metrics
    from serve.core.generation import GenerationCore
    from serve.jobs.core import JobsCore
    from serve.openai.app import HttpDeps, create_app
    from serve.openai.files import FileStore

    class Refusing:
        def submit(self, ticket: Any) -> None:
            raise Unavailable("the server is shutting down; retry on another replica")

    store, metrics, adapters = JobStore(tmp_path), Metrics(), AdapterRegistry()
    jobs = JobManager(store, tmp_path, metrics, adapters, tmp_path, None, 64, lambda: None)
    facts = types.SimpleNamespace(name="base", context_length=64, config=types.SimpleNamespace(vocab_size=300))
    deps = HttpDeps(GenerationCore(Refusing(), None, facts, adapters, metrics),  # type: ignore[arg-type]
                    JobsCore(jobs, None, 64, adapters, 1 << 20), metrics, None, 1 << 20, 0.0,
                    FileStore(tmp_path, None, 64, 1 << 20, store), Redactor({tmp_path: ""}))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", max_retries=0,
                           http_client=TestClient(create_app(deps)))
    jobs.stop_accepting()
    for why in ("shutting down", "rank 1 died"):
        if why != "shutting down":
            jobs.ranks_broken(why)
        with pytest.raises(openai.InternalServerError) as info:
            client.fine_tuning.jobs.create(model="base", training_file="file-" + "0" * 24)
        assert info.value.status_code == 503 and why in info.value.message
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="base", prompt=[1, 2, 3], max_tokens=2)
    assert info.value.status_code == 503 and "shutting down" in info.value.message
    store.close()


def test_file_store_sweeps_what_a_crash_left(tmp_path: Path) -> None:
    """A crash mid-upload leaves a temporary upload or data without its row: neither was ever
    listed, and the next start removes both; whole files stay, and an object an earlier release
    kept beside its data (`<id>.json`) moves into the table."""
    from serve.jobs.store import JobStore
    from serve.openai.files import FileStore

    files = tmp_path / "files"
    files.mkdir()
    whole, orphan = "file-" + "a" * 24, "file-" + "b" * 24
    obj = {"id": whole, "object": "file", "bytes": 15, "created_at": 1_700_000_000, "filename": "a.jsonl",
           "purpose": "fine-tune", "status": "processed", "status_details": None}
    (files / f"{whole}.jsonl").write_text('{"text": "hi"}\n')
    (files / f"{whole}.json").write_text(json.dumps(obj))
    (files / f"{orphan}.jsonl").write_text('{"text": "hi"}\n')
    (files / f".file-{'c' * 24}.upload").write_text("half")
    store = FileStore(tmp_path, None, 64, 1 << 20, JobStore(tmp_path))
    assert sorted(p.name for p in files.iterdir()) == [f"{whole}.jsonl"]
    assert store.list() == [obj] and store.get(whole) == obj and store.stored_bytes() == 15
    assert store.content(whole) == files / f"{whole}.jsonl"


# ----------------------------------------------------------------- the HTTP surface in-process (issue 30)
#
# The app's real routes, middleware and connection guard, served by uvicorn in this process on a
# port of its own, over a scheduler that answers at once and a file store whose dataset check
# waits at a gate: tight limits, and states (uploads held mid-check) that a real server reaches
# only by timing.

LOCAL_LIMITS = dict(header_timeout=1.0, body_timeout=1.0, max_connections=56, max_unauthenticated=48)
FAIL_ID, HOLD_ID = 7, 8  # prompt ids: an error naming a path and an address / held until released


class InstantScheduler:
    """One token then "length" for every ticket; FAIL_ID fails, HOLD_ID waits for `release`."""

    adapters = None

    def __init__(self) -> None:
        import threading

        self.held: list[Any] = []
        self.lock = threading.Lock()

    def submit(self, ticket: Any) -> None:
        from serve.errors import Unavailable

        if ticket.prompt[0] == FAIL_ID:
            ticket.events.put(Unavailable("rank 1 at 10.1.2.3:29500 died; see /var/lib/tprt-secret/logs/rank1.log"))
        elif ticket.prompt[0] == HOLD_ID:
            with self.lock:
                self.held.append(ticket)
        else:
            self._finish(ticket)

    @staticmethod
    def _finish(ticket: Any) -> None:
        from tprt.engine.sequence import TokenEvent, Usage

        ticket.events.put(TokenEvent(ticket.request_id, 5, "x", finish_reason="length",
                                     usage=Usage(len(ticket.prompt), 1)))

    def release(self) -> None:
        with self.lock:
            held, self.held = self.held, []
        for ticket in held:
            self._finish(ticket)

    def cancel(self, request_id: str, why: str) -> None:
        pass


class Local:
    """An in-process app on its own port (see above)."""

    def __init__(self, root: Path, datasets: Any = None) -> None:
        import threading

        from serve.adapters.registry import AdapterRegistry
        from serve.auth import TokenCheck
        from serve.jobs.datasets import DatasetWork
        from serve.errors import Redactor
        from serve.jobs.manager import JobManager
        from serve.openai.http_guard import HttpLimits
        from serve.openai.http_server import HttpServer
        from serve.jobs.store import JobStore
        from serve.metrics import Metrics
        from serve.core.generation import GenerationCore
        from serve.jobs.core import JobsCore
        from serve.openai.app import HttpDeps, create_app
        from serve.openai.files import FileStore

        gate = self.gate = threading.Event()
        self.checking = threading.Semaphore(0)  # released by each upload that reaches its dataset check

        class GatedFiles(FileStore):
            def _check_dataset(inner, path: Path, filename: str) -> None:  # noqa: N805
                self.checking.release()
                assert gate.wait(60)

        self.store, metrics, adapters = JobStore(root), Metrics(), AdapterRegistry()
        jobs = JobManager(self.store, root, metrics, adapters, root, None, 64, lambda: None)
        facts = types.SimpleNamespace(name="base", context_length=64, config=types.SimpleNamespace(vocab_size=300))
        self.scheduler = InstantScheduler()
        self.datasets = datasets or DatasetWork(workers=2, waiting=2)
        deps = HttpDeps(GenerationCore(self.scheduler, None, facts, adapters, metrics),  # type: ignore[arg-type]
                        JobsCore(jobs, None, 64, adapters, 1 << 20), metrics, TOKEN, 1 << 20, 0.0,
                        GatedFiles(root, object(), 64, 1 << 20, self.store),  # type: ignore[arg-type]
                        Redactor({root: ""}), datasets=self.datasets)
        self.http = HttpServer("127.0.0.1", 0, None, None, HttpLimits(**LOCAL_LIMITS))  # type: ignore[arg-type]
        self.http.start(create_app(deps), TokenCheck(TOKEN))
        self.url = f"http://127.0.0.1:{self.http.port}"
        wait_for(lambda: self._up(), 10, "the in-process server")

    def _up(self) -> bool:
        try:
            return httpx.get(f"{self.url}/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        except httpx.TransportError:
            return False

    def client(self, token: str = TOKEN) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=20)

    def close(self) -> None:
        self.gate.set()
        self.scheduler.release()
        self.http.stop()
        self.store.close()


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Local]:
    server = Local(tmp_path_factory.mktemp("local-http"))
    try:
        yield server
    finally:
        server.close()


def _raw(local: Local, data: bytes = b"") -> Any:
    import socket

    s = socket.create_connection(("127.0.0.1", local.http.port), timeout=20)
    if data:
        s.sendall(data)
    return s


def _closed_by_server(s: Any) -> bool:
    """Whether the server has closed `s` (reads what it answered first, if anything)."""
    import socket

    s.settimeout(0.05)
    try:
        while True:
            if not s.recv(65536):
                return True
    except socket.timeout:
        return False
    except OSError:  # reset: the guard aborts
        return True


def _read_response(s: Any) -> bytes:
    """Everything the server sends until it closes the connection."""
    s.settimeout(20)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def _upload(client: httpx.Client, name: str = "d.jsonl") -> httpx.Response:
    return client.post("/v1/files", files={"file": (name, b'{"text": "hi"}\n')}, data={"purpose": "fine-tune"})


def test_silent_and_slow_connections_are_closed_and_bounded(local: Local) -> None:
    """Issue 30 #2: connections that never finish their headers are closed at the header deadline
    however they trickle; past --http-max-unauthenticated the oldest goes at once; a stalled body
    is closed too; requests with the token are served throughout."""
    guard = local.http.guard
    assert guard is not None
    before = dict(guard.closed)
    partial = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    silent = [_raw(local) for _ in range(3)] + [_raw(local, partial) for _ in range(2 * LOCAL_LIMITS["max_connections"])]
    try:
        with local.client() as c:
            for _ in range(3):  # each new connection takes an older silent one's place
                assert c.get("/v1/models").status_code == 200
                assert c.post("/v1/completions", json={"model": "base", "prompt": [1, 2], "max_tokens": 1}).status_code == 200
        assert len(guard.untrusted) <= LOCAL_LIMITS["max_unauthenticated"]
        wait_for(lambda: all(_closed_by_server(s) for s in silent), 20, "the silent connections to be closed")
        by_guard = sum(guard.closed[k] - before[k] for k in ("evicted", "header_timeout", "refused"))
        assert by_guard >= len(silent)  # evicted as newer ones came, or at their deadline
        # One header byte at a time keeps no connection open past its deadline.
        trickle = _raw(local)
        sent = 0
        for byte in partial * 100:
            try:
                trickle.sendall(bytes([byte]))
            except OSError:
                break
            sent += 1
            if _closed_by_server(trickle):
                break
        assert sent < len(partial) * 100 and _closed_by_server(trickle)
        # A body that stops arriving (the token given: the app waits for it).
        stalled = _raw(local, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 100\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n{\"mo")
        wait_for(lambda: _closed_by_server(stalled), 20, "the stalled body's connection to be closed")
        assert guard.closed["header_timeout"] > before["header_timeout"]
        assert guard.closed["body_timeout"] > before["body_timeout"]
    finally:
        for s in silent:
            s.close()
    wait_for(lambda: not guard.untrusted, 10, "no unauthenticated connection left")


def test_the_guard_closes_the_oldest_unauthenticated_connection() -> None:
    """The caps' bookkeeping: past max_unauthenticated the oldest unauthenticated connection is
    closed; past max_connections the oldest unauthenticated one makes room, and when there is none
    the new connection is refused; a request with the token takes a connection out of the count."""
    from serve.openai.http_guard import ConnectionGuard, HttpLimits

    class Conn:
        def __init__(self, name: str) -> None:
            self.name = name

        def close_now(self) -> None:
            guard.drop(self)  # type: ignore[arg-type]
            closed.append(self.name)

    closed: list[str] = []
    guard = ConnectionGuard(HttpLimits(max_connections=4, max_unauthenticated=2),
                            lambda headers: (b"authorization", b"Bearer ok") in headers)
    a, b, c, d, e, f = (Conn(n) for n in "abcdef")
    assert guard.admit(a) and guard.admit(b)  # type: ignore[arg-type]
    guard.request(a, [(b"authorization", b"Bearer no")])  # type: ignore[arg-type]  # still unauthenticated
    assert guard.admit(c) and closed == ["a"]  # type: ignore[arg-type]
    for conn in (b, c):
        guard.request(conn, [(b"authorization", b"Bearer ok")])  # type: ignore[arg-type]
    assert guard.admit(d) and guard.admit(e) and closed == ["a"]  # type: ignore[arg-type]
    assert guard.admit(f) and closed == ["a", "d"]  # type: ignore[arg-type]  # the cap: d makes room
    guard.request(e, [(b"authorization", b"Bearer ok")])  # type: ignore[arg-type]
    guard.request(f, [(b"authorization", b"Bearer ok")])  # type: ignore[arg-type]
    assert not guard.admit(Conn("g")) and guard.closed["refused"] == 1  # type: ignore[arg-type]
    assert list(guard.open) == [b, c, e, f] and not guard.untrusted


def test_the_connection_cap_answers_503_when_all_are_busy(local: Local) -> None:
    """Past --http-max-connections, with every connection authenticated and busy, a new one
    gets 503 in OpenAI's shape; once they finish, it is served."""
    body = json.dumps({"model": "base", "prompt": [HOLD_ID], "max_tokens": 1, "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
               + TOKEN.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    busy: list[Any] = []
    try:
        for _ in range(LOCAL_LIMITS["max_connections"]):  # one at a time: a burst of new connections
            busy.append(_raw(local, request))              # past the unauthenticated cap would evict some
            wait_for(lambda: len(local.scheduler.held) == len(busy), 20, "the connection to hold a request")
        refused = _read_response(_raw(local, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert refused.startswith(b"HTTP/1.1 503")
        assert json.loads(refused.partition(b"\r\n\r\n")[2])["error"]["type"] == "server_error"
    finally:
        local.scheduler.release()
        for s in busy:
            s.close()
    with local.client() as c:
        wait_for(lambda: c.get("/v1/models").status_code == 200, 20, "a connection to be served again")


def test_the_token_is_checked_before_the_body_is_read(local: Local) -> None:
    """Issue 30 #5: without the token, a request announcing a large body (JSON or an upload) gets
    its 401 before sending any of it, and the connection is closed."""
    for path, kind in ((b"/v1/completions", b"application/json"), (b"/v1/files", b"multipart/form-data; boundary=x")):
        s = _raw(local, b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: " + kind +
                 b"\r\nContent-Length: 16000000\r\nAuthorization: Bearer wrong\r\n\r\n")
        answer = _read_response(s)  # the server closes the connection: nothing of the body was wanted
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 401") and b"connection: close" in head.lower(), head
        assert json.loads(payload)["error"]["code"] == "invalid_api_key"


def test_uploads_have_threads_of_their_own(local: Local) -> None:
    """Issue 30 #6: 45 uploads at once while dataset checks are held: those past the dataset
    threads' queue get 429, and a completion is answered meanwhile (it would wait for a thread
    behind the uploads if they shared one pool)."""
    from concurrent.futures import ThreadPoolExecutor

    local.gate.clear()
    clients = [local.client() for _ in range(45)]
    try:
        with ThreadPoolExecutor(len(clients)) as pool:
            uploads = [pool.submit(_upload, c) for c in clients]
            for _ in range(2):  # both dataset threads are checking
                assert local.checking.acquire(timeout=30)
            wait_for(lambda: sum(u.done() for u in uploads) >= 45 - local.datasets.capacity, 30, "the refusals")
            with local.client() as c:
                done = c.post("/v1/completions", json={"model": "base", "prompt": [1, 2, 3], "max_tokens": 1})
            assert done.status_code == 200 and done.json()["choices"][0]["text"] == "x"
            refused = [u.result() for u in uploads if u.done()]
            assert len(refused) == 45 - local.datasets.capacity
            assert {r.status_code for r in refused} == {429}
            assert refused[0].json()["error"]["type"] == "rate_limit_error"
            local.gate.set()
            statuses = sorted(u.result().status_code for u in uploads)
        assert statuses.count(200) == local.datasets.capacity
    finally:
        local.gate.set()
        for c in clients:
            c.close()
        while local.checking.acquire(blocking=False):
            pass


def test_stream_error_events_are_redacted(local: Local) -> None:
    """Issue 30 #8: an error after a stream's headers is an event, shown as a non-streaming error
    would be: no server paths, no addresses."""
    with local.client() as c, c.stream("POST", "/v1/completions", json={"model": "base", "prompt": [FAIL_ID],
                                                                      "max_tokens": 2, "stream": True}) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    message = json.loads(events[-2])["error"]["message"]
    assert "rank1.log" in message and "<address>" in message, message
    assert "/var/lib" not in message and "10.1.2.3" not in message, message


def test_draining_refuses_new_uploads_and_waits_for_those_being_checked(tmp_path: Path) -> None:
    """Issue 30 #13: at SIGTERM (serve/server.py's drain) an upload being checked finishes; a new
    one is refused with 503 in OpenAI's shape."""
    from concurrent.futures import ThreadPoolExecutor

    server = Local(tmp_path)
    try:
        with ThreadPoolExecutor(1) as pool, server.client() as c, server.client() as late:
            first = pool.submit(_upload, c, "first.jsonl")
            assert server.checking.acquire(timeout=30)
            server.datasets.stop_accepting()  # what the drain does first
            refused = _upload(late, "late.jsonl")
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
            assert "shutting down" in refused.json()["error"]["message"]
            assert not server.datasets.wait_idle(0.05)  # the drain waits for the upload being checked
            server.gate.set()
            assert server.datasets.wait_idle(30)
            assert first.result().status_code == 200 and first.result().json()["filename"] == "first.jsonl"
    finally:
        server.close()


def test_http_errors_have_openai_shape_and_strict_types(local: Local) -> None:
    """Issue 30 #7 and the smaller ones: 404/405, bad JSON, lone surrogates, token ids past any
    vocabulary, strings for numbers: 400s naming the parameter as OpenAI spells it, never 500."""
    with local.client() as c:
        missing = c.get("/v1/nothing-here")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        wrong = c.get("/v1/completions")
        assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"
        chat = {"model": "base", "messages": [{"role": "user", "content": "hi"}]}
        cases: list[tuple[Any, str]] = [
            (b'{"model": "base", "prompt": [1, 2', "body"),
            (b"\xff\xfe{}", "body"),
            (b'[1, 2]', "body"),
            (b'{"model": "base", "prompt": "x", "temperature": NaN}', "body"),
            (b'{"model": "base", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
            ({"model": "base", "prompt": [1, 2**63]}, "prompt"),
            ({"model": "base", "prompt": [[1], [2**70]]}, "prompt"),
            ({"model": "base", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
            ({"model": "base", "prompt": "x", "stream": 1}, "stream"),
            ({"model": "base", "prompt": 5}, "prompt"),
            ({**chat, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
            ({**chat, "messages": [{"role": "user", "content": [{"text": "a"}]}]}, "messages[0].content[0].type"),
            ({**chat, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ]
        for body, param in cases:
            path = "/v1/chat/completions" if (b"messages" in body if isinstance(body, bytes) else "messages" in body) \
                else "/v1/completions"
            r = c.post(path, content=body) if isinstance(body, bytes) else c.post(path, json=body)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", (body, error)
        # What OpenAI takes stays taken: an int where a float goes, nulls for optional fields.
        ok = c.post("/v1/completions", json={"model": "base", "prompt": [1], "temperature": 1, "top_p": None,
                                             "max_tokens": 1})
        assert ok.status_code == 200, ok.text


def test_repeated_loop_errors_are_logged_once_per_interval() -> None:
    """Issue 30 #2: asyncio's accept loop failing thousands of times a second logs one line per
    interval, and the next line says how many were held back."""
    import logging

    from serve.openai.http_guard import RateLimitedLog

    now = [0.0]
    logger = logging.getLogger("test-rate-limited")
    logger.propagate = False
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger.addHandler(Keep())
    logger.addFilter(RateLimitedLog(every=10.0, clock=lambda: now[0]))
    for i in range(11_000):  # a second of the accept loop at the fd limit, each with its own numbers
        logger.error("socket.accept() out of system resource\nsocket: <fd=%d>" % (i % 7))
        now[0] += 1 / 11_000
    logger.error("something else")
    now[0] += 10
    logger.error("socket.accept() out of system resource\nsocket: <fd=3>")
    assert len(seen) == 3 and seen[1] == "something else"
    assert "(10999 more like it in the last 10s were not logged)" in seen[2]


def test_a_full_disk_is_507_and_job_reads_are_off_the_event_loop(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The app in-process: an upload over --max-stored-bytes, one whose copy hits ENOSPC (injected)
    and one when the disk has no room are 507 in OpenAI's shape, leaving nothing behind; a job
    then too; the job store is read off the event loop."""
    import asyncio
    import errno

    from starlette.testclient import TestClient

    import serve.jobs.storage
    from serve.adapters.pool import AdapterPool
    from serve.adapters.registry import AdapterRegistry
    from serve.errors import Redactor
    from serve.jobs.manager import JobManager
    from serve.jobs.store import JobStore
    from serve.metrics import Metrics
    from serve.core.generation import GenerationCore
    from serve.jobs.core import JobsCore
    from serve.openai.app import HttpDeps, create_app
    from serve.openai.files import FileStore
    from tprt.text.tokenizer import Tokenizer
    from train_fixtures import write_tokenizer

    tok = Tokenizer.from_dir(write_tokenizer(tmp_path / "tok"))
    data = tmp_path / "data"
    store, metrics, adapters = JobStore(data), Metrics(), AdapterRegistry()
    jobs = JobManager(store, data, metrics, AdapterPool(adapters, data, metrics), tmp_path, tok, 64, lambda: None)
    files = FileStore(data, tok, 64, 1 << 20, store, max_stored_bytes=len(_chat_jsonl(2)) + 10)
    facts = types.SimpleNamespace(name="base", context_length=64, config=types.SimpleNamespace(vocab_size=300))
    deps = HttpDeps(GenerationCore(None, tok, facts, adapters, metrics),  # type: ignore[arg-type]
                    JobsCore(jobs, tok, 64, adapters, 1 << 20), metrics, None, 1 << 20, 0.0, files,
                    Redactor({data: ""}))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", max_retries=0,
                           http_client=TestClient(create_app(deps)))

    def refused(call: Any, **kw: Any) -> openai.APIStatusError:
        with pytest.raises(openai.APIStatusError) as info:
            call(**kw)
        assert info.value.status_code == 507 and info.value.type == "server_error", info.value
        return info.value

    kept = client.files.create(file=("a.jsonl", _chat_jsonl(2)), purpose="fine-tune")
    assert "--max-stored-bytes" in refused(client.files.create, file=("b.jsonl", _chat_jsonl(2)),
                                           purpose="fine-tune").message
    files.max_stored_bytes = None

    def no_space(self: Any, upload: Any, tmp: Path, limit: int | None) -> int:
        tmp.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(FileStore, "_copy", no_space)
        assert "full" in refused(client.files.create, file=("c.jsonl", _chat_jsonl(2)), purpose="fine-tune").message
    monkeypatch.setattr(serve.jobs.storage, "free_bytes", lambda path: 1 << 10)
    refused(client.files.create, file=("d.jsonl", _chat_jsonl(2)), purpose="fine-tune")
    refused(client.fine_tuning.jobs.create, model="base", training_file=kept.id)
    assert [f.id for f in client.files.list().data] == [kept.id]
    assert sorted(p.name for p in (data / "files").iterdir()) == [f"{kept.id}.jsonl"]
    assert store.select() == [] and not (data / "jobs").exists()
    monkeypatch.undo()

    on_loop: list[bool] = []
    real_page, real_get = store.page, store.get

    def running_loop() -> bool:
        try:
            asyncio.get_running_loop()
            return True
        except RuntimeError:
            return False

    def page(*args: Any) -> Any:
        on_loop.append(running_loop())
        return real_page(*args)

    def get(*args: Any) -> Any:
        on_loop.append(running_loop())
        return real_get(*args)

    monkeypatch.setattr(store, "page", page)
    monkeypatch.setattr(store, "get", get)
    job = client.fine_tuning.jobs.create(model="base", training_file=kept.id, metadata={"team": "a"},
                                         hyperparameters={"n_epochs": 2, "max_seq_len": 64})  # type: ignore[typeddict-unknown-key]
    assert job.metadata == {"team": "a"} and (job.model_extra or {})["tprt"]["total_steps"] == 4  # 2 x 2 examples / 1
    assert [j.id for j in client.fine_tuning.jobs.list().data] == [job.id]
    assert client.fine_tuning.jobs.retrieve(job.id).status == "queued"
    client.fine_tuning.jobs.list_events(job.id)
    assert on_loop and not any(on_loop), on_loop
    store.close()


# Every field of OpenAI's documented request bodies (the `openai` package's, pinned in
# pyproject.toml), with a value to send and what must happen: "ok" (a 200: the field works,
# or describes the caller) or "refused" (a 400 naming it). Effects are checked by their own tests
# (the penalties, logit_bias and echo above, tools and formats in test_http_outputs.py). A third
# member holds other fields the value needs.
_CHAT_FIELDS: dict[str, list[tuple[Any, ...]]] = {
    "audio": [({"voice": "alloy", "format": "wav"}, "refused")],
    "frequency_penalty": [(0.5, "ok")], "presence_penalty": [(0.5, "ok")],
    "function_call": [("auto", "refused")], "functions": [([{"name": "f", "parameters": {}}], "refused")],
    "logit_bias": [({"5": 1}, "ok")], "logprobs": [(True, "ok")],
    "top_logprobs": [(2, "ok", {"logprobs": True}), (2, "refused")],  # as OpenAI: only with logprobs
    "max_completion_tokens": [(3, "ok")], "max_tokens": [(3, "ok")], "messages": [(CHAT, "ok")],
    "metadata": [({"k": "v"}, "ok")], "modalities": [(["text"], "ok"), (["text", "audio"], "refused")],
    "model": [(None, "ok")], "moderation": [({}, "refused")], "n": [(2, "ok")],
    "parallel_tool_calls": [(False, "ok")], "prediction": [({"type": "content", "content": "x"}, "refused")],
    "prompt_cache_key": [("k", "ok")], "prompt_cache_options": [({}, "ok")], "prompt_cache_retention": [("24h", "ok")],
    "reasoning_effort": [("low", "refused")], "response_format": [({"type": "json_object"}, "ok")],
    "safety_identifier": [("u", "ok")], "seed": [(1, "ok")], "service_tier": [("auto", "ok")], "stop": [(["x"], "ok")],
    "store": [(False, "ok")], "stream": [(True, "ok")],
    "stream_options": [({"include_usage": True}, "ok"), ({"include_obfuscation": True}, "refused")],
    "temperature": [(0.0, "ok")], "top_p": [(0.5, "ok")], "tool_choice": [("none", "ok")],
    "tools": [([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "ok")],
    "user": [("u", "ok")], "verbosity": [("medium", "ok"), ("low", "refused")], "web_search_options": [({}, "refused")],
}
_COMPLETION_FIELDS: dict[str, list[tuple[Any, ...]]] = {
    "best_of": [(1, "ok"), (2, "ok"), (2, "refused", {"n": 3})], "echo": [(True, "ok")], "frequency_penalty": [(0.5, "ok")],
    "presence_penalty": [(0.5, "ok")], "logit_bias": [({"5": 1}, "ok")], "logprobs": [(2, "ok")],
    "max_tokens": [(3, "ok")], "model": [(None, "ok")], "n": [(2, "ok")], "prompt": [("Hello", "ok")],
    "seed": [(1, "ok")], "stop": [(["x"], "ok")], "stream": [(True, "ok")],
    "stream_options": [({"include_usage": True}, "ok")], "suffix": [("x", "refused")], "temperature": [(0.0, "ok")],
    "top_p": [(0.5, "ok")], "user": [("u", "ok")],
}
_RESPONSES_FIELDS: dict[str, list[tuple[Any, ...]]] = {
    "access_programs": [({}, "refused")], "background": [(False, "ok"), (True, "refused")],
    "background_options": [({}, "refused")], "context_management": [([{"type": "compaction"}], "refused")],
    "conversation": [("conv_1", "refused")], "image": [({}, "refused")],
    "include": [(["message.output_text.logprobs"], "ok"), (["file_search_call.results"], "refused")],
    "input": [("Hello", "ok")], "instructions": [("Be brief.", "ok")], "max_output_tokens": [(3, "ok")],
    "max_tool_calls": [(2, "refused")], "metadata": [({"k": "v"}, "ok")], "model": [(None, "ok")],
    "moderation": [({}, "refused")], "parallel_tool_calls": [(False, "ok")],
    "previous_response_id": [("resp_none", "refused")], "prompt": [({"id": "pmpt_1"}, "refused")],
    "prompt_cache_key": [("k", "ok")], "prompt_cache_options": [({}, "ok")], "prompt_cache_retention": [("24h", "ok")],
    "reasoning": [({"effort": "low"}, "refused")], "safety_identifier": [("u", "ok")],
    "service_tier": [("auto", "ok")], "store": [(False, "ok")], "stream": [(True, "ok")],
    "stream_options": [({"include_obfuscation": False}, "ok"), ({"include_obfuscation": True}, "refused")],
    "temperature": [(0.0, "ok")], "text": [({"format": {"type": "json_object"}}, "ok"), ({"verbosity": "high"}, "refused")],
    "tool_choice": [("none", "ok")],
    "tools": [([{"type": "function", "name": "f", "parameters": {"type": "object"}}], "ok"),
              ([{"type": "web_search"}], "refused")],
    "top_logprobs": [(2, "ok")], "top_p": [(0.5, "ok")], "truncation": [("disabled", "ok"), ("auto", "refused")],
    "user": [("u", "ok")],
}


def _documented(module: Any, base: str) -> set[str]:
    """The fields of an `openai` request's TypedDicts, streaming and not."""
    fields = set(getattr(module, base).__annotations__)
    for suffix in ("Streaming", "NonStreaming"):
        fields |= set(getattr(module, base.removesuffix("Base") + suffix).__annotations__)
    return fields


def test_every_documented_field_is_honoured_or_refused(api: Api) -> None:
    """Walks OpenAI's documented request fields for chat, completions and responses (issue 42):
    each is taken (200) or refused with a 400 naming it; none is dropped without a word."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params
    from openai.types.responses import response_create_params

    base = {"chat/completions": {"model": api.model, "messages": CHAT, "max_tokens": 3},
            "completions": {"model": api.model, "prompt": "Hello", "max_tokens": 3},
            "responses": {"model": api.model, "input": "Hello", "max_output_tokens": 3}}
    tables = {"chat/completions": (_CHAT_FIELDS, _documented(chat_params, "CompletionCreateParamsBase")),
              "completions": (_COMPLETION_FIELDS, _documented(completion_create_params, "CompletionCreateParamsBase")),
              "responses": (_RESPONSES_FIELDS, _documented(response_create_params, "ResponseCreateParamsBase"))}
    with api.http(timeout=60) as http:
        for endpoint, (table, documented) in tables.items():
            assert documented == set(table), (endpoint, sorted(documented ^ set(table)))
            for field, cases in table.items():
                for value, expected, *more in cases:
                    body = {**base[endpoint], **(more[0] if more else {})}
                    if value is not None:
                        body[field] = value
                    r = http.post(f"{api.base_url}/{endpoint}", json=body)
                    what = f"{endpoint} {field}={value!r}: {r.status_code} {r.text[:300]}"
                    if expected == "ok":
                        assert r.status_code == 200, what
                        continue
                    assert r.status_code in (400, 404), what
                    param = r.json()["error"]["param"]
                    assert param == field or param.startswith((field + ".", field + "[")), what
