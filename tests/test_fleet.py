"""A fleet on this machine (issue 43): two `tprt serve` replicas sharing one PostgreSQL store
(tests/pg.py starts it) and one data directory. A job created on one replica is trained once, by
the replica that claims it; that replica is killed mid-job (SIGKILL, its ranks too) and the other
takes the job over when the lease lapses, resumes it from its last checkpoint and finishes it with
the loss of an uninterrupted run; the adapter it trained answers there."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from pg import PostgresServer
from serve.grpc.pb import finetuning_pb2 as ft_pb
from serve.jobs.store import JobStore
from serve.store.database import PostgresDatabase
from servers import TOKEN, ServerProcess, data_dir, wait_for
from tiny_chat import make_tiny_chat_model

JOB = {"dataset_path": "train.jsonl", "steps": 60, "batch_size": 2, "max_seq_len": 32, "lora_rank": 4,
       "checkpoint_every": 3, "seed": 7}
LEASE_S = 3


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, ServerProcess], str, Path]]:
    root = tmp_path_factory.mktemp("fleet")
    make_tiny_chat_model(root / "model", (1,), max_positions=512)
    (root / "token").write_text(TOKEN + "\n")
    shared = data_dir(root, "shared")
    postgres = PostgresServer()
    url = postgres.database()
    replicas: dict[str, ServerProcess] = {}
    try:
        for name in ("a", "b"):
            replicas[name] = ServerProcess(
                ["--model", str(root / "model" / "tp1"), "--port", "0", "--metrics-port", "0", "--data-dir",
                 str(shared), "--auth-token-file", str(root / "token"), "--threads", "1", "--max-seq-len", "512",
                 "--store", url, "--replica-id", name, "--job-lease", str(LEASE_S)], root / f"replica-{name}.log")
        yield replicas, url, shared
    finally:
        for srv in replicas.values():
            srv.kill()
        postgres.stop()


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
    replicas, url, shared = fleet
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
            assert len(c.complete("Q1: say hi", adapter_id="fleet-tuned", max_new_tokens=3).tokens) == 3
            # The same job uninterrupted, on the survivor: the same final loss.
            ref = c.create_job(adapter_id="fleet-ref", **JOB)
            wait_for(lambda: c.get_job(ref.id).state == ft_pb.JOB_STATE_SUCCEEDED, 180, "the reference job")
            assert abs(c.get_job(ref.id).loss - done.loss) <= 1e-5, (c.get_job(ref.id).loss, done.loss)
    finally:
        db.close()
