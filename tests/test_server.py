"""`tprt serve` end to end: a real server on loopback with 2 gloo ranks and a tiny model, called
through the generated client (serve/client/__init__.py).

One server (module fixture, started as `python -m tprt.cli serve`, bearer-token auth on) takes
every functional check: streaming, 16 concurrent streams vs 16 sequential greedy calls,
cancellation and deadlines freeing the KV slot, every validation status code, auth, a full queue,
metrics, reflection, and fine-tuning jobs (a LoRA job's adapter is then served). The lifecycle
has servers of its own on another --data-dir: one is stopped with SIGTERM (drain, job checkpoint,
exit 0; the `drained` fixture records what it showed), a second starts on the same --data-dir
(job recovery after restart) and loses one of its ranks (NOT_SERVING, UNAVAILABLE, no hang).
torchrun's world and `tprt demo`'s serving part start their own servers too.

Every test passes alone and in any order. Nothing waits for a guessed duration: a request that
must still be running when something happens is one of LONG tokens (seconds of work even on a
fast machine), the test acts once its first token has streamed, and the request is cancelled
afterwards. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from serve.client import Client, field_of  # noqa: E402
from serve.jobs.store import RUNNING, JobRecord, JobStore  # noqa: E402
from serve.grpc.pb import finetuning_pb2 as ft_pb  # noqa: E402
from serve.grpc.pb import generation_pb2 as gen_pb  # noqa: E402
from servers import (CONTEXT, MAX_BATCH, MAX_MESSAGE, MAX_QUEUE, ServerProcess, data_dir, metric,  # noqa: E402
                     prepare_root, rpc_error, self_signed_cert, server_args, wait_for, wait_idle, write_model_adapter)

LONG = CONTEXT - 16  # max_new_tokens of a request that must outlast what a test does meanwhile
DEADLINE_S = 2.0  # shorter than LONG tokens take, longer than a first token does
DRAIN_TOKENS = 400  # the in-flight stream at SIGTERM: running when the drain starts, done within it


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_root(tmp_path_factory.mktemp("serve"))


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


# ----------------------------------------------------------------- generation


def test_streaming(client: Client) -> None:
    chunks = list(client.generate("Hello there", max_new_tokens=12, temperature=0, ignore_eos=True,
                                  logprobs=True, top_logprobs=3))
    assert len(chunks) == 12
    assert all(c.HasField("token") for c in chunks)
    assert [c.finish_reason for c in chunks[:-1]] == [gen_pb.FINISH_REASON_UNSPECIFIED] * 11
    last = chunks[-1]
    assert last.finish_reason == gen_pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 12
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
    assert cut.finish_reason == gen_pb.FINISH_REASON_STOP and cut.stop_reason == str(stop_id)


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
    wait_idle(server)
    before = metric(server.metrics(), "tprt_requests_total", method="Generate", outcome="cancelled")
    call = client.generate("cancel me", max_new_tokens=LONG, temperature=0, ignore_eos=True)
    for _, _ in zip(range(2), call):  # running: two tokens streamed
        pass
    assert metric(server.metrics(), "tprt_running_requests") == 1
    call.cancel()
    wait_idle(server)
    wait_for(lambda: metric(server.metrics(), "tprt_requests_total", method="Generate", outcome="cancelled")
             == before + 1, 10, "the cancellation to be counted")
    assert len(client.complete("after", max_new_tokens=3, temperature=0, ignore_eos=True).tokens) == 3


def test_deadline_ends_a_running_request_and_frees_its_slot(server: ServerProcess, client: Client) -> None:
    wait_idle(server)
    call = client.generate("slow", max_new_tokens=LONG, temperature=0, ignore_eos=True, timeout=DEADLINE_S)
    got = [next(call)]  # running: its first token streamed
    assert metric(server.metrics(), "tprt_running_requests") == 1
    with pytest.raises(grpc.RpcError) as info:
        got.extend(call)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(got) < LONG, "the request finished before its deadline"
    wait_idle(server)
    assert len(client.complete("after", max_new_tokens=3, temperature=0, ignore_eos=True).tokens) == 3


def test_full_queue_is_resource_exhausted(server: ServerProcess, client: Client) -> None:
    """Every slot runs a LONG request and MAX_QUEUE wait: the next is refused at once. A waiting
    request whose deadline passes leaves the queue (DEADLINE_EXCEEDED), freeing its place."""
    wait_idle(server)
    calls = [client.generate(f"long {i}", max_new_tokens=LONG, temperature=0, ignore_eos=True)
             for i in range(MAX_BATCH)]
    try:
        for call in calls:
            next(call)  # each holds a slot: its first token streamed
        calls += [client.generate(f"queued {i}", max_new_tokens=2) for i in range(MAX_QUEUE)]
        wait_for(lambda: metric(server.metrics(), "tprt_waiting_requests") == MAX_QUEUE, 20, "a full queue")
        err = rpc_error(lambda: client.complete("one too many", max_new_tokens=2, timeout=30))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in err.details(), err.details()
        calls.pop().cancel()  # a waiting request the client cancels leaves the queue ...
        wait_for(lambda: metric(server.metrics(), "tprt_waiting_requests") == MAX_QUEUE - 1, 20, "a free place")
        before = metric(server.metrics(), "tprt_requests_total", method="Complete", outcome="deadline_exceeded")
        err = rpc_error(lambda: client.complete("late", max_new_tokens=2, timeout=0.5))  # ... and one that times out
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: metric(server.metrics(), "tprt_requests_total", method="Complete",
                                outcome="deadline_exceeded") == before + 1, 10, "the server to end it")
        # The RPC ends on the caller's deadline; the scheduler drops the ticket at its next iteration.
        wait_for(lambda: metric(server.metrics(), "tprt_waiting_requests") == MAX_QUEUE - 1, 10,
                 "the expired request to leave the queue")
        assert metric(server.metrics(), "tprt_running_requests") == MAX_BATCH  # the blockers never finished
    finally:
        for call in calls:
            call.cancel()
    wait_idle(server)


GEN_ERRORS: list[tuple[dict[str, Any], Any, str]] = [
    ({}, grpc.StatusCode.INVALID_ARGUMENT, "input"),
    ({"prompt": ""}, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ({"prompt_ids": [5, 9999]}, grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids.ids"),
    ({"chat": []}, grpc.StatusCode.INVALID_ARGUMENT, "chat.messages"),
    ({"chat": [{"role": "robot", "content": "x"}]}, grpc.StatusCode.INVALID_ARGUMENT, "chat.messages[0].role"),
    ({"prompt": "x", "temperature": -1.0}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
    ({"prompt": "x", "temperature": float("nan")}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
    ({"prompt": "x", "top_k": -1}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_k"),
    ({"prompt": "x", "top_p": 0.0}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
    ({"prompt": "x", "min_p": 1.5}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.min_p"),
    ({"prompt": "x", "repetition_penalty": 0.0}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.repetition_penalty"),
    ({"prompt": "x", "max_new_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_new_tokens"),
    ({"prompt": "x", "stop": [""]}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop"),
    ({"prompt": "x", "stop_token_ids": [100000]}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop_token_ids"),
    ({"prompt": "x", "top_logprobs": 2}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_logprobs"),
    ({"prompt": "x", "logprobs": True, "top_logprobs": 21}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_logprobs"),
    ({"prompt": "x", "adapter_id": "no-such-adapter"}, grpc.StatusCode.NOT_FOUND, "adapter_id"),
    ({"prompt": "x", "max_new_tokens": CONTEXT}, grpc.StatusCode.OUT_OF_RANGE, "sampling.max_new_tokens"),
    ({"prompt_ids": [5] * CONTEXT}, grpc.StatusCode.OUT_OF_RANGE, "prompt"),
]


@pytest.mark.parametrize("kw,code,field", GEN_ERRORS, ids=[f"{c.name}-{f}" for _, c, f in GEN_ERRORS])
def test_generation_validation(client: Client, kw: dict[str, Any], code: Any, field: str) -> None:
    prompt = kw.pop("prompt", None)
    for call in (client.complete, client.generate):
        err = rpc_error(lambda: call(prompt, **kw))
        assert (err.code(), field_of(err)) == (code, field), err.details()
        assert err.details().startswith(field)


def test_job_validation(workdir: Path, client: Client) -> None:
    jobs_before = [j.id for j in client.list_jobs()]
    train = {"dataset_path": "train.jsonl"}
    cases: list[tuple[dict[str, Any], Any, str]] = [
        ({}, grpc.StatusCode.INVALID_ARGUMENT, "dataset"),
        ({"dataset_path": "../../etc/passwd"}, grpc.StatusCode.INVALID_ARGUMENT, "dataset_path"),
        ({"dataset_path": "missing.jsonl"}, grpc.StatusCode.NOT_FOUND, "dataset_path"),
        ({"inline_jsonl": "{not json\n"}, grpc.StatusCode.INVALID_ARGUMENT, "inline_jsonl"),
        ({"inline_jsonl": "  \n"}, grpc.StatusCode.INVALID_ARGUMENT, "inline_jsonl"),
        ({**train, "learning_rate": 0.0}, grpc.StatusCode.INVALID_ARGUMENT, "hyperparameters.learning_rate"),
        ({**train, "steps": 0}, grpc.StatusCode.INVALID_ARGUMENT, "hyperparameters.steps"),
        ({**train, "max_seq_len": CONTEXT + 1}, grpc.StatusCode.OUT_OF_RANGE, "hyperparameters.max_seq_len"),
        ({**train, "full": True, "lora_rank": 4}, grpc.StatusCode.INVALID_ARGUMENT, "hyperparameters.lora_rank"),
        ({**train, "adapter_id": "bad id!"}, grpc.StatusCode.INVALID_ARGUMENT, "adapter_id"),
    ]
    (workdir / "outside.jsonl").write_text('{"text": "x"}\n')
    cases.append(({"dataset_path": str(workdir / "outside.jsonl")}, grpc.StatusCode.INVALID_ARGUMENT, "dataset_path"))
    for kw, code, field in cases:
        err = rpc_error(lambda: client.create_job(**kw))
        assert (err.code(), field_of(err)) == (code, field), (kw, err.details())
    bad_method = ft_pb.CreateJobRequest(dataset_path="train.jsonl", method=7)
    err = rpc_error(lambda: client.finetuning.CreateJob(bad_method, metadata=client.metadata, timeout=30))
    assert (err.code(), field_of(err)) == (grpc.StatusCode.INVALID_ARGUMENT, "method")
    err = rpc_error(lambda: client.finetuning.ListJobs(ft_pb.ListJobsRequest(limit=-1), metadata=client.metadata))
    assert (err.code(), field_of(err)) == (grpc.StatusCode.INVALID_ARGUMENT, "limit")
    for call in (client.get_job, client.cancel_job, client.watch_job):
        err = rpc_error(lambda: call("job-unknown"))
        assert (err.code(), field_of(err)) == (grpc.StatusCode.NOT_FOUND, "job_id")
    assert [j.id for j in client.list_jobs()] == jobs_before  # the refused requests created nothing


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
    assert (info.kv_cache_dtype, info.kv_cache_tokens) == ("fp32", MAX_BATCH * CONTEXT)  # the default pool, on CPU
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    req = reflection_pb2.ServerReflectionRequest(list_services="")
    (resp,) = list(stub.ServerReflectionInfo(iter([req]), metadata=client.metadata, timeout=10))
    names = {s.name for s in resp.list_services_response.service}
    assert {"tprt.v1.Generation", "tprt.v1.FineTuning", "grpc.health.v1.Health"} <= names


def test_metrics_count(server: ServerProcess, client: Client) -> None:
    before = server.metrics()
    prompt = "count me, " * 5
    done = client.complete(prompt, max_new_tokens=5, temperature=0, ignore_eos=True)
    # The same prompt again shares the KV blocks the first one left cached (tprt.engine.prefix_cache,
    # on both ranks): the whole blocks of all but the last prompt token, and the same answer.
    again = client.complete(prompt, max_new_tokens=5, temperature=0, ignore_eos=True)
    after = server.metrics()
    delta = lambda name, **lab: metric(after, name, **lab) - metric(before, name, **lab)  # noqa: E731
    shared = (again.usage.prompt_tokens - 1) // 16 * 16
    assert again.usage.cached_prompt_tokens == shared > 0 and again.text == done.text
    assert delta("tprt_prefix_cache_hit_tokens_total") == shared
    assert delta("tprt_prefix_cache_queried_tokens_total") == 2 * done.usage.prompt_tokens
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
                 "tprt_kv_cache_blocks", "tprt_preemptions_total",
                 "tprt_batch_size_count", "tprt_finetune_tokens_total", "tprt_finetune_loss"):
        assert re.search(rf"^{name}(\{{.*\}})? ", after, re.M), name
    assert 'tprt_finetune_jobs{state="running"}' in after
    assert metric(after, "tprt_model_info", kv_cache_dtype="fp32", kv_cache_tokens=str(MAX_BATCH * CONTEXT)) == 1
    dashboard = (Path(__file__).resolve().parents[1] / "docs" / "grafana-dashboard.json").read_text()
    plotted = set(re.findall(r"tprt_[a-z_]+", dashboard))
    assert plotted and all(re.search(rf"^{name}[{{ ]", after, re.M) for name in plotted), \
        f"the dashboard plots metrics the server does not export: {sorted(plotted)}"
    assert metric(after, "tprt_serving") == 1
    assert metric(after, "tprt_requests_total", method="Generate", outcome="internal") == 0
    assert metric(after, "tprt_requests_total", method="Complete", outcome="internal") == 0


def test_small_kv_budget_serves_48_streams_sharing_a_system_prompt(workdir: Path, client: Client) -> None:
    """A KV cache of 8192 positions, far below 48 sequences x 4096: 48 concurrent streams with a
    600-token system prompt all finish, with the module server's greedy tokens, and the metrics
    show the prompt's blocks shared (hits) and every block returned at the end."""
    system = ("You are a terse assistant; answer in one word. " * 13)[:600]
    prompts = [f"{system}Q{i}: colour?" for i in range(48)]
    srv = ServerProcess([*server_args(workdir, data_dir(workdir, "data-kv")), "--max-batch-size", "48",
                         "--max-queue", "8", "--kv-cache-tokens", "8192"], workdir / "server-kv.log")
    try:
        with srv.client() as small:
            def run(p: str) -> list[int]:
                return [c.token.id for c in small.generate(p, max_new_tokens=8, temperature=0, ignore_eos=True)]

            with ThreadPoolExecutor(48) as pool:
                outputs = list(pool.map(run, prompts))
            assert all(len(ids) == 8 for ids in outputs)
            for i in (0, 17, 47):  # the same tokens as a server with ample KV memory
                assert outputs[i] == [c.token.id for c in client.generate(prompts[i], max_new_tokens=8, temperature=0,
                                                                           ignore_eos=True)], i
            m = srv.metrics()
            prefix = (len(small.tokenize(system).ids) - 1) // 16 * 16  # its whole blocks (BOS included)
            assert metric(m, "tprt_prefix_cache_hit_tokens_total") >= (48 - 8) * prefix > 0
            wait_for(lambda: metric(srv.metrics(), "tprt_kv_cache_blocks", state="used") == 0, 20, "blocks returned")
            assert metric(srv.metrics(), "tprt_kv_cache_blocks", state="cached") > 0
    finally:
        srv.kill()


