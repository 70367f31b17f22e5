"""serve.jobs.manager.JobManager on its own: the SQLite job store (serve/jobs/store.py) and a fake rank
group standing in for the ranks' trainer, no server.

Jobs are created the way CreateJob does (serve.grpc.jobs.job_request, then serve.jobs.spec.check_create,
with a real tokenizer and dataset) and stepped the way the scheduler does (`has_work`, `step(ranks)`). Covered: the
queued -> running -> succeeded / failed / cancelled transitions and what the store records for
each, one job at a time in creation order, a LoRA job's adapter registered, the shutdown
checkpoint, WatchJob's progress stream, and a restart (a running job resumes from its checkpoint
or is failed with the reason; adapters are restored).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from serve.adapters.pool import AdapterPool
from serve.adapters.registry import DISK, AdapterRegistry
from serve.errors import AlreadyExists, FailedPrecondition, NotFound, QueueFull, Unavailable
from serve.jobs.core import JobsCore
from serve.jobs.manager import JobManager
from serve.grpc.handlers import FineTuningService
from serve.jobs.store import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, JobRecord, JobStore
from serve.jobs.spec import check_create
from serve.grpc.jobs import job_pb, job_request
from serve.metrics import Metrics
from serve.grpc.pb import finetuning_pb2 as ft_pb
from serve.ranks.commands import (AdapterLoaded, LoadAdapter, RankCommand, TrainAbort, TrainFinish, TrainSave,
                                  TrainStart, TrainStarted, TrainStep, TrainStepResult)
from tprt.distributed.ranks import CommandFailed
from tprt.lora.peft_io import adapter_config
from tprt.text.tokenizer import Tokenizer
from train_fixtures import write_tokenizer

CONTEXT = 64
WAIT_S = 10.0
TOKENS_PER_STEP = 64
STEP_SECONDS = 0.5
EVAL_LOSS = 2.5


# ----------------------------------------------------------------- fakes

KINDS = {TrainStart: "train_start", TrainStep: "train_step", TrainSave: "train_save", TrainFinish: "train_finish",
         TrainAbort: "train_abort", LoadAdapter: "load_adapter"}


class FakeRanks:
    """tprt.distributed.ranks.RankGroup as the job manager uses it: `run(command)` returns rank 0's result.

    It plays the ranks' side (serve.ranks.executor.RankExecutor's commands): a step's loss is 1/step,
    and the last step of a job with held-out rows reports an eval loss of EVAL_LOSS;
    "train_save" writes the step into the job's directory and "train_start" with resume=True
    reads it back (so a restarted server resumes there); "load_adapter" fails for a directory
    that does not exist. `fail` maps a command kind to the error every rank would report."""

    def __init__(self) -> None:
        self.commands: list[str] = []  # kinds, in order
        self.fail: dict[str, str] = {}
        self.started: list[dict[str, Any]] = []  # train_start's arguments
        self.loaded: list[str] = []  # adapter ids
        self._config: Any = None
        self._dataset: Any = None
        self._step = 0

    def run(self, cmd: RankCommand) -> Any:
        kind = KINDS[type(cmd)]
        self.commands.append(kind)
        if kind in self.fail:
            raise CommandFailed(self.fail[kind])
        match cmd:
            case TrainStart():
                return self._train_start(cmd.config, cmd.dataset, cmd.resume)
            case TrainStep():
                return self._train_step()
            case TrainSave():
                return self._train_save()
            case TrainFinish():
                return self._train_finish(cmd.loss)
            case TrainAbort():
                return self._train_abort()
            case LoadAdapter():
                return self._load_adapter(cmd.adapter_id, cmd.path, cmd.index)

    def _train_start(self, config: Any, dataset: Any, resume: bool) -> TrainStarted:
        self.started.append({"config": config, "dataset": dataset, "resume": resume})
        self._config, self._dataset = config, dataset
        self._step = int((config.out / "checkpoint-step").read_text()) if resume else 0
        return TrainStarted(self._step, int(config.steps))

    def _train_step(self) -> TrainStepResult:
        self._step += 1
        last = self._step == self._config.steps
        return TrainStepResult(step=self._step, loss=1.0 / self._step, grad_norm=0.5, seconds=STEP_SECONDS,
                               tokens=TOKENS_PER_STEP,
                               eval_loss=EVAL_LOSS if last and self._dataset.eval is not None else None)

    def _train_save(self) -> str:
        self._config.out.mkdir(parents=True, exist_ok=True)
        (self._config.out / "checkpoint-step").write_text(str(self._step))
        return str(self._config.out)

    def _train_finish(self, loss: float) -> str:
        out = self._config.out / ("model" if self._config.full else "adapter")
        out.mkdir(parents=True)
        if not self._config.full:  # what the pool reads to register it (no base model to fit: no weights)
            (out / "adapter_config.json").write_text(json.dumps(adapter_config(["q"], 4, 8.0, 0.0, None)))
        return str(out)

    def _train_abort(self) -> None:
        self._config = None

    def _load_adapter(self, adapter_id: str, path: str, index: int) -> AdapterLoaded:
        if not Path(path).is_dir():
            raise CommandFailed(f"{path}: no such adapter")
        self.loaded.append(adapter_id)
        return AdapterLoaded(rank=4, alpha=8.0, index=index)


class FakeContext:
    """The part of grpc.ServicerContext WatchJob uses."""

    def __init__(self) -> None:
        self.active = True

    def is_active(self) -> bool:
        return self.active


# ----------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_tokenizer(tmp_path_factory.mktemp("tokenizer")))


class Server:
    """What serve/server.py builds around the job manager, over one --data-dir."""

    def __init__(self, data_dir: Path, tokenizer: Tokenizer, max_stored: int | None = None,
                 replica: str | None = None, lease_ms: int = 30_000, run_jobs: bool = True) -> None:
        """`replica`: one of a fleet's replicas (its name), sharing the store and data dir with
        the others; else the one server on them."""
        self.data_dir = data_dir
        self.tokenizer = tokenizer
        self.store = JobStore(data_dir)
        # as App does at start-up: alone on its store, every running job was its own
        self.recovered = self.store.recover(data_dir) if replica is None else []
        self.metrics = Metrics()
        self.adapters = AdapterRegistry()
        self.pool = AdapterPool(self.adapters, data_dir, self.metrics)
        self.wakes = 0
        self.woken = threading.Event()
        self.ranks = FakeRanks()
        self.jobs = JobManager(self.store, data_dir, self.metrics, self.pool, data_dir / "model", tokenizer,
                               CONTEXT, self._wake, max_stored=max_stored, replica_id=replica,
                               shared=replica is not None, lease_ms=lease_ms, run_jobs=run_jobs)

    def _wake(self) -> None:
        self.wakes += 1
        self.woken.set()

    def create(self, full: bool = False, adapter_id: str = "", validation: str = "", **hp: Any) -> str:
        """A CreateJob request checked as the service does; returns the job id."""
        req = ft_pb.CreateJobRequest(dataset_path="train.jsonl", adapter_id=adapter_id,
                                     method=ft_pb.METHOD_FULL if full else ft_pb.METHOD_LORA,
                                     validation_dataset_path=validation)
        for key, value in {"steps": 3, "max_seq_len": 16, "batch_size": 1, **hp}.items():
            setattr(req.hyperparameters, key, value)
        spec = check_create(job_request(req), self.store, self.data_dir, self.tokenizer, CONTEXT, self.adapters.has)
        return self.jobs.create(spec).id

    def run(self, turns: int) -> None:
        """`turns` turns of side work, as the scheduler gives them."""
        for _ in range(turns):
            assert self.jobs.has_work()
            self.jobs.step(self.ranks)

    def job(self, job_id: str) -> JobRecord:
        return self.jobs.get(job_id)

    def gauge(self, state: str) -> float:
        return self.metric("tprt_finetune_jobs", state=state)

    def metric(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        assert value is not None, name
        return value


@pytest.fixture
def server(tmp_path: Path, tokenizer: Tokenizer) -> Callable[[], Server]:
    """Starts a Server over tmp_path (call again for a restart on the same --data-dir)."""
    (tmp_path / "train.jsonl").write_text("".join(f'{{"text": "hello number {i}"}}\n' for i in range(6)))
    made: list[Server] = []

    def start(max_stored: int | None = None) -> Server:
        if made:
            made[-1].store.close()
        made.append(Server(tmp_path, tokenizer, max_stored))
        return made[-1]

    return start


# ----------------------------------------------------------------- replicas of a fleet (issue 43)


def test_a_replica_that_stalls_loses_its_job_to_another_which_resumes_it(
        tmp_path: Path, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replicas on one store: A trains to a checkpoint and stalls past its lease; B takes the
    job over from the checkpoint and finishes it; A, waking up, drops the job without writing.
    Every step is trained once, and a --no-jobs replica never trains."""
    import serve.jobs.manager

    monkeypatch.setattr(serve.jobs.manager, "POLL_S", 0.0)
    (tmp_path / "train.jsonl").write_text("".join(f'{{"text": "hello number {i}"}}\n' for i in range(6)))
    a, b = (Server(tmp_path, tokenizer, replica=name, lease_ms=300) for name in ("a", "b"))
    idle = Server(tmp_path, tokenizer, replica="idle", run_jobs=False)
    job_id = idle.create(steps=4, checkpoint_every=2)  # accepted by a replica that trains none
    assert not idle.jobs.has_work()
    a.run(3)  # claim, step 1, step 2 and its checkpoint
    rec = b.job(job_id)
    assert (rec.state, rec.step, rec.checkpoint) == (RUNNING, 2, f"jobs/{job_id}")
    assert a.store.lease_owner(job_id) == "a"
    b.run(1)  # A's lease is current: nothing for B
    assert b.ranks.commands == [] and a.store.lease_owner(job_id) == "a"
    time.sleep(0.4)  # A stalls past its lease
    b.run(1)  # B re-queues the lapsed job and claims it, resuming at A's checkpoint
    assert b.ranks.started[-1]["resume"] is True and b.store.lease_owner(job_id) == "b"
    a.run(1)  # A wakes: its lease is gone, so is its job (aborted, nothing written)
    assert a.ranks.commands[-1] == "train_abort" and a.jobs._active is None
    assert b.job(job_id).step == 2
    b.run(2)  # steps 3 and 4
    rec = b.job(job_id)
    assert (rec.state, rec.step, rec.error) == (SUCCEEDED, 4, "")
    assert a.ranks.commands.count("train_step") + b.ranks.commands.count("train_step") == 4
    assert idle.ranks.commands == []


