"""`tprt serve` against hostile and careless clients (issue 13): one real TP=2 server takes every check.

The server (module fixture) is test_server.py's tiny model and flags with small limits, so that
a test can reach each limit in a few calls. The rank-fault test alone starts a server of its own
(a killed rank breaks it), and restarts it on the same --data-dir. Calls are made with the generated client or, where a
client would refuse to send them, as raw bytes on a bare channel. Every wait is bounded; a test
that makes jobs cancels them, so the tests pass alone and in any order.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from serve.client import Client, field_of  # noqa: E402
from serve.grpc.pb import finetuning_pb2 as ft_pb  # noqa: E402
from serve.grpc.pb import generation_pb2 as gen_pb  # noqa: E402
from servers import (TOKEN, ServerProcess, data_dir, metric, prepare_root, rpc_error, server_args,  # noqa: E402
                     wait_for, write_model_adapter)

CONTEXT = 256
MAX_DATASET_BYTES = 4096
MAX_QUEUED_JOBS = 2
MAX_OPEN_CALLS = 4
JOB_MEMORY_LIMIT_MIB = 256
BYTE_LIMIT = CONTEXT * 5  # the tiny tokenizer's longest entry is "<unk>": 5 bytes (serve.core.generation.text_byte_limit)

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_root(tmp_path_factory.mktemp("hostile"), CONTEXT)


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[ServerProcess]:
    args = server_args(root) + ["--max-seq-len", str(CONTEXT), "--max-dataset-bytes", str(MAX_DATASET_BYTES),
                                "--max-queued-jobs", str(MAX_QUEUED_JOBS), "--max-open-calls", str(MAX_OPEN_CALLS),
                                "--job-memory-limit", str(JOB_MEMORY_LIMIT_MIB << 20)]
    srv = ServerProcess(args, root / "server.log")
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    with server.client() as c:
        yield c


def raw_call(server: ServerProcess, method: str, payload: bytes, stream: bool = False) -> Any:
    """Calls `method` with `payload` as the serialized request; the RpcError it ends with."""
    with grpc.insecure_channel(server.target) as channel:
        kw = {"metadata": (("authorization", f"Bearer {TOKEN}"),), "timeout": 30}
        if stream:
            return rpc_error(lambda: channel.unary_stream(method)(payload, **kw))
        return rpc_error(lambda: channel.unary_unary(method)(payload, **kw))


# A job that runs until it is cancelled.
ENDLESS = {"inline_jsonl": '{"text": "hello hello hello"}\n', "steps": 100_000, "batch_size": 1,
           "max_seq_len": 16, "lora_rank": 2}


def cancel_jobs(client: Client, ids: list[str]) -> None:
    for job_id in ids:
        client.cancel_job(job_id)
    wait_for(lambda: all(client.get_job(j).state == ft_pb.JOB_STATE_CANCELLED for j in ids), 60, "jobs to cancel")


def job_dirs(root: Path) -> set[str]:
    jobs = root / "data" / "jobs"
    return {p.name for p in jobs.iterdir()} if jobs.exists() else set()


# ----------------------------------------------------------------- 1: admission by memory


def test_a_job_too_large_for_the_memory_is_refused_naming_the_field_and_limit(root: Path, client: Client) -> None:
    before = job_dirs(root)
    huge = {**ENDLESS, "batch_size": 1024, "max_seq_len": CONTEXT}  # gigabytes of activations
    err = rpc_error(lambda: client.create_job(**huge))
    assert (err.code(), field_of(err)) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "hyperparameters.batch_size")
    assert f"{JOB_MEMORY_LIMIT_MIB} MiB of --job-memory-limit" in err.details(), err.details()
    assert job_dirs(root) == before
    fits = client.create_job(**{**huge, "batch_size": 4})  # tens of MiB
    cancel_jobs(client, [fits.id])


def test_a_job_that_fails_while_running_fails_alone(root: Path, client: Client) -> None:
    job = client.create_job(**{**ENDLESS, "checkpoint_every": 5})
    wait_for(lambda: client.get_job(job.id).step >= 1, 60, "the job to run")
    checkpoints = root / "data" / "jobs" / job.id / "checkpoints"
    checkpoints.mkdir(exist_ok=True)
    for step in range(5, 1000, 5):  # files where the next checkpoints go: rank 0 alone fails to replace one
        (checkpoints / f"step-{step:08d}").write_text("in the way")
    wait_for(lambda: client.get_job(job.id).state == ft_pb.JOB_STATE_FAILED, 30, "the job to fail")
    error = client.get_job(job.id).error
    assert error and str(root) not in error, error  # says why, without the server's paths
    assert client.health_check() == "SERVING"  # serving goes on
    assert len(client.complete("still there?", max_new_tokens=3, temperature=0).tokens) == 3


# ----------------------------------------------------------------- 6: never INTERNAL for the caller's mistake


def test_undecodable_requests_are_invalid_argument_without_a_traceback(server: ServerProcess) -> None:
    not_utf8 = b"\x0a\x03\xff\xfe\xfd"  # field 1 (prompt, dataset_path) holding bytes that are not UTF-8
    surrogate = gen_pb.GenerateRequest(chat=gen_pb.Chat(messages=[gen_pb.ChatMessage(role="user", content="@@@")]))
    lone_surrogate = surrogate.SerializeToString().replace(b"@@@", b"\xed\xa0\x80")  # UTF-8 of U+D800
    cases = [
        ("/tprt.v1.Generation/Complete", not_utf8, False, "prompt"),
        ("/tprt.v1.Generation/Generate", not_utf8, True, "prompt"),
        ("/tprt.v1.Generation/Tokenize", not_utf8, False, "prompt"),
        ("/tprt.v1.Generation/Complete", lone_surrogate, False, "chat.messages.content"),
        ("/tprt.v1.FineTuning/CreateJob", not_utf8, False, "dataset_path"),
        ("/tprt.v1.Generation/Complete", b"\xff\xff\xff\xff", False, "request"),
        ("/tprt.v1.FineTuning/GetJob", b"\x0a\x05ab", False, "request"),  # truncated
    ]
    before = metric(server.metrics(), "tprt_requests_total", method="Complete", outcome="invalid_argument")
    for method, payload, stream, field in cases:
        err = raw_call(server, method, payload, stream)
        assert (err.code(), field_of(err)) == (INVALID, field), (method, payload, err.details())
    after = metric(server.metrics(), "tprt_requests_total", method="Complete", outcome="invalid_argument")
    assert after - before == 3  # answered and counted
    log = server.tail()
    assert "Traceback" not in log and "deserializing" not in log, log


def test_bad_paths_and_data_are_invalid_argument_and_leave_nothing(root: Path, client: Client) -> None:
    before = job_dirs(root)
    deep = json.dumps({"text": "x"}).replace('"x"', "[" * 100_000 + "]" * 100_000)
    cases = [
        ({"dataset_path": "train\x00.jsonl"}, "dataset_path"),
        ({"dataset_path": "a" * 5000}, "dataset_path"),
        ({"dataset_path": "/".join(["b" * 250] * 30)}, "dataset_path"),
        ({"inline_jsonl": deep + "\n"}, "inline_jsonl"),
        ({"inline_jsonl": "[" * 100_000 + "\n"}, "inline_jsonl"),
        ({"inline_jsonl": '{"text": "\\ud800"}\n'}, "inline_jsonl"),
    ]
    for kw, field in cases:
        err = rpc_error(lambda: client.create_job(steps=1, **kw))
        assert (err.code(), field_of(err)) == (INVALID, field), (kw, err.details()[:200])
    assert job_dirs(root) == before  # nothing left on disk by a refused call


# ----------------------------------------------------------------- 5: atomic uniqueness, full-match ids

def test_concurrent_creates_with_one_adapter_id_give_one_success(root: Path, client: Client) -> None:
    before = job_dirs(root)

    def create(_: int) -> Any:
        try:
            return client.create_job(adapter_id="claimed-once", **ENDLESS)
        except grpc.RpcError as e:
            return e

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(create, range(8)))
    made = [r for r in results if not isinstance(r, grpc.RpcError)]
    refused = [r for r in results if isinstance(r, grpc.RpcError)]
    try:
        assert len(made) == 1, [r.details() for r in refused]
        assert {(e.code(), field_of(e)) for e in refused} == {(grpc.StatusCode.ALREADY_EXISTS, "adapter_id")}
        assert job_dirs(root) - before == {made[0].id}  # the refused left no directory behind
        again = rpc_error(lambda: client.create_job(adapter_id="claimed-once", **ENDLESS))
        assert again.code() == grpc.StatusCode.ALREADY_EXISTS
    finally:
        cancel_jobs(client, [j.id for j in made])


@pytest.mark.parametrize("adapter_id", ["ok-id\n", "\nok-id", "ok id", "-leading-dash", "x" * 65])
def test_adapter_ids_are_matched_in_full(client: Client, adapter_id: str) -> None:
    err = rpc_error(lambda: client.create_job(adapter_id=adapter_id, **ENDLESS))
    assert (err.code(), field_of(err)) == (INVALID, "adapter_id")


# ----------------------------------------------------------------- 3: size before work


def test_text_that_cannot_fit_is_refused_before_tokenizing(client: Client) -> None:
    huge = "x" * (BYTE_LIMIT + 1)
    for call, field in ((lambda: client.tokenize(huge), "prompt"),
                        (lambda: client.complete(huge, max_new_tokens=1), "prompt"),
                        (lambda: list(client.generate(huge, max_new_tokens=1)), "prompt"),
                        (lambda: client.complete(chat=[{"role": "user", "content": huge}]), "chat.messages")):
        err = rpc_error(call)
        assert (err.code(), field_of(err)) == (grpc.StatusCode.OUT_OF_RANGE, field), err.details()
        assert f"at most {BYTE_LIMIT} bytes" in err.details()
    assert len(client.tokenize("x" * BYTE_LIMIT).ids) >= BYTE_LIMIT  # at the bound: tokenized as ever


def test_datasets_over_the_size_limit_are_refused_before_they_are_read(root: Path, client: Client) -> None:
    line = json.dumps({"text": "y" * 100}) + "\n"
    big = line * (MAX_DATASET_BYTES // len(line) + 1)
    (root / "data" / "big.jsonl").write_text(big)
    before = job_dirs(root)
    for kw, field in (({"inline_jsonl": big}, "inline_jsonl"), ({"dataset_path": "big.jsonl"}, "dataset_path")):
        err = rpc_error(lambda: client.create_job(steps=1, **kw))
        assert (err.code(), field_of(err)) == (INVALID, field), err.details()
        assert f"at most {MAX_DATASET_BYTES} bytes" in err.details()
    assert job_dirs(root) == before


# ----------------------------------------------------------------- 4: bounded state


def test_the_job_queue_is_bounded(root: Path, client: Client) -> None:
    made = [client.create_job(**ENDLESS)]
    try:
        wait_for(lambda: client.get_job(made[0].id).state == ft_pb.JOB_STATE_RUNNING, 60, "the first job to run")
        made += [client.create_job(**ENDLESS) for _ in range(MAX_QUEUED_JOBS)]
        before = job_dirs(root)
        err = rpc_error(lambda: client.create_job(**ENDLESS))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queued-jobs" in err.details()
        assert job_dirs(root) == before
        client.cancel_job(made[-1].id)  # a cancelled job frees its place at once
        made.append(client.create_job(**ENDLESS))
    finally:
        cancel_jobs(client, [j.id for j in made])


# ----------------------------------------------------------------- 7: errors that are safe to show


def test_errors_echo_little_and_show_no_server_paths(root: Path, client: Client) -> None:
    long = "z" * 10_000
    refused = [
        rpc_error(lambda: client.create_job(inline_jsonl='{"prompt": 3}\n', steps=1)),  # names the file and line
        rpc_error(lambda: client.create_job(dataset_path=long, steps=1)),
        rpc_error(lambda: client.create_job(dataset_path=str(root / "data" / "missing.jsonl"), steps=1)),
        rpc_error(lambda: client.complete("hi", adapter_id=long, max_new_tokens=1)),
        rpc_error(lambda: client.get_job(long)),
        rpc_error(lambda: client.complete(chat=[{"role": long, "content": "hi"}])),
    ]
    for err in refused:
        assert err.code() != grpc.StatusCode.INTERNAL
        assert len(err.details()) < 400, err.details()[:400]
        assert str(root) not in err.details() and "/tmp" not in err.details(), err.details()
    assert "dataset.jsonl:1" in refused[0].details()  # still says where


# ----------------------------------------------------------------- 2: unauthenticated traffic cannot starve the rest


def test_calls_without_a_token_cannot_take_the_threads_of_authenticated_ones(server: ServerProcess,
                                                                               client: Client) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    threads = 16 + 2 + 32  # test_server's --max-batch-size and --max-queue: more than the server had before
    with grpc.insecure_channel(server.target) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch
        streams = [watch(health_pb2.HealthCheckRequest(), timeout=60) for _ in range(threads + 10)]
        try:
            firsts = []
            for s in streams:
                try:
                    firsts.append(next(s).status)
                except grpc.RpcError as e:
                    firsts.append(e.code())
            assert firsts.count(health_pb2.HealthCheckResponse.SERVING) == MAX_OPEN_CALLS
            assert set(firsts) == {health_pb2.HealthCheckResponse.SERVING, grpc.StatusCode.RESOURCE_EXHAUSTED}
            # The watches hold their share, and only it: authenticated work and probes go on.
            assert len(client.complete("hi", max_new_tokens=2, temperature=0).tokens) == 2
            assert client.health_check() == "SERVING"
            with server.client(token=None) as anonymous:
                assert anonymous.health_check() == "SERVING"
                assert rpc_error(anonymous.model_info).code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            for s in streams:
                s.cancel()
    wait_for(lambda: _watch_once(server), 10, "the watches' share to be given back")


def _watch_once(server: ServerProcess) -> bool:
    """Whether a new health Watch is served (then ends it)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(server.target) as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
        try:
            return bool(next(stream).status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.RpcError:
            return False
        finally:
            stream.cancel()


# ----------------------------------------------------------------- issue 30: adapters and the jobs that make them


def _corrupt_adapters(root: Path) -> list[str]:
    """Adapter directories under --data-dir/adapters/, each broken in one way (their names)."""
    import struct

    import torch
    from safetensors.torch import load_file, save_file

    adapters = root / "data" / "adapters"
    write_model_adapter(root, adapters / "bad-sound", ("q",), 2, 1)  # the template, and proof the rest is sound
    sound = adapters / "bad-sound"
    made: list[str] = []

    def variant(name: str, file: str, content: bytes | None) -> None:
        shutil.copytree(sound, adapters / name)
        target = adapters / name / file
        target.unlink()
        if content is None:
            target.mkdir()
        else:
            target.write_bytes(content)
        made.append(name)

    weights = "adapter_model.safetensors"
    good = (sound / weights).read_bytes()
    (n,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8:8 + n])
    first = next(k for k in header if k != "__metadata__")
    lying = {**header, first: {**header[first], "data_offsets": [0, 10**12]}}
    raw = json.dumps(lying).encode()
    variant("bad-empty", weights, b"")
    variant("bad-truncated", weights, good[:-64])
    variant("bad-length", weights, struct.pack("<Q", 2**62) + good[8:])
    variant("bad-offsets", weights, struct.pack("<Q", len(raw)) + raw + good[8 + n:])
    variant("bad-dir", weights, None)
    variant("bad-deep", "adapter_config.json", b"[" * 200_000 + b"]" * 200_000)
    variant("bad-binary", "adapter_config.json", bytes(range(256)) * 8)
    variant("bad-config-dir", "adapter_config.json", None)
    tensors = load_file(str(sound / weights))
    tensors[first] = torch.full_like(tensors[first], float("nan"))
    shutil.copytree(sound, adapters / "bad-nan")
    save_file(tensors, str(adapters / "bad-nan" / weights))
    made.append("bad-nan")
    return made