# ----------------------------------------------------------------- torchrun


def test_torchrun_world_serves_the_same_tokens(workdir: Path, client: Client) -> None:
    """`torchrun ... -m tprt.cli serve`: the ranks join torchrun's world instead of being started
    by tprt; greedy answers equal the local launcher's, and torchrun's SIGTERM drains rank 0."""
    launcher = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "tprt.cli")
    srv = ServerProcess(server_args(workdir, data_dir(workdir, "data-torchrun")), workdir / "server-torchrun.log",
                        launcher=launcher)
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


# ----------------------------------------------------------------- fine-tuning


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
    succeeded_before = metric(server.metrics(), "tprt_finetune_jobs", state="succeeded")
    ids = client.tokenize("Q1: say hi").ids
    base = _first_logprobs(client, list(ids))
    job = client.create_job(dataset_path="train.jsonl", steps=4, batch_size=2, max_seq_len=32, lora_rank=4,
                            lora_alpha=8.0, learning_rate=0.05, checkpoint_every=2, adapter_id="tiny-lora")
    assert job.state == ft_pb.JOB_STATE_QUEUED and job.adapter_id == "tiny-lora" and job.hyperparameters.steps == 4
    progress = list(client.watch_job(job.id, timeout=120))
    last = progress[-1]
    assert last.state == ft_pb.JOB_STATE_SUCCEEDED, f"job ended {last.state}: {last.error}"
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
    assert metric(m, "tprt_finetune_jobs", state="succeeded") == succeeded_before + 1