def test_replicas_dying_stalling_and_racing_train_20_jobs_each_step_under_one_lease(
        tmp_path: Path, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three replicas at a time over 20 jobs, in a seeded random order of turns: now and then one
    dies (it never runs again; a new replica takes its place) or stalls past its lease. Every
    training step runs on the replica that holds the job's lease at that moment, a replica that
    lost a job never trains it again (a stalled one that wakes drops it), and every job succeeds."""
    import random

    import serve.jobs.manager

    monkeypatch.setattr(serve.jobs.manager, "POLL_S", 0.0)
    (tmp_path / "train.jsonl").write_text("".join(f'{{"text": "hello number {i}"}}\n' for i in range(6)))
    lease_ms, rng, born = 150, random.Random(43), 0
    steps_by: dict[str, list[str]] = {}  # job -> the replicas that ran each TrainStep, in order

    def replica() -> Server:
        nonlocal born
        born += 1
        srv = Server(tmp_path, tokenizer, replica=f"r{born}", lease_ms=lease_ms)
        run = srv.ranks.run

        def checked(cmd: RankCommand) -> Any:
            active = srv.jobs._active
            if isinstance(cmd, TrainStep) and active is not None:
                assert srv.store.lease_owner(active.job_id) == srv.jobs.owner, (active.job_id, srv.jobs.owner)
                steps_by.setdefault(active.job_id, []).append(srv.jobs.owner)
            return run(cmd)

        srv.ranks.run = checked  # type: ignore[method-assign]
        return srv

    live = [replica() for _ in range(3)]
    ids = [live[0].create(steps=4, checkpoint_every=2) for _ in range(20)]
    stalled: dict[str, float] = {}  # replica -> when it may run again
    deadline = time.monotonic() + 120
    while any(live[0].store.get(j).state != SUCCEEDED for j in ids):  # type: ignore[union-attr]
        assert time.monotonic() < deadline, live[0].store.counts()
        srv = rng.choice(live)
        roll = rng.random()
        if roll < 0.02:  # it dies: a new replica starts in its place
            live[live.index(srv)] = replica()
            continue
        if roll < 0.04 and srv.jobs._active is not None:  # it stalls past its lease
            stalled[srv.jobs.owner] = time.monotonic() + lease_ms / 1000 * 1.5
            continue
        if time.monotonic() < stalled.get(srv.jobs.owner, 0.0):
            continue
        held = srv.jobs._active.job_id if srv.jobs._active is not None else None
        if srv.jobs.has_work():
            srv.jobs.step(srv.ranks)
        if held is not None and srv.jobs._active is None and srv.store.lease_owner(held) not in ("", srv.jobs.owner):
            assert srv.ranks.commands[-1] == "train_abort"  # woke without its lease: dropped the job
        time.sleep(0.002)
    for job_id in ids:
        rec = live[0].store.get(job_id)
        assert rec is not None and (rec.state, rec.step) == (SUCCEEDED, 4), rec
        owners = steps_by[job_id]
        assert len(owners) >= 4
        runs = [o for i, o in enumerate(owners) if i == 0 or owners[i - 1] != o]
        assert len(runs) == len(set(runs)), owners  # a replica that lost a job never trains it again
    assert born > 3 and stalled  # the run did kill and stall replicas
    assert any(len(set(steps_by[j])) > 1 for j in ids)  # and jobs changed hands mid-run


# ----------------------------------------------------------------- transitions


def test_a_lora_job_runs_to_success_and_its_adapter_is_served(server: Callable[[], Server]) -> None:
    s = server()
    job_id = s.create(steps=4, checkpoint_every=2, adapter_id="tuned")
    rec = s.job(job_id)
    assert (rec.state, rec.step, rec.total_steps, rec.started_ms) == (QUEUED, 0, 4, 0)
    assert s.wakes == 1 and s.gauge("queued") == 1 and s.jobs.has_work()
    s.run(1)  # starts it
    rec = s.job(job_id)
    assert (rec.state, rec.step, rec.total_steps) == (RUNNING, 0, 4) and rec.started_ms >= rec.created_ms
    assert s.gauge("running") == 1 and s.gauge("queued") == 0
    started = s.ranks.started[0]
    assert started["resume"] is False and started["config"].out == s.data_dir / "jobs" / job_id
    assert started["config"].steps == 4 and started["config"].full is False
    s.run(2)
    rec = s.job(job_id)
    assert (rec.step, rec.loss, rec.checkpoint) == (2, 0.5, f"jobs/{job_id}")  # checkpoint_every=2
    assert rec.tokens_per_second == TOKENS_PER_STEP / STEP_SECONDS and rec.trained_tokens == 2 * TOKENS_PER_STEP
    s.run(2)
    rec = s.job(job_id)
    assert (rec.state, rec.step, rec.loss, rec.error) == (SUCCEEDED, 4, 0.25, "")
    assert rec.output_path == f"jobs/{job_id}/adapter" and rec.finished_ms >= rec.started_ms
    assert s.ranks.commands == ["train_start", "train_step", "train_step", "train_save", "train_step",
                                "train_step", "train_finish"]  # registered on disk: no device slot needed
    adapter = s.adapters.get("tuned")
    assert adapter is not None and (adapter.rank, adapter.alpha, adapter.tier) == (4, 8.0, DISK)
    assert adapter.source_job_id == job_id and adapter.path == s.data_dir / rec.output_path
    s.pool.acquire("tuned")  # its first request loads it
    assert s.pool.make_resident(s.ranks, "tuned") == 1 and s.ranks.commands[-1] == "load_adapter"
    assert not s.jobs.has_work()
    assert s.gauge("succeeded") == 1 and s.gauge("running") == 0
    assert s.metric("tprt_finetune_steps_total") == 4 and s.metric("tprt_finetune_loss") == 0.25
    assert s.metric("tprt_finetune_tokens_total") == 4 * TOKENS_PER_STEP


def test_a_validation_dataset_is_checked_evaluated_and_its_loss_kept(server: Callable[[], Server]) -> None:
    from serve.errors import InvalidArgument

    s = server()
    (s.data_dir / "valid.jsonl").write_text('{"text": "held out one"}\n{"text": "held out two"}\n')
    (s.data_dir / "empty.jsonl").write_text("")
    job_id = s.create(steps=2, validation="valid.jsonl")
    assert s.job(job_id).validation_dataset == "valid.jsonl"
    s.run(1)
    started = s.ranks.started[0]
    assert len(started["dataset"].eval) == 2 and started["config"].eval_data == s.data_dir / "valid.jsonl"
    s.run(1)
    assert s.job(job_id).eval_loss is None  # measured after the last step only
    s.run(1)  # the last step, then the adapter is written and loaded
    rec = s.job(job_id)
    assert (rec.state, rec.eval_loss) == (SUCCEEDED, EVAL_LOSS)
    assert job_pb(rec).eval_loss == EVAL_LOSS and job_pb(rec).validation_dataset == "valid.jsonl"
    assert not job_pb(s.job(s.create(steps=1))).HasField("eval_loss")  # none given: none measured
    for given, kind in (("nope.jsonl", NotFound), ("../outside.jsonl", InvalidArgument),
                        ("empty.jsonl", InvalidArgument)):
        with pytest.raises(kind) as info:
            s.create(validation=given)
        assert info.value.field == "validation_dataset_path", given


def test_a_store_from_schema_1_gains_the_new_columns(tmp_path: Path) -> None:
    import sqlite3

    db = sqlite3.connect(tmp_path / "jobs.sqlite3")
    db.executescript("""CREATE TABLE jobs (
        id TEXT PRIMARY KEY, method TEXT NOT NULL, dataset TEXT NOT NULL, adapter_id TEXT NOT NULL,
        hyperparameters TEXT NOT NULL, state TEXT NOT NULL, created_ms INTEGER NOT NULL, started_ms INTEGER NOT NULL,
        finished_ms INTEGER NOT NULL, step INTEGER NOT NULL, total_steps INTEGER NOT NULL, loss REAL NOT NULL,
        tokens_per_second REAL NOT NULL, error TEXT NOT NULL, output_path TEXT NOT NULL, checkpoint TEXT NOT NULL,
        cancel_requested INTEGER NOT NULL);
        INSERT INTO jobs VALUES ('job-old', 'lora', 'd.jsonl', 'a', '{}', 'succeeded', 1, 2, 3, 4, 4, 0.5, 9.0, '',
                                 'jobs/job-old/adapter', '', 0);""")
    db.commit()
    db.close()
    store = JobStore(tmp_path)
    old = store.get("job-old")
    assert (old.state, old.loss, old.validation_dataset, old.eval_loss) == (SUCCEEDED, 0.5, "", None)
    assert (old.objective, old.init_adapter) == ("supervised", "")  # schema 4: jobs from before DPO
    store.update("job-old", eval_loss=1.25)
    assert store.get("job-old").eval_loss == 1.25
    store.close()


def test_a_full_job_writes_a_model_and_serves_nothing_new(server: Callable[[], Server]) -> None:
    s = server()
    job_id = s.create(full=True, steps=1)
    s.run(2)
    rec = s.job(job_id)
    assert (rec.state, rec.method, rec.adapter_id, rec.output_path) == (SUCCEEDED, "full", "", f"jobs/{job_id}/model")
    assert s.ranks.started[0]["config"].full is True
    assert "load_adapter" not in s.ranks.commands and s.adapters.list() == []


def test_jobs_run_one_at_a_time_in_creation_order(server: Callable[[], Server]) -> None:
    s = server()
    first, second = s.create(steps=2), s.create(steps=1)
    s.run(2)  # first starts and steps; second waits
    assert (s.job(first).state, s.job(second).state) == (RUNNING, QUEUED)
    s.run(1)  # first succeeds
    assert (s.job(first).state, s.job(second).state) == (SUCCEEDED, QUEUED)
    s.run(2)
    assert s.job(second).state == SUCCEEDED and not s.jobs.has_work()
    assert [st["config"].out.name for st in s.ranks.started] == [first, second]


def test_a_failed_command_fails_the_job_and_the_next_one_runs(server: Callable[[], Server]) -> None:
    s = server()
    s.ranks.fail["train_start"] = "rank 1: out of memory"
    broken, failing, fine = s.create(), s.create(), s.create(steps=1)
    s.run(1)
    rec = s.job(broken)
    assert (rec.state, rec.error) == (FAILED, "rank 1: out of memory") and rec.finished_ms > 0
    del s.ranks.fail["train_start"]
    s.ranks.fail["train_step"] = "loss is nan at step 1"
    s.run(2)  # starts "failing", whose first step fails
    rec = s.job(failing)
    assert (rec.state, rec.error, rec.step) == (FAILED, "loss is nan at step 1", 0)
    del s.ranks.fail["train_step"]
    s.run(2)
    assert s.job(fine).state == SUCCEEDED
    assert s.gauge("failed") == 2 and s.gauge("succeeded") == 1


def test_cancelling_queued_running_and_finished_jobs(server: Callable[[], Server]) -> None:
    s = server()
    running, queued = s.create(steps=100), s.create()
    s.run(2)
    commands = len(s.ranks.commands)
    rec = s.jobs.cancel(queued)  # at once, without the ranks
    assert (rec.state, rec.cancel_requested, rec.started_ms) == (CANCELLED, True, 0) and rec.finished_ms > 0
    assert len(s.ranks.commands) == commands
    wakes = s.wakes
    rec = s.jobs.cancel(running)  # at its next turn
    assert (rec.state, rec.cancel_requested) == (RUNNING, True) and s.wakes == wakes + 1
    s.run(1)
    rec = s.job(running)
    assert (rec.state, rec.step) == (CANCELLED, 1) and s.ranks.commands[-1] == "train_abort"
    assert not s.jobs.has_work()  # the cancelled queued job never starts
    assert s.gauge("cancelled") == 2 and s.gauge("running") == 0
    assert s.jobs.cancel(running).state == CANCELLED  # again: no error
    done = s.create(steps=1)
    s.run(2)
    with pytest.raises(FailedPrecondition, match="already succeeded"):
        s.jobs.cancel(done)
    with pytest.raises(NotFound):
        s.jobs.cancel("job-unknown")


# ----------------------------------------------------------------- watching


def test_watch_job_streams_every_change_until_the_end(server: Callable[[], Server]) -> None:
    s = server()
    job_id = s.create(steps=2)
    service = FineTuningService(JobsCore(s.jobs, s.tokenizer, CONTEXT, s.adapters))
    seen: list[tuple[int, int, float]] = []
    changed = threading.Condition()
    ended = threading.Event()

    def watch() -> None:
        for p in service.WatchJob(ft_pb.WatchJobRequest(job_id=job_id), FakeContext()):
            assert p.job_id == job_id and p.total_steps == 2
            with changed:
                seen.append((p.state, p.step, round(p.loss, 6)))
                changed.notify_all()
        ended.set()

    def saw(n: int) -> None:
        with changed:
            assert changed.wait_for(lambda: len(seen) >= n, WAIT_S), seen

    threading.Thread(target=watch, daemon=True).start()
    saw(1)
    for turn in range(2):  # start, then step 1; each change is seen before the next turn
        s.run(1)
        saw(2 + turn)
    s.run(1)  # step 2, the last: the job succeeds
    assert ended.wait(WAIT_S), "the stream did not end with the job"
    assert seen[:3] == [(ft_pb.JOB_STATE_QUEUED, 0, 0.0), (ft_pb.JOB_STATE_RUNNING, 0, 0.0),
                        (ft_pb.JOB_STATE_RUNNING, 1, 1.0)]
    assert seen[-1] == (ft_pb.JOB_STATE_SUCCEEDED, 2, 0.5)
    assert set(seen[3:-1]) <= {(ft_pb.JOB_STATE_RUNNING, 2, 0.5)}  # step 2 may be seen before the end


# ----------------------------------------------------------------- shutdown and restart


def test_shutdown_checkpoints_the_running_job_and_a_restart_resumes_it(server: Callable[[], Server]) -> None:
    s = server()
    job_id = s.create(steps=5, checkpoint_every=100)
    s.run(3)  # started, 2 steps
    s.woken.clear()
    s.jobs.stop_accepting()
    pausing = threading.Thread(target=s.jobs.pause_for_shutdown, args=(WAIT_S,))
    pausing.start()
    assert s.woken.wait(WAIT_S)  # the scheduler is asked for a turn ...
    s.jobs.step(s.ranks)  # ... in which the job is checkpointed and re-queued
    pausing.join(WAIT_S)
    assert not pausing.is_alive()
    assert s.ranks.commands[-2:] == ["train_save", "train_abort"]
    rec = s.job(job_id)
    assert (rec.state, rec.step, rec.checkpoint) == (QUEUED, 2, f"jobs/{job_id}")
    assert "checkpointed at step 2" in rec.error
    assert not s.jobs.has_work()  # not while shutting down
    with pytest.raises(Unavailable):
        s.create()
    s = server()  # a new server process on the same --data-dir
    assert s.recovered == []  # nothing was left running
    s.run(1)
    assert s.ranks.started[0]["resume"] is True and s.job(job_id).step == 2
    s.run(3)
    rec = s.job(job_id)
    assert (rec.state, rec.step, rec.error) == (SUCCEEDED, 5, "")


def test_a_restart_resumes_or_fails_jobs_left_running(server: Callable[[], Server]) -> None:
    s = server()
    resumable, lost = s.create(steps=6, checkpoint_every=2), s.create(steps=4)
    s.run(4)  # resumable: started, 3 steps, a checkpoint at step 2
    s.store.update(lost, state=RUNNING, step=1)  # another job the crash caught running, never checkpointed
    # The process dies here (no shutdown): the store still says RUNNING.
    s = server()
    by_id = {r.id: r for r in s.recovered}
    assert (by_id[resumable].state, by_id[resumable].error) == (QUEUED, "resumed from step 3 after a server restart")
    assert by_id[lost].state == FAILED and "no checkpoint to resume from" in by_id[lost].error
    assert s.job(lost).finished_ms > 0  # the store holds what recover() returned
    s.run(1)  # the dataset is read again from --data-dir: this process never saw the request
    started = s.ranks.started[0]
    assert started["resume"] is True and started["config"].out.name == resumable
    assert len(started["dataset"].train) > 0
    assert s.job(resumable).step == 2  # from the checkpoint, not the step the store last saw
    s.run(4)
    assert s.job(resumable).state == SUCCEEDED


def test_a_restart_restores_every_succeeded_adapter(server: Callable[[], Server]) -> None:
    s = server()
    ids = [s.create(steps=1, adapter_id=name) for name in ("one", "two")]
    s.run(4)
    s.store.create(JobRecord(id="job-gone", method="lora", dataset="train.jsonl", adapter_id="gone",
                             state=SUCCEEDED, output_path="jobs/job-gone/adapter"))  # its files were deleted
    s = server()
    s.jobs.restore_adapters()  # a failed registration is logged, not fatal
    assert s.ranks.commands == []  # registered on disk: start-up loads nothing
    assert [(a.id, a.source_job_id, a.tier) for a in s.adapters.list()] == [("one", ids[0], DISK), ("two", ids[1], DISK)]


def test_a_finished_job_needs_no_device_slot(server: Callable[[], Server]) -> None:
    """Every device slot pinned: the job still succeeds, its adapter registered on disk; a request
    for it is refused at once (no slot would ever free)."""
    s = server()
    s.pool.max_loras = 1
    (s.data_dir / "adapters" / "pinned").mkdir(parents=True)
    (s.data_dir / "adapters" / "pinned" / "adapter_config.json").write_text(
        json.dumps(adapter_config(["q"], 4, 8.0, 0.0, None)))
    s.pool.load(s.ranks, "pinned", s.data_dir / "adapters" / "pinned", pin=True)
    job_id = s.create(steps=1, adapter_id="tuned")
    s.run(2)
    rec = s.job(job_id)
    assert (rec.state, rec.error) == (SUCCEEDED, "") and s.adapters.get("tuned").tier == DISK  # type: ignore[union-attr]
    s.pool.acquire("tuned")
    with pytest.raises(QueueFull, match="pinned"):
        s.pool.make_resident(s.ranks, "tuned")


def test_an_adapter_id_taken_while_the_job_ran_leaves_the_job_succeeded(server: Callable[[], Server]) -> None:
    """A directory of the job's id appeared and has requests in flight: the job succeeds and says
    how to load its adapter; the served one is untouched."""
    s = server()
    job_id = s.create(steps=1, adapter_id="late")
    late = s.data_dir / "adapters" / "late"
    late.mkdir(parents=True)
    (late / "adapter_config.json").write_text(json.dumps(adapter_config(["q"], 2, 4.0, 0.0, None)))
    s.pool.acquire("late")  # in flight
    s.run(2)
    rec = s.job(job_id)
    assert rec.state == SUCCEEDED and f"LoadAdapter(job_id={job_id!r})" in rec.error, rec.error
    served = s.adapters.get("late")
    assert served is not None and served.rank == 2 and served.source_job_id == ""


def test_adapter_ids_that_name_the_base_model_or_a_directory_are_refused_at_creation(
        server: Callable[[], Server]) -> None:
    s = server()
    s.pool.reserved = frozenset({"base-model"})
    (s.data_dir / "adapters" / "on-disk").mkdir(parents=True)
    for taken in ("base-model", "on-disk"):
        with pytest.raises(AlreadyExists) as e:
            s.create(adapter_id=taken)
        assert e.value.field == "adapter_id"
    assert not list((s.data_dir / "jobs").glob("*"))  # a refused job leaves nothing behind


def test_an_error_of_the_job_itself_fails_it_alone(server: Callable[[], Server], monkeypatch: Any) -> None:
    """What a turn raises with the ranks sound: step() raises nothing, the job fails, its trainer
    is dropped on the ranks, the next job runs; the scheduler guard's `fail` (for whatever would
    still escape a turn) fails the running job the same way."""
    s = server()
    first, second, third = s.create(steps=5), s.create(steps=1), s.create(steps=5)
    s.run(1)
    error = OSError(28, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(s.jobs, "_train_step", lambda ranks, job: (_ for _ in ()).throw(error))
        s.jobs.step(s.ranks)
    rec = s.job(first)
    assert rec.state == FAILED and "storage (--data-dir) is full" in rec.error and s.ranks.commands[-1] == "train_abort"
    s.run(2)
    assert s.job(second).state == SUCCEEDED
    s.run(2)
    assert s.job(third).state == RUNNING
    s.jobs.fail(s.ranks, RuntimeError("a bug"))
    rec = s.job(third)
    assert rec.state == FAILED and "a bug" in rec.error and s.ranks.commands[-1] == "train_abort"


# ----------------------------------------------------------------- limits and a full disk


def test_the_store_is_bounded_pruning_the_oldest_failed_and_cancelled(server: Callable[..., Server]) -> None:
    """--max-stored-jobs 3: cancelled jobs make room (oldest first, their directories removed);
    when every stored job is live, a new one is refused with RESOURCE_EXHAUSTED naming the flag."""
    from serve.errors import QueueFull

    s = server(max_stored=3)
    a, b = s.create(), s.create()
    (s.data_dir / "jobs" / a).mkdir(parents=True, exist_ok=True)
    s.jobs.cancel(a)
    s.jobs.cancel(b)
    c = s.create()
    d = s.create()  # 4 jobs asked for, 3 stored: the oldest cancelled one (a) went
    assert [r.id for r in s.store.select()] == [d, c, b] and not (s.data_dir / "jobs" / a).exists()
    e = s.create()  # b went too
    assert {r.id for r in s.store.select()} == {c, d, e}
    with pytest.raises(QueueFull) as info:  # c, d, e all queued: nothing to prune
        s.create()
    assert "--max-stored-jobs" in str(info.value) and len(s.store.select()) == 3


def test_a_full_disk_fails_the_job_alone_and_the_next_one_runs(server: Callable[[], Server],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite's "database or disk is full" in a running job's step write (injected in the store's
    connection): step() raises nothing, the job is FAILED (kept in memory and shown until the store
    takes the write), the scheduler goes on and the next job runs once the disk has room again."""
    import sqlite3

    import serve.jobs.manager

    monkeypatch.setattr(serve.jobs.manager, "STORE_RETRY_S", 0.0)
    s = server()
    first, second = s.create(steps=5), s.create(steps=1)
    s.run(2)
    real = s.store.db._db  # type: ignore[attr-defined]
    full = {"on": True}

    class FullDisk:  # the store's connection, whose writes fail while the disk is full
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def execute(self, sql: str, *args: Any) -> Any:
            if full["on"] and sql.lstrip().startswith(("UPDATE", "INSERT")):
                raise sqlite3.OperationalError("database or disk is full")
            return real.execute(sql, *args)

    s.store.db._db = FullDisk()  # type: ignore[attr-defined]
    s.jobs.step(s.ranks)  # the step's write fails: no exception reaches the scheduler
    rec = s.job(first)
    assert rec.state == FAILED and "storage (--data-dir) is full" in rec.error
    assert s.ranks.commands[-1] == "train_abort"
    assert s.store.get(first).state == RUNNING  # the store could not take it yet ...
    with pytest.raises(Exception) as refused:
        s.create()
    assert type(refused.value).__name__ == "InsufficientStorage"
    full["on"] = False
    s.run(2)  # ... and takes it at the next turn; the next job runs
    assert s.store.get(first).state == FAILED and s.job(second).state == SUCCEEDED


