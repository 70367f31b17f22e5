"""A fleet on this machine (issue 43): two `tprt serve` replicas sharing one PostgreSQL store
(tests/pg.py starts it) and one artifact store (each its own data dir), SGLang's model gateway
(sglang-router, cache-aware) in front. Chat goes through the router, and requests that share a prefix reach one replica. A job
created on one replica is trained once, by the replica that claims it; its adapter answers on the
other; an adapter loaded or unloaded through one replica is loaded or unloaded on both, and a
file uploaded through one is listed, read and deleted through the other. The training replica is killed mid-job (SIGKILL, its ranks too) and the other takes the job
over when the lease lapses, resumes it from its last checkpoint and finishes it with the loss of
an uninterrupted run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest

from pg import PostgresServer, free_port
from serve.grpc.pb import finetuning_pb2 as ft_pb
from serve.jobs.store import JobStore
from serve.store.database import PostgresDatabase
from servers import TOKEN, ServerProcess, data_dir, metric, wait_for
from tiny_chat import make_tiny_chat_model

JOB = {"dataset_path": "train.jsonl", "steps": 60, "batch_size": 2, "max_seq_len": 32, "lora_rank": 4,
       "checkpoint_every": 3, "seed": 7}
LEASE_S = 3


class Router:
    """sglang-router in front of the replicas' HTTP APIs, cache-aware."""

    def __init__(self, workers: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
             "--worker-urls", *workers, "--policy", "cache_aware", "--log-level", "warn"],
            stdout=log.open("w"), stderr=subprocess.STDOUT)
        wait_for(self._healthy, 60, "the router")

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the router exited with {self.proc.returncode}")
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _http_base(srv: ServerProcess) -> str:
    m = re.search(r"OpenAI API (https?://[\d.]+:\d+)/v1", srv.line)
    assert m, srv.line
    return m.group(1)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, ServerProcess], str, Path]]:
    root = tmp_path_factory.mktemp("fleet")
    make_tiny_chat_model(root / "model", (1,), max_positions=512)
    (root / "token").write_text(TOKEN + "\n")
    artifacts = root / "artifacts"  # what the replicas share; each has a data dir of its own
    postgres = PostgresServer()
    url = postgres.database()
    replicas: dict[str, ServerProcess] = {}
    try:
        for name in ("a", "b"):
            replicas[name] = ServerProcess(
                ["--model", str(root / "model" / "tp1"), "--port", "0", "--http-port", "0", "--metrics-port", "0",
                 "--data-dir", str(data_dir(root, f"data-{name}")), "--artifacts", str(artifacts),
                 "--auth-token-file", str(root / "token"), "--threads", "1", "--max-seq-len", "512",
                 "--store", url, "--replica-id", name, "--job-lease", str(LEASE_S),
                 "--kv-events", "tcp://127.0.0.1:*", "--kv-events-replay", "tcp://127.0.0.1:*"],
                root / f"replica-{name}.log")
        yield replicas, url, artifacts
    finally:
        for srv in replicas.values():
            srv.kill()
        postgres.stop()


def test_the_router_sends_shared_prefixes_to_one_replica_and_adapters_answer_anywhere(
        fleet: tuple[dict[str, ServerProcess], str, Path], tmp_path: Path) -> None:
    replicas, url, _ = fleet
    router = Router([_http_base(srv) for srv in replicas.values()], tmp_path / "router.log")
    try:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=TOKEN, max_retries=0, timeout=60)
        chats = {name: metric(srv.metrics(), "tprt_requests_total", method="/v1/chat/completions", outcome="ok")
                 for name, srv in replicas.items()}
        system = "You are the support assistant of a shop that sells tea. " * 6  # the shared prefix
        for i in range(6):
            reply = client.chat.completions.create(
                model="tp1", max_tokens=3, messages=[{"role": "system", "content": system},
                                                     {"role": "user", "content": f"question {i}"}])
            assert reply.choices[0].message.content is not None and reply.usage is not None
        served = sorted(metric(srv.metrics(), "tprt_requests_total", method="/v1/chat/completions", outcome="ok")
                        - chats[name] for name, srv in replicas.items())
        assert served == [0, 6], served  # cache-aware: every request where the prefix is cached
        # A job created through one replica is trained by one; its adapter answers on the other.
        with replicas["a"].client() as a:
            job = a.create_job(adapter_id="fleet-small", **{**JOB, "steps": 2})
            wait_for(lambda: a.get_job(job.id).state == ft_pb.JOB_STATE_SUCCEEDED, 120, "the small job")
        db = PostgresDatabase(url)
        trainer = JobStore(db).lease_owner(job.id)
        db.close()
        other = "b" if trainer == "a" else "a"
        with replicas[other].client() as c:
            assert len(c.complete("Q1: say hi", adapter_id="fleet-small", max_new_tokens=3, ignore_eos=True).tokens) == 3
            assert {x.id: x.source_job_id for x in c.list_adapters()}["fleet-small"] == job.id
            # Loaded under another id through the replica that did not train it: every replica serves it...
            c.load_adapter("fleet-renamed", job_id=job.id)
        with replicas[trainer].client() as t:
            wait_for(lambda: "fleet-renamed" in {x.id for x in t.list_adapters()}, 30, "the trainer to follow the load")
            assert len(t.complete("Q1: say hi", adapter_id="fleet-renamed", max_new_tokens=3, ignore_eos=True).tokens) == 3
            t.unload_adapter("fleet-renamed")  # ...and an unload through one reaches the other
        with replicas[other].client() as c:
            wait_for(lambda: "fleet-renamed" not in {x.id for x in c.list_adapters()}, 30, "the unload to follow")
            with pytest.raises(grpc.RpcError) as info:
                c.complete("Q1: say hi", adapter_id="fleet-renamed", max_new_tokens=3, ignore_eos=True)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND and "unloaded from the fleet" in info.value.details()
        # A file uploaded through one replica is listed, read and deleted through the other.
        a_api, b_api = (openai.OpenAI(base_url=f"{_http_base(replicas[n])}/v1", api_key=TOKEN, max_retries=0)
                        for n in ("a", "b"))
        requests = b'{"custom_id": "1", "method": "POST", "url": "/v1/completions", "body": {}}\n'
        uploaded = a_api.files.create(file=("requests.jsonl", requests), purpose="batch")
        assert [f.id for f in b_api.files.list()] == [uploaded.id]
        assert b_api.files.content(uploaded.id).content == requests
        b_api.files.delete(uploaded.id)
        assert a_api.files.list().data == []
    finally:
        router.stop()