def test_adapter_mistakes_are_invalid_argument_naming_the_field_without_a_traceback(
        root: Path, server: ServerProcess, client: Client) -> None:
    outside = root / "outside"
    write_model_adapter(root, outside / "escape", ("q",), 2, 3)
    (root / "data" / "adapters").mkdir(parents=True, exist_ok=True)
    (root / "data" / "adapters" / "escape").symlink_to(outside / "escape")  # on demand, it led out of --data-dir
    ids = list(client.tokenize("hi").ids)
    calls = [(lambda p=p: client.load_adapter("x", path=p), "path")
             for p in ("adapters/x\0y", "a" * 5000, "/".join(["b" * 300] * 3), "adapters/escape")]
    calls.append((lambda: client.complete(prompt_ids=ids, adapter_id="escape", max_new_tokens=1), "adapter_id"))
    for name in _corrupt_adapters(root):
        calls.append((lambda name=name: client.load_adapter("x", path=f"adapters/{name}"), "path"))
        calls.append((lambda name=name: client.complete(prompt_ids=ids, adapter_id=name, max_new_tokens=1),
                      "adapter_id"))
    for call, field in calls:
        err = rpc_error(call)
        assert (err.code(), field_of(err)) == (INVALID, field), err.details()
        assert len(err.details()) < 400 and str(root) not in err.details(), err.details()[:400]
    assert "adapter_model.safetensors" in rpc_error(lambda: client.load_adapter("x", path="adapters/bad-nan")).details()
    assert "NaN" in rpc_error(lambda: client.load_adapter("x", path="adapters/bad-nan")).details()
    assert len(client.complete(prompt_ids=ids, adapter_id="bad-sound", max_new_tokens=2).tokens) == 2
    assert client.health_check() == "SERVING"
    assert "Traceback" not in server.tail() and "a" * 5000 not in server.tail()