def test_dpo_job_then_its_adapter_serves(server: ServerProcess, client: Client) -> None:
    """OBJECTIVE_DPO over gRPC: preference pairs inline, rewards in Prometheus, the adapter served
    at once; a starting adapter that does not exist is NOT_FOUND; rpo_alpha (RPO) is echoed back,
    refused out of [0, 100] and on a supervised job."""
    pairs = "".join(json.dumps({"input": {"messages": [{"role": "user", "content": f"Q{i}: say hi"}]},
                                "preferred_output": [{"role": "assistant", "content": "hi there"}],
                                "non_preferred_output": [{"role": "assistant", "content": "go away"}]}) + "\n"
                    for i in range(4))
    common: dict[str, Any] = {"inline_jsonl": pairs, "objective": "dpo", "steps": 3, "batch_size": 2,
                              "max_seq_len": 32, "lora_rank": 4, "learning_rate": 0.05, "beta": 0.5, "rpo_alpha": 1.0}
    err = rpc_error(lambda: client.create_job(**common, init_adapter="no-such-adapter"))
    assert (err.code(), field_of(err)) == (grpc.StatusCode.NOT_FOUND, "init_adapter")
    err = rpc_error(lambda: client.create_job(**{**common, "objective": "supervised"}))
    assert (err.code(), field_of(err)) == (grpc.StatusCode.INVALID_ARGUMENT, "hyperparameters.beta")
    err = rpc_error(lambda: client.create_job(dataset_path="train.jsonl", steps=1, rpo_alpha=1.0))
    assert (err.code(), field_of(err)) == (grpc.StatusCode.INVALID_ARGUMENT, "hyperparameters.rpo_alpha")
    err = rpc_error(lambda: client.create_job(**{**common, "rpo_alpha": 101.0}))
    assert (err.code(), field_of(err)) == (grpc.StatusCode.INVALID_ARGUMENT, "hyperparameters.rpo_alpha")
    assert "[0.0, 100.0]" in (err.details() or "")
    job = client.create_job(**common, adapter_id="tiny-dpo")
    assert job.objective == ft_pb.OBJECTIVE_DPO and job.hyperparameters.beta == 0.5
    assert job.hyperparameters.dpo_loss == "sigmoid" and job.hyperparameters.rpo_alpha == 1.0
    assert client.get_job(job.id).hyperparameters.rpo_alpha == 1.0
    last = list(client.watch_job(job.id, timeout=120))[-1]
    assert last.state == ft_pb.JOB_STATE_SUCCEEDED, last.error
    assert "tiny-dpo" in {a.id for a in client.model_info().adapters}
    ids = list(client.tokenize("Q1: say hi").ids)
    assert _first_logprobs(client, ids, "tiny-dpo") != _first_logprobs(client, ids)
    m = server.metrics()
    assert 0.0 <= metric(m, "tprt_finetune_preference", metric="reward_accuracy") <= 1.0


