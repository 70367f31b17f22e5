"""AdamW with float32 masters against torch.optim.AdamW, the warmup + cosine schedule, and the
global gradient norm at TP 2 and 4 with replicated values (norms, kv rows) counted once."""

from __future__ import annotations

import io
import math
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from mp import Checks, WorldResults, names, run_single, run_world
from tprt.distributed.context import TPContext
from tprt.errors import ValidationError
from tprt.parallel.spec import TPSpec, set_spec
from tprt.train.grads import clip_grad_norm
from tprt.plan import memory as plan_memory
from tprt.train import optim
from tprt.train.optim import AdamW, warmup_cosine

HP: dict[str, Any] = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
SHAPES = [(8, 16), (16,), (3, 5, 2)]


def _grads(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _params(dtype: torch.dtype) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _run(opt: torch.optim.Optimizer, params: list[nn.Parameter], steps: range) -> None:
    for step in steps:
        for p, grad in zip(params, _grads(step, params[0].dtype)):
            p.grad = grad
        opt.step()


@pytest.fixture(params=["fused", "per-parameter"])
def update_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both update paths of AdamW: torch's fused kernel (CPU/CUDA) and the per-parameter ops."""
    if request.param == "per-parameter":
        monkeypatch.setattr("tprt.train.optim._FUSED_DEVICES", ())
    return str(request.param)


def test_fp32_matches_torch_adamw(update_path: str) -> None:
    """Two param groups (one without weight decay), 6 steps: the same weights as torch's AdamW."""
    ours, ref = _params(torch.float32), _params(torch.float32)
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0, "lr": 3e-3}]  # noqa: E731
    opt = AdamW(groups(ours), **HP)
    opt_ref = torch.optim.AdamW(groups(ref), **HP)
    _run(opt, ours, range(6))
    _run(opt_ref, ref, range(6))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert "master" not in opt.state[ours[0]]  # float32 params are their own master


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_keep_fp32_masters(dtype: torch.dtype, update_path: str) -> None:
    """The masters follow float32 AdamW fed the same gradients; params are the masters rounded."""
    ours, ref = _params(dtype), [nn.Parameter(p.detach().float()) for p in _params(dtype)]
    opt = AdamW(ours, **HP)
    opt_ref = torch.optim.AdamW(ref, **HP)
    for step in range(5):
        for p, q, grad in zip(ours, ref, _grads(step, dtype)):
            p.grad, q.grad = grad, grad.float()
        opt.step()
        opt_ref.step()
    for p, q in zip(ours, ref):
        state = opt.state[p]
        assert {state[k].dtype for k in ("master", "exp_avg", "exp_avg_sq")} == {torch.float32}
        torch.testing.assert_close(state["master"], q.detach(), rtol=1e-6, atol=1e-7)
        assert p.dtype == dtype and torch.equal(p.detach(), state["master"].to(dtype))
        assert opt.master(p) is state["master"]


def test_updates_below_bf16_resolution_accumulate_in_the_master() -> None:
    """lr 1e-4 on weights of 1.0: one bf16 ulp there is 2^-7, so the bf16 weight cannot move by a
    step, but 100 steps move the master by ~1e-2 and the weight follows."""
    p = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = AdamW([p], lr=1e-4, weight_decay=0.0)
    for _ in range(100):
        p.grad = torch.ones(4, dtype=torch.bfloat16)
        opt.step()
    master = opt.master(p)
    assert master.dtype == torch.float32 and abs(master[0].item() - (1 - 1e-2)) < 1e-5
    assert p[0].item() < 1.0 and torch.equal(p.detach(), master.to(torch.bfloat16))


def test_resume_from_state_dict_is_exact() -> None:
    """5 steps == 3 steps, state_dict through torch.save/load into a fresh optimizer, 2 steps;
    the moments and masters stay float32 across the load (torch would cast them to bf16)."""
    straight = _params(torch.bfloat16)
    opt = AdamW(straight, **HP)
    _run(opt, straight, range(5))

    first = _params(torch.bfloat16)
    opt1 = AdamW(first, **HP)
    _run(opt1, first, range(3))
    buf = io.BytesIO()
    torch.save(opt1.state_dict(), buf)
    buf.seek(0)
    second = [nn.Parameter(p.detach().clone()) for p in first]
    opt2 = AdamW(second, lr=123.0)  # hyperparameters come from the state
    opt2.load_state_dict(torch.load(buf))
    assert opt2.param_groups[0]["lr"] == HP["lr"] and opt2.state[second[0]]["step"] == 3
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert opt2.state[second[0]][key].dtype == torch.float32
    _run(opt2, second, range(3, 5))
    for a, b in zip(straight, second):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["master"], opt2.state[b]["master"])


def test_warmup_cosine_values_and_resume() -> None:
    p = nn.Parameter(torch.zeros(2))
    opt = AdamW([p], lr=2.0)
    sched = warmup_cosine(opt, warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    lrs = []
    for _ in range(9):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    mid = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))  # halfway through the cosine (step 4)
    want = [2 / 3, 4 / 3, 2.0, None, 2 * mid, None, 0.2, 0.2, 0.2]
    for i, (got, w) in enumerate(zip(lrs, want)):
        if w is not None:
            assert got == pytest.approx(w, rel=1e-12), f"step {i}: lr {got} != {w}"
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:])), "the cosine must not increase"
    opt2 = AdamW([nn.Parameter(torch.zeros(2))], lr=2.0)
    sched2 = warmup_cosine(opt2, 2, 6, 0.1)
    sched2.load_state_dict(sched.state_dict())
    opt2.param_groups[0]["lr"] = sched2.get_last_lr()[0]
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("args", "field"),
    [((-1, 10), "warmup_steps"), ((5, 0), "total_steps"), ((11, 10), "warmup_steps"), ((1, 10, 1.5), "min_lr_ratio")],
)
def test_schedule_validation(args: tuple[float, ...], field: str) -> None:
    opt = AdamW([nn.Parameter(torch.zeros(1))])
    with pytest.raises(ValidationError) as e:
        warmup_cosine(opt, *args)  # type: ignore[arg-type]
    assert e.value.field == field


