"""The server's stores (jobs, stored responses, batches) on both databases: every test here runs
on an SQLite file and on a PostgreSQL server started for this module (tests/pg.py), through the
same code (serve/store/database.py). "Two connections" stand for two replicas, or one server
before and after a restart."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pg import PostgresServer
from serve.errors import NotFound
from serve.jobs.store import (FAILED, QUEUED, RUNNING, AdapterIdTaken, JobRecord, JobStore, LeaseLost, QueueLimit,
                              StoreLimit)
from serve.openai.batches import BatchStore
from serve.openai.response_store import ResponseStore
from serve.store.database import Database, PostgresDatabase, SqliteDatabase, StoreError, Stores, redact_url

Connect = Callable[[], Database]


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def connect(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Connect]:
    """Opens another connection to one fresh database (closed at the end)."""
    opened: list[Database] = []
    if request.param == "sqlite":
        def make() -> Database:
            return SqliteDatabase(tmp_path / "state.sqlite")
    else:
        url = request.getfixturevalue("postgres").database()

        def make() -> Database:
            return PostgresDatabase(url)

    def connect_() -> Database:
        opened.append(make())
        return opened[-1]

    yield connect_
    for db in opened:
        db.close()


def _job(job_id: str, adapter: str = "", created_ms: int | None = None) -> JobRecord:
    rec = JobRecord(id=job_id, method="lora" if adapter else "full", dataset="d.jsonl", adapter_id=adapter)
    if created_ms is not None:
        rec.created_ms = created_ms
    return rec


# ----------------------------------------------------------------- jobs


def test_jobs_created_in_one_millisecond_are_claimed_in_creation_order(connect: Connect) -> None:
    """Ids are random, so within one created_ms the queue's order is the order of insertion."""
    store = JobStore(connect())
    ids = ["job-f00", "job-a00", "job-c00", "job-b00"]
    for job_id in ids:
        store.create(_job(job_id, created_ms=1_000))
    assert store.next_queued().id == ids[0]  # type: ignore[union-attr]
    started = []
    while (rec := store.claim("replica-a")) is not None:
        assert rec.state == RUNNING and rec.started_ms > 0
        started.append(rec.id)
    assert started == ids


def test_adapter_id_is_claimed_once_across_connections(connect: Connect) -> None:
    first, second = JobStore(connect()), JobStore(connect())
    first.create(_job("job-a", "shared"))
    with pytest.raises(AdapterIdTaken):
        second.create(_job("job-b", "shared"))
    second.create(_job("job-c"))  # no id to claim
    second.create(_job("job-d"))
    first.update("job-a", state=FAILED)  # a failed job frees its id
    second.create(_job("job-e", "shared"))
    with pytest.raises(QueueLimit):  # jobs c, d and e wait: a bound of 1 is reached
        second.create(_job("job-f"), max_queued=1)
    assert second.adapter_taken("shared") and not second.adapter_taken("other")


def test_a_full_store_prunes_the_oldest_failed_jobs_else_refuses(connect: Connect) -> None:
    store = JobStore(connect())
    for i in range(3):
        store.create(_job(f"job-{i}", created_ms=i), max_stored=3)
    store.update("job-1", state=FAILED)
    _, pruned = store.create(_job("job-3", created_ms=3), max_stored=3)
    assert pruned == ["job-1"] and store.get("job-1") is None
    with pytest.raises(StoreLimit):
        store.create(_job("job-4", created_ms=4), max_stored=3)
    assert store.counts() == {QUEUED: 3}


def test_page_lists_newest_first_after_a_job(connect: Connect) -> None:
    store = JobStore(connect())
    # two jobs created in the same millisecond, the later one with the smaller (random) id: insertion order decides
    for i, created in zip((0, 2, 1, 3), (100, 200, 200, 300)):
        store.create(_job(f"job-{i}", created_ms=created))
    assert [r.id for r in store.page(None, 2)] == ["job-3", "job-1"]
    assert [r.id for r in store.page("job-1", 10)] == ["job-2", "job-0"]
    assert [r.id for r in store.select()] == ["job-3", "job-1", "job-2", "job-0"]
    assert store.page("job-0", 10) == []
    with pytest.raises(KeyError):
        store.page("job-nope", 1)
    assert [r.id for r in store.using_dataset("d.jsonl")] and store.using_dataset("other.jsonl") == []


