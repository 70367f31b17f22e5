"""The tensor-parallel context: which process group a rank talks to, passed explicitly everywhere.

`init_distributed()` reads the environment that torchrun (single- or multi-node) or
`tprt.distributed.launcher.launch_local` sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and
returns a frozen `TPContext`. Nothing below this module reads the environment. On CPU, a TP group
whose ranks share a host also gets a shared-memory all-reduce (tprt.distributed.shm_allreduce).

The world is laid out by one `ParallelDims` as a mesh [pp, dp, tp] with the TP ranks innermost
(consecutive global ranks share a TP group, so on a multi-GPU node TP traffic stays on NVLink);
pp is always 1 for now. Inference uses tp == world size and no DP group; the fine-tuning path may
ask for tp < world size.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tprt.distributed.shm_allreduce import ShmAllReduce, for_group
from tprt.errors import ConfigError

log = logging.getLogger("tprt")


@dataclass(frozen=True)
class ParallelDims:
    """How the world's ranks divide, as a [dp, pp, tp] mesh: `tp` ranks per tensor-parallel group
    (innermost: consecutive global ranks), `pp` pipeline stages of such groups
    (tprt.train.pipeline), and `dp` data-parallel replicas of the whole."""

    tp: int = 1
    dp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be at least 1, got {getattr(self, name)}")

    @classmethod
    def for_world(cls, world: int, tp: int | None = None) -> ParallelDims:
        """The layout of `world` ranks in TP groups of `tp` (None: one group of all), the rest DP."""
        tp = tp or world
        if tp < 1 or world % tp:
            raise ConfigError(f"--tp {tp} does not divide the world size {world}")
        return cls(tp=tp, dp=world // tp)

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """(dp, tp): the DeviceMesh of FSDP (tprt.train.fsdp), dimensions named MESH_DIMS."""
        return self.dp, self.tp

    def tp_rank(self, global_rank: int) -> int:
        return global_rank % self.tp

    def pp_rank(self, global_rank: int) -> int:
        """The pipeline stage `global_rank` belongs to."""
        return global_rank // self.tp % self.pp

    def dp_rank(self, global_rank: int) -> int:
        return global_rank // (self.tp * self.pp)

    def _rank(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return (dp_rank * self.pp + pp_rank) * self.tp + tp_rank

    def tp_group_ranks(self, dp_rank: int, pp_rank: int = 0) -> list[int]:
        """The global ranks of DP replica `dp_rank`'s TP group (of stage `pp_rank`)."""
        return [self._rank(dp_rank, pp_rank, t) for t in range(self.tp)]

    def dp_group_ranks(self, tp_rank: int, pp_rank: int = 0) -> list[int]:
        """The global ranks holding TP shard `tp_rank` (of stage `pp_rank`), one per DP replica."""
        return [self._rank(d, pp_rank, tp_rank) for d in range(self.dp)]

    def pp_group_ranks(self, dp_rank: int, tp_rank: int) -> list[int]:
        """One pipeline: TP rank `tp_rank` of every stage of DP replica `dp_rank`, in stage order."""
        return [self._rank(dp_rank, s, tp_rank) for s in range(self.pp)]


MESH_DIMS = ("dp", "tp")


@dataclass(frozen=True)
class TPContext:
    """One rank's view of the TP group (and of the DP group, when the world is a 2-D mesh)."""

    group: dist.ProcessGroup | None  # the TP group; None when there is a single TP rank and no world
    rank: int  # rank inside the TP group
    world_size: int  # TP degree
    device: torch.device  # where this rank's weights and activations live
    backend: str | None  # "nccl", "gloo", or None without a process group
    global_rank: int = 0  # rank in the default (world) group
    dp_group: dist.ProcessGroup | None = None  # ranks holding the same TP shard; None when dp_size == 1
    dp_rank: int = 0
    dp_size: int = 1
    # The TP group's all-reduce through shared memory when its ranks share a host (CPU, gloo);
    # tprt.distributed.shm_allreduce. None: every collective goes through `group`.
    shm: ShmAllReduce | None = None

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> TPContext:
        """A one-rank context with no process group (every collective is skipped)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(group=None, rank=0, world_size=1, device=device, backend=None)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dims(self) -> ParallelDims:
        """The world's layout this context is part of."""
        return ParallelDims(tp=self.world_size, dp=self.dp_size)

    @property
    def is_main(self) -> bool:
        """True on the one rank of the whole world that logs and talks to the outside."""
        return self.global_rank == 0


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ConfigError(f"environment variable {name} is not set (expected torchrun's or tprt's launcher's)")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