def test_full_finetune_job_writes_a_checkpoint(workdir: Path, client: Client) -> None:
    adapters = list(client.model_info().adapters)
    job = client.create_job(dataset_path="train.jsonl", full=True, steps=2, batch_size=1, max_seq_len=16,
                            learning_rate=1e-3)
    assert job.adapter_id == "" and not job.hyperparameters.HasField("lora_rank")
    last = list(client.watch_job(job.id, timeout=120))[-1]
    assert last.state == ft_pb.JOB_STATE_SUCCEEDED, last.error
    out = client.get_job(job.id).output_path
    assert out == f"jobs/{job.id}/model" and (workdir / "data" / out / "tprt_manifest.json").is_file()
    assert list(client.model_info().adapters) == adapters  # a full fine-tune serves nothing new


def test_cancel_queued_and_running_jobs(client: Client) -> None:
    endless = {"inline_jsonl": '{"text": "hello hello hello"}\n', "steps": 100000, "batch_size": 1,
               "max_seq_len": 16, "lora_rank": 2}
    running = client.create_job(**endless)
    wait_for(lambda: client.get_job(running.id).step >= 1, 60, "the job to run")
    queued = client.create_job(**endless)  # one job runs at a time: this one waits
    assert client.get_job(queued.id).state == ft_pb.JOB_STATE_QUEUED
    assert client.cancel_job(queued.id).state == ft_pb.JOB_STATE_CANCELLED  # at once
    assert client.cancel_job(running.id).state == ft_pb.JOB_STATE_RUNNING  # at its next step
    wait_for(lambda: client.get_job(running.id).state == ft_pb.JOB_STATE_CANCELLED, 30, "the job to be cancelled")
    assert client.get_job(queued.id).started_unix_ms == 0  # it never ran
    cancelled = client.list_jobs(state="cancelled")
    assert {running.id, queued.id} <= {j.id for j in cancelled}
    assert all(j.state == ft_pb.JOB_STATE_CANCELLED for j in cancelled)


