"""One ParallelDims lays out the world: TP innermost, pipeline stages outside it, DP outermost."""

from __future__ import annotations

import pytest
import torch

from tprt.distributed.context import ParallelDims, TPContext
from tprt.errors import ConfigError


def test_world_of_eight_in_tp_groups_of_two() -> None:
    dims = ParallelDims.for_world(8, 2)
    assert (dims.tp, dims.dp, dims.pp, dims.world, dims.mesh_shape) == (2, 4, 1, 8, (4, 2))
    assert [dims.tp_group_ranks(d) for d in range(dims.dp)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [dims.dp_group_ranks(t) for t in range(dims.tp)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for rank in range(8):  # every global rank sits in exactly its TP group and its DP group
        assert rank in dims.tp_group_ranks(dims.dp_rank(rank)) and rank in dims.dp_group_ranks(dims.tp_rank(rank))
    assert ParallelDims.for_world(4) == ParallelDims(tp=4, dp=1)  # no tp: one group of all


def test_bad_layouts_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match=r"^--tp 3 does not divide the world size 8$"):
        ParallelDims.for_world(8, 3)
    with pytest.raises(ConfigError, match=r"^--dp must be at least 1, got 0$"):
        ParallelDims(tp=2, dp=0)
    with pytest.raises(ConfigError, match=r"^--pp must be at least 1, got 0$"):
        ParallelDims(tp=2, pp=0)


def test_dp_pp_tp_mesh_of_sixteen() -> None:
    """[dp 2, pp 2, tp 4]: TP groups of consecutive ranks, a stage's TP group after the
    previous stage's, DP replicas outermost; every rank in exactly one group of each kind."""
    dims = ParallelDims(tp=4, dp=2, pp=2)
    assert dims.world == 16
    assert dims.tp_group_ranks(0, 1) == [4, 5, 6, 7] and dims.tp_group_ranks(1, 0) == [8, 9, 10, 11]
    assert dims.pp_group_ranks(1, 2) == [10, 14] and dims.dp_group_ranks(3, 1) == [7, 15]
    for rank in range(16):
        d, s, t = dims.dp_rank(rank), dims.pp_rank(rank), dims.tp_rank(rank)
        assert rank in dims.tp_group_ranks(d, s) and rank in dims.pp_group_ranks(d, t)
        assert rank in dims.dp_group_ranks(t, s)


def test_a_context_gives_its_dims_back() -> None:
    ctx = TPContext(group=None, rank=1, world_size=4, device=torch.device("cpu"), backend=None, dp_size=2)
    assert ctx.dims == ParallelDims(tp=4, dp=2) and ctx.dims.world == 8
    assert TPContext.single().dims == ParallelDims()
