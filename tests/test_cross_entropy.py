"""Vocab-parallel cross-entropy against F.cross_entropy on the whole vocabulary, TP 1, 2 and 4.

Every rank builds the same full logits (padded columns hold junk that must be ignored), keeps its
vocabulary block, and checks the per-token loss and the gradient of its block.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mp import Checks, WorldResults, names, run_single, run_world
from tprt.distributed.context import TPContext
from tprt.parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy

CASES = {  # name -> (vocab_size, padded vocab, dtype)
    "exact": (64, 64, torch.float32),
    "padded": (61, 64, torch.float32),
    "bf16": (50, 64, torch.bfloat16),
}


def _data(vocab: int, padded: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full logits [2, 5, padded] (junk in padded columns), targets [2, 5] with ignored ones, grads."""
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(2, 5, padded, generator=g) * 4).to(dtype)
    logits[..., vocab:] = 100.0  # would dominate the softmax if padding leaked in
    target = torch.randint(0, vocab, (2, 5), generator=g)
    target[0, 1] = target[1, 4] = IGNORE_INDEX
    target[1, 0] = vocab - 1  # the last real id, next to the padding
    return logits, target, torch.randn(2, 5, generator=g)


def check_case(ctx: TPContext, workdir: Path, case: str) -> None:
    vocab, padded, dtype = CASES[case]
    full, target, grad_out = _data(vocab, padded, dtype)
    n = padded // ctx.world_size
    local = full[..., ctx.rank * n : (ctx.rank + 1) * n].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, ctx, vocab_size=vocab)
    loss.backward(grad_out)
    ref_in = full[..., :vocab].float().clone().requires_grad_(True)
    ref = F.cross_entropy(ref_in.reshape(-1, vocab), target.reshape(-1), reduction="none",
                          ignore_index=IGNORE_INDEX).reshape(2, 5)
    ref.backward(grad_out)
    assert ref_in.grad is not None and local.grad is not None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss, ref, atol=tol, rtol=tol)
    ref_grad = torch.cat((ref_in.grad, torch.zeros(2, 5, padded - vocab)), dim=-1)  # padding gets no gradient
    mine = ref_grad[..., ctx.rank * n : (ctx.rank + 1) * n]
    assert local.grad.dtype == dtype
    torch.testing.assert_close(local.grad.float(), mine, atol=tol, rtol=tol)
    assert loss[0, 1] == 0 and loss[1, 4] == 0


def check_input_untouched(ctx: TPContext, workdir: Path) -> None:
    """The caller's logits are not modified (padding masking works on a copy)."""
    full, target, _ = _data(61, 64, torch.float32)
    n = 64 // ctx.world_size
    local = full[..., ctx.rank * n : (ctx.rank + 1) * n].clone()
    before = local.clone()
    vocab_parallel_cross_entropy(local, target, ctx, vocab_size=61)
    assert torch.equal(local, before)


CHECKS: Checks = [
    *((f"ce-{c}", partial(check_case, case=c)) for c in CASES),
    ("input_untouched", check_input_untouched),
]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[int, WorldResults]:
    wd = tmp_path_factory.mktemp("ce")
    return {1: run_single(CHECKS, wd), 2: run_world(2, CHECKS, wd), 4: run_world(4, CHECKS, wd)}


@pytest.mark.parametrize("check", names(CHECKS))
@pytest.mark.parametrize("tp", (1, 2, 4))
def test_cross_entropy(worlds: dict[int, WorldResults], tp: int, check: str) -> None:
    worlds[tp].assert_ok(check)