def test_storage_errors_are_resource_exhausted(server: Callable[[], Server], monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC / EDQUOT / SQLITE_FULL map to RESOURCE_EXHAUSTED; CreateJob checks the free space first."""
    import errno
    import sqlite3

    import serve.jobs.storage
    from serve.errors import Status, status_of

    for e in (OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EDQUOT, "Disk quota exceeded"),
              sqlite3.OperationalError("database or disk is full")):
        assert status_of(e)[0] == Status.RESOURCE_EXHAUSTED, e
    assert status_of(OSError(errno.EACCES, "Permission denied"))[0] == Status.INTERNAL
    s = server()
    monkeypatch.setattr(serve.jobs.storage, "free_bytes", lambda path: 1 << 20)
    service = FineTuningService(JobsCore(s.jobs, s.tokenizer, CONTEXT, s.adapters))
    req = ft_pb.CreateJobRequest(inline_jsonl='{"text": "hi"}\n')
    with pytest.raises(Exception) as info:
        service.CreateJob(req, FakeContext())
    assert status_of(info.value)[0] == Status.RESOURCE_EXHAUSTED and "free" in str(info.value)
    assert s.store.select() == [] and not (s.data_dir / "jobs").exists()


def test_a_dataset_that_is_not_utf8_is_invalid_argument(server: Callable[[], Server]) -> None:
    from serve.errors import InvalidArgument

    s = server()
    (s.data_dir / "utf16.jsonl").write_text('{"text": "hello"}\n', encoding="utf-16")
    (s.data_dir / "binary.jsonl").write_bytes(b'{"text": "ok"}\n\xff\xfe\x00garbage\n')
    for name, line in (("utf16.jsonl", 1), ("binary.jsonl", 2)):
        req = ft_pb.CreateJobRequest(dataset_path=name)
        with pytest.raises(InvalidArgument) as info:
            check_create(job_request(req), s.store, s.data_dir, s.tokenizer, CONTEXT, s.adapters.has)
        assert info.value.field == "dataset_path" and f"{name}:{line}: not UTF-8 text" in str(info.value)


def test_hyperparameters_past_their_range_name_the_field(server: Callable[[], Server]) -> None:
    from serve.errors import InvalidArgument
    from serve.jobs.spec import checked_value

    for name, value in (("steps", 10**30), ("batch_size", 2**70), ("seed", -1), ("seed", 2**64),
                        ("learning_rate", float("nan")), ("learning_rate", float("inf")), ("learning_rate", -1.0),
                        ("batch_size", 1.5), ("steps", True)):
        with pytest.raises(InvalidArgument) as info:
            checked_value(name, value)
        assert info.value.field == f"hyperparameters.{name}", (name, value)
    assert checked_value("seed", 2**63 - 1) == 2**63 - 1 and checked_value("batch_size", 4.0) == 4


def test_a_dpo_job_starts_from_an_earlier_jobs_adapter(server: Callable[[], Server]) -> None:
    """OBJECTIVE_DPO: the trainer gets preference pairs, beta and the earlier job's adapter (whose
    rank, alpha and targets become the job's); a bad pair is refused by line at creation."""
    from serve.errors import InvalidArgument

    s = server()
    sft = s.create(steps=1, adapter_id="sft-first")
    s.run(2)
    assert s.job(sft).state == SUCCEEDED
    pair = {"input": {"messages": [{"role": "user", "content": "hello"}]},
            "preferred_output": [{"role": "assistant", "content": "hi"}],
            "non_preferred_output": [{"role": "assistant", "content": "go"}]}
    (s.data_dir / "pairs.jsonl").write_text(json.dumps(pair) + "\n" + json.dumps(pair) + "\n")

    def request(**fields: Any) -> Any:
        req = ft_pb.CreateJobRequest(**{"dataset_path": "pairs.jsonl", "objective": ft_pb.OBJECTIVE_DPO, **fields})
        for key, value in {"steps": 2, "max_seq_len": 48, "batch_size": 1, "beta": 0.25, "rpo_alpha": 2.5}.items():
            setattr(req.hyperparameters, key, value)
        return req

    spec = check_create(job_request(request(init_adapter="sft-first")), s.store, s.data_dir, s.tokenizer, CONTEXT,
                        s.adapters.has)
    job_id = s.jobs.create(spec).id
    rec = s.job(job_id)
    assert (rec.objective, rec.init_adapter) == ("dpo", f"jobs/{sft}/adapter")
    assert rec.hyperparameters["beta"] == 0.25 and rec.hyperparameters["dpo_loss"] == "sigmoid"
    assert (rec.hyperparameters["lora_rank"], rec.hyperparameters["lora_alpha"]) == (4, 8.0)  # the adapter's
    assert job_pb(rec).objective == ft_pb.OBJECTIVE_DPO and job_pb(rec).hyperparameters.beta == 0.25
    assert rec.hyperparameters["rpo_alpha"] == 2.5 and job_pb(rec).hyperparameters.rpo_alpha == 2.5
    s.run(1)
    started = s.ranks.started[-1]
    config, dataset = started["config"], started["dataset"]
    assert (config.objective, config.dpo.beta, config.lora.rank, config.lora.targets) == ("dpo", 0.25, 4, ("q",))
    assert config.dpo.rpo_alpha == 2.5
    assert config.lora.init == s.data_dir / "jobs" / sft / "adapter"
    assert dataset.pairs and dataset.n_examples == 2 and len(dataset.train) == 4
    (s.data_dir / "bad.jsonl").write_text(json.dumps(pair) + "\n" + json.dumps({**pair, "preferred_output": []}))
    # R8: an adapter under --data-dir/adapters/ whose files lead out of --data-dir is not followed
    outside = s.data_dir.parent / f"{s.data_dir.name}-outside"
    shutil.copytree(s.data_dir / "jobs" / sft / "adapter", outside)
    leaky = s.data_dir / "adapters" / "leaky"
    leaky.mkdir(parents=True)
    for f in outside.iterdir():
        (leaky / f.name).symlink_to(f)
    for req, field, message in (
            (request(init_adapter="leaky"), "init_adapter", "leads outside the server's --data-dir"),
            (request(init_adapter="sft-first", hyperparameters=ft_pb.Hyperparameters(lora_rank=8)),
             "hyperparameters.lora_rank", "differs from init_adapter's 4"),
            (request(dataset_path="bad.jsonl"), "dataset_path", "bad.jsonl:2: 'preferred_output' must be"),
            (request(method=ft_pb.METHOD_FULL, init_adapter="sft-first"), "init_adapter", "full fine-tune")):
        with pytest.raises(InvalidArgument) as info:
            check_create(job_request(req), s.store, s.data_dir, s.tokenizer, CONTEXT, s.adapters.has)
        assert info.value.field == field and message in str(info.value), (field, str(info.value))


def test_rpo_alpha_is_a_dpo_hyperparameter_in_0_to_100(server: Callable[[], Server]) -> None:
    """rpo_alpha (RPO, tprt/train/dpo.py): 0 unless set, both ends of [0, 100] taken; outside it, not
    finite, or on a supervised job it is INVALID_ARGUMENT naming hyperparameters.rpo_alpha."""
    from serve.errors import InvalidArgument

    s = server()
    pair = {"input": {"messages": [{"role": "user", "content": "hello"}]},
            "preferred_output": [{"role": "assistant", "content": "hi"}],
            "non_preferred_output": [{"role": "assistant", "content": "go"}]}
    (s.data_dir / "pairs.jsonl").write_text(json.dumps(pair) + "\n")

    def create(objective: int = ft_pb.OBJECTIVE_DPO, **hp: Any) -> Any:
        req = ft_pb.CreateJobRequest(dataset_path="pairs.jsonl" if objective == ft_pb.OBJECTIVE_DPO else "train.jsonl",
                                     objective=objective,
                                     hyperparameters=ft_pb.Hyperparameters(steps=1, max_seq_len=48, batch_size=1, **hp))
        return check_create(job_request(req), s.store, s.data_dir, s.tokenizer, CONTEXT, s.adapters.has).record

    assert create().hyperparameters["rpo_alpha"] == 1.0  # the default: DPO that moves greedy answers (dpo_advice)
    for value in (0.0, 1, 100.0):
        rec = create(rpo_alpha=value)
        assert rec.hyperparameters["rpo_alpha"] == value and job_pb(rec).hyperparameters.rpo_alpha == value
    assert "rpo_alpha" not in create(ft_pb.OBJECTIVE_SUPERVISED).hyperparameters
    for objective, value, message in ((ft_pb.OBJECTIVE_SUPERVISED, 1.0, "applies to OBJECTIVE_DPO jobs only"),
                                      (ft_pb.OBJECTIVE_DPO, -0.5, "must be a number in [0.0, 100.0], got -0.5"),
                                      (ft_pb.OBJECTIVE_DPO, 100.5, "got 100.5"),
                                      (ft_pb.OBJECTIVE_DPO, float("nan"), "got nan"),
                                      (ft_pb.OBJECTIVE_DPO, float("inf"), "got inf")):
        with pytest.raises(InvalidArgument) as info:
            create(objective, rpo_alpha=value)
        assert info.value.field == "hyperparameters.rpo_alpha" and message in str(info.value), (value, str(info.value))


def test_a_job_request_is_neutral_and_grpc_maps_onto_it(server: Callable[[], Server]) -> None:
    """check_create takes serve.jobs.request.JobRequest, which either front end builds: gRPC's
    mapping keeps proto3 presence (only the hyper-parameters set) and its own enum errors, and the
    neutral request's own mistakes are refused by name."""
    from serve.errors import InvalidArgument
    from serve.jobs.request import JobRequest

    req = ft_pb.CreateJobRequest(inline_jsonl="x", method=ft_pb.METHOD_FULL, objective=ft_pb.OBJECTIVE_DPO,
                                 hyperparameters=ft_pb.Hyperparameters(steps=5, beta=0.5, dpo_loss="ipo"))
    assert job_request(req) == JobRequest(method="full", objective="dpo", inline_jsonl="x",
                                          hyperparameters={"steps": 5, "beta": 0.5, "dpo_loss": "ipo"})
    assert job_request(ft_pb.CreateJobRequest(dataset_path="")) == JobRequest(dataset_path="")  # set, if empty
    for bad, field in ((ft_pb.CreateJobRequest(method=7), "method"), (ft_pb.CreateJobRequest(objective=9), "objective")):
        with pytest.raises(InvalidArgument, match="unknown") as info:
            job_request(bad)
        assert info.value.field == field
    s = server()
    spec = check_create(JobRequest(dataset_path="train.jsonl", hyperparameters={"steps": 2, "seed": 7}),
                        s.store, s.data_dir, s.tokenizer, CONTEXT, s.adapters.has)
    assert (spec.record.hyperparameters["steps"], spec.record.hyperparameters["seed"]) == (2, 7)
    assert spec.record.hyperparameters["batch_size"] == 4 and spec.record.method == "lora"  # defaults filled in
    for bad, field in ((JobRequest(dataset_path="train.jsonl", inline_jsonl="{}"), "dataset"),
                       (JobRequest(dataset_path="train.jsonl", method="METHOD_FULL"), "method"),
                       (JobRequest(dataset_path="train.jsonl", objective="sft"), "objective"),
                       (JobRequest(dataset_path="train.jsonl", hyperparameters={"epochs": 3}), "hyperparameters.epochs"),
                       (JobRequest(dataset_path="train.jsonl", objective="dpo", hyperparameters={"beta": "high"}),
                        "hyperparameters.beta")):
        with pytest.raises(InvalidArgument) as info:
            check_create(bad, s.store, s.data_dir, s.tokenizer, CONTEXT, s.adapters.has)
        assert info.value.field == field, (bad, str(info.value))
    assert s.store.select() == [] and not (s.data_dir / "jobs").exists()  # nothing kept of a refused request


def test_the_job_side_and_the_http_path_import_no_protobuf() -> None:
    """Protobuf stays in serve/grpc/: the job checks and the OpenAI routes read their own types (gRPC's
    status codes are the errors' vocabulary, serve/errors.py, and may be named)."""
    import ast

    root = Path(__file__).resolve().parents[1] / "serve"
    for path in sorted([*(root / "jobs").glob("*.py"), *(root / "openai").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(("serve.grpc", "serve._proto", "google.protobuf")), (path, name)
