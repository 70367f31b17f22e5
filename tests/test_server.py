"""`tprt serve` end to end: a real server on loopback with 2 gloo ranks and a tiny model, called
through the generated client (serve/client.py).

One server (module fixture, started as `python -m tprt.cli serve`, bearer-token auth on) takes
every functional check: streaming, 16 concurrent streams vs 16 sequential greedy calls,
cancellation and deadlines freeing the KV slot, every validation status code, auth, a full queue,
metrics, reflection, and a LoRA fine-tuning job whose adapter is then served. The last tests stop
it with SIGTERM (drain, job checkpoint, exit 0), start a second server on the same --data-dir
(job recovery after restart) and kill one of its ranks (NOT_SERVING, UNAVAILABLE, no hang).
Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from serve.client import Client, field_of  # noqa: E402
from serve.jobs import RUNNING, JobRecord, JobStore  # noqa: E402
from tiny_chat import make_tiny_chat_model  # noqa: E402

TOKEN = "s3cret-token"
MAX_BATCH = 16
MAX_QUEUE = 4
MAX_MESSAGE = 1 << 20
CONTEXT = 512  # long enough that the queue-full test's blockers outlast its extra call
START_TIMEOUT_S = 120.0
STATE: dict[str, Any] = {}  # what the SIGTERM test leaves for the restart test


class ServerProcess:
    """`tprt serve` in a subprocess: waits for its "listening on" line, stops it, keeps its log."""

    def __init__(self, args: list[str], log: Path, tls_ca: Path | None = None,
                 launcher: tuple[str, ...] = (sys.executable, "-m", "tprt.cli")) -> None:
        self.log = log
        self.tls_ca = tls_ca
        self.proc = subprocess.Popen(
            [*launcher, "serve", *args], stdout=subprocess.PIPE,
            stderr=log.open("w"), text=True, env={**_env(), "PYTHONUNBUFFERED": "1"})
        self.ready = threading.Event()
        self.line = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(START_TIMEOUT_S) or not self.line:
            self.kill()
            raise AssertionError(f"server did not start: {self.tail()}")
        m = re.search(r"listening on ([\d.]+:\d+) .*metrics http://([\d.]+:\d+)/metrics; rank pids \[([\d, ]+)\]",
                      self.line)
        assert m, self.line
        self.target, self.metrics_addr = m.group(1), m.group(2)
        self.pids = [int(p) for p in m.group(3).split(",")]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "listening on" in line:
                self.line = line
                self.ready.set()
        self.ready.set()  # exited before becoming ready

    def tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else ""

    def client(self, token: str | None = TOKEN, timeout: float | None = 60.0) -> Client:
        return Client(self.target, token=token, timeout=timeout, tls_ca=self.tls_ca)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://{self.metrics_addr}/metrics", timeout=10) as r:
            return str(r.read().decode())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"server did not exit within {timeout}s: {self.tail()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _env() -> dict[str, str]:
    return dict(os.environ)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        sample, _, lab = key.partition("{")
        got = ",".join(sorted(lab.rstrip("}").split(","))) if lab else ""
        if sample == name and got == want:
            return float(value)
    return 0.0


def wait_for(pred: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("serve")
    make_tiny_chat_model(root / "model", (2,), max_positions=CONTEXT)
    (root / "token").write_text(TOKEN + "\n")
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text("".join(
        json.dumps({"prompt": f"Q{i}: say hi", "completion": " hi there"}) + "\n" for i in range(8)))
    return root


def server_args(root: Path) -> list[str]:
    return ["--model", str(root / "model" / "tp2"), "--port", "0", "--metrics-port", "0",
            "--data-dir", str(root / "data"), "--auth-token-file", str(root / "token"),
            "--max-batch-size", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE), "--drain-timeout", "20",
            "--threads", "1", "--collective-timeout", "30", "--max-message-bytes", str(MAX_MESSAGE)]


@pytest.fixture(scope="module")
def server(workdir: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(server_args(workdir), workdir / "server-a.log")
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    with server.client() as c:
        yield c


def rpc_error(fn: Callable[[], Any]) -> Any:
    with pytest.raises(grpc.RpcError) as info:
        result = fn()
        if hasattr(result, "__next__"):
            list(result)
    return info.value


# ----------------------------------------------------------------- generation


def test_streaming(client: Client) -> None:
    chunks = list(client.generate("Hello there", max_new_tokens=12, temperature=0, ignore_eos=True,
                                  logprobs=True, top_logprobs=3))
    assert len(chunks) == 12
    assert all(c.HasField("token") for c in chunks)
    assert [c.finish_reason for c in chunks[:-1]] == [0] * 11
    last = chunks[-1]
    assert last.finish_reason == 2 and last.usage.completion_tokens == 12  # LENGTH
    assert last.usage.prompt_tokens == len(client.tokenize("Hello there").ids)
    done = client.complete("Hello there", max_new_tokens=12, temperature=0, ignore_eos=True)
    assert [t.id for t in done.tokens] == [c.token.id for c in chunks]
    assert done.text == "".join(c.text for c in chunks)
    for c in chunks:
        assert c.token.logprob <= 0 and len(c.token.top_logprobs) == 3
        assert c.token.top_logprobs[0].logprob >= c.token.logprob - 1e-6


def test_chat_and_stops(client: Client) -> None:
    base = client.complete(chat=[{"role": "user", "content": "hi"}], max_new_tokens=8, temperature=0,
                           ignore_eos=True)
    assert len(base.tokens) == 8
    stop_id = base.tokens[3].id
    first = next(i for i, t in enumerate(base.tokens) if t.id == stop_id)
    cut = client.complete(chat=[{"role": "user", "content": "hi"}], max_new_tokens=8, temperature=0,
                          ignore_eos=True, stop_token_ids=[stop_id])
    assert [t.id for t in cut.tokens] == [t.id for t in base.tokens[: first + 1]]
    assert cut.finish_reason == 1 and cut.stop_reason == str(stop_id)  # STOP


def test_sixteen_concurrent_streams_match_sequential(client: Client) -> None:
    prompts = [f"prompt {i} " + "x" * (i % 5) for i in range(16)]  # uneven lengths

    def run(p: str) -> list[int]:
        return [c.token.id for c in client.generate(p, max_new_tokens=10, temperature=0, ignore_eos=True)]

    sequential = [run(p) for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(run, prompts))
    assert concurrent == sequential
    assert all(len(ids) == 10 for ids in concurrent)


def test_seeded_sampling_is_reproducible(client: Client) -> None:
    kw: dict[str, Any] = dict(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    a, b = client.complete("Once", **kw), client.complete("Once", **kw)
    assert [t.id for t in a.tokens] == [t.id for t in b.tokens]


def test_cancel_frees_the_slot(server: ServerProcess, client: Client) -> None:
    before = metric(server.metrics(), "tprt_requests_total", method="Generate", outcome="cancelled")
    call = client.generate("cancel me", max_new_tokens=100, temperature=0, ignore_eos=True)
    for _, _ in zip(range(2), call):
        pass
    call.cancel()
    wait_for(lambda: metric(server.metrics(), "tprt_kv_cache_slots_used") == 0
             and metric(server.metrics(), "tprt_running_requests") == 0, 10, "the slot to be freed")
    wait_for(lambda: metric(server.metrics(), "tprt_requests_total", method="Generate", outcome="cancelled")
             == before + 1, 10, "the cancellation to be counted")
    # A deadline does the same: the client gets DEADLINE_EXCEEDED and the slot is freed.
    err = rpc_error(lambda: client.complete("slow", max_new_tokens=120, temperature=0, ignore_eos=True,
                                            timeout=0.3))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: metric(server.metrics(), "tprt_kv_cache_slots_used") == 0, 10, "the slot to be freed")
    assert len(client.complete("after", max_new_tokens=3, temperature=0, ignore_eos=True).tokens) == 3


def test_queue_full_is_resource_exhausted(server: ServerProcess, client: Client) -> None:
    # On a fast machine the blockers can finish before the extra call arrives, which legitimately
    # frees room; such a try shows nothing, so it is repeated (at most 3 times).
    for _ in range(3):
        finished_before = metric(server.metrics(), "tprt_requests_total", method="Generate", outcome="ok")
        calls = [client.generate(f"long {i}", max_new_tokens=CONTEXT - 16, temperature=0, ignore_eos=True)
                 for i in range(MAX_BATCH + MAX_QUEUE)]
        try:
            wait_for(lambda: metric(server.metrics(), "tprt_waiting_requests") == MAX_QUEUE, 20, "a full queue")
            try:
                # A deadline: a call that waited for room instead of being refused would hang here.
                client.complete("one too many", max_new_tokens=2, timeout=30)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                return
            finished = metric(server.metrics(), "tprt_requests_total", method="Generate", outcome="ok")
            assert finished > finished_before, "accepted while the queue was full and no blocker had finished"
        finally:
            for call in calls:
                call.cancel()
            wait_for(lambda: metric(server.metrics(), "tprt_running_requests") == 0
                     and metric(server.metrics(), "tprt_waiting_requests") == 0, 20, "the batch to empty")
    pytest.fail("in every try the blockers finished before the extra call arrived")


GEN_ERRORS: list[tuple[dict[str, Any], str, str]] = [
    ({}, "INVALID_ARGUMENT", "input"),
    ({"prompt": ""}, "INVALID_ARGUMENT", "prompt"),
    ({"prompt_ids": [5, 9999]}, "INVALID_ARGUMENT", "prompt_ids.ids"),
    ({"chat": []}, "INVALID_ARGUMENT", "chat.messages"),
    ({"chat": [{"role": "robot", "content": "x"}]}, "INVALID_ARGUMENT", "chat.messages[0].role"),
    ({"prompt": "x", "temperature": -1.0}, "INVALID_ARGUMENT", "sampling.temperature"),
    ({"prompt": "x", "temperature": float("nan")}, "INVALID_ARGUMENT", "sampling.temperature"),
    ({"prompt": "x", "top_k": -1}, "INVALID_ARGUMENT", "sampling.top_k"),
    ({"prompt": "x", "top_p": 0.0}, "INVALID_ARGUMENT", "sampling.top_p"),
    ({"prompt": "x", "min_p": 1.5}, "INVALID_ARGUMENT", "sampling.min_p"),
    ({"prompt": "x", "repetition_penalty": 0.0}, "INVALID_ARGUMENT", "sampling.repetition_penalty"),
    ({"prompt": "x", "max_new_tokens": 0}, "INVALID_ARGUMENT", "sampling.max_new_tokens"),
    ({"prompt": "x", "stop": [""]}, "INVALID_ARGUMENT", "sampling.stop"),
    ({"prompt": "x", "stop_token_ids": [100000]}, "INVALID_ARGUMENT", "sampling.stop_token_ids"),
    ({"prompt": "x", "top_logprobs": 2}, "INVALID_ARGUMENT", "sampling.top_logprobs"),
    ({"prompt": "x", "logprobs": True, "top_logprobs": 21}, "INVALID_ARGUMENT", "sampling.top_logprobs"),
    ({"prompt": "x", "adapter_id": "no-such-adapter"}, "NOT_FOUND", "adapter_id"),
    ({"prompt": "x", "max_new_tokens": CONTEXT}, "OUT_OF_RANGE", "sampling.max_new_tokens"),
    ({"prompt_ids": [5] * CONTEXT}, "OUT_OF_RANGE", "prompt"),
]


@pytest.mark.parametrize("kw,code,field", GEN_ERRORS, ids=[f"{c}-{f}" for _, c, f in GEN_ERRORS])
def test_generation_validation(client: Client, kw: dict[str, Any], code: str, field: str) -> None:
    prompt = kw.pop("prompt", None)
    for call in (client.complete, client.generate):
        err = rpc_error(lambda: call(prompt, **kw))
        assert (err.code().name, field_of(err)) == (code, field), err.details()
        assert err.details().startswith(field)


def test_job_validation(workdir: Path, client: Client) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({}, "INVALID_ARGUMENT", "dataset"),
        ({"dataset_path": "../../etc/passwd"}, "INVALID_ARGUMENT", "dataset_path"),
        ({"dataset_path": "missing.jsonl"}, "NOT_FOUND", "dataset_path"),
        ({"inline_jsonl": "{not json\n"}, "INVALID_ARGUMENT", "inline_jsonl"),
        ({"inline_jsonl": "  \n"}, "INVALID_ARGUMENT", "inline_jsonl"),
        ({"dataset_path": "train.jsonl", "learning_rate": 0.0}, "INVALID_ARGUMENT", "hyperparameters.learning_rate"),
        ({"dataset_path": "train.jsonl", "steps": 0}, "INVALID_ARGUMENT", "hyperparameters.steps"),
        ({"dataset_path": "train.jsonl", "max_seq_len": 4096}, "OUT_OF_RANGE", "hyperparameters.max_seq_len"),
        ({"dataset_path": "train.jsonl", "full": True, "lora_rank": 4}, "INVALID_ARGUMENT", "hyperparameters.lora_rank"),
        ({"dataset_path": "train.jsonl", "adapter_id": "bad id!"}, "INVALID_ARGUMENT", "adapter_id"),
    ]
    (workdir / "outside.jsonl").write_text('{"text": "x"}\n')
    cases.append(({"dataset_path": str(workdir / "outside.jsonl")}, "INVALID_ARGUMENT", "dataset_path"))
    for kw, code, field in cases:
        err = rpc_error(lambda: client.create_job(**kw))
        assert (err.code().name, field_of(err)) == (code, field), (kw, err.details())
    from serve.pb import finetuning_pb2 as ft_pb

    bad_method = ft_pb.CreateJobRequest(dataset_path="train.jsonl", method=7)
    err = rpc_error(lambda: client.finetuning.CreateJob(bad_method, metadata=client.metadata, timeout=30))
    assert (err.code().name, field_of(err)) == ("INVALID_ARGUMENT", "method")
    err = rpc_error(lambda: client.finetuning.ListJobs(ft_pb.ListJobsRequest(limit=-1), metadata=client.metadata))
    assert (err.code().name, field_of(err)) == ("INVALID_ARGUMENT", "limit")
    for call in (client.get_job, client.cancel_job, client.watch_job):
        err = rpc_error(lambda: call("job-unknown"))
        assert (err.code().name, field_of(err)) == ("NOT_FOUND", "job_id")
    assert client.list_jobs() == []  # nothing was created by the refused requests


def test_auth(server: ServerProcess) -> None:
    for token in (None, "wrong"):
        with server.client(token=token) as c:
            for call in (c.model_info, lambda: c.complete("x", max_new_tokens=1), c.list_jobs,
                         lambda: list(c.generate("x", max_new_tokens=1))):
                assert rpc_error(call).code() == grpc.StatusCode.UNAUTHENTICATED
            assert c.health_check() == "SERVING"  # exempt


def test_message_size_is_bounded(client: Client) -> None:
    err = rpc_error(lambda: client.complete("x" * (2 * MAX_MESSAGE), max_new_tokens=1))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_cli(server: ServerProcess, workdir: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tprt.cli", "client", "--server", server.target,
                               "--token-file", str(workdir / "token"), *args],
                              capture_output=True, text=True, timeout=60)

    out = cli("complete", "Hello there", "--max-new-tokens", "4", "--temperature", "0", "--ignore-eos", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["usage"]["completion_tokens"] == 4
    bad = cli("generate", "x", "--top-p", "5")
    assert bad.returncode == 1 and "INVALID_ARGUMENT [sampling.top_p]" in bad.stderr


def test_model_info_and_reflection(client: Client) -> None:
    info = client.model_info()
    assert (info.tp_size, info.context_length, info.max_batch_size) == (2, CONTEXT, MAX_BATCH)
    assert info.config.vocab_size == 259 and info.config.num_hidden_layers == 2
    assert info.has_chat_template and list(info.eos_token_ids) == [2]
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    req = reflection_pb2.ServerReflectionRequest(list_services="")
    (resp,) = list(stub.ServerReflectionInfo(iter([req]), metadata=client.metadata, timeout=10))
    names = {s.name for s in resp.list_services_response.service}
    assert {"tprt.v1.Generation", "tprt.v1.FineTuning", "grpc.health.v1.Health"} <= names


def test_metrics_count(server: ServerProcess, client: Client) -> None:
    before = server.metrics()
    done = client.complete("count me", max_new_tokens=5, temperature=0, ignore_eos=True)
    # The same prompt again reuses its keys and values from the slot the first one freed
    # (tprt.engine.prefix_cache, on both ranks): all but the last prompt token, and the same answer.
    again = client.complete("count me", max_new_tokens=5, temperature=0, ignore_eos=True)
    after = server.metrics()
    delta = lambda name, **lab: metric(after, name, **lab) - metric(before, name, **lab)  # noqa: E731
    assert again.usage.cached_prompt_tokens == again.usage.prompt_tokens - 1 and again.text == done.text
    assert delta("tprt_prompt_cached_tokens_total") == (done.usage.cached_prompt_tokens
                                                        + again.usage.cached_prompt_tokens)
    assert delta("tprt_requests_total", method="Complete", outcome="ok") == 2
    assert delta("tprt_generated_tokens_total") == 10
    assert delta("tprt_prompt_tokens_total") == 2 * done.usage.prompt_tokens
    assert delta("tprt_time_to_first_token_seconds_count") == 2
    assert delta("tprt_inter_token_latency_seconds_count") == 8
    assert delta("tprt_request_duration_seconds_count") == 2
    assert delta("tprt_queue_time_seconds_count") == 2
    assert delta("tprt_engine_steps_total") >= 10
    for name in ("tprt_running_requests", "tprt_waiting_requests", "tprt_kv_cache_usage_ratio",
                 "tprt_batch_size_count", "tprt_finetune_tokens_total", "tprt_finetune_loss"):
        assert re.search(rf"^{name}(\{{.*\}})? ", after, re.M), name
    assert 'tprt_finetune_jobs{state="running"}' in after
    dashboard = (Path(__file__).resolve().parents[1] / "docs" / "grafana-dashboard.json").read_text()
    plotted = set(re.findall(r"tprt_[a-z_]+", dashboard))
    assert plotted and all(re.search(rf"^{name}[{{ ]", after, re.M) for name in plotted), \
        f"the dashboard plots metrics the server does not export: {sorted(plotted)}"
    assert metric(after, "tprt_serving") == 1
    assert metric(after, "tprt_requests_total", method="Generate", outcome="internal") == 0
    assert metric(after, "tprt_requests_total", method="Complete", outcome="internal") == 0


# ----------------------------------------------------------------- fine-tuning


def test_torchrun_world_serves_the_same_tokens(workdir: Path, client: Client) -> None:
    """`torchrun ... -m tprt.cli serve`: the ranks join torchrun's world instead of being started
    by tprt; greedy answers equal the local launcher's, and torchrun's SIGTERM drains rank 0."""
    data = workdir / "data-torchrun"  # another server's --data-dir is locked by it
    data.mkdir(exist_ok=True)
    args = server_args(workdir)
    args[args.index("--data-dir") + 1] = str(data)
    launcher = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "tprt.cli")
    srv = ServerProcess(args, workdir / "server-torchrun.log", launcher=launcher)
    try:
        with srv.client() as c:
            assert c.model_info().tp_size == 2
            for prompt in ("Hello there", "Count: one, two,", "Q7: say hi"):
                kw: dict[str, Any] = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
                want = [t.id for t in client.complete(prompt, **kw).tokens]
                assert [t.id for t in c.complete(prompt, **kw).tokens] == want, prompt
        srv.stop(timeout=60)  # torchrun forwards SIGTERM to both ranks (its own exit code is its business)
        assert "stopped (drained)" in srv.tail(), srv.tail()
    finally:
        srv.kill()


def _first_logprobs(client: Client, ids: list[int], adapter_id: str = "") -> list[float]:
    out = client.complete(prompt_ids=ids, adapter_id=adapter_id, max_new_tokens=3, temperature=0,
                          ignore_eos=True, logprobs=True, top_logprobs=5)
    return [t.logprob for t in out.tokens[0].top_logprobs]


def _reference_top_logprobs(workdir: Path, ids: list[int], adapter: Path | None) -> list[float]:
    """The same numbers from an independent single-process run (TP 1 from the HF weights)."""
    import torch

    from convert.api import hf_to_tp
    from tprt.distributed.context import TPContext
    from tprt.checkpoint.loading import load_model

    tp1 = workdir / "model" / "tp1"
    if not tp1.exists():
        hf_to_tp(workdir / "model" / "hf", tp1, 1)
    ctx = TPContext.single()
    model = load_model(tp1, ctx)
    if adapter is not None:
        from tprt.lora.attach import attach
        from tprt.lora.peft_io import read_adapter

        attach(model, read_adapter(model, adapter, ctx))
    with torch.no_grad():
        logits = model.gather_logits(model(torch.tensor([ids])))[0, -1]  # [vocab]
    return torch.log_softmax(logits.double(), -1).topk(5).values.tolist()


def test_finetune_job_then_its_adapter_serves(workdir: Path, server: ServerProcess, client: Client) -> None:
    ids = client.tokenize("Q1: say hi").ids
    base = _first_logprobs(client, list(ids))
    job = client.create_job(dataset_path="train.jsonl", steps=4, batch_size=2, max_seq_len=32, lora_rank=4,
                            lora_alpha=8.0, learning_rate=0.05, checkpoint_every=2, adapter_id="tiny-lora")
    assert job.state == 1 and job.adapter_id == "tiny-lora" and job.hyperparameters.steps == 4  # QUEUED
    progress = list(client.watch_job(job.id, timeout=120))
    last = progress[-1]
    assert last.state == 3, f"job ended {last.state}: {last.error}"  # SUCCEEDED
    steps = [p.step for p in progress]
    assert steps == sorted(steps) and steps[-1] == 4 and last.loss > 0
    done = client.get_job(job.id)
    assert done.output_path == f"jobs/{job.id}/adapter" and done.finished_unix_ms >= done.started_unix_ms > 0
    adapters = {a.id: a for a in client.model_info().adapters}
    assert adapters["tiny-lora"].rank == 4 and adapters["tiny-lora"].source_job_id == job.id
    tuned = _first_logprobs(client, list(ids), "tiny-lora")
    ref_base = _reference_top_logprobs(workdir, list(ids), None)
    ref_tuned = _reference_top_logprobs(workdir, list(ids), workdir / "data" / done.output_path)
    assert max(abs(a - b) for a, b in zip(base, ref_base)) < 1e-4
    assert max(abs(a - b) for a, b in zip(tuned, ref_tuned)) < 1e-4
    assert max(abs(a - b) for a, b in zip(tuned, base)) > 1e-3  # the adapter changed the model
    # Base-model and adapter requests share batches (rows routed per request): concurrent calls
    # get what each got alone.
    with ThreadPoolExecutor(8) as pool:
        mixed = list(pool.map(lambda i: _first_logprobs(client, list(ids), "tiny-lora" if i % 2 else ""), range(8)))
    for i, got in enumerate(mixed):
        assert max(abs(a - b) for a, b in zip(got, tuned if i % 2 else base)) < 1e-4, f"call {i}"
    assert _first_logprobs(client, list(ids)) == base  # and the base model is back without it
    err = rpc_error(lambda: client.create_job(dataset_path="train.jsonl", adapter_id="tiny-lora"))
    assert (err.code(), field_of(err)) == (grpc.StatusCode.ALREADY_EXISTS, "adapter_id")
    m = server.metrics()
    assert metric(m, "tprt_finetune_steps_total") >= 4 and metric(m, "tprt_finetune_tokens_total") > 0
    assert metric(m, "tprt_finetune_jobs", state="succeeded") == 1
    STATE["adapter"] = "tiny-lora"


def test_full_finetune_job_writes_a_checkpoint(workdir: Path, client: Client) -> None:
    adapters = list(client.model_info().adapters)
    job = client.create_job(dataset_path="train.jsonl", full=True, steps=2, batch_size=1, max_seq_len=16,
                            learning_rate=1e-3)
    assert job.adapter_id == "" and not job.hyperparameters.HasField("lora_rank")
    last = list(client.watch_job(job.id, timeout=120))[-1]
    assert last.state == 3, last.error  # SUCCEEDED
    out = client.get_job(job.id).output_path
    assert out == f"jobs/{job.id}/model" and (workdir / "data" / out / "tprt_manifest.json").is_file()
    assert list(client.model_info().adapters) == adapters  # a full fine-tune serves nothing new


def test_cancel_queued_and_running_jobs(client: Client) -> None:
    job = client.create_job(inline_jsonl='{"text": "hello hello hello"}\n', steps=100000, batch_size=1,
                            max_seq_len=16, lora_rank=2)
    wait_for(lambda: client.get_job(job.id).step >= 1, 60, "the job to run")
    assert client.cancel_job(job.id).state in (2, 5)
    wait_for(lambda: client.get_job(job.id).state == 5, 30, "the job to be cancelled")  # CANCELLED
    assert [j.id for j in client.list_jobs(state="cancelled")] == [job.id]


# ----------------------------------------------------------------- lifecycle (keep these last)


def test_sigterm_drains_checkpoints_and_exits_0(workdir: Path, server: ServerProcess) -> None:
    c = server.client()
    job = c.create_job(dataset_path="train.jsonl", steps=100000, batch_size=2, max_seq_len=32, lora_rank=4,
                       checkpoint_every=100000, adapter_id="long-run")
    wait_for(lambda: c.get_job(job.id).step >= 2, 60, "the job to take steps")
    stream = c.generate("drain me", max_new_tokens=60, temperature=0, ignore_eos=True)
    first = next(stream)
    server.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: c.health_check() == "NOT_SERVING", 10, "health NOT_SERVING")
    err = rpc_error(lambda: c.complete("too late", max_new_tokens=1))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    rest = list(stream)  # the in-flight stream finishes
    assert 1 + len(rest) == 60 and rest[-1].finish_reason == 2
    assert first.token.id >= 0
    c.close()
    assert server.stop(timeout=60) == 0, server.tail()
    store = JobStore(workdir / "data")
    rec = store.get(job.id)
    store.close()
    assert rec is not None and rec.state == "queued" and rec.checkpoint == f"jobs/{job.id}", rec
    assert rec.step >= 2 and (workdir / "data" / rec.checkpoint / "checkpoints").is_dir()
    STATE["checkpointed"] = (job.id, rec.step)


def _self_signed_cert(workdir: Path) -> tuple[Path, Path] | None:
    import shutil

    if shutil.which("openssl") is None:
        return None
    cert, key = workdir / "cert.pem", workdir / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_restart_recovers_jobs_then_rank_death(workdir: Path) -> None:
    store = JobStore(workdir / "data")
    store.create(JobRecord(id="job-crashed", method="lora", dataset="train.jsonl", adapter_id="crashed",
                           hyperparameters={"steps": 10}, state=RUNNING, step=3, total_steps=10))
    store.close()
    tls = _self_signed_cert(workdir)  # this server speaks TLS (when openssl is available)
    extra = ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])] if tls else []
    srv = ServerProcess(server_args(workdir) + extra, workdir / "server-b.log", tls[0] if tls else None)
    try:
        c = srv.client()
        second = subprocess.run([sys.executable, "-m", "tprt.cli", "serve", *server_args(workdir)],
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "in use by another tprt serve" in second.stderr, second.stderr
        crashed = c.get_job("job-crashed")
        assert crashed.state == 4 and "no checkpoint" in crashed.error  # FAILED, with the reason
        if "adapter" in STATE:
            assert STATE["adapter"] in {a.id for a in c.model_info().adapters}  # reloaded at start-up
        if "checkpointed" in STATE:
            job_id, step = STATE["checkpointed"]
            wait_for(lambda: f"job {job_id}: started at step {step} of" in srv.tail(), 60, "the job to resume")
            wait_for(lambda: c.get_job(job_id).step > step, 60, "the resumed job to step")
            c.cancel_job(job_id)
            wait_for(lambda: c.get_job(job_id).state == 5, 30, "the resumed job to cancel")
        os.kill(srv.pids[1], signal.SIGKILL)  # a follower rank dies
        wait_for(lambda: c.health_check() == "NOT_SERVING", 15, "health NOT_SERVING")
        # UNAVAILABLE, not DEADLINE_EXCEEDED: the request fails instead of hanging on the dead rank.
        err = rpc_error(lambda: c.complete("anyone?", max_new_tokens=2, timeout=30))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        c.close()
        assert srv.stop(timeout=60) == 1  # a broken world exits non-zero
    finally:
        srv.kill()


def test_serve_demo_walkthrough(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`tprt demo`'s serving part (serve/demo.py) on the tiny model: its own server starts, a chat
    answer streams, a LoRA job over the API succeeds and its adapter answers, metrics are shown,
    SIGTERM drains with status 0."""
    from serve.demo import METRICS_SHOWN, run_serve_demo

    lines: list[str] = []
    chats = "".join(json.dumps({"messages": [{"role": "user", "content": f"Who are you {i}?"},
                                             {"role": "assistant", "content": "Tippy."}]}) + "\n" for i in range(6))
    run_serve_demo(workdir / "model" / "tp2", workdir / "demo", chats, steps=2, max_new_tokens=4, say=lines.append)
    text = "\n".join(lines)
    assert "listening on 127.0.0.1:" in text and "(TP 2," in text, text
    assert "succeeded, step 2/2" in text, text
    assert text.count("client.generate(") == 2 and "adapter_id='tippy'" in text, text
    assert 'tprt_finetune_jobs{state="succeeded"} 1.0' in text, text
    shown = [line for line in lines if line.strip().startswith(METRICS_SHOWN)]
    assert any(line.strip().startswith("tprt_generated_tokens_total") and not line.endswith(" 0.0") for line in shown)
    assert lines[-1].endswith("exited with status 0"), lines[-1]
    answers = [line for line in capsys.readouterr().out.splitlines() if line.startswith("    assistant: ")]
    assert len(answers) == 2 and all(len(a) > len("    assistant: ") for a in answers), answers
