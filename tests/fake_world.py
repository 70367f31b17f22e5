"""A TP world of any size in one process, on meta tensors: the real code paths at real shapes.

torch's fake process group (backend "fake") accepts every collective and moves no data; meta
tensors have shapes and dtypes but no storage. Together they run a 70B model's forward and
backward in seconds on a laptop. Each TP rank is simulated in turn by building its model with
`TPContext(rank=r)`: the model reads its rank from the context, never from the process group.

The meta device stands in for the accelerator: like CUDA it is not "cpu", so the CPU-only
paths (packed matmuls, native decode layers, huge pages, the float32 KV cache for bf16 weights,
per-step range checks) stay off, as on a GPU. torch's FakeTensorMode on a fake "cuda" device
would be closer, but a CPU-only build of torch cannot index such tensors (no CUDA device guard).

`CollectiveLog` records every collective the code issues (op, shape, dtype, reduction) by
wrapping the torch.distributed functions, so a test can hold them against the Megatron design.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from tprt.distributed.context import TPContext
from tprt.model.config import ModelConfig, TPLayout
from tprt.model.llama import TPLlamaForCausalLM

CONFIGS = Path(__file__).resolve().parents[1] / "bench" / "configs"
META = torch.device("meta")


def real_config(name: str) -> ModelConfig:
    """A published model's config.json from bench/configs (e.g. "llama-3.1-70b")."""
    return ModelConfig.from_file(CONFIGS / name / "config.json")


@contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """The default process group as a fake one of `world_size` ranks (this process is rank 0)."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def rank_context(rank: int, tp: int) -> TPContext:
    """TP rank `rank` of the fake world, on the meta device."""
    group = dist.group.WORLD if tp > 1 else None
    return TPContext(group=group, rank=rank, world_size=tp, device=META,
                     backend="fake" if tp > 1 else None, global_rank=rank)


def build_rank(cfg: ModelConfig, tp: int, rank: int, dtype: torch.dtype = torch.bfloat16) -> TPLlamaForCausalLM:
    """Rank `rank`'s shard of the model at TP=`tp`, built as the loader builds it (on meta)."""
    with META:
        return TPLlamaForCausalLM(cfg, TPLayout.for_model(cfg, tp), rank_context(rank, tp), dtype)


@dataclass(frozen=True)
class Collective:
    op: str  # "all_reduce", "all_gather", "broadcast", "gather", "all_gather_single", "reduce_scatter_single"
    shape: tuple[int, ...]  # of this rank's input tensor
    dtype: torch.dtype
    reduce: str | None = None  # "SUM", "MAX" for all_reduce

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


class CollectiveLog:
    """Every collective issued while `recording()`, in order (the wrapped functions still run)."""

    def __init__(self) -> None:
        self.calls: list[Collective] = []

    def take(self) -> list[Collective]:
        """The calls so far; the log starts afresh."""
        calls, self.calls = self.calls, []
        return calls

    @contextmanager
    def recording(self) -> Iterator[CollectiveLog]:
        names = ("all_reduce", "all_gather", "broadcast", "gather", "all_gather_single", "reduce_scatter_single")
        originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}  # *_single: torch 2.13+

        def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                # the input: the second argument where the first is the output
                tensor = args[1] if name in ("all_gather", "all_gather_single", "reduce_scatter_single") else args[0]
                op = kwargs.get("op", dist.ReduceOp.SUM) if name == "all_reduce" else None
                reduce = None if op is None else ("MAX" if op == dist.ReduceOp.MAX else "SUM")
                self.calls.append(Collective(name, tuple(tensor.shape), tensor.dtype, reduce))
                if name == "gather" and (args[1] if len(args) > 1 else kwargs.get("gather_list")) is None:
                    # A simulated rank other than the destination: this process is rank 0 of the
                    # fake group, where torch demands a list; the fake group moves no data anyway.
                    return None
                return fn(*args, **kwargs)
            return call

        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