def test_jobs_cannot_take_what_the_adapter_pool_refuses(root: Path, client: Client) -> None:
    before = job_dirs(root)
    (root / "data" / "adapters" / "a-directory").mkdir(parents=True, exist_ok=True)
    base = client.model_info().model
    err = rpc_error(lambda: client.create_job(**{**ENDLESS, "lora_rank": 256}))  # --max-lora-rank is 16
    assert (err.code(), field_of(err)) == (INVALID, "hyperparameters.lora_rank") and "--max-lora-rank" in err.details()
    for taken in (base, "a-directory"):
        err = rpc_error(lambda: client.create_job(adapter_id=taken, **ENDLESS))
        assert (err.code(), field_of(err)) == (grpc.StatusCode.ALREADY_EXISTS, "adapter_id"), err.details()
    assert job_dirs(root) == before
    sound = root / "data" / "adapters" / "a-directory" / "sound"
    if not sound.exists():
        write_model_adapter(root, sound, ("q",), 2, 4)
    err = rpc_error(lambda: client.load_adapter(base, path="adapters/a-directory/sound"))
    assert (err.code(), field_of(err)) == (grpc.StatusCode.ALREADY_EXISTS, "id")


def test_a_job_finishing_while_every_slot_is_pinned_succeeds_and_serving_goes_on(
        root: Path, server: ServerProcess, client: Client) -> None:
    """test_server's --max-loras 2, both pinned: the job's adapter is registered on disk; a request
    for it is refused at once (RESOURCE_EXHAUSTED: no slot would ever free), and served once a pin goes."""
    pins = ["pin-1", "pin-2"]
    for seed, name in enumerate(pins):
        write_model_adapter(root, root / "data" / "adapters" / name, ("q",), 2, 20 + seed)
    try:
        for name in pins:
            client.load_adapter(name, path=f"adapters/{name}", pin=True)
        job = client.create_job(inline_jsonl='{"text": "hello hello hello"}\n', steps=2, batch_size=1,
                                max_seq_len=16, lora_rank=2, adapter_id="finished-pinned")
        last = list(client.watch_job(job.id, timeout=120))[-1]
        assert last.state == ft_pb.JOB_STATE_SUCCEEDED, last.error
        assert client.health_check() == "SERVING"
        tiers = {a.id: a.tier for a in client.list_adapters()}
        assert tiers["finished-pinned"] == "disk" and tiers["pin-1"] == tiers["pin-2"] == "device"
        err = rpc_error(lambda: client.complete("hi", adapter_id="finished-pinned", max_new_tokens=2, timeout=30))
        assert (err.code(), field_of(err)) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "adapter_id"), err.details()
        assert len(client.complete("hi", max_new_tokens=2).tokens) == 2
        client.unload_adapter("pin-1")
        assert len(client.complete("hi", adapter_id="finished-pinned", max_new_tokens=2).tokens) == 2
    finally:
        for name in pins:
            try:
                client.unload_adapter(name)
            except grpc.RpcError:
                pass