def test_an_update_writes_only_its_fields(connect: Connect) -> None:
    """Replica B's cancellation is not undone by replica A's progress write of the same job."""
    a, b = JobStore(connect()), JobStore(connect())
    a.create(_job("job-x", "x", created_ms=1))
    rec = a.claim("replica-a")
    assert rec is not None and rec.hyperparameters == {} and rec.eval_loss is None
    b.update("job-x", cancel_requested=True)
    a.update("job-x", "replica-a", step=3, loss=0.5, hyperparameters={"steps": 9}, eval_loss=1.5)
    got = b.get("job-x")
    assert got is not None and got.cancel_requested and (got.step, got.loss, got.eval_loss) == (3, 0.5, 1.5)
    assert got.hyperparameters == {"steps": 9}


def test_leases_keep_a_job_on_one_replica_until_they_lapse(connect: Connect) -> None:
    a, b = JobStore(connect()), JobStore(connect())
    for i in range(3):
        a.create(_job(f"job-{i}", created_ms=i))
    first = a.claim("replica-a", lease_ms=60_000)
    second = b.claim("replica-b", lease_ms=60_000)
    assert (first.id, second.id) == ("job-0", "job-1")  # type: ignore[union-attr]
    assert a.renew("job-0", "replica-a") and not b.renew("job-0", "replica-b")
    with pytest.raises(LeaseLost, match="replica-a"):
        b.update("job-0", "replica-b", step=1)
    assert a.update("job-0", "replica-a", step=1, checkpoint="jobs/job-0").step == 1
    assert b.expire_leases(lambda rec: True) == []  # every lease is current
    # replica-a stalls past a short lease: its job goes back to the queue, resumable from its checkpoint
    a.claim("replica-a", lease_ms=1)  # job-2
    a.renew("job-0", "replica-a", lease_ms=1)
    time.sleep(0.01)
    lapsed = b.expire_leases(lambda rec: bool(rec.checkpoint))
    assert sorted((r.id, r.state) for r in lapsed) == [("job-0", QUEUED), ("job-2", FAILED)]
    assert "replica-a stopped renewing" in lapsed[0].error or "replica-a stopped renewing" in lapsed[1].error
    assert "no checkpoint" in b.get("job-2").error  # type: ignore[union-attr]
    taken = b.claim("replica-b")
    assert taken is not None and (taken.id, taken.step, taken.checkpoint) == ("job-0", 1, "jobs/job-0")
    assert not a.renew("job-0", "replica-a")
    with pytest.raises(LeaseLost):  # the stalled replica wakes up: it cannot write over replica-b's run
        a.update("job-0", "replica-a", step=2)
    assert b.lease_owner("job-0") == "replica-b"