# ----------------------------------------------------------------- lifecycle: SIGTERM, restart, a rank dies


@dataclass
class Drained:
    """What a server on its own --data-dir showed while SIGTERM drained it (`drained` acts, the
    tests judge): it had served a LoRA job's adapter and was running a long job and a stream."""

    data: Path
    adapter_id: str
    job_id: str  # the long job, running at SIGTERM
    running_while_draining: float  # tprt_running_requests once health was NOT_SERVING
    too_late: Any  # the status of a request sent then
    stream: list[Any]  # every chunk of the stream in flight at SIGTERM
    exit_code: int
    log: str
    record: JobRecord | None  # the long job, as stored after the exit


@pytest.fixture(scope="module")
def drained(workdir: Path) -> Drained:
    data = data_dir(workdir, "data-lifecycle")
    srv = ServerProcess(server_args(workdir, data), workdir / "server-lifecycle.log")
    try:
        with srv.client() as c:
            small = c.create_job(dataset_path="train.jsonl", steps=2, batch_size=2, max_seq_len=32, lora_rank=4,
                                 adapter_id="before-restart")
            last = list(c.watch_job(small.id, timeout=120))[-1]
            assert last.state == ft_pb.JOB_STATE_SUCCEEDED, last.error
            job = c.create_job(dataset_path="train.jsonl", steps=100000, batch_size=2, max_seq_len=32, lora_rank=4,
                               checkpoint_every=100000, adapter_id="long-run")
            wait_for(lambda: c.get_job(job.id).step >= 2, 60, "the job to take steps")
            stream = c.generate("drain me", max_new_tokens=DRAIN_TOKENS, temperature=0, ignore_eos=True)
            chunks = [next(stream)]
            srv.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: c.health_check() == "NOT_SERVING", 10, "health NOT_SERVING")
            running = metric(srv.metrics(), "tprt_running_requests")
            try:
                c.complete("too late", max_new_tokens=1)
                too_late = grpc.StatusCode.OK
            except grpc.RpcError as e:
                too_late = e.code()
            chunks += list(stream)
        exit_code = srv.stop(timeout=60)
    finally:
        srv.kill()
    store = JobStore(data)
    record = store.get(job.id)
    store.close()
    return Drained(data, "before-restart", job.id, running, too_late, chunks, exit_code, srv.tail(), record)


