"""`tprt serve`: the ranks, and on rank 0 the gRPC server, the engine loop's thread and /metrics.

Start-up (rank 0): check the flags and files (one-line errors, before anything starts), open
the job store (recovering jobs a previous run left RUNNING), bind the gRPC port, start the
follower ranks (tprt.distributed.launcher.start_followers) or join torchrun's world, load the
model shard, start the engine loop and serve. Every other rank loads its shard and follows
(tprt.distributed.ranks.follower_loop).

Shutdown (SIGTERM or SIGINT on rank 0): health goes NOT_SERVING and new requests are refused
with UNAVAILABLE (HTTP uploads and job creations with 503); in-flight requests, and uploads
being checked, get up to --drain-timeout seconds to finish (the rest are cancelled); a running
fine-tuning job is checkpointed and re-queued; the followers are released; exit status 0. If a rank dies, health goes NOT_SERVING and every request fails with UNAVAILABLE
until the process is stopped (exit status 1): a supervisor restarts it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serve.adapters.catalogue import AdapterCatalogue
from serve.kv_events import KVEventPublisher, KVEventsError
from serve.adapters.pool import AdapterPool
from serve.adapters.registry import AdapterRegistry
from serve.jobs.admission import JobAdmission
from serve.auth import TokenCheck, load_token
from serve.grpc.auth import AuthInterceptor
from serve.jobs.datasets import DatasetWork
from serve.errors import Redactor
from serve.grpc.errors import ErrorInterceptor
from serve.ranks.executor import RankExecutor
from serve.jobs.core import JobsCore
from serve.jobs.manager import JobManager, new_replica_id
from serve.openai.http_guard import HttpLimits
from serve.openai.http_server import HttpServer
from serve.openai.app import HttpDeps, create_app
from serve.openai.batches import BatchRunner, BatchStore
from serve.openai.files import FileStore
from serve.openai.response_store import ResponseStore
from serve.core.generation import GenerationCore, ModelFacts, text_byte_limit
from serve.grpc.handlers import FineTuningService, GenerationService
from serve.jobs.store import DB_NAME, JobStore
from serve.store.artifacts import Artifacts
from serve.store.database import StoreError, Stores, is_postgres_url, redact_url
from serve.grpc.limits import OpenCallLimiter
from serve.jobs.spec import DEFAULT_MAX_DATASET_BYTES
from serve.metrics import Metrics
from serve.router_metrics import RouterContract
from serve.grpc.pb import finetuning_pb2, finetuning_pb2_grpc, generation_pb2, generation_pb2_grpc
from serve.core.loop import EngineLoop
from tprt.engine.speculative import SpeculativeConfig, check_draft_model
from tprt.checkpoint.format import TPCheckpoint
from tprt.distributed.context import TPContext, in_distributed_env, init_distributed, shutdown
from tprt.distributed.launcher import start_followers, stop_followers, watch
from tprt.distributed.ranks import RankGroup, follower_loop
from tprt.engine.constraints import StructuredOutputs
from tprt.engine.core import Engine, EngineConfig
from tprt.engine.settings import CacheSettings, SchedulerSettings
from tprt.errors import ConfigError
from tprt.checkpoint.loading import load_model, load_stage, parse_dtype
from tprt.distributed.pipeline_mesh import PipelineMesh, init_pipeline
from tprt.parallel.stages import stages
from tprt.model.kv_cache import kv_cache_dtype
from tprt.model.kv_scales import kv_cache_flags, load_kv_scales
from tprt.model.llama import TPLlamaForCausalLM
from tprt.cpu.threads import run_on_exiting_thread, spare_cores
from tprt.text.tokenizer import Tokenizer

log = logging.getLogger("tprt.serve")

SERVICES = (
    generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
    finetuning_pb2.DESCRIPTOR.services_by_name["FineTuning"].full_name,
)


@dataclass(frozen=True)
class ServeConfig:
    """`tprt serve`'s flags."""

    model: Path
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port (printed)
    metrics_port: int = 9400  # 0: any free port (printed); -1: no /metrics endpoint
    http_port: int | None = None  # the OpenAI-compatible HTTP API (serve/openai/app.py); None: off; 0: any
    http_limits: HttpLimits = HttpLimits()  # serve/openai/http_guard.py
    scheduler: SchedulerSettings = SchedulerSettings()  # tprt.engine.settings
    cache: CacheSettings = CacheSettings()  # the KV cache (tprt.engine.settings)
    max_queue: int = 256
    auth_token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    data_dir: Path = Path("tprt-data")
    store: str | None = None  # PostgreSQL URL shared by replicas (serve/store); None: SQLite under data_dir
    artifacts: str | None = None  # the artifact store's URL (serve/store/artifacts.py); None: none
    replica_id: str | None = None  # the lease holder's name (serve/jobs/manager.py); None: host, pid, random
    job_lease: float = 30.0  # seconds a running job's lease lasts unless renewed
    run_jobs: bool = True  # --no-jobs: accept jobs, train none
    drain_timeout: float = 30.0
    dtype: str | None = None
    max_message_bytes: int = 16 * 1024 * 1024
    collective_timeout: float = 120.0
    threads: int | None = None  # torch threads per rank
    pp: int = 1  # pipeline stages of the checkpoint's TP ranks each (generation only: tprt.engine.stage_runner)
    max_dataset_bytes: int = DEFAULT_MAX_DATASET_BYTES  # inline JSONL or a dataset file of CreateJob
    ignore_unknown_fields: bool = False  # the HTTP APIs: drop fields the endpoint does not know
    max_queued_jobs: int = 64  # more CreateJobs are refused with RESOURCE_EXHAUSTED
    max_stored_jobs: int = 10_000  # serve/jobs/store.py: the oldest failed/cancelled are pruned, else refused
    max_stored_responses: int = 10_000  # serve/openai/response_store.py: the oldest are removed
    max_stored_bytes: int | None = None  # uploaded files' quota (serve/jobs/storage.py)
    max_open_calls: int = 8  # unary and streaming calls each, without a token (health, refused for one)
    job_memory_limit: int | None = None  # bytes a fine-tuning job may take; None: what is available then
    max_loras: int = 8  # LoRA adapters on the device, routable in one batch (serve/adapters/pool.py)
    max_cpu_loras: int = 8  # more adapters kept in host memory
    max_lora_rank: int = 64  # adapters of a higher rank are refused
    speculative: SpeculativeConfig | None = None  # tprt.engine.speculative; None: off
    kv_events: str | None = None  # ZeroMQ endpoint of the KV-cache events (serve/kv_events.py); None: off
    kv_events_replay: str | None = None  # and of their replay
    kv_events_topic: str = ""