def test_replicas_racing_for_jobs_claim_each_once(connect: Connect) -> None:
    """Four replicas (threads, a connection each) claim 20 jobs at once: every job is taken by
    exactly one of them."""
    JobStore(connect()).create(_job("job-warm"))  # migrated before the race
    creator = JobStore(connect())
    for i in range(20):
        creator.create(_job(f"job-{i:02d}", created_ms=i))
    stores = [JobStore(connect()) for _ in range(4)]
    claimed: list[list[str]] = [[] for _ in stores]
    start = threading.Barrier(len(stores))

    def replica(k: int) -> None:
        start.wait()
        while (rec := stores[k].claim(f"replica-{k}")) is not None:
            claimed[k].append(rec.id)

    threads = [threading.Thread(target=replica, args=(k,)) for k in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    every = [job for ids in claimed for job in ids]
    assert sorted(every) == sorted(["job-warm", *(f"job-{i:02d}" for i in range(20))])  # each once
    for k, ids in enumerate(claimed):
        assert all(creator.lease_owner(j) == f"replica-{k}" for j in ids)


def test_a_database_migrated_by_a_newer_tprt_is_refused(connect: Connect) -> None:
    db = connect()
    JobStore(db)
    db.execute("UPDATE tprt_schema SET version = 99 WHERE component = 'jobs'")
    with pytest.raises(StoreError, match="jobs tables are at schema version 99, newer than this tprt's 2"):
        JobStore(connect())
    assert db.migrate("jobs-like", ["CREATE TABLE t1 (k TEXT)", "CREATE TABLE t2 (k TEXT)"]) == 0
    assert db.migrate("jobs-like", ["CREATE TABLE t1 (k TEXT)", "CREATE TABLE t2 (k TEXT)"]) == 2  # nothing to do


# ----------------------------------------------------------------- responses and batches


def test_stored_responses_are_bounded_and_deleted(connect: Connect, tmp_path: Path) -> None:
    store = ResponseStore(tmp_path, max_stored=3, db=connect())
    for i in range(5):
        store.put({"id": f"resp_{i}", "output": [i]}, [{"id": f"msg_{i}"}], [{"turn": i}])
    store.put({"id": "resp_2", "output": ["again"]}, [], [{"turn": "again"}])  # replaced, now the newest
    assert store.count() == 3
    with pytest.raises(NotFound):
        store.get("resp_1")
    assert store.get("resp_2") == {"id": "resp_2", "output": ["again"]}
    assert store.conversation("resp_2") == [{"turn": "again"}] and store.input_items("resp_3") == [{"id": "msg_3"}]
    store.delete("resp_4")
    with pytest.raises(NotFound):
        store.delete("resp_4")
    assert ResponseStore(tmp_path, max_stored=3, db=connect()).count() == 2  # another connection sees them


def test_batches_page_newest_first_and_list_the_active_oldest_first(connect: Connect, tmp_path: Path) -> None:
    store = BatchStore(tmp_path, connect())
    for i, created in enumerate((10, 20, 20, 30)):
        store.put({"id": f"batch_{i}", "created_at": created, "status": "in_progress"})
    store.put({"id": "batch_1", "created_at": 20, "status": "completed"})  # an update keeps its place
    objs, more = store.page(None, 2)
    assert [o["id"] for o in objs] == ["batch_3", "batch_2"] and more
    objs, more = store.page("batch_2", 10)
    assert [o["id"] for o in objs] == ["batch_1", "batch_0"] and not more
    assert [o["id"] for o in BatchStore(tmp_path, connect()).active()] == ["batch_0", "batch_2", "batch_3"]
    assert store.get("batch_1")["status"] == "completed"
    with pytest.raises(NotFound):
        store.page("batch_nope", 1)


def test_each_replica_runs_the_batches_it_created(connect: Connect, tmp_path: Path) -> None:
    a, b = BatchStore(tmp_path, connect(), owner="a"), BatchStore(tmp_path, connect(), owner="b")
    a.put({"id": "batch_a", "created_at": 1, "status": "in_progress"})
    b.put({"id": "batch_b", "created_at": 2, "status": "in_progress"})
    b.put({"id": "batch_a", "created_at": 1, "status": "cancelling"})  # a cancel through b keeps a's run
    assert [o["id"] for o in a.active()] == ["batch_a"] and [o["id"] for o in b.active()] == ["batch_b"]
    assert [o["id"] for o in BatchStore(tmp_path, connect()).active()] == ["batch_a", "batch_b"]  # one server: all
    assert [o["id"] for o in a.page(None, 10)[0]] == ["batch_b", "batch_a"]  # every replica lists them all


# ----------------------------------------------------------------- store URLs


def test_store_urls_are_checked_and_their_passwords_never_shown(tmp_path: Path) -> None:
    assert redact_url("postgresql://tprt:s3cret@db:5432/tprt") == "postgresql://tprt:***@db:5432/tprt"
    with pytest.raises(StoreError, match="expected a postgresql:// URL"):
        Stores(tmp_path, "mysql://u:p@h/db")
    with pytest.raises(StoreError, match=r"cannot connect within 1 s.*") as info:
        PostgresDatabase("postgresql://tprt:s3cret@127.0.0.1:1/tprt", connect_timeout_s=1)
    assert "s3cret" not in str(info.value) and "tprt:***@127.0.0.1:1" in str(info.value)
    stores = Stores(tmp_path)
    assert not stores.shared and isinstance(stores.open("jobs.sqlite3"), SqliteDatabase)
    stores.close()


# ----------------------------------------------------------------- the artifact store


@pytest.fixture(params=["path", "memory"])
def artifact_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A directory (renames) and fsspec's in-memory filesystem (an object store's semantics)."""
    if request.param == "path":
        yield str(tmp_path / "artifacts")
    else:
        import fsspec

        url = f"memory://tprt-{tmp_path.name}"
        yield url
        fsspec.filesystem("memory").rm(url.removeprefix("memory:/"), recursive=True)


def _job_dir(data: Path, step: int) -> None:
    (data / "jobs" / "job-x" / "checkpoints" / f"step-{step}").mkdir(parents=True, exist_ok=True)
    (data / "jobs" / "job-x" / "checkpoints" / f"step-{step}" / "state.bin").write_bytes(bytes(range(256)) * step)
    (data / "jobs" / "job-x" / "dataset.jsonl").write_text('{"text": "hi"}\n')


def test_artifacts_travel_between_data_dirs_and_are_checked_on_read(artifact_url: str, tmp_path: Path) -> None:
    from serve.store.artifacts import ArtifactError, Artifacts

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    here, there = Artifacts(artifact_url, a), Artifacts(artifact_url, b)
    assert not there.fetch("jobs/job-x") and not there.exists("jobs/job-x")
    _job_dir(a, 3)
    first = here.publish("jobs/job-x")
    assert set(first["files"]) == {"checkpoints/step-3/state.bin", "dataset.jsonl"}
    assert there.fetch("jobs/job-x")
    assert (b / "jobs/job-x/checkpoints/step-3/state.bin").read_bytes() == bytes(range(256)) * 3
    # A newer version replaces the whole directory there; the older one leaves the store.
    _job_dir(a, 6)
    second = here.publish("jobs/job-x")
    assert second["version"] != first["version"] and not here.fs.exists(here._remote(f"jobs/job-x@{first['version']}"))
    assert there.fetch("jobs/job-x") and (b / "jobs/job-x/checkpoints/step-6/state.bin").exists()
    # A single file (an upload).
    (a / "files").mkdir()
    (a / "files/file-1.jsonl").write_text('{"text": "upload"}\n')
    here.publish("files/file-1.jsonl")
    assert there.fetch("files/file-1.jsonl") and (b / "files/file-1.jsonl").read_text() == '{"text": "upload"}\n'
    # A file changed in the store is refused, and the copy in the data dir stays as it was.
    blob = here._remote(f"files/file-1.jsonl@{here.manifest('files/file-1.jsonl')['version']}/file-1.jsonl")  # type: ignore[index]
    with here.fs.open(blob, "wb") as f:
        f.write(b'{"text": "tampered"}\n')
    (b / "files/.file-1.jsonl.artifact-version").unlink()  # as if b had never fetched it
    with pytest.raises(ArtifactError, match="does not match its checksum"):
        there.fetch("files/file-1.jsonl")
    assert (b / "files/file-1.jsonl").read_text() == '{"text": "upload"}\n'
    assert not [p for p in (b / "files").iterdir() if ".fetch-" in p.name]  # no staging left behind
    # Files uploaded without their manifest (a publish cut short) are not an artifact.
    here.fs.makedirs(here._remote("jobs/job-cut@1"), exist_ok=True)
    with here.fs.open(here._remote("jobs/job-cut@1/dataset.jsonl"), "wb") as f:
        f.write(b"{}\n")
    assert not there.fetch("jobs/job-cut") and not (b / "jobs/job-cut").exists()


# ----------------------------------------------------------------- files across replicas


def test_files_uploaded_through_one_replica_are_listed_read_and_deleted_through_another(
        connect: Connect, tmp_path: Path) -> None:
    """Two replicas with data dirs of their own, one database and one artifact store: each lists
    every file, reads another's upload (fetched and checked), counts every upload against
    --max-stored-bytes, and a delete through one is a delete everywhere."""
    import io
    import os

    from serve.errors import InsufficientStorage, Unavailable
    from serve.openai.files import FileStore
    from serve.store.artifacts import Artifacts

    a, b, blobs = tmp_path / "a", tmp_path / "b", str(tmp_path / "artifacts")
    jobs = JobStore(connect())

    def replica(data: Path, artifacts: bool = True) -> FileStore:
        data.mkdir(exist_ok=True)
        return FileStore(data, None, 64, 1 << 20, jobs, max_stored_bytes=200,
                         artifacts=Artifacts(blobs, data) if artifacts else None, db=connect(), shared=True)

    here, there = replica(a), replica(b)
    body = b'{"custom_id": "1", "method": "POST", "url": "/v1/completions", "body": {}}\n'
    obj = here.add(io.BytesIO(body), "requests.jsonl", "batch")
    assert there.list() == [obj] and there.list("batch") == [obj] and there.list("fine-tune") == []
    assert there.get(obj["id"]) == obj and there.stored_bytes() == len(body)
    assert there.content(obj["id"]).read_bytes() == body  # fetched from the artifact store
    with pytest.raises(InsufficientStorage, match="--max-stored-bytes"):  # both uploads count, wherever they went
        there.add(io.BytesIO(body * 2), "more.jsonl", "batch")
    alone = replica(tmp_path / "c", artifacts=False)  # a replica that cannot reach the upload's data says so
    with pytest.raises(Unavailable, match="same --artifacts"):
        alone.content(obj["id"])
    assert there.delete(obj["id"]) == {"id": obj["id"], "object": "file", "deleted": True}
    assert here.list() == [] and not here.artifacts.exists(f"files/{obj['id']}.jsonl")  # type: ignore[union-attr]
    with pytest.raises(NotFound):
        here.content(obj["id"])
    # The deleted file's copy in a's data dir goes at a's next start, once older than an upload could be.
    stale = a / "files" / f"{obj['id']}.jsonl"
    assert stale.exists()
    replica(a)
    assert stale.exists()  # young: it might be another replica's upload in progress on a shared dir
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    replica(a)
    assert not stale.exists()


# ----------------------------------------------------------------- adapters across replicas


def test_adapters_loaded_or_unloaded_through_one_replica_follow_on_the_others(
        connect: Connect, tmp_path: Path) -> None:
    """Two replicas' pools (the ranks' side is tests/test_fleet.py's): a load through one is
    registered on the other (fetched from the artifact store) at its next poll or first request,
    a reload replaces the other's copy once its requests finish, and an unload reaches every
    replica and stays: neither a trained job nor a copy left in a data dir brings it back."""
    import json

    from serve.adapters.catalogue import AdapterCatalogue
    from serve.adapters.pool import AdapterPool
    from serve.adapters.registry import DISK, AdapterRegistry
    from serve.store.artifacts import Artifacts
    from tprt.lora.peft_io import adapter_config

    def write(data: Path, name: str, rank: int) -> Path:
        path = data / "adapters" / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "adapter_config.json").write_text(json.dumps(adapter_config(["q"], rank, 8.0, 0.0, None)))
        return path

    trained: dict[str, tuple[Path, str]] = {}
    blobs = str(tmp_path / "artifacts")
    replicas = {}
    for name in ("a", "b"):
        data = tmp_path / name
        data.mkdir()
        pool = AdapterPool(AdapterRegistry(), data, max_rank=16)
        catalogue = AdapterCatalogue(connect(), data, name, Artifacts(blobs, data), trained.get)
        pool.find_shared = catalogue.find
        replicas[name] = (pool, catalogue)
    (pa, ca), (pb, cb) = replicas["a"], replicas["b"]

    ca.loaded("tea", write(tmp_path / "a", "tea", rank=4))  # LoadAdapter through a
    assert not cb.sync(pb) and pb.registry.get("tea").tier == DISK  # type: ignore[union-attr]
    assert pb.registry.get("tea").rank == 4 and (tmp_path / "b/adapters/tea").is_dir()  # type: ignore[union-attr]
    ca.loaded("coffee", write(tmp_path / "a", "coffee", rank=2))
    assert pb.acquire("coffee").rank == 2  # a request before b's poll: resolved at once
    pb.release("coffee", started=False)
    assert not cb.sync(pb) and pb.registry.get("coffee").rank == 2  # type: ignore[union-attr]

    pb.acquire("tea")  # a request in flight on b while a reloads tea with new weights
    ca.loaded("tea", write(tmp_path / "a", "tea", rank=8))
    assert cb.sync(pb)  # b drains its old version; new requests there are refused as during an unload
    with pytest.raises(NotFound):
        pb.acquire("tea")
    pb.release("tea", started=False)
    pb.registry.remove("tea")  # what finish_unloads does on b's engine loop once the request ended
    assert not cb.sync(pb) and pb.registry.get("tea").rank == 8  # type: ignore[union-attr]

    pa.acquire("tea")  # a serves it too
    pa.release("tea", started=False)
    assert cb.unloaded("tea", here=True) and pb.begin_unload("tea") is None  # UnloadAdapter through b
    pb.registry.remove("tea")
    assert ca.sync(pa) and "tea" in {i.id for i in pa.registry.unloadable()}  # a unloads it too
    pa.registry.remove("tea")
    trained["tea"] = (tmp_path / "a/adapters/tea", "job-1")  # as if a job had trained it
    for pool in (pa, pb):  # nothing brings it back, not even the copy in each data dir
        with pytest.raises(NotFound, match="unloaded from the fleet"):
            pool.acquire("tea")
    assert not cb.unloaded("nothing", here=False)  # an id nobody knew: no tombstone
    assert cb.find("nothing") is None
    trained["espresso"] = (write(tmp_path / "b", "espresso", rank=4), "job-2")  # trained elsewhere, no row
    assert pa.acquire("espresso").source_job_id == "job-2"
    ca.loaded("tea", tmp_path / "a/adapters/tea")  # loaded again: every replica serves it again
    assert not cb.sync(pb) and pb.registry.get("tea").rank == 8  # type: ignore[union-attr]


# ----------------------------------------------------------------- batches across replicas


def test_a_batch_whose_replica_stops_is_finished_by_another_once_per_line(connect: Connect, tmp_path: Path) -> None:
    """Replica a runs a batch and stops midway (as its server would drain or die); once its
    lease lapses, replica b takes the batch over with the results a published, runs the rest,
    and the batch ends with one result per line. a, were it only stalled, can write nothing more."""
    import json

    from serve.errors import Unavailable
    from serve.openai.batches import BatchBody, BatchRunner, BatchStore, new_batch
    from serve.store.artifacts import Artifacts

    blobs = str(tmp_path / "artifacts")
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": f"p{i}"}}
             for i in range(12)]
    source = tmp_path / "input.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    ran: dict[str, list[str]] = {"a": [], "b": []}
    kept: dict[str, str] = {}

    def runner(name: str) -> BatchRunner:
        data = tmp_path / name
        data.mkdir()
        r = BatchRunner(BatchStore(data, connect(), owner=name, lease_ms=600), data, concurrency=1,
                        artifacts=Artifacts(blobs, data))

        def run_line(url: str, body: dict[str, Any], gone: Callable[[], str | None]) -> tuple[int, dict[str, Any]]:
            if name == "a" and len(ran["a"]) == 6:
                raise Unavailable("the server is shutting down")  # a stops here
            time.sleep(0.1)
            ran[name].append(body["prompt"])
            return 200, {"text": name}

        def publish(path: Path, filename: str) -> str:
            kept[filename] = path.read_text()
            return "file-" + name

        r.bind(run_line, publish)
        return r

    a = runner("a")
    obj = new_batch(BatchBody(input_file_id="file-1", endpoint="/v1/completions", completion_window="24h"), 12, None)
    a.submit(obj, source)
    a.start()
    wait_for_(lambda: len(ran["a"]) == 6 and not a._thread.is_alive(), 30)  # type: ignore[union-attr]
    b = runner("b")
    b.start()
    try:
        wait_for_(lambda: b.store.get(obj["id"])["status"] == "completed", 30)
    finally:
        b.stop()
    done = b.store.get(obj["id"])
    assert done["request_counts"] == {"total": 12, "completed": 12, "failed": 0} and done["output_file_id"] == "file-b"
    results = [json.loads(x) for x in kept[f"{obj['id']}_output.jsonl"].splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(x["custom_id"] for x in lines)  # each line once
    assert 0 < len(ran["b"]) < 12 and set(ran["a"]) | set(ran["b"]) == {f"p{i}" for i in range(12)}
    assert len([r for r in results if r["response"]["body"]["text"] == "a"]) == 12 - len(ran["b"])
    assert not BatchStore(tmp_path / "a", connect(), owner="a").save(done)  # a stalled a writes nothing now


def wait_for_(cond: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