def in_distributed_env() -> bool:
    """True when started by torchrun or tprt's local launcher."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(
    tp_size: int | None = None,
    backend: str | None = None,
    timeout_s: float = 600.0,
    device: str | torch.device | None = None,
) -> TPContext:
    """Joins the world described by the environment and returns this rank's TP context.

    Without RANK/WORLD_SIZE in the environment this is the single-rank fallback. NCCL (device
    cuda:LOCAL_RANK) when CUDA is present, gloo on CPU otherwise. `tp_size` defaults to the whole
    world; a smaller one makes a [world / tp_size, tp_size] mesh with a DP group per TP rank.
    `device` overrides where the rank's tensors live: gloo also reduces CUDA tensors, so with
    `backend="gloo", device="cuda:0"` several ranks share one GPU (bench/gpu_check.sh's TP 2).
    """
    if not in_distributed_env():
        use_cuda = torch.cuda.is_available() and backend != "gloo"
        return TPContext.single(device or (torch.device("cuda", 0) if use_cuda else torch.device("cpu")))
    rank, world, backend, device = join_world(backend, timeout_s, device)
    dims = ParallelDims.for_world(world, tp_size)
    tp_group, dp_group = build_mesh_groups(dims, rank)
    tp_rank = dims.tp_rank(rank)
    shm = (for_group(tp_group, tp_rank, dims.tp, timeout_s)
           if backend == "gloo" and device.type == "cpu" and dims.tp > 1 else None)
    return TPContext(
        group=tp_group,
        rank=tp_rank,
        world_size=dims.tp,
        device=device,
        backend=backend,
        global_rank=rank,
        dp_group=dp_group,
        dp_rank=dims.dp_rank(rank),
        dp_size=dims.dp,
        shm=shm,
    )


def join_world(backend: str | None = None, timeout_s: float = 600.0,
               device: str | torch.device | None = None) -> tuple[int, int, str, torch.device]:
    """Joins the world the environment describes (once; RANK and WORLD_SIZE set) with the
    backend and device `init_distributed` says; returns (rank, world size, backend, device)."""
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", rank)
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    backend = backend or ("nccl" if use_cuda else "gloo")
    device = torch.device(device) if device is not None else (
        torch.device("cuda", local_rank) if use_cuda else torch.device("cpu"))
    if device.type == "cuda" and device.index is None:  # "cuda": this rank's GPU, shared when there are fewer
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return rank, world, backend, device


def build_mesh_groups(dims: ParallelDims, rank: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """This rank's (TP group, DP group) in the [dp, tp] mesh of `dims`; collective over the world.

    Every rank must call this with the same arguments: `new_group` is itself collective.
    Pipeline stages make theirs in tprt.distributed.pipeline_mesh.
    """
    if dims.pp > 1:
        raise ConfigError(f"--pp {dims.pp}: this command does not run pipeline stages "
                          "(tprt.distributed.pipeline_mesh makes their groups)")
    if dims.tp == dims.world:
        assert dist.group.WORLD is not None
        return dist.group.WORLD, None
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    for d in range(dims.dp):
        g = dist.new_group(dims.tp_group_ranks(d))
        if dims.dp_rank(rank) == d:
            tp_group = g
    for t in range(dims.tp):
        g = dist.new_group(dims.dp_group_ranks(t))
        if dims.tp_rank(rank) == t:
            dp_group = g
    assert tp_group is not None and dp_group is not None
    return tp_group, dp_group


def barrier(ctx: TPContext) -> None:
    """Waits for every rank of the TP group (no-op on one rank)."""
    if ctx.group is not None and ctx.world_size > 1:
        dist.barrier(group=ctx.group)


def shutdown() -> None:
    """Leaves the world, if joined, and frees its process groups before the interpreter exits.

    gloo's `shutdown()` is a no-op: its worker threads live until the C++ group is freed, and the
    groups sit in reference cycles (the collect frees them). Left to interpreter exit, a worker
    that drops a finished collective's tensor there needs the GIL, which a finalizing interpreter
    answers with pthread_exit through a noexcept destructor: std::terminate, SIGABRT, and torchrun's
    other agents wait at their exit barrier (seen about once in ten loaded two-node runs).
    """
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()


def log0(ctx: TPContext, msg: str, *args: object, level: int = logging.INFO) -> None:
    """Logs on the main rank only, so N ranks do not print N copies."""
    if ctx.is_main:
        log.log(level, msg, *args)