def check_config(cfg: ServeConfig) -> TPCheckpoint:
    """Every flag and file, checked before anything starts; one-line ConfigErrors."""
    ckpt = TPCheckpoint(cfg.model)
    stages(ckpt.config.num_hidden_layers, cfg.pp)  # refuses a --pp the layers cannot take
    if cfg.pp > 1 and cfg.run_jobs:
        raise ConfigError(f"--pp {cfg.pp}: pipeline stages generate but do not train here; add --no-jobs (the "
                          "fine-tuning jobs are then accepted for a replica without --pp)")
    if cfg.dtype is not None:
        parse_dtype(cfg.dtype)
    draft = cfg.speculative.validate().draft_model if cfg.speculative is not None else None
    if draft is not None:
        check_draft_model(draft, ckpt.config.vocab_size)
    kv_cache_flags(cfg.cache.dtype, cfg.cache.scales, ckpt.config)
    cfg.cache.check()
    cfg.scheduler.check()
    limits = cfg.http_limits
    counts = {"max_queue": cfg.max_queue, "max_message_bytes": cfg.max_message_bytes,
              "max_dataset_bytes": cfg.max_dataset_bytes, "max_queued_jobs": cfg.max_queued_jobs,
              "max_stored_jobs": cfg.max_stored_jobs,
              "max_stored_responses": cfg.max_stored_responses, "max_stored_bytes": cfg.max_stored_bytes,
              "max_open_calls": cfg.max_open_calls, "job_memory_limit": cfg.job_memory_limit,
              "max_loras": cfg.max_loras, "max_lora_rank": cfg.max_lora_rank,
              "http_max_connections": limits.max_connections, "http_max_unauthenticated": limits.max_unauthenticated}
    for name, value in counts.items():
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name in ("port", "metrics_port"):
        if not -1 <= getattr(cfg, name) <= 65535:
            raise ConfigError(f"--{name.replace('_', '-')} must be a port number, got {getattr(cfg, name)}")
    if cfg.http_port is not None and not 0 <= cfg.http_port <= 65535:
        raise ConfigError(f"--http-port must be a port number, got {cfg.http_port}")
    if cfg.max_cpu_loras < 0:
        raise ConfigError(f"--max-cpu-loras must be at least 0, got {cfg.max_cpu_loras}")
    if cfg.store is not None and not is_postgres_url(cfg.store):
        raise ConfigError(f"--store {redact_url(cfg.store)}: expected a postgresql:// URL (without --store, the "
                          "stores are SQLite files under --data-dir)")
    if not cfg.job_lease > 0:
        raise ConfigError(f"--job-lease must be a positive number of seconds, got {cfg.job_lease}")
    if cfg.kv_events is not None and not cfg.cache.prefix_cache:
        raise ConfigError("--kv-events tells routers which prefixes are cached; it needs prefix caching (drop "
                          "--no-prefix-cache)")
    if cfg.kv_events is None and cfg.kv_events_replay is not None:
        raise ConfigError("--kv-events-replay replays what --kv-events publishes; give --kv-events too")
    if cfg.drain_timeout < 0 or cfg.collective_timeout <= 0:
        raise ConfigError("--drain-timeout must be >= 0 and --collective-timeout > 0")
    for flag, seconds in (("--http-header-timeout", limits.header_timeout), ("--http-body-timeout", limits.body_timeout)):
        if not seconds > 0:
            raise ConfigError(f"{flag} must be > 0 seconds, got {seconds}")
    if (cfg.tls_cert is None) != (cfg.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    for flag, path in (("--tls-cert", cfg.tls_cert), ("--tls-key", cfg.tls_key)):
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"{flag} {path}: no such file")
    if cfg.auth_token_file is not None:
        load_token(cfg.auth_token_file)
    try:
        Path(cfg.data_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--data-dir {cfg.data_dir}: cannot create it ({e.strerror})") from None
    if not os.access(cfg.data_dir, os.W_OK):
        raise ConfigError(f"--data-dir {cfg.data_dir}: not writable")
    return ckpt


# Running sequences when --max-batch-size is not given: on a GPU the paged KV pool (sized by free
# memory) holds far more than 16 sequences' tokens, and decode throughput grows with the batch.
DEFAULT_MAX_BATCH = {"cuda": 256, "cpu": 16}
DEFAULT_GPU_MEMORY_FRACTION = 0.9


def engine_config(cfg: ServeConfig, device: torch.device | None = None) -> EngineConfig:
    """The engine's settings; `device` (this rank's) lets masks use the cores it leaves free."""
    cache, scheduler = cfg.cache, cfg.scheduler
    fraction = cache.gpu_memory_fraction if cache.gpu_memory_fraction is not None else DEFAULT_GPU_MEMORY_FRACTION
    kv_scales = None if cache.scales is None else load_kv_scales(cache.scales, TPCheckpoint(cfg.model).config)
    return EngineConfig(max_batch=max_batch_size(cfg), max_seq_len=scheduler.max_seq_len,
                        token_budget=scheduler.token_budget, prefix_cache=cache.prefix_cache,
                        kv_cache_tokens=cache.tokens, kv_block_size=cache.block_size, gpu_memory_fraction=fraction,
                        speculative=cfg.speculative,
                        cache_dtype=torch.int8 if kv_scales is not None else kv_cache_dtype(cache.dtype),
                        kv_scales=kv_scales, mask_threads=0 if device is None else spare_cores(device),
                        attention_backend=cache.attention, cuda_graphs=scheduler.cuda_graphs,
                        sequence_parallel_tokens=scheduler.sequence_parallel)


def max_batch_size(cfg: ServeConfig) -> int:
    """--max-batch-size, or the default for this machine's device (CUDA when it has one)."""
    if cfg.scheduler.max_batch_size is not None:
        return cfg.scheduler.max_batch_size
    return DEFAULT_MAX_BATCH["cuda" if torch.cuda.is_available() else "cpu"]


def run_serve(cfg: ServeConfig) -> int:
    """The `tprt serve` entry point: this process is rank 0 (or torchrun's rank)."""
    ckpt = check_config(cfg)
    cfg = replace(cfg, model=Path(cfg.model).resolve(), data_dir=Path(cfg.data_dir).resolve())
    if in_distributed_env():
        return serve_rank(cfg, [])
    ranks = ckpt.tp_size * cfg.pp
    if cfg.threads is None:  # the machine's cores shared by the local ranks (rank 0 included)
        cfg = replace(cfg, threads=max(1, (os.cpu_count() or 1) // ranks))
    app = App(cfg)  # binds the ports before any rank starts: a busy port fails fast
    procs: list[Any] = []
    try:
        if ranks > 1:
            procs = start_followers(ranks, follower_main, (cfg,), cfg.threads or 1)
        return app.run(procs)
    finally:
        stop_followers(procs, grace_s=0 if app.broken else 10)


def follower_main(cfg: ServeConfig) -> None:
    """A follower rank of a local launch (a picklable entry point)."""
    serve_rank(cfg, [])


def serve_rank(cfg: ServeConfig, procs: list[Any]) -> int:
    """Every rank under torchrun; followers of a local launch. Rank 0 serves, the others follow."""
    if os.environ.get("RANK", "0") == "0":
        return App(cfg).run(procs)
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when to stop (after draining)
        signal.signal(sig, signal.SIG_IGN)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    mesh = join_ranks(cfg)
    try:
        model, engine = load_rank(cfg, mesh, None, driver=False)  # no tokenizer, no masks to compute
        follower_loop(engine.follow, engine.tp, RankExecutor(model, engine, cfg.model, Path(cfg.data_dir)))
    finally:
        shutdown()
    return 0


def join_ranks(cfg: ServeConfig) -> TPContext | PipelineMesh:
    """Joins the world: its TP context, or with --pp the groups of its pipeline."""
    if cfg.pp == 1:
        return init_distributed(timeout_s=cfg.collective_timeout)
    return init_pipeline(TPCheckpoint(cfg.model).tp_size, cfg.pp, timeout_s=cfg.collective_timeout)


def load_rank(cfg: ServeConfig, joined: TPContext | PipelineMesh, tokenizer: Tokenizer | None,
              driver: bool) -> tuple[TPLlamaForCausalLM, Engine]:
    """This rank's model (its stage's, with --pp) and engine; the `driver` (rank 0) computes
    masks on the cores the ranks leave."""
    ctx = joined if isinstance(joined, TPContext) else joined.tp
    config = engine_config(cfg, ctx.device if driver else None)
    if isinstance(joined, TPContext):
        model = load_model(cfg.model, ctx, cfg.dtype)
        return model, Engine(model, tokenizer, config)
    stage = stages(TPCheckpoint(cfg.model).config.num_hidden_layers, cfg.pp)[joined.stage_index]
    stage_model = load_stage(cfg.model, ctx, stage, cfg.dtype)
    return stage_model, Engine(stage_model, tokenizer, config, pipeline=joined)


class App:
    """Rank 0: gRPC, health, metrics, job store and the engine loop around one engine."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.metrics = Metrics()
        # One server per data dir, unless the replicas of a fleet share it behind a shared store
        # (whose leases keep them from running one job twice).
        self._data_lock = _lock_data_dir(Path(cfg.data_dir)) if cfg.store is None else None
        try:
            self.stores = Stores(cfg.data_dir, cfg.store)
            self.store = JobStore(self.stores.open(DB_NAME))
        except StoreError as e:  # unreachable, or migrated by a newer tprt
            raise ConfigError(str(e)) from None
        self.replica_id = cfg.replica_id or new_replica_id()  # the lease holder's name in the shared store
        try:
            self.artifacts = Artifacts(cfg.artifacts, Path(cfg.data_dir)) if cfg.artifacts else None
        except (ImportError, ValueError, OSError) as e:  # an unknown protocol, its package missing, no access
            raise ConfigError(f"--artifacts {cfg.artifacts}: {e}") from None
        if not self.stores.shared:  # alone on its files: every running job was this server's
            for rec in self.store.recover(Path(cfg.data_dir)):
                log.warning("job %s: %s after restart (%s)", rec.id, rec.state, rec.error)
        self.redact = Redactor({Path(cfg.data_dir): "", Path(cfg.model): "<model>/"})  # what callers may see
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self._set_health(False)
        self.server = self._grpc_server()
        self.port = self._bind()
        self.http = (HttpServer(cfg.host, cfg.http_port, cfg.tls_cert, cfg.tls_key, cfg.http_limits)
                     if cfg.http_port is not None else None)
        self.http_app: Any = None
        self.batches: BatchRunner | None = None  # the Batch API's (with --http-port)
        self.datasets = DatasetWork()  # HTTP uploads' and job creations' file work (the drain waits for it)
        self.stop = threading.Event()
        self.broken = False
        self.serving = False  # ready for requests: started, every rank up, not draining (HTTP /ready)
        self.loop: EngineLoop | None = None
        self.jobs: JobManager | None = None
        self.catalogue: AdapterCatalogue | None = None  # a fleet's replica: the adapters every replica serves
        self.kv_events: KVEventPublisher | None = None  # --kv-events

    # ----------------------------------------------------------------- set-up

    def _grpc_server(self) -> grpc.Server:
        cfg = self.cfg
        auth = AuthInterceptor(load_token(cfg.auth_token_file)) if cfg.auth_token_file is not None else None
        limiter = OpenCallLimiter(cfg.max_open_calls, auth.authenticated if auth is not None else lambda d: True)
        interceptors: list[grpc.ServerInterceptor] = [ErrorInterceptor(self.metrics.outcome, self.redact), limiter]
        if auth is not None:
            interceptors.append(auth)
        # A streaming RPC holds a thread throughout: authenticated work, plus the shares of calls
        # that need no token (serve/grpc/limits.py), so that those can never take the others' threads.
        workers = max_batch_size(cfg) + cfg.max_queue + 32 + 2 * cfg.max_open_calls
        options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                   ("grpc.max_send_message_length", cfg.max_message_bytes),
                   ("grpc.so_reuseport", 0)]
        return grpc.server(ThreadPoolExecutor(workers, thread_name_prefix="tprt-grpc"), interceptors=interceptors,
                           options=options, maximum_concurrent_rpcs=workers)

    def _bind(self) -> int:
        cfg = self.cfg
        address = f"{cfg.host}:{cfg.port}"
        try:
            if cfg.tls_cert is not None and cfg.tls_key is not None:
                creds = grpc.ssl_server_credentials([(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())])
                port = self.server.add_secure_port(address, creds)
            else:
                port = self.server.add_insecure_port(address)
        except RuntimeError as e:
            raise ConfigError(f"--host/--port {address}: cannot listen there ({e})") from None
        if not port:
            raise ConfigError(f"--host/--port {address}: cannot listen there (in use?)")
        return port

    def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *SERVICES):
            self.health.set(name, status)
        self.metrics.healthy.set(1 if serving else 0)
        self.serving = serving

    def _on_broken(self, reason: str) -> None:
        self.broken = True
        self._set_health(False)
        if self.jobs is not None:
            self.jobs.ranks_broken(self.redact(reason))  # a job's error is shown to callers

    def _load(self, joined: TPContext | PipelineMesh) -> tuple[TPLlamaForCausalLM, Engine, Tokenizer | None]:
        tokenizer = _tokenizer(Path(self.cfg.model))
        model, engine = load_rank(self.cfg, joined, tokenizer, driver=True)
        return model, engine, tokenizer

    def _services(self, ctx: TPContext, model: TPLlamaForCausalLM, engine: Engine, tokenizer: Tokenizer | None) -> None:
        cfg = self.cfg
        executor = RankExecutor(model, engine, cfg.model, Path(cfg.data_dir))
        ranks = RankGroup(ctx, executor)
        adapters = AdapterRegistry()
        name = Path(cfg.model).resolve().name  # the served model's name: no adapter may take it
        pool = AdapterPool(adapters, Path(cfg.data_dir), self.metrics, model.config, cfg.max_loras, cfg.max_cpu_loras,
                           cfg.max_lora_rank, reserved=(name,))
        self.loop = EngineLoop(engine, ranks, self.metrics, cfg.max_queue,
                               keepalive_s=min(2.0, cfg.collective_timeout / 4), on_broken=self._on_broken,
                                   adapters=pool)
        self.jobs = JobManager(self.store, Path(cfg.data_dir), self.metrics, pool, Path(cfg.model), tokenizer,
                               engine.max_seq_len, self.loop.wake, cfg.max_queued_jobs, self.redact,
                               cfg.max_stored_jobs, self.replica_id, self.stores.shared, int(cfg.job_lease * 1000),
                               cfg.run_jobs, self.artifacts)
        self.loop.side = self.jobs
        if cfg.kv_events is not None:
            self.kv_events = self._kv_events(engine, adapters)
        if self.stores.shared:  # adapters loaded, unloaded or trained through any replica, followed here
            self.catalogue = AdapterCatalogue(self.stores.open(DB_NAME), Path(cfg.data_dir), self.replica_id,
                                              self.artifacts, self.jobs.trained_adapter)
            pool.find_shared = self.catalogue.find
            self.catalogue.follow(pool, self.loop.wake)
        else:  # the fleet's are resolved at their first request instead
            self.jobs.restore_adapters()  # registered on disk: each loads at its first request
        facts = ModelFacts(name=name, config=model.config, tp_size=model.tp.world_size,
                           context_length=engine.max_seq_len, max_batch_size=max_batch_size(cfg),
                           dtype=str(model.dtype).removeprefix("torch."), eos_token_ids=engine.eos_token_ids,
                           kv_cache_dtype=engine.runner.cache.format_name,
                           kv_cache_tokens=engine.runner.cache.positions)
        compile_constraint = None
        if tokenizer is not None:  # output constraints: compiled on the requests' threads, cached for the engine
            m = self.metrics
            engine.structured_outputs = StructuredOutputs(tokenizer, on_compile=m.structured_compile.observe,
                                                          on_mask=m.structured_mask.observe)
            compile_constraint = engine.structured_outputs.compile
            threading.Thread(target=engine.structured_outputs.warm_up, daemon=True, name="tprt-grammar-warm-up").start()
        max_text_bytes = text_byte_limit(tokenizer, facts.context_length) if tokenizer is not None else None
        core = GenerationCore(self.loop, tokenizer, facts, adapters, self.metrics, compile_constraint, max_text_bytes)
        generation = GenerationService(core, pool, self.store, self.catalogue)
        generation_pb2_grpc.add_GenerationServicer_to_server(generation, self.server)
        jobs = JobsCore(self.jobs, tokenizer, engine.max_seq_len, adapters, cfg.max_dataset_bytes,
                        self._job_admission(ctx, model))
        if self.http is not None:
            token = load_token(cfg.auth_token_file) if cfg.auth_token_file is not None else None
            self.batches = BatchRunner(BatchStore(Path(cfg.data_dir), self.stores.open("batches.sqlite"),
                                                  self.replica_id if self.stores.shared else None,
                                                  int(cfg.job_lease * 1000)),
                                       Path(cfg.data_dir), max_batch_size(cfg), self.artifacts)
            files = FileStore(Path(cfg.data_dir), tokenizer, engine.max_seq_len, cfg.max_dataset_bytes, self.store,
                              cfg.max_stored_bytes, self.artifacts, self.stores.open("files.sqlite"), self.stores.shared)
            self.http_app = create_app(HttpDeps(core, jobs, self.metrics, token, cfg.max_message_bytes, time.time(),
                                                files, self.redact, datasets=self.datasets,
                                                ignore_unknown_fields=cfg.ignore_unknown_fields,
                                                responses=ResponseStore(Path(cfg.data_dir), cfg.max_stored_responses,
                                                                        self.stores.open("responses.sqlite")),
                                                batches=self.batches, alive=lambda: not self.broken,
                                                ready=lambda: self.serving, registry=self.metrics.registry))
        finetuning_pb2_grpc.add_FineTuningServicer_to_server(FineTuningService(jobs), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        loop = self.loop
        self.metrics.registry.register(RouterContract(lambda: loop.router_facts(cfg.max_loras), facts.name))
        self.metrics.info.info({"model": facts.name, "tp_size": str(model.tp.world_size), "dtype": facts.dtype,
                                "context_length": str(facts.context_length), "kv_cache_dtype": facts.kv_cache_dtype,
                                "kv_cache_tokens": str(facts.kv_cache_tokens)})

    def _kv_events(self, engine: Engine, adapters: AdapterRegistry) -> KVEventPublisher:
        """The KV-cache events' publisher, fed by the engine loop after every step."""
        cfg = self.cfg
        assert cfg.kv_events is not None and self.loop is not None

        def lora_name(index: int) -> str | None:
            return next((a.id for a in adapters.list() if a.index == index), None)

        medium = "GPU" if engine.runner.cache.kv.device.type == "cuda" else "CPU"
        try:
            publisher = KVEventPublisher(cfg.kv_events, cfg.kv_events_replay, cfg.kv_events_topic,
                                         engine.kv_block_size, medium, lora_name)
        except KVEventsError as e:
            raise ConfigError(str(e)) from None
        engine.record_kv_events()
        self.loop.after_step = lambda: publisher.publish(engine.take_kv_events())
        log.info("KV-cache events on %s%s", publisher.endpoint,
                 f" (replay on {publisher.replay_endpoint})" if publisher.replay_endpoint else "")
        return publisher

    def _job_admission(self, ctx: TPContext, model: TPLlamaForCausalLM) -> JobAdmission:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))  # they share this host's memory
        device = next(model.parameters()).device
        served = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[model.dtype]
        return JobAdmission(model.config, model.tp.world_size, local_ranks, device, self.cfg.job_memory_limit, served,
                            self.cfg.max_lora_rank)

    # ----------------------------------------------------------------- life

    def run(self, procs: list[Any]) -> int:
        """Serves until SIGTERM/SIGINT; returns the exit status (0 after a clean drain)."""
        self._install_signals()
        if self.cfg.threads is not None:
            torch.set_num_threads(self.cfg.threads)
        stop_watch = threading.Event()
        if procs:
            watch(procs, self._rank_died, stop_watch)
        joined = join_ranks(self.cfg)
        try:
            # The torch work of set-up (loading, prepacking, restoring adapters) on a thread that
            # ends, so the engine loop's thread's OpenMP pool is the only one (tprt.cpu.threads).
            model, engine, tokenizer = run_on_exiting_thread(lambda: self._load(joined))
            ctx = engine.tp  # the ranks rank 0 sends commands to: the TP group, or the whole pipeline
            run_on_exiting_thread(lambda: self._services(ctx, model, engine, tokenizer))
            assert self.loop is not None and self.jobs is not None
            self.loop.start()
            metrics_port = self.metrics.serve(self.cfg.host, self.cfg.metrics_port) if self.cfg.metrics_port >= 0 else -1
            self.server.start()
            if self.http is not None:
                token = load_token(self.cfg.auth_token_file) if self.cfg.auth_token_file is not None else None
                self.http.start(self.http_app, TokenCheck(token))
            if self.batches is not None:
                self.batches.start()  # resumes the batches a restart interrupted
            self._set_health(not self.broken)
            _announce(self.cfg.host, self.port, metrics_port, model.tp.world_size, self.cfg.pp, procs, self.http)
            while not self.stop.wait(0.5):
                pass
            return self._drain()
        finally:
            stop_watch.set()
            self.server.stop(0)
            if self.http is not None:
                self.http.stop()
            self.metrics.close()
            if self.catalogue is not None:
                self.catalogue.close()
            if self.kv_events is not None:
                self.kv_events.close()
            self.stores.close()
            if not self.broken:
                shutdown()

    def _rank_died(self, reason: str) -> None:
        if self.loop is not None:
            self.loop.mark_broken(reason)
        else:
            self._on_broken(reason)
        log.error("%s; health is NOT_SERVING (stop this server and start it again)", reason)

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self.stop.set())

    def _drain(self) -> int:
        """SIGTERM: refuse new work, finish or cancel what runs, checkpoint jobs, release the ranks."""
        t0 = time.monotonic()
        log.info("shutting down: draining for up to %.0fs", self.cfg.drain_timeout)
        self._set_health(False)
        assert self.loop is not None and self.jobs is not None
        self.jobs.stop_accepting()
        self.datasets.stop_accepting()
        if self.batches is not None:  # its running requests are cancelled; they run again after a restart
            self.batches.stop()
        clean = self.loop.drain(self.cfg.drain_timeout)
        clean = self.datasets.wait_idle(max(0.0, self.cfg.drain_timeout - (time.monotonic() - t0))) and clean
        if not self.broken:
            self.jobs.pause_for_shutdown(max(5.0, self.cfg.drain_timeout - (time.monotonic() - t0)))
        self.server.stop(grace=1.0).wait(5.0)
        if self.http is not None:
            self.http.stop()
        self.loop.shutdown(timeout_s=self.cfg.collective_timeout)
        log.info("stopped (%s)", "drained" if clean else "cancelled requests and uploads still running at the drain "
                 "timeout")
        return 1 if self.broken else 0


