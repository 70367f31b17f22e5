"""Rank 0's adapter pool: which LoRA adapters sit on the device, which in host memory, which on disk.

Up to `max_loras` adapters are on the device (installed in every rank's model, routable), up to
`max_cpu_loras` more in host memory (a move back is a copy, not a read from disk); the rest are
only known by their directory. When a request needs an adapter that is not on the device, the
least recently used device adapter that is neither pinned nor has rows in the running batch moves
to host memory (and the least recently used host adapter beyond `max_cpu_loras` is dropped), then
the wanted one is restored from host memory or loaded from disk. When no device adapter can make
room, the request waits in the queue (requests for other adapters go ahead) - unless every device
slot holds a pinned adapter: then it could wait for ever, and is refused at once (QueueFull:
RESOURCE_EXHAUSTED, HTTP 429, saying to unload a pinned adapter or retry).

Every load gets a new index (a load generation): the engine's prefix cache keys keys and values by
index (tprt.engine.prefix_cache), so an unloaded or reloaded adapter's cached blocks never match.
A move between device and host keeps the index: the weights are the same.

Threads: `acquire`/`release`, `describe` and `begin_unload` run on handler threads; everything that
sends a command to the ranks (`load`, `make_resident`, `finish_unloads`) runs on the engine loop's thread
(or at start-up, before it runs), the only one that talks to the ranks.

On-demand loading: a request naming an adapter that is not registered but whose directory exists
as `--data-dir/adapters/<id>/` registers it (on disk) and loads it when the request joins the batch.
Its directory is resolved as LoadAdapter's path is (`resolve_path`): symlinks that lead out of
--data-dir are refused. A finished LoRA job's adapter, and at start-up every succeeded job's, is
registered on disk the same way (`register`) and loaded at its first request: a job never has to
find a device slot, and start-up does not load adapters nobody asked for.

Ids: the served base model's name is reserved (`reserved`), and a new job's adapter id may name
neither a registered adapter nor a directory under `--data-dir/adapters/` (`check_new_id`).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from serve.adapters.registry import DEVICE, DISK, HOST, TIERS, AdapterInfo, AdapterRegistry
from serve.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, QueueFull, echo
from serve.jobs.spec import ADAPTER_ID, MAX_NAME_BYTES, MAX_PATH_BYTES
from serve.metrics import Metrics
from serve.paths import check_files_inside
from serve.ranks.commands import LoadAdapter, MoveAdapter
from tprt.distributed.ranks import CommandFailed
from tprt.errors import TprtError
from tprt.lora.fit import AdapterFacts, check_fits, read_facts
from tprt.model.config import ModelConfig

log = logging.getLogger("tprt.serve")

ADAPTERS_DIR = "adapters"  # --data-dir/adapters/<id>/: adapters loaded on demand by id


class AdapterPool:
    """The adapter tiers of one server (see the module docstring)."""

    def __init__(self, registry: AdapterRegistry, data_dir: Path, metrics: Metrics | None = None,
                 base: ModelConfig | None = None, max_loras: int = 8, max_cpu_loras: int = 8,
                 max_rank: int = 64, reserved: tuple[str, ...] = ()) -> None:
        if max_loras < 1 or max_cpu_loras < 0 or max_rank < 1:
            raise ValueError("max_loras and max_rank must be at least 1, max_cpu_loras at least 0")
        self.registry = registry
        self.data_dir = Path(data_dir)
        self.metrics = metrics
        self.base = base  # the served model's config: adapters are checked against it (None: not checked)
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_rank = max_rank
        self.reserved = frozenset(reserved)  # names no adapter may take (the served base model's)
        self._indices = itertools.count(1)
        # A fleet's replica: the adapters the fleet serves (id -> the directory here and the job
        # that trained it; serve/adapters/catalogue.py), so that an adapter loaded through another
        # replica, or trained there, answers here too; None: one server alone.
        self.find_shared: Callable[[str], tuple[Path, str] | None] | None = None

    # ----------------------------------------------------------------- handler threads

    def acquire(self, adapter_id: str) -> AdapterInfo:
        """A request names `adapter_id`: counts it (release it when the request ends). An adapter
        not yet registered is registered from the fleet's catalogue (`find_shared`: loaded through
        another replica, or trained there), else from `--data-dir/adapters/<id>/` when that exists.
        NotFound otherwise (or while it is being unloaded, or when the fleet unloaded it);
        InvalidArgument when its files do not fit this server or its directory leads out of
        --data-dir."""
        info = self.registry.acquire(adapter_id)
        if info is None and not self.registry.has(adapter_id) and ADAPTER_ID.fullmatch(adapter_id) \
                and adapter_id not in self.reserved:
            found = self.find_shared(adapter_id) if self.find_shared is not None else None
            path, job_id = found if found is not None else (self._adapter_dir(adapter_id), "")
            if path is not None:  # the weights' values are left to the ranks' load (this may be an event loop)
                facts = self.describe(path, "adapter_id", values=False)
                # add_new: another request may have registered it meanwhile
                self.registry.add_new(AdapterInfo(adapter_id, path, facts.rank, facts.alpha, job_id,
                                                  targets=facts.targets, tier=DISK))
                info = self.registry.acquire(adapter_id)
        if info is None:
            base = " (that is the base model: leave the adapter empty)" if adapter_id in self.reserved else ""
            raise NotFound(f"no adapter {echo(adapter_id)} is loaded or under --data-dir/{ADAPTERS_DIR}/{base} "
                           "(see ListAdapters)", "adapter_id")
        if self.metrics is not None:
            self.metrics.adapter_requests.labels(adapter=adapter_id).inc()
        return info

    def _adapter_dir(self, adapter_id: str) -> Path | None:
        """`--data-dir/adapters/<id>/`, resolved as LoadAdapter's paths are; None when nothing is there."""
        given = f"{ADAPTERS_DIR}/{adapter_id}"  # the id's characters keep it one plain name
        if not os.path.lexists(self.data_dir / given):
            return None
        return self.resolve_path(given, "adapter_id")

    def release(self, adapter_id: str, started: bool) -> None:
        self.registry.release(adapter_id, started)

    def describe(self, path: Path, field: str, values: bool = True) -> AdapterFacts:
        """The adapter directory's facts, checked against this server (rank limit, base model,
        sound files, and with `values` finite weights, which reads them all: the ranks check them
        again at every load); InvalidArgument naming `field` otherwise."""
        try:
            facts = read_facts(path, self.max_rank)
            if self.base is not None:
                check_fits(path, self.base, facts, values)
        except TprtError as e:
            raise InvalidArgument(str(e), field) from None
        return facts

    def resolve_path(self, given: str, field: str = "path") -> Path:
        """An adapter directory named by a LoadAdapter request, or by an id loaded on demand:
        relative to --data-dir (or absolute) and, symlinks followed, inside it.
        InvalidArgument(`field`) for a path that cannot name a file or leads outside;
        NotFound(`field`) when it is no directory."""
        if "\0" in given:
            raise InvalidArgument("a path cannot contain a NUL byte", field)
        raw = given.encode("utf-8", "surrogatepass")
        if len(raw) > MAX_PATH_BYTES or any(len(part) > MAX_NAME_BYTES for part in raw.split(b"/")):
            raise InvalidArgument(f"a path is at most {MAX_PATH_BYTES} bytes, {MAX_NAME_BYTES} per component", field)
        root = self.data_dir.resolve()
        try:
            path = (root / given).resolve()
            is_dir = path.is_dir()
        except (OSError, RuntimeError, ValueError) as e:  # a loop of symlinks, a file as a directory, ...
            raise InvalidArgument(f"{echo(given)} cannot be resolved ({type(e).__name__})", field) from None
        if not path.is_relative_to(root):
            raise InvalidArgument(f"{echo(given)} is outside the server's --data-dir", field)
        if not is_dir:
            raise NotFound(f"{echo(given)} is not a directory under the server's --data-dir", field)
        check_files_inside(path, root, given, field)
        return path

    def check_new_id(self, adapter_id: str, field: str = "adapter_id") -> None:
        """AlreadyExists(`field`) when a new adapter (a job's) may not take `adapter_id`: the base
        model's name, a registered adapter's, or a directory's under --data-dir/adapters/ (which
        requests naming the id would load instead)."""
        if adapter_id in self.reserved:
            raise AlreadyExists(f"{echo(adapter_id)} is the served base model's name", field)
        if self.registry.has(adapter_id):
            raise AlreadyExists(f"adapter id {echo(adapter_id)} is already used", field)
        if ADAPTER_ID.fullmatch(adapter_id) and os.path.lexists(self.data_dir / ADAPTERS_DIR / adapter_id):
            raise AlreadyExists(f"adapter id {echo(adapter_id)} names a directory under --data-dir/{ADAPTERS_DIR}/",
                                field)

    def register(self, adapter_id: str, path: Path, source_job_id: str = "", values: bool = True) -> AdapterInfo:
        """Makes a finished job's adapter known, on disk: it loads at its first request (any
        thread; no command is sent). InvalidArgument('adapter_id') when its files do not fit this
        server (`values`: its weights are read and must be finite); AlreadyExists('adapter_id')
        when the id was taken meanwhile (LoadAdapter, or a directory loaded on demand)."""
        facts = self.describe(path, "adapter_id", values)
        info = AdapterInfo(adapter_id, path, facts.rank, facts.alpha, source_job_id, targets=facts.targets, tier=DISK)
        if adapter_id in self.reserved or not self.registry.add_new(info):
            raise AlreadyExists(f"adapter id {echo(adapter_id)} is already used", "adapter_id")
        self._update_gauges()
        return info

    def begin_unload(self, adapter_id: str) -> None:
        """New requests for the adapter are refused; it leaves once its requests finish
        (`finish_unloads`, on the engine loop's thread). NotFound when it is not registered."""
        if not self.registry.mark_unloading(adapter_id):
            raise NotFound(f"no adapter {echo(adapter_id)} is loaded (see ListAdapters)", "id")

    # ----------------------------------------------------------------- engine loop's thread

    def load(self, ranks: Any, adapter_id: str, path: Path, pin: bool = False, source_job_id: str = "") -> AdapterInfo:
        """Loads (or reloads) an adapter onto the device under a new index, making room first.
        FailedPrecondition when it has requests in flight (a reload) or too many are pinned;
        QueueFull when no device room can be made (every device adapter pinned or busy);
        CommandFailed when a rank could not read it."""
        if self.registry.has(adapter_id) and self.registry.in_flight(adapter_id):
            raise FailedPrecondition(f"adapter {echo(adapter_id)} has requests in flight; load it again when they "
                                     "finish, or under another id", "id")
        return self._load(ranks, adapter_id, path, pin, source_job_id)

    def _load(self, ranks: Any, adapter_id: str, path: Path, pin: bool, source_job_id: str) -> AdapterInfo:
        old = self.registry.get(adapter_id)
        if pin and not (old is not None and old.pinned):
            pinned = sum(a.pinned for a in self.registry.in_tier(DEVICE))
            if pinned >= self.max_loras:
                raise FailedPrecondition(f"{pinned} adapters are pinned already, as many as --max-loras allows", "pin")
        if old is not None:
            self._drop(ranks, old)
        if not self._make_room(ranks, adapter_id):
            if old is not None:  # known again, on disk, as before the attempt
                self.registry.add(old if old.tier == DISK else _on_disk(old))
            raise QueueFull(f"all {self.max_loras} device adapter slots hold pinned adapters or adapters in use "
                            "(--max-loras); retry later", "id")
        index = next(self._indices)
        try:
            loaded = ranks.run(LoadAdapter(adapter_id, str(path), index))
        except CommandFailed:
            if old is not None:
                self.registry.add(_on_disk(old))
            raise
        requests = old.requests if old is not None else 0
        info = AdapterInfo(adapter_id, Path(path), loaded.rank, loaded.alpha, source_job_id, loaded.index,
                           loaded.targets, DEVICE, pin, requests)
        self.registry.add(info)
        if self.metrics is not None:
            self.metrics.adapter_loads.inc()
        self._update_gauges()
        log.info("adapter %s loaded (index %d%s)", adapter_id, loaded.index, ", pinned" if pin else "")
        return info

    def make_resident(self, ranks: Any, adapter_id: str) -> int | None:
        """The device index of the adapter, restoring or loading it first when needed; None when
        no device room can be made now (the request waits). NotFound when it is not registered
        (it was unloaded); InvalidArgument when its directory can no longer be loaded; QueueFull
        when every device slot is pinned (no room would ever be made)."""
        info = self.registry.get(adapter_id)
        if info is None:
            raise NotFound(f"adapter {echo(adapter_id)} was unloaded", "adapter_id")
        if info.tier == DEVICE:
            return info.index
        if not self._make_room(ranks, adapter_id):
            pinned = [a for a in self.registry.in_tier(DEVICE) if a.pinned and a.id != adapter_id]
            if len(pinned) >= self.max_loras:  # no slot frees until one is unloaded: waiting would be for ever
                raise QueueFull(f"adapter {echo(adapter_id)} cannot be placed: all {self.max_loras} device slots "
                                "(--max-loras) hold pinned adapters; unload one, or retry later", "adapter_id")
            return None
        if info.tier == HOST:
            ranks.run(MoveAdapter(info.index, DEVICE))
            self.registry.update(adapter_id, tier=DEVICE)
            self._update_gauges()
            return info.index
        try:
            return self._load(ranks, adapter_id, info.path, info.pinned, info.source_job_id).index
        except CommandFailed as e:
            raise InvalidArgument(f"adapter {echo(adapter_id)} could not be loaded: {e}", "adapter_id") from None

    def next_eviction(self) -> str | None:
        """The device adapter that will make room next when the device is full: the least
        recently used one that is not pinned, rows running or not (None: there is room, or every
        device adapter is pinned). The engine loop stops admitting its new requests while another
        adapter's request waits for room, so its rows drain and a steady stream of requests for
        the loaded adapters cannot keep the waiting one out for ever."""
        device = self.registry.in_tier(DEVICE)
        if len(device) < self.max_loras:
            return None
        return next((a.id for a in device if not a.pinned), None)

    def finish_unloads(self, ranks: Any) -> None:
        """Removes every adapter being unloaded whose requests have finished."""
        for info in self.registry.unloadable():
            self._drop(ranks, info)
            self.registry.remove(info.id)
            if self.metrics is not None:
                self.metrics.forget_adapter(info.id)
            self._update_gauges()
            log.info("adapter %s unloaded", info.id)

    # ----------------------------------------------------------------- tiers

    def _make_room(self, ranks: Any, wanted: str) -> bool:
        """Frees a device slot for `wanted` unless it has one or one is free; False when every
        device adapter is pinned or has rows in the batch."""
        device = [a for a in self.registry.in_tier(DEVICE) if a.id != wanted]
        if len(device) < self.max_loras:
            return True
        victims = [a for a in device if not a.pinned and not self.registry.running(a.id)]
        if not victims:
            return False
        victim = victims[0]  # least recently used
        if self.max_cpu_loras == 0:
            self._drop(ranks, victim)
            self._count_eviction(DEVICE)
            return True
        ranks.run(MoveAdapter(victim.index, HOST))
        self.registry.update(victim.id, tier=HOST)
        self._count_eviction(DEVICE)
        host = [a for a in self.registry.in_tier(HOST) if a.id != wanted]
        for extra in host[: max(0, len(host) - self.max_cpu_loras)]:
            self._drop(ranks, extra)
            self._count_eviction(HOST)
        self._update_gauges()
        return True

    def _drop(self, ranks: Any, info: AdapterInfo) -> None:
        """Frees the adapter's weights on every rank; it stays known, on disk."""
        if info.tier != DISK:
            ranks.run(MoveAdapter(info.index, "drop"))
            if self.registry.has(info.id):
                self.registry.add(_on_disk(info))
            self._update_gauges()

    def _count_eviction(self, tier: str) -> None:
        if self.metrics is not None:
            self.metrics.adapter_evictions.labels(tier=tier).inc()

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            for tier in TIERS:
                self.metrics.adapters_resident.labels(tier=tier).set(len(self.registry.in_tier(tier)))


def _on_disk(info: AdapterInfo) -> AdapterInfo:
    return AdapterInfo(info.id, info.path, info.rank, info.alpha, info.source_job_id, 0, info.targets, DISK,
                       info.pinned, info.requests)
