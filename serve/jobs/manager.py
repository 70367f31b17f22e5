"""Fine-tuning jobs on the serving ranks: the job manager (rank 0) and the FineTuning service.

One job runs at a time, one optimizer step per turn the engine loop gives it (serve/core/loop.py:
whenever generation is idle, and at least once a second while it is busy), each step a
command every rank executes (serve/ranks/commands.py, serve/ranks/executor.py). Jobs live in the
job store (serve/jobs/store.py); each has a directory `--data-dir/jobs/<id>/` holding its inline
dataset, its training checkpoints (every `checkpoint_every` steps and at shutdown), metrics and
the output.

Replicas sharing one store (`--store postgresql://...`) train each job once: this replica claims
the oldest queued job with a lease it renews while it trains (`lease_ms`), and writes the job's
progress only while it holds it; a job whose lease lapsed (its replica died or stalled) is
re-queued from its last checkpoint, or failed without one, by whichever replica looks first.
Replicas look for jobs queued elsewhere and lapsed leases every POLL_S.

A job's failure (bad data, a failed command, a store write that a full disk refuses) fails that
job alone: nothing a job raises reaches the engine loop's thread.

A finished LoRA job's adapter enters the adapter pool (serve/adapters/pool.py) under its adapter
id, registered on disk: servable at once, no restart, loaded onto the device by its first request
(and registered again at every start-up, where nothing is loaded until asked for). Finishing never
needs a device slot, so a job whose adapter cannot be placed now still succeeds. An adapter id
must be free when the job is created (not the base model's name, not a registered adapter's,
not a directory under --data-dir/adapters/); if it was taken meanwhile, the job still succeeds
and says how to load its adapter. A full fine-tune writes a TP checkpoint (`output_path`) to
serve with `tprt serve --model`.

No error of a job stops serving: the engine loop hands whatever a step raises (other than a broken
collective) to `fail`, which fails the running job alone.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve.adapters.pool import AdapterPool
from serve.errors import (AlreadyExists, FailedPrecondition, NotFound, QueueFull, ServeError, Unavailable, echo,
                          is_disk_full)
from serve.jobs.store import (CANCELLED, DEFAULT_LEASE_MS, FAILED, QUEUED, RUNNING, SUCCEEDED, AdapterIdTaken,
                              JobRecord, JobStore, LeaseLost, QueueLimit, StoreLimit, has_checkpoint, now_ms)
from serve.jobs.spec import JobSpec, finetune_config, load_dataset
from serve.metrics import Metrics
from serve.store.artifacts import Artifacts
from serve.ranks.commands import TrainAbort, TrainFinish, TrainSave, TrainStart, TrainStep
from tprt.distributed.ranks import CommandFailed, RankGroup
from tprt.errors import TprtError

log = logging.getLogger("tprt.serve")

BROKEN_GRACE_S = 2.0  # how long a failed command waits for the rank watcher before failing its job
STORE_RETRY_S = 5.0  # after a job store write failed (a full disk), the next job waits this long
POLL_S = 2.0  # a replica on a shared store looks this often for other replicas' queued jobs and lapsed leases


@dataclass
class _Active:
    job_id: str
    total: int
    step: int
    loss: float = 0.0
    tokens: int = 0  # trained so far


class JobManager:
    """Rank 0's view of the jobs; `has_work`/`step` are the engine loop's side-work interface."""

    def __init__(self, store: JobStore, data_dir: Path, metrics: Metrics, adapters: AdapterPool,
                 model_dir: Path, tokenizer: Any, context_length: int, wake: Any,
                 max_queued: int | None = None, redact: Callable[[str], str] = str,
                 max_stored: int | None = None, replica_id: str | None = None, shared: bool = False,
                 lease_ms: int = DEFAULT_LEASE_MS, run_jobs: bool = True,
                 artifacts: Artifacts | None = None) -> None:
        self.store = store
        self.artifacts = artifacts  # --artifacts: job directories shared with the other replicas
        self.owner = replica_id or new_replica_id()  # the lease holder's name in the store
        self.shared = shared  # other replicas use the store: poll it, and never take their running jobs
        self.lease_ms = lease_ms
        self.run_jobs = run_jobs  # --no-jobs: this replica accepts jobs for the others but trains none
        self._renewed = 0.0  # monotonic time the running job's lease was last renewed
        self._next_poll = 0.0
        self.data_dir = Path(data_dir)
        self.metrics = metrics
        self.adapters = adapters
        self.model_dir = Path(model_dir)
        self.tokenizer = tokenizer
        self.context_length = context_length
        self._wake = wake
        self.max_queued = max_queued
        self.max_stored = max_stored  # --max-stored-jobs (serve/jobs/store.py: the oldest failed/cancelled are pruned)
        self._unrecorded: dict[str, dict[str, Any]] = {}  # job id -> the end its store write could not record
        self._retry_at = 0.0  # monotonic time before which no job starts (a store write failed)
        self._redact = redact  # a job's error is shown to callers (serve.errors.Redactor)
        self._active: _Active | None = None
        self._accepting = True
        self._refusal = ""  # why no new jobs are taken, once they are not
        self._broken = False
        self._broken_event = threading.Event()  # set with _broken: a failed command waits on it briefly
        self._queued = store.next_queued() is not None
        self._pause = threading.Event()
        self._paused = threading.Event()
        self._lock = threading.Lock()
        self._update_gauges()

    # ----------------------------------------------------------------- API side (handler threads)

    def create(self, spec: JobSpec) -> JobRecord:
        """Stores a checked job as QUEUED and wakes the engine loop. It holds no prepared dataset
        while it waits (the data is read again when it starts): queued jobs cost only their row."""
        with self._lock:
            try:
                if not self._accepting:
                    raise Unavailable(self._refusal)
                if spec.record.method == "lora":
                    self.adapters.check_new_id(spec.record.adapter_id)
                if self.artifacts is not None and (self.data_dir / _job_dir(spec.record.id)).exists():
                    self.artifacts.publish(_job_dir(spec.record.id))  # its inline dataset, for whoever trains it
                rec, pruned = self.store.create(spec.record, self.max_queued, self.max_stored)
            except BaseException as e:  # a refused job leaves nothing on disk
                shutil.rmtree(self.data_dir / _job_dir(spec.record.id), ignore_errors=True)
                if isinstance(e, QueueLimit):
                    raise QueueFull(f"{self.max_queued} jobs are already queued (--max-queued-jobs); "
                                    "try again when one has started", "job") from None
                if isinstance(e, StoreLimit):
                    raise QueueFull(f"{self.max_stored} jobs are stored (--max-stored-jobs), none of them failed or "
                                    "cancelled that could make room", "job") from None
                if isinstance(e, AdapterIdTaken):  # another create claimed it since check_create looked
                    raise AlreadyExists(f"adapter id {spec.record.adapter_id!r} is already used",
                                        "adapter_id") from None
                raise
            self._queued = True
        for old in pruned:  # their rows are gone: so go their checkpoints and metrics
            shutil.rmtree(self.data_dir / _job_dir(old), ignore_errors=True)
        self._update_gauges()
        self._wake()
        return rec

    def get(self, job_id: str) -> JobRecord:
        rec = self.store.get(job_id) if job_id else None
        if rec is None:
            raise NotFound(f"no job {echo(job_id)}", "job_id")
        return self.shown(rec)

    def shown(self, rec: JobRecord) -> JobRecord:
        """A stored job as it is: with the end the store could not record (a full disk), if any."""
        ended = self._unrecorded.get(rec.id)
        if ended is None:
            return rec
        for k, v in ended.items():
            setattr(rec, k, v)
        return rec

    def cancel(self, job_id: str) -> JobRecord:
        """A queued job is cancelled at once; a running one at its next step."""
        rec = self.get(job_id)
        if rec.state == CANCELLED:
            return rec
        if rec.terminal:
            raise FailedPrecondition(f"job {job_id} has already {rec.state}", "job_id")
        if rec.state == QUEUED:
            rec = self.store.update(job_id, state=CANCELLED, finished_ms=now_ms(), cancel_requested=True)
        else:
            rec = self.store.update(job_id, cancel_requested=True)
            self._wake()
        self._update_gauges()
        return rec

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def refusal(self) -> str:
        return self._refusal

    def stop_accepting(self, why: str = "the server is shutting down; no new jobs") -> None:
        self._refusal = why
        self._accepting = False

    def ranks_broken(self, reason: str) -> None:
        """A rank died or a collective failed (any thread): the running job's record says so at
        once, queued to resume from its checkpoint after a restart (or FAILED without one); watchers
        end; CreateJob is refused with UNAVAILABLE until the server is restarted."""
        with self._lock:
            self._broken = True
            self._broken_event.set()
            job = self._active
            if job is not None:
                rec = self.store.get(job.job_id)
                if rec is not None and rec.state == RUNNING:
                    rec = self.store.interrupt(
                        rec, self.data_dir,
                        f"{reason} at step {rec.step}; resumes from its last checkpoint when the server restarts",
                        f"{reason} while the job was running")
                    log.error("job %s: %s", rec.id, rec.error)
            self.stop_accepting(f"the server cannot run jobs until it is restarted: {reason}")
        self._update_gauges()

    def pause_for_shutdown(self, timeout_s: float) -> None:
        """Checkpoints the running job and re-queues it (it resumes at the next start)."""
        if self._active is None:
            return
        self._pause.set()
        self._wake()
        if not self._paused.wait(timeout_s):
            log.warning("the running job did not checkpoint within %.0fs", timeout_s)

    # ----------------------------------------------------------------- start-up

    def restore_adapters(self) -> None:
        """Registers every succeeded LoRA job's adapter, on disk (before the engine loop's thread
        starts): each loads at its first request, so start-up time does not grow with history."""
        for rec in self.store.select(SUCCEEDED, limit=1_000_000):
            if rec.method == "lora" and rec.output_path:
                try:
                    # values=False: checked when the job finished, and again by the ranks at load
                    self.adapters.register(rec.adapter_id, self.data_dir / rec.output_path, rec.id, values=False)
                except ServeError as e:
                    log.error("job %s: adapter %s not registered: %s", rec.id, rec.adapter_id, e)

    def trained_adapter(self, adapter_id: str) -> tuple[Path, str] | None:
        """Where the job that trained `adapter_id` (on any replica) left it, and the job's id: the
        fleet's adapter catalogue falls back on it (serve/adapters/catalogue.py)."""
        rec = self.store.trained(adapter_id)
        if rec is None:
            return None
        if self.artifacts is not None and not (self.data_dir / rec.output_path).exists():
            self.artifacts.fetch(_job_dir(rec.id))
        return self.data_dir / rec.output_path, rec.id

    # ----------------------------------------------------------------- engine loop side

    def has_work(self) -> bool:
        if self._active is not None:
            return True
        now = time.monotonic()
        if self._unrecorded and now >= self._retry_at:
            return True
        if self.shared and self.run_jobs and now >= self._next_poll:  # other replicas' jobs and lapsed leases
            self._next_poll = now + POLL_S
            self._queued = True
        return self._queued and self._accepting and self.run_jobs and now >= self._retry_at

    def step(self, ranks: RankGroup) -> None:
        """One turn: start the next job, or run one step of the running one (or end it). A job's
        own failure (its data, a failed command, a store write the disk cannot take) fails that
        job alone, and nothing a job raises stops the engine loop: what even that leaves (the store
        unreadable) is logged, and the next turn waits STORE_RETRY_S."""
        try:
            self._turn(ranks)
        except Exception:  # noqa: BLE001 - see above
            if _world_broken(ranks):  # not the job's fault: the engine loop's guard breaks the world
                raise
            log.exception("fine-tuning jobs: a turn failed")
            self._retry_at = time.monotonic() + STORE_RETRY_S

    def _turn(self, ranks: RankGroup) -> None:
        if self._unrecorded:
            self._record_ends()
        job = self._active
        try:
            if job is None:
                if self.shared:
                    self._take_over_lapsed()
                self._start_next(ranks)
            elif self._pause.is_set():
                self._checkpoint_and_requeue(ranks, job)
            elif self.get(job.job_id).cancel_requested:
                ranks.run(TrainAbort())
                self._end(job, CANCELLED, "")
            else:
                self._train_step(ranks, job)
        except LeaseLost as e:  # another replica took the job over (this one stalled past its lease)
            log.warning("job %s: no longer trained here: %s", job.job_id if job else "?", e)
            self._abort_quietly(ranks)
            self._active = None
            self._update_gauges()
        except CommandFailed as e:
            if _world_broken(ranks):  # a rank died or a collective failed: ranks_broken requeues the job
                raise
            # A rank killed mid-step can surface here (its peer's read failed) a moment before the
            # rank watcher reports the death: give it that moment, then the job's own failure it is.
            if job is not None and not self._broken_event.wait(BROKEN_GRACE_S):
                self._end(job, FAILED, self._shown(e))
        except Exception as e:  # noqa: BLE001 - a store write, or a bug: that job fails, serving goes on
            if _world_broken(ranks):
                raise
            current = self._active
            log.exception("job %s failed", current.job_id if current is not None else "(none running)")
            if current is None:
                raise
            self._abandon(ranks, current, e)

    def _abandon(self, ranks: RankGroup, job: _Active, e: Exception) -> None:
        """The running job ends FAILED after an error outside its commands; its trainer is dropped."""
        try:
            ranks.run(TrainAbort())
        except CommandFailed:
            pass
        why = "the server's storage (--data-dir) is full" if is_disk_full(e) else f"internal error ({type(e).__name__})"
        self._end(job, FAILED, f"{why} at step {job.step}")

    def fail(self, ranks: RankGroup, error: Exception) -> None:
        """A turn raised `error` with the ranks sound (the engine loop's guard): the running job
        fails alone and its trainer is dropped; with none running, queued jobs wait for the next
        CreateJob's wake-up rather than retrying the failing start every turn."""
        job = self._active
        if job is None:
            self._queued = False
            return
        self._abort_quietly(ranks)
        try:
            self._end(job, FAILED, f"internal error: {self._shown(error)}")
        except Exception as e:  # noqa: BLE001 - the store itself failed: the job is at least no longer run
            log.error("job %s: its failure could not be recorded: %s", job.job_id, e)
            self._active = None

    def _abort_quietly(self, ranks: RankGroup) -> None:
        try:
            ranks.run(TrainAbort())
        except CommandFailed:
            pass

    def _take_over_lapsed(self) -> None:
        for rec in self.store.expire_leases(self._resumable):
            log.warning("job %s: %s", rec.id, rec.error)

    def _resumable(self, rec: JobRecord) -> bool:
        """Whether the job has a checkpoint here, or in the artifact store for this replica to fetch."""
        return has_checkpoint(rec, self.data_dir) or (
            bool(rec.checkpoint) and self.artifacts is not None and self.artifacts.exists(_job_dir(rec.id)))

    def _fetch_inputs(self, rec: JobRecord) -> None:
        """With --artifacts: what the job reads that another replica wrote (its directory, an
        uploaded file, another job's adapter it starts from), brought into this data dir."""
        if self.artifacts is None:
            return
        self.artifacts.fetch(_job_dir(rec.id))
        for rel in (rec.dataset, rec.validation_dataset, rec.init_adapter):
            name = _artifact_of(rel)
            if name and not (self.data_dir / rel).exists():
                self.artifacts.fetch(name)

    def _publish(self, job_id: str) -> None:
        if self.artifacts is not None:
            self.artifacts.publish(_job_dir(job_id))

    def _start_next(self, ranks: RankGroup) -> None:
        rec = self.store.claim(self.owner, self.lease_ms)
        self._queued = rec is not None
        if rec is None:
            return
        self._renewed = time.monotonic()
        try:
            self._fetch_inputs(rec)
            dataset = load_dataset(rec, self.data_dir, self.tokenizer)
            resume = has_checkpoint(rec, self.data_dir)
            config = finetune_config(rec, self.model_dir, self.data_dir)
            started = ranks.run(TrainStart(config, dataset, resume))
        except (TprtError, OSError) as e:  # bad data, a failed command, a full disk: the job fails, serving goes on
            self._record(rec.id, state=FAILED, finished_ms=now_ms(), error=self._shown(e))
            self._update_gauges()
            return
        self._active = _Active(rec.id, started.total, started.step, tokens=rec.trained_tokens)
        self._update_gauges()
        log.info("job %s: started at step %d of %d", rec.id, started.step, started.total)
        self.store.update(rec.id, self.owner, step=started.step, total_steps=started.total, error="")

    def _train_step(self, ranks: RankGroup, job: _Active) -> None:
        self._renew(job)
        out = ranks.run(TrainStep())
        job.step, job.loss = out.step, out.loss
        job.tokens += out.tokens
        tok_s = out.tokens / max(out.seconds, 1e-9)
        self.metrics.ft_steps.inc()
        self.metrics.ft_tokens.inc(out.tokens)
        self.metrics.ft_loss.set(job.loss)
        for name, value in (out.metrics or {}).items():  # a DPO job's rewards
            self.metrics.ft_preference.labels(name).set(value)
        measured = {} if out.eval_loss is None else {"eval_loss": out.eval_loss}
        rec = self.store.update(job.job_id, self.owner, step=job.step, loss=job.loss, tokens_per_second=tok_s,
                                trained_tokens=job.tokens, **measured)
        every = int(rec.hyperparameters.get("checkpoint_every", 0))
        if job.step >= job.total:
            self._finish(ranks, job, rec)
        elif every and job.step % every == 0:
            ranks.run(TrainSave())
            self._publish(job.job_id)
            self.store.update(job.job_id, self.owner, checkpoint=_job_dir(job.job_id))

    def _renew(self, job: _Active) -> None:
        """Extends the running job's lease once a third of it has passed; LeaseLost if it lapsed
        and another replica has the job now."""
        if time.monotonic() - self._renewed < self.lease_ms / 3000:
            return
        if not self.store.renew(job.job_id, self.owner, self.lease_ms):
            raise LeaseLost(f"its lease lapsed and the job is now {self.store.lease_owner(job.job_id) or 'queued'}'s")
        self._renewed = time.monotonic()

    def _finish(self, ranks: RankGroup, job: _Active, rec: JobRecord) -> None:
        output = Path(ranks.run(TrainFinish(job.loss)))
        rel = str(output.relative_to(self.data_dir)) if output.is_relative_to(self.data_dir) else str(output)
        self._publish(job.job_id)  # the adapter or model, for every replica
        rec = self.store.update(job.job_id, self.owner, output_path=rel)
        if rec.method == "lora":
            try:
                self.adapters.register(rec.adapter_id, output, rec.id)
            except AlreadyExists as e:  # taken since the job was created (LoadAdapter, a directory)
                self._end(job, SUCCEEDED, f"{self._redact(str(e))}; its adapter is not served: load it with "
                                          f"LoadAdapter(job_id={rec.id!r}) under another id")
                return
            except ServeError as e:  # its weights are unsound (NaN from a diverged run) or do not fit
                self._end(job, FAILED, f"the trained adapter cannot be served: {self._shown(e)}")
                return
        self._end(job, SUCCEEDED, "")

    def _checkpoint_and_requeue(self, ranks: RankGroup, job: _Active) -> None:
        try:
            ranks.run(TrainSave())
            ranks.run(TrainAbort())
            self._publish(job.job_id)
            self.store.update(job.job_id, self.owner, state=QUEUED, checkpoint=_job_dir(job.job_id),
                              error=f"checkpointed at step {job.step} for a server shutdown; resumes at the next "
                                    "start (or on another replica)")
        finally:
            self._active = None
            self._update_gauges()
            self._paused.set()

    def _end(self, job: _Active, state: str, error: str) -> None:
        self._active = None
        self._record(job.job_id, state=state, finished_ms=now_ms(), error=error)
        self._queued = self.store.next_queued() is not None
        self._update_gauges()
        log.info("job %s: %s%s", job.job_id, state, f" ({error})" if error else "")

    def _record(self, job_id: str, **end: Any) -> None:
        """Stores how a job ended; when the store cannot take the write (a full disk), the end is
        kept here, shown by `get`, and written again at later turns, and no job starts for a while."""
        try:
            self.store.update(job_id, self.owner, **end)  # every job it records, it claimed
            self._unrecorded.pop(job_id, None)
        except LeaseLost as e:  # another replica has the job now: its end is theirs to record
            log.warning("job %s: its end (%s) is not recorded here: %s", job_id, end.get("state"), e)
            self._unrecorded.pop(job_id, None)
        except Exception as e:  # noqa: BLE001 - a full disk (InsufficientStorage), a locked database
            log.error("job %s: its end (%s) could not be stored: %s", job_id, end.get("state"), e)
            self._unrecorded[job_id] = end
            self._retry_at = time.monotonic() + STORE_RETRY_S

    def _record_ends(self) -> None:
        if time.monotonic() < self._retry_at:
            return
        for job_id, end in list(self._unrecorded.items()):
            self._record(job_id, **end)

    def _shown(self, e: BaseException) -> str:
        """A job's failure as callers may see it; the full text goes to the log."""
        log.warning("job failed: %s", e)
        return self._redact(str(e))

    def _update_gauges(self) -> None:
        self.metrics.set_jobs(self.store.counts())


def _world_broken(ranks: Any) -> bool:
    """Whether the ranks' collectives failed (a rank died): the world's fault, not the job's."""
    return getattr(ranks, "failed", None) is not None


def new_replica_id() -> str:
    """This server process's name as a lease holder: host, process and a random part (a restarted
    process on the same host is another holder: it waits for the old leases to lapse)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def _artifact_of(rel: str) -> str:
    """The artifact that holds a path relative to the data dir: its job's directory, or an
    uploaded file; "" for anything else (a file the operator put in every data dir)."""
    parts = rel.split("/")
    if len(parts) >= 2 and parts[0] == "jobs":
        return "/".join(parts[:2])
    return rel if len(parts) == 2 and parts[0] == "files" else ""


def _job_dir(job_id: str) -> str:
    return f"jobs/{job_id}"