def _lock_data_dir(data_dir: Path) -> Any:
    """An exclusive lock on --data-dir for this server's life: two servers recovering and running
    the same jobs would corrupt each other's work."""
    f = open(data_dir / ".serve.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        owner = f.read().strip() or "?"
        f.close()
        raise ConfigError(f"--data-dir {data_dir}: in use by another tprt serve (pid {owner})") from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


def _tokenizer(path: Path) -> Tokenizer | None:
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        log.warning("%s: no tokenizer; requests must send prompt_ids", path)
        return None
    return Tokenizer.from_dir(path)


def _announce(host: str, port: int, metrics_port: int, tp: int, pp: int, procs: list[Any],
              http: HttpServer | None) -> None:
    """The one line scripts and tests wait for (stdout), plus the ranks' pids (log)."""
    pids = [os.getpid(), *(p.pid for p in procs)]
    log.info("rank pids: %s", pids)
    api = f", OpenAI API {http.scheme}://{host}:{http.port}/v1" if http is not None else ""
    metrics = f", metrics http://{host}:{metrics_port}/metrics" if metrics_port >= 0 else ""
    layout = f"TP {tp}" + (f" x PP {pp}" if pp > 1 else "")
    print(f"tprt serve: listening on {host}:{port} ({layout}{api}{metrics}; rank pids {pids})",
          flush=True)
    sys.stdout.flush()