def test_sigterm_drains_checkpoints_and_exits_0(drained: Drained) -> None:
    assert drained.too_late == grpc.StatusCode.UNAVAILABLE
    # The stream was running while the server drained, and it finished.
    assert drained.running_while_draining == 1
    assert len(drained.stream) == DRAIN_TOKENS
    assert drained.stream[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH
    assert drained.exit_code == 0 and "stopped (drained)" in drained.log, drained.log
    # The running job was checkpointed and re-queued, to resume at the next start.
    rec = drained.record
    assert rec is not None and rec.state == "queued" and rec.checkpoint == f"jobs/{drained.job_id}", rec
    assert rec.step >= 2 and (drained.data / rec.checkpoint / "checkpoints").is_dir()
    assert "checkpointed at step" in rec.error


def test_restart_recovers_jobs_then_rank_death(workdir: Path, drained: Drained) -> None:
    store = JobStore(drained.data)
    store.create(JobRecord(id="job-crashed", method="lora", dataset="train.jsonl", adapter_id="crashed",
                           hyperparameters={"steps": 10}, state=RUNNING, step=3, total_steps=10))
    store.close()
    tls = self_signed_cert(workdir)  # this server speaks TLS (when openssl is available)
    extra = ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])] if tls else []
    args = server_args(workdir, drained.data)
    srv = ServerProcess(args + extra, workdir / "server-restarted.log", tls[0] if tls else None)
    try:
        c = srv.client()
        second = subprocess.run([sys.executable, "-m", "tprt.cli", "serve", *args],
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "in use by another tprt serve" in second.stderr, second.stderr
        crashed = c.get_job("job-crashed")
        assert crashed.state == ft_pb.JOB_STATE_FAILED and "no checkpoint" in crashed.error  # with the reason
        assert drained.adapter_id in {a.id for a in c.model_info().adapters}  # registered at start-up (on disk)
        assert len(c.complete("hi", adapter_id=drained.adapter_id, max_new_tokens=2).tokens) == 2
        assert drained.record is not None
        job_id, step = drained.job_id, drained.record.step
        wait_for(lambda: f"job {job_id}: started at step {step} of" in srv.tail(), 60, "the job to resume")
        wait_for(lambda: c.get_job(job_id).step > step, 60, "the resumed job to step")
        c.cancel_job(job_id)
        wait_for(lambda: c.get_job(job_id).state == ft_pb.JOB_STATE_CANCELLED, 30, "the resumed job to cancel")
        os.kill(srv.pids[1], signal.SIGKILL)  # a follower rank dies
        wait_for(lambda: c.health_check() == "NOT_SERVING", 15, "health NOT_SERVING")
        # UNAVAILABLE, not DEADLINE_EXCEEDED: the request fails instead of hanging on the dead rank.
        err = rpc_error(lambda: c.complete("anyone?", max_new_tokens=2, timeout=30))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        c.close()
        assert srv.stop(timeout=60) == 1  # a broken world exits non-zero
    finally:
        srv.kill()


# ----------------------------------------------------------------- tprt demo


def test_serve_demo_walkthrough(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`tprt demo`'s serving part (serve/client/demo.py) on the tiny model: its own server starts, a chat
    answer streams, a LoRA job over the API succeeds and its adapter answers, metrics are shown,
    SIGTERM drains with status 0."""
    from serve.client.demo import METRICS_SHOWN, run_serve_demo

    lines: list[str] = []
    chats = "".join(json.dumps({"messages": [{"role": "user", "content": f"Who are you {i}?"},
                                             {"role": "assistant", "content": "Tippy."}]}) + "\n" for i in range(6))
    run_serve_demo(workdir / "model" / "tp2", workdir / "demo", chats, steps=2, max_new_tokens=4, say=lines.append)
    text = "\n".join(lines)
    assert "listening on 127.0.0.1:" in text and "(TP 2," in text, text
    assert "succeeded, step 2/2" in text, text
    assert text.count("client.generate(") == 2 and "adapter_id='tippy'" in text, text
    assert "a JSON-schema answer (response_format json_schema)" in text, text  # through the OpenAI client
    # the tiny random model may run out of tokens mid-call; the demo says which
    assert re.search(r"get_weather\(\{.*\}\)  finish_reason 'tool_calls'|no complete call within max_tokens "
                     r"\(finish_reason 'length'\)", text), text
    assert 'tprt_finetune_jobs{state="succeeded"} 1.0' in text, text
    shown = [line for line in lines if line.strip().startswith(METRICS_SHOWN)]
    assert any(line.strip().startswith("tprt_generated_tokens_total") and not line.endswith(" 0.0") for line in shown)
    assert lines[-1].endswith("exited with status 0"), lines[-1]
    answers = [line for line in capsys.readouterr().out.splitlines() if line.startswith("    assistant: ")]
    assert len(answers) == 2 and all(len(a) > len("    assistant: ") for a in answers), answers


# ----------------------------------------------------------------- many adapters


POOL_ADAPTERS = {"pool-a": (("q", "v"), 2), "pool-b": (("k", "o", "down"), 8), "pool-c": (("gate", "up"), 4),
                 "pool-d": (("q", "k", "v", "o", "gate", "up", "down"), 3)}  # name -> (targets, rank)


def _answer(client: Client, ids: list[int], adapter_id: str = "", n: int = 6) -> tuple[list[int], list[float], Any]:
    out = client.complete(prompt_ids=ids, adapter_id=adapter_id, max_new_tokens=n, temperature=0, ignore_eos=True,
                          logprobs=True)
    return [t.id for t in out.tokens], [t.logprob for t in out.tokens], out.usage


def _same(got: tuple[list[int], list[float], Any], want: tuple[list[int], list[float], Any], what: str) -> None:
    assert got[0] == want[0], what
    assert max(abs(a - b) for a, b in zip(got[1], want[1])) < 1e-4, what


def test_many_adapters_share_batches_through_the_pool(workdir: Path, server: ServerProcess, client: Client) -> None:
    """Four adapters (ranks 2-8, different targets) loaded on demand from --data-dir/adapters/ on a
    server holding two on the device and one in host memory (server_args): concurrent streams
    across them and the base model get what each gets alone, through evictions and reloads; a
    pinned adapter stays on the device; errors name their field; the adapter metrics move."""
    data = workdir / "data"
    for seed, (name, (targets, rank)) in enumerate(POOL_ADAPTERS.items()):
        write_model_adapter(workdir, data / "adapters" / name, targets, rank, seed)
    ids = list(client.tokenize("Q3: say hi").ids)
    names = ["", *POOL_ADAPTERS]
    alone = {name: _answer(client, ids, name) for name in names}  # each loaded on demand; two evicted meanwhile
    for name in POOL_ADAPTERS:  # each adapter changes the outputs
        assert max(abs(a - b) for a, b in zip(alone[name][1], alone[""][1])) > 1e-3, name
    tiers = {a.id: a for a in client.list_adapters()}
    assert sum(a.tier == "device" for a in tiers.values()) == 2 and sum(a.tier == "host" for a in tiers.values()) == 1
    assert {n: (tuple(tiers[n].targets), tiers[n].rank) for n in POOL_ADAPTERS} == POOL_ADAPTERS

    def stream(i: int) -> tuple[list[int], list[float], Any]:
        chunks = list(client.generate(prompt_ids=ids, adapter_id=names[i % 5], max_new_tokens=6, temperature=0,
                                      ignore_eos=True, logprobs=True))
        return [c.token.id for c in chunks if c.HasField("token")], \
            [c.token.logprob for c in chunks if c.HasField("token")], chunks[-1].usage

    with ThreadPoolExecutor(10) as threads:
        for i, got in enumerate(threads.map(stream, range(10))):
            _same(got, alone[names[i % 5]], f"stream {i} ({names[i % 5] or 'base'})")
    m = server.metrics()
    assert metric(m, "tprt_adapter_evictions_total", tier="device") >= 2
    assert metric(m, "tprt_adapter_loads_total") >= 4 and metric(m, "tprt_adapters", tier="device") == 2
    assert metric(m, "tprt_adapter_requests_total", adapter="pool-b") >= 1
    assert metric(m, "tprt_adapter_generated_tokens_total", adapter="pool-b") >= 6
    steps = metric(m, "tprt_adapters_per_step_count")
    assert 0 < metric(m, "tprt_adapters_per_step_bucket", le="1.0") < steps  # some steps mixed adapters

    # Pinned: requests for the three others evict around it.
    pinned = client.load_adapter("pool-a", path="adapters/pool-a", pin=True)
    assert (pinned.tier, pinned.pinned, pinned.rank) == ("device", True, 2)
    for name in ("pool-b", "pool-c", "pool-d", "pool-b"):
        _same(_answer(client, ids, name), alone[name], f"{name} after evictions")
    tiers = {a.id: a for a in client.list_adapters()}
    assert tiers["pool-a"].tier == "device" and tiers["pool-a"].pinned and tiers["pool-b"].tier == "device"
    _same(_answer(client, ids, "pool-a"), alone["pool-a"], "pool-a reloaded pinned")

    # Errors name their field.
    write_model_adapter(workdir, data / "adapters" / "other-base", ("q",), 2, 9, hidden=48)
    write_model_adapter(workdir, data / "big-rank", ("q",), 32, 9)
    for call, code, field in (
        (lambda: client.load_adapter("x", path="../elsewhere"), grpc.StatusCode.INVALID_ARGUMENT, "path"),
        (lambda: client.load_adapter("x", path="big-rank"), grpc.StatusCode.INVALID_ARGUMENT, "path"),
        (lambda: client.load_adapter("x", path="adapters/other-base"), grpc.StatusCode.INVALID_ARGUMENT, "path"),
        (lambda: client.load_adapter("x", path="no-such-dir"), grpc.StatusCode.NOT_FOUND, "path"),
        (lambda: client.load_adapter("bad id!", path="adapters/pool-a"), grpc.StatusCode.INVALID_ARGUMENT, "id"),
        (lambda: client.load_adapter(job_id="job-none"), grpc.StatusCode.NOT_FOUND, "job_id"),
        (lambda: client.complete(prompt_ids=ids, adapter_id="other-base"), grpc.StatusCode.INVALID_ARGUMENT,
         "adapter_id"),
        (lambda: client.unload_adapter("no-such-adapter"), grpc.StatusCode.NOT_FOUND, "id"),
    ):
        err = rpc_error(call)
        assert (err.code(), field_of(err)) == (code, field), err.details()
    assert "another base model" in rpc_error(lambda: client.load_adapter("x", path="adapters/other-base")).details()
    listed = subprocess.run([sys.executable, "-m", "tprt.cli", "client", "--server", server.target, "--token-file",
                             str(workdir / "token"), "adapters", "list"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "pool-a  device  rank 2" in listed.stdout and "pinned" in listed.stdout, listed
    client.unload_adapter("pool-a")  # pinned adapters unload too
    assert "pool-a" not in {a.id for a in client.list_adapters()}


def test_unloading_lets_requests_in_flight_finish(workdir: Path, client: Client) -> None:
    """UnloadAdapter returns once the adapter's streams have finished; meanwhile new requests for it
    are refused; reloaded (on demand, from its directory), it answers as before, and no keys or
    values cached under the earlier load are reused."""
    path = workdir / "data" / "adapters" / "pool-e"
    write_model_adapter(workdir, path, ("q", "down"), 4, 11)
    ids = list(client.tokenize("Q5: " + "say hi, " * 12).ids)  # full KV blocks, which alone are shared
    first = _answer(client, ids, "pool-e")
    assert _answer(client, ids, "pool-e")[2].cached_prompt_tokens > 0  # its prefix is reused while loaded
    n_long = 1500
    long_stream = client.generate(prompt_ids=ids, adapter_id="pool-e", max_new_tokens=n_long, temperature=0,
                                  ignore_eos=True)
    next(long_stream)  # it is running

    def refused() -> bool:
        try:
            client.complete(prompt_ids=ids, adapter_id="pool-e", max_new_tokens=1)
            return False
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND, e.details()
            return True

    with ThreadPoolExecutor(1) as threads:
        unloaded = threads.submit(client.unload_adapter, "pool-e")
        wait_for(refused, 30, "requests for an adapter being unloaded to be refused")
        assert not unloaded.done() and "pool-e" in {a.id for a in client.list_adapters()}  # its stream runs
        rest = list(long_stream)
        unloaded.result(timeout=60)
    assert rest[-1].usage.completion_tokens == n_long and rest[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH
    assert "pool-e" not in {a.id for a in client.list_adapters()}
    again = _answer(client, ids, "pool-e")  # on demand again: a new load
    _same(again, first, "pool-e reloaded")
    assert again[2].cached_prompt_tokens == 0