# ----------------------------------------------------------------- 8: jobs reflect rank faults


def test_a_dead_rank_shows_in_the_running_job_which_resumes_after_a_restart(root: Path) -> None:
    args = server_args(root, data_dir(root, "faults")) + ["--max-seq-len", str(CONTEXT)]
    srv = ServerProcess(args, root / "faults.log")
    try:
        c = srv.client()
        job = c.create_job(**{**ENDLESS, "checkpoint_every": 1})
        wait_for(lambda: c.get_job(job.id).step >= 2, 60, "the job to checkpoint")
        seen: list[Any] = []
        watch_ended = threading.Event()

        def watch() -> None:
            try:
                seen.extend(c.watch_job(job.id, timeout=60))
            except grpc.RpcError as e:
                seen.append(e)
            finally:
                watch_ended.set()

        threading.Thread(target=watch, daemon=True).start()
        wait_for(lambda: seen, 10, "the watch to start")
        os.kill(srv.pids[1], signal.SIGKILL)  # a follower rank dies mid-job
        wait_for(lambda: c.get_job(job.id).state != ft_pb.JOB_STATE_RUNNING, 15, "the job to show the fault")
        faulted = c.get_job(job.id)
        assert faulted.state == ft_pb.JOB_STATE_QUEUED, faulted
        assert "resumes from its last checkpoint" in faulted.error, faulted.error
        assert "127.0.0.1" not in faulted.error and "/__w" not in faulted.error  # safe to show
        assert watch_ended.wait(15) and seen[-1].state == ft_pb.JOB_STATE_QUEUED  # the watch ends with it
        err = rpc_error(lambda: c.create_job(**ENDLESS))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "restarted" in err.details(), err.details()
        c.close()
        assert srv.stop(timeout=60) == 1
        srv = ServerProcess(args, root / "faults-restarted.log")
        c = srv.client()
        wait_for(lambda: c.get_job(job.id).state == ft_pb.JOB_STATE_RUNNING and c.get_job(job.id).step >= 1,
                 60, "the job to resume")
        cancel_jobs(c, [job.id])
        c.close()
    finally:
        srv.kill()


# ----------------------------------------------------------------- fuzz: random requests against the live server

FUZZ_EXAMPLES = 60  # bounded for CI (each call has a deadline); bench/serve_fuzz.py runs many more


def test_fuzzed_requests_never_get_internal_and_the_server_stays_exact(server: ServerProcess, client: Client) -> None:
    from hypothesis import HealthCheck, Phase, given, settings

    from fuzz_requests import Call, calls, send

    control = {"prompt": "The control request", "max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    expected = list(client.complete(**control).tokens)
    made: list[str] = []
    codes: dict[str, int] = {}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(call=calls())
    def one(call: Call) -> None:
        code, jobs = send(channel, TOKEN, call)
        made.extend(jobs)
        codes[code.name] = codes.get(code.name, 0) + 1
        assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), call

    with grpc.insecure_channel(server.target) as channel:
        try:
            one()
        finally:
            cancel_jobs(client, made)
    assert client.health_check() == "SERVING"
    assert list(client.complete(**control).tokens) == expected, codes
    assert "Traceback" not in server.tail()