def _kill_replica(srv: ServerProcess) -> None:
    """As a node dies: the server and its ranks at once, nothing released."""
    for pid in (*srv.pids, srv.proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    srv.proc.wait(30)


def test_a_job_survives_its_replica_and_ends_as_an_uninterrupted_run(
        fleet: tuple[dict[str, ServerProcess], str, Path]) -> None:
    replicas, url, artifacts = fleet
    with replicas["a"].client() as a:
        job = a.create_job(adapter_id="fleet-tuned", **JOB)
    db = PostgresDatabase(url)
    store = JobStore(db)
    try:
        wait_for(lambda: store.lease_owner(job.id) in replicas, 60, "a replica to claim the job")
        trainer = store.lease_owner(job.id)
        survivor = "b" if trainer == "a" else "a"
        with replicas[survivor].client() as c:  # the other replica sees the job, and its progress
            wait_for(lambda: c.get_job(job.id).step >= 4, 120, "the job to pass its first checkpoint")
        _kill_replica(replicas[trainer])
        killed_at = store.get(job.id)
        assert killed_at is not None and killed_at.checkpoint == f"jobs/{job.id}" and killed_at.step < JOB["steps"]
        assert (artifacts / f"jobs/{job.id}.manifest.json").is_file()  # its checkpoint, where the survivor finds it
        with replicas[survivor].client() as c:
            wait_for(lambda: c.get_job(job.id).state in (ft_pb.JOB_STATE_SUCCEEDED, ft_pb.JOB_STATE_FAILED), 180,
                     "the survivor to finish the job")
            done = c.get_job(job.id)
            assert done.state == ft_pb.JOB_STATE_SUCCEEDED, done.error
            assert store.lease_owner(job.id) == survivor
            log = replicas[survivor].tail()
            assert f"replica {trainer} stopped renewing its lease" in log, log
            resumed = re.search(rf"job {job.id}: started at step (\d+) of {JOB['steps']}", log)
            assert resumed, log  # from the last checkpoint, not from 0:
            assert 0 < int(resumed.group(1)) <= killed_at.step and int(resumed.group(1)) % JOB["checkpoint_every"] == 0
            # The adapter it trained answers on the replica that finished it.
            assert len(c.complete("Q1: say hi", adapter_id="fleet-tuned", max_new_tokens=3, ignore_eos=True).tokens) == 3
            # The same job uninterrupted, on the survivor: the same final loss.
            ref = c.create_job(adapter_id="fleet-ref", **JOB)
            wait_for(lambda: c.get_job(ref.id).state == ft_pb.JOB_STATE_SUCCEEDED, 180, "the reference job")
            assert abs(c.get_job(ref.id).loss - done.loss) <= 1e-5, (c.get_job(ref.id).loss, done.loss)
    finally:
        db.close()


def test_a_replica_publishes_the_blocks_it_caches_for_prefix_routers(
        fleet: tuple[dict[str, ServerProcess], str, Path]) -> None:
    """--kv-events: a prompt's full blocks reach a subscriber as BlockStored events (hashes
    chained, the prompt's own tokens), after the AllBlocksCleared of the replica's start; a
    subscriber that joined late gets them by replay. (The stream's format: tests/test_kv_events.py.)"""
    import msgpack
    import zmq

    srv = next(srv for srv in fleet[0].values() if srv.proc.poll() is None)  # one was killed above
    m = re.search(r"KV-cache events on (tcp://[\d.]+:\d+) \(replay on (tcp://[\d.]+:\d+)\)", srv.log.read_text())
    assert m, srv.tail()
    client = openai.OpenAI(base_url=f"{_http_base(srv)}/v1", api_key=TOKEN, max_retries=0, timeout=60)
    prompt = list(range(20, 60))  # 40 tokens: two full blocks of 16, whatever else the replica cached
    client.completions.create(model="tp1", prompt=prompt, max_tokens=1)
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        replay = ctx.socket(zmq.DEALER)
        replay.setsockopt(zmq.RCVTIMEO, 10_000)
        replay.connect(m.group(2))

        def stored() -> list[list[Any]]:
            replay.send_multipart((b"", (0).to_bytes(8, "big")))
            batches = []
            while (frames := replay.recv_multipart())[1] != b"\xff" * 8:
                batches.append(msgpack.unpackb(frames[2])[1])
            assert batches[0] == [["AllBlocksCleared"]]
            return [ev for batch in batches for ev in batch if ev[0] == "BlockStored"]

        wait_for(lambda: any(ev[3][:32] == prompt[:32] for ev in stored()), 10, "the prompt's blocks to be published")
        ours = next(ev for ev in stored() if ev[3][:32] == prompt[:32])
        assert ours[2] is None and len(ours[1]) == len(ours[3]) // 16 >= 2 and ours[4] == 16  # from the root
        assert ours[5] is None and ours[6] == "CPU" and ours[7] is None  # the base model, in host memory
    finally:
        ctx.destroy(linger=0)