def test_optimizer_validation() -> None:
    with pytest.raises(ValidationError, match="learning rate"):
        AdamW([nn.Parameter(torch.zeros(1))], lr=-1.0)
    with pytest.raises(ValidationError, match="betas"):
        AdamW([nn.Parameter(torch.zeros(1))], betas=(0.9, 1.0))


# ----------------------------------------------------------------------------- clipping at TP 2 and 4


def _full_grads() -> dict[str, torch.Tensor]:
    """Whole gradients of a sharded matrix, a norm weight (large: double counting would show),
    and a fused [q; k/v] weight with 2 kv heads of 3 rows (q: 4 rows per rank)."""
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(8, 6, generator=g), "norm": 10 * torch.randn(6, generator=g),
            "q": torch.randn(16, 6, generator=g), "kv": torch.randn(2, 3, 6, generator=g)}


def _local_params(ctx: TPContext, mark: bool = True) -> list[nn.Parameter]:
    """This rank's shards: w by rows, the norm whole, [q_r; kv head] with kv heads split (TP 2)
    or each held by two ranks (TP 4)."""
    full, tp, r = _full_grads(), ctx.world_size, ctx.rank
    rep = max(1, tp // 2)
    kv_local = full["kv"].chunk(tp // rep)[r // rep].reshape(-1, 6)
    grads = [full["w"].chunk(tp)[r], full["norm"], torch.cat((full["q"].chunk(tp)[r], kv_local))]
    specs = [TPSpec(), TPSpec(replicated=True), TPSpec(kv_rows=(16 // tp, 16 // tp + kv_local.shape[0]), kv_replication=rep)]
    params = []
    for grad, spec in zip(grads, specs):
        p = nn.Parameter(torch.zeros_like(grad))
        p.grad = grad.clone()
        if mark:
            set_spec(p, spec)
        params.append(p)
    return params


def check_clip_counts_replicas_once(ctx: TPContext, workdir: Path) -> None:
    full = _full_grads()
    want = math.sqrt(sum(float(t.square().sum()) for t in full.values()))
    doubled = math.sqrt(want**2 + (ctx.world_size - 1) * float(full["norm"].square().sum()))
    params = _local_params(ctx)
    before = [p.grad.clone() for p in params if p.grad is not None]
    got = clip_grad_norm(params, 1.0, ctx)
    assert got == pytest.approx(want, rel=1e-6), f"norm {got} != {want} (replicated counted {got**2 / want**2:.2f}x?)"
    assert ctx.world_size == 1 or abs(got - doubled) > 1e-3 * want
    for p, g in zip(params, before):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, g * (1.0 / (want + 1e-6)), rtol=1e-5, atol=1e-7)
    # below max_norm nothing changes
    params = _local_params(ctx)
    clip_grad_norm(params, 10 * want, ctx)
    assert all(p.grad is not None and torch.equal(p.grad, g) for p, g in zip(params, before))


def check_unmarked_params_refused(ctx: TPContext, workdir: Path) -> None:
    params = _local_params(ctx, mark=False)
    if ctx.world_size == 1:
        clip_grad_norm(params, 1.0, ctx)  # one rank: nothing is replicated
        return
    with pytest.raises(ValueError, match="has no TP layout; call tprt.parallel.spec.mark_tp_params"):
        clip_grad_norm(params, 1.0, ctx)


CHECKS: Checks = [("clip", check_clip_counts_replicas_once), ("unmarked", check_unmarked_params_refused)]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[int, WorldResults]:
    wd = tmp_path_factory.mktemp("optim")
    return {1: run_single(CHECKS, wd), 2: run_world(2, CHECKS, wd), 4: run_world(4, CHECKS, wd)}


@pytest.mark.parametrize("check", names(CHECKS))
@pytest.mark.parametrize("tp", (1, 2, 4))
def test_clip(worlds: dict[int, WorldResults], tp: int, check: str) -> None:
    worlds[tp].assert_ok(check)


def test_fused_update_converts_gradients_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 gradients reach the fused kernel GRAD_CHUNK_BYTES of float32 at a time (a larger
    parameter alone), never all at once, with the weights of one call over every parameter."""
    calls: list[int] = []
    fused = torch._fused_adamw_

    def counting(weights: list[torch.Tensor], grads: list[torch.Tensor], *args: Any, **kwargs: Any) -> None:
        calls.append(sum(g.numel() for g in grads))
        fused(weights, grads, *args, **kwargs)

    ours, ref = _params(torch.bfloat16), _params(torch.bfloat16)
    opt, opt_ref = AdamW(ours, **HP), AdamW(ref, **HP)
    _run(opt_ref, ref, range(3))  # one chunk: every gradient at once
    monkeypatch.setattr("tprt.train.optim.GRAD_CHUNK_BYTES", 4 * 16 * 8)  # the (8, 16) parameter's float32 gradient
    monkeypatch.setattr(torch, "_fused_adamw_", counting)
    _run(opt, ours, range(3))
    assert calls == [128, 16 + 30] * 3  # (8, 16) fills a chunk; (16,) and (3, 5, 2) share the next
    for p, q in zip(ours, ref):
        assert torch.equal(p, q) and torch.equal(opt.master(p), opt_ref.master(q))


def test_planner_counts_the_update_chunks() -> None:
    assert plan_memory.GRAD_CHUNK_BYTES == optim.GRAD_CHUNK_BYTES
