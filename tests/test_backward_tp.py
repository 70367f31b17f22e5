"""TP backward and optimizer steps against a single-process transformers LlamaForCausalLM.

The parent writes three tiny HF checkpoints (gqa, rope_pad, tied), converts each to TP 1/2/4 (and
8 for two of them), and records transformers' loss and every gradient on one batch, and the
losses, clipped gradient norms and final weights of a few torch.optim.AdamW steps (warmup +
cosine, clipping active). Batches have four rows of uneven length (right padding, -100 labels)
and a masked prompt. Every TP world (tests/mp.py) then checks, on every rank:

- loss (1e-5) and each parameter's gradient, sliced to this rank by the TP rules (1e-4),
  after `sync_gradients`; replicated values (norms, kv rows shared by ranks) bitwise identical;
- N_STEPS of our AdamW + `clip_grad_norm` give transformers' losses, norms and weights;
- activation checkpointing leaves the gradients unchanged; bf16 weights with fp32 masters train
  close to the fp32 reference and keep their replicas identical;
- DP x TP meshes (dp 2 x tp 2 in the world of 4, dp 2 x tp 4 in the world of 8): each DP rank
  gets half the rows, and gradients and steps still equal the whole-batch reference.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from helpers import make_hf_llama
from mp import Checks, WorldResults, names, run_single, run_world
from tprt.model.config import ModelConfig
from tprt.distributed.context import ParallelDims, TPContext, build_mesh_groups
from tprt.checkpoint.loading import load_model
from tprt.parallel.sharding import hf_sources
from tprt.model.llama import TPLlamaForCausalLM
from tprt.train.grads import clip_grad_norm, sync_gradients
from tprt.train.optim import AdamW, WarmupCosine, warmup_cosine
from tprt.train.step import (compute_loss, dp_loss, enable_activation_checkpointing, enable_sequence_parallel,
                             enable_tp_comm_overlap)

CONFIGS = ("gqa", "rope_pad", "tied")
TP8_CONFIGS = ("gqa", "rope_pad")  # kv heads replicated 2x and 4x
ROW_LENS = (11, 6, 9, 4)  # uneven on purpose; DP rank d gets rows 2d, 2d + 1
N_STEPS = 4
HP: dict[str, Any] = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
WARMUP, MIN_LR_RATIO = 2, 0.1
MAX_NORM = 1.0  # below every step's norm: clipping is active (asserted on the reference)
DP_MESHES = {4: ("gqa", 2), 8: ("rope_pad", 4)}  # world size -> (config, tp) of its dp x tp check


# ----------------------------------------------------------------------------- shared with test_lora


def make_batch(seed: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, labels [4, 11]: right padding (id 0, label -100), row 1's 3-token prompt masked."""
    g = torch.Generator().manual_seed(seed)
    width = max(ROW_LENS)
    ids = torch.zeros(len(ROW_LENS), width, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for r, n in enumerate(ROW_LENS):
        ids[r, :n] = torch.randint(3, vocab, (n,), generator=g)
        labels[r, :n] = ids[r, :n]
    ids[0, 5] = labels[0, 5] = vocab - 1  # the last real id, next to the vocabulary padding
    labels[1, :3] = -100
    return ids, labels


def local_slice(hf_name: str, full: torch.Tensor, model: TPLlamaForCausalLM) -> torch.Tensor:
    """This rank's part of a whole HF tensor by the TP rules (written here, not the converter's)."""
    tp, rank = model.tp.world_size, model.tp.rank
    if hf_name.endswith(("embed_tokens.weight", "lm_head.weight")):
        pad = model.layout.padded_vocab_size - full.shape[0]
        return torch.cat((full, full.new_zeros(pad, *full.shape[1:]))).chunk(tp)[rank]
    if hf_name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
        rep = max(1, tp // model.config.num_key_value_heads)  # ranks holding the same kv head
        return full.chunk(tp // rep)[rank // rep]
    if hf_name.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight", "q_proj.bias")):
        return full.chunk(tp)[rank]
    if hf_name.endswith(("o_proj.weight", "down_proj.weight")):
        return full.chunk(tp, dim=1)[rank]
    assert "norm" in hf_name or hf_name.endswith("o_proj.bias"), hf_name  # replicated
    return full


def assert_rel(ours: torch.Tensor, ref: torch.Tensor, what: str, tol: float) -> None:
    """max |ours - ref| <= tol * max |ref| (an all-zero reference must be met exactly)."""
    scale = ref.float().abs().max().item() or 1.0
    err = (ours.detach().float().cpu() - ref.float().cpu()).abs().max().item() / scale  # references live on the CPU
    assert err <= tol, f"{what}: max error {err:.2e} of the reference's scale > {tol:.0e}"


def assert_tp_identical(t: torch.Tensor, ctx: TPContext, what: str, group: dist.ProcessGroup | None = None) -> None:
    """`t` is bitwise the same on every rank of `group` (default: the TP group)."""
    group = group if group is not None else ctx.group
    if group is None or dist.get_world_size(group) == 1:
        return
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    assert all(torch.equal(p, parts[0]) for p in parts), f"{what} differs between ranks that replicate it"


# ----------------------------------------------------------------------------- setup (parent only)


def _reference(hf_dir: Path, vocab: int) -> dict[str, Any]:
    """transformers' loss and gradients on batch 0, then N_STEPS of AdamW on batches 0..N-1."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    batches = [make_batch(s, vocab) for s in range(N_STEPS)]
    ids, labels = batches[0]
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    ref: dict[str, Any] = {
        "loss": loss.item(), "n_tokens": int((labels[:, 1:] != -100).sum()),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    }
    opt = torch.optim.AdamW(model.parameters(), **HP)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(WARMUP, N_STEPS, MIN_LR_RATIO))
    ref["losses"], ref["norms"] = [], []
    for ids, labels in batches:
        opt.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        ref["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        ref["losses"].append(loss.item())
        opt.step()
        sched.step()
    assert min(ref["norms"]) > MAX_NORM, f"clipping would not be active: norms {ref['norms']}"
    ref["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref["batches"] = batches
    return ref


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from convert.api import hf_to_tp

    root = tmp_path_factory.mktemp("backward_tp")
    for i, name in enumerate(CONFIGS):
        hf_dir = make_hf_llama(root / f"{name}-hf", name, seed=10 + i)
        for tp in (1, 2, 4, 8) if name in TP8_CONFIGS else (1, 2, 4):
            hf_to_tp(hf_dir, root / f"{name}-tp{tp}", tp)
        vocab = ModelConfig.from_file(hf_dir / "config.json").vocab_size
        torch.save(_reference(hf_dir, vocab), root / f"{name}-ref.pt")
    return root


# ----------------------------------------------------------------------------- helpers (every rank)


def _ref(workdir: Path, name: str) -> dict[str, Any]:
    ref: dict[str, Any] = torch.load(workdir / f"{name}-ref.pt")
    return ref


def _model(ctx: TPContext, workdir: Path, name: str, sp: bool = False, overlap: bool = False) -> TPLlamaForCausalLM:
    model = load_model(workdir / f"{name}-tp{ctx.world_size}", ctx, requires_grad=True).train()
    enable_sequence_parallel(model, sp)
    enable_tp_comm_overlap(model, overlap)
    return model


def _rows(ctx: TPContext) -> slice:
    """This DP rank's rows of a batch (all of them without DP)."""
    n = len(ROW_LENS) // ctx.dp_size
    return slice(ctx.dp_rank * n, (ctx.dp_rank + 1) * n)


def compare_to_ref(model: TPLlamaForCausalLM, ref: dict[str, torch.Tensor], what: str, tol: float) -> None:
    """Every parameter (what="grad": its gradient) against the HF tensors it is made of, sliced."""
    for pname, param in model.named_parameters():
        value = param.grad if what == "grad" else param.detach()
        assert value is not None, f"{pname}: no gradient"
        want = torch.cat([local_slice(src, ref[src], model) for src in hf_sources(pname)])
        assert value.shape == want.shape, f"{pname}: shape {list(value.shape)} != {list(want.shape)}"
        assert_rel(value, want, f"{what} of {pname} (TP rank {model.tp.rank})", tol)


def assert_replicas_identical(model: TPLlamaForCausalLM, ctx: TPContext, what: str = "grad") -> None:
    """Norm weights equal on every TP rank; k/v rows equal on the ranks that share a kv head."""
    from tprt.parallel.spec import get_spec
    from tprt.train.grads import kv_group

    for pname, param in model.named_parameters():
        value = param.grad if what == "grad" else param.detach()
        spec = get_spec(param)
        if value is None or spec is None:
            continue
        if spec.replicated:
            assert_tp_identical(value, ctx, f"{what} of {pname}")
        elif spec.kv_rows is not None and spec.kv_replication > 1:
            a, b = spec.kv_rows
            assert_tp_identical(value[a:b], ctx, f"{what} of {pname} k/v rows", kv_group(ctx, spec.kv_replication))


def run_steps(
    model: TPLlamaForCausalLM, ctx: TPContext, batches: list[Any], opt: AdamW | None = None
) -> tuple[list[float], list[float]]:
    """N_STEPS of AdamW with warmup + cosine and clipping; (mean losses, norms before clipping)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = opt or AdamW(params, **HP)
    sched = warmup_cosine(opt, WARMUP, N_STEPS, MIN_LR_RATIO)
    losses, norms = [], []
    for ids, labels in batches:
        opt.zero_grad(set_to_none=True)
        loss_sum, n_tokens = compute_loss(model, ids[_rows(ctx)], labels[_rows(ctx)])
        loss, mean = dp_loss(loss_sum, n_tokens, ctx)
        loss.backward()
        sync_gradients(model, ctx)
        norms.append(clip_grad_norm(params, MAX_NORM, ctx))
        opt.step()
        sched.step()
        losses.append(float(mean))
    return losses, norms


# ----------------------------------------------------------------------------- checks (every rank)


def check_grads(ctx: TPContext, workdir: Path, name: str, sp: bool = False, overlap: bool = False) -> None:
    """Loss and every gradient equal transformers'; replicated values identical on every rank
    (`sp`: under sequence parallelism, the batch's 11 positions padded to split over TP;
    `overlap`: the column-parallel backward's collective overlapped)."""
    ref, model = _ref(workdir, name), _model(ctx, workdir, name, sp, overlap)
    ids, labels = ref["batches"][0]
    loss_sum, n_tokens = compute_loss(model, ids[_rows(ctx)], labels[_rows(ctx)])
    loss, mean = dp_loss(loss_sum, n_tokens, ctx)
    assert abs(mean.item() - ref["loss"]) <= 1e-5 * abs(ref["loss"]), f"loss {mean.item()} != {ref['loss']}"
    if ctx.dp_size == 1:
        assert int(n_tokens) == ref["n_tokens"]
    loss.backward()
    sync_gradients(model, ctx)
    compare_to_ref(model, ref["grads"], "grad", 1e-4)
    assert_replicas_identical(model, ctx)


def check_steps(ctx: TPContext, workdir: Path, name: str, sp: bool = False, overlap: bool = False) -> None:
    """N_STEPS of AdamW + clipping: losses, global norms (replicated values counted once) and the
    final weights equal transformers' with torch.optim.AdamW and clip_grad_norm_."""
    ref, model = _ref(workdir, name), _model(ctx, workdir, name, sp, overlap)
    losses, norms = run_steps(model, ctx, ref["batches"])
    for i, (ours, want) in enumerate(zip(losses, ref["losses"])):
        assert abs(ours - want) <= 1e-5 * abs(want), f"step {i} loss {ours} != {want}"
    for i, (ours, want) in enumerate(zip(norms, ref["norms"])):
        assert abs(ours - want) <= 1e-5 * want, f"step {i} gradient norm {ours} != {want}"
    compare_to_ref(model, ref["params"], "weight", 1e-4)
    assert_replicas_identical(model, ctx, "weight")


def check_bf16_steps(ctx: TPContext, workdir: Path, name: str) -> None:
    """bf16 weights: the steps track the fp32 reference loosely, every weight is its fp32 master
    rounded, and replicated weights stay bitwise identical (the gradient sync sums in fp32)."""
    ref = _ref(workdir, name)
    model = load_model(workdir / f"{name}-tp{ctx.world_size}", ctx, dtype="bf16", requires_grad=True).train()
    opt = AdamW([p for p in model.parameters() if p.requires_grad], **HP)
    losses, norms = run_steps(model, ctx, ref["batches"], opt)
    for i, (ours, want) in enumerate(zip(losses, ref["losses"])):
        assert abs(ours - want) <= 2e-2 * abs(want), f"step {i} bf16 loss {ours} far from fp32 {want}"
    assert all(abs(a - b) <= 0.1 * b for a, b in zip(norms, ref["norms"])), f"bf16 norms {norms} vs {ref['norms']}"
    for pname, p in model.named_parameters():
        master = opt.master(p)
        assert p.dtype == torch.bfloat16 and master.dtype == torch.float32, pname
        assert torch.equal(p.detach(), master.to(torch.bfloat16)), f"{pname}: not its master rounded"
    assert_replicas_identical(model, ctx, "weight")


def check_checkpointing(ctx: TPContext, workdir: Path, name: str, sp: bool = False, overlap: bool = False) -> None:
    """Per-block activation checkpointing gives the same loss and gradients."""
    ids, labels = _ref(workdir, name)["batches"][1]
    grads = []
    for enabled in (False, True):
        model = _model(ctx, workdir, name, sp, overlap)
        enable_activation_checkpointing(model, enabled)
        loss_sum, n_tokens = compute_loss(model, ids, labels)
        (loss_sum / n_tokens).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n, g in grads[0].items():
        other = grads[1][n]
        assert g is not None and other is not None and torch.equal(g, other), f"{n}: gradient changed under checkpointing"


_MESHES: dict[tuple[int, int], TPContext] = {}


def _mesh(world: TPContext, tp: int) -> TPContext:
    """This rank's context in a [world / tp, tp] mesh of the test world (built once per process)."""
    key = (world.world_size, tp)
    if key not in _MESHES:
        g = world.global_rank
        tp_group, dp_group = build_mesh_groups(ParallelDims.for_world(world.world_size, tp), g)
        _MESHES[key] = TPContext(
            group=tp_group, rank=g % tp, world_size=tp, device=world.device, backend=world.backend,
            global_rank=g, dp_group=dp_group, dp_rank=g // tp, dp_size=world.world_size // tp,
        )
    return _MESHES[key]


def check_dp(ctx: TPContext, workdir: Path, which: str, sp: bool = False) -> None:
    """dp x tp: half the rows per DP rank; gradients (or steps) equal the whole-batch reference."""
    name, tp = DP_MESHES[ctx.world_size]
    mesh = _mesh(ctx, tp)
    (check_grads if which == "grads" else check_steps)(mesh, workdir, name, sp)


def _checks(world: int) -> Checks:
    configs = TP8_CONFIGS if world == 8 else CONFIGS
    checks: list[tuple[str, Any]] = [
        *((f"{n}-grads", partial(check_grads, name=n)) for n in configs),
        *((f"{n}-steps", partial(check_steps, name=n)) for n in configs),
        ("rope_pad-checkpointing", partial(check_checkpointing, name="rope_pad")),
        ("rope_pad-bf16_steps", partial(check_bf16_steps, name="rope_pad")),
        # Sequence parallelism (issue 44): the same references.
        *((f"{n}-sp-grads", partial(check_grads, name=n, sp=True)) for n in configs),
        ("gqa-sp-steps", partial(check_steps, name="gqa", sp=True)),
        ("rope_pad-sp-checkpointing", partial(check_checkpointing, name="rope_pad", sp=True)),
        # The backward's collectives overlapped with the weight gradients (issue 44), with and without SP.
        *((f"{n}-overlap-grads", partial(check_grads, name=n, overlap=True)) for n in configs),
        *((f"{n}-sp-overlap-grads", partial(check_grads, name=n, sp=True, overlap=True)) for n in configs),
        ("gqa-sp-overlap-steps", partial(check_steps, name="gqa", sp=True, overlap=True)),
        ("rope_pad-sp-overlap-checkpointing", partial(check_checkpointing, name="rope_pad", sp=True, overlap=True)),
    ]
    if world in DP_MESHES:
        checks += [("dp-grads", partial(check_dp, which="grads")), ("dp-steps", partial(check_dp, which="steps")),
                   ("dp-sp-grads", partial(check_dp, which="grads", sp=True))]
    return checks


# ----------------------------------------------------------------------------- tests

WORLDS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def worlds(workdir: Path) -> dict[int, WorldResults]:
    """Every check of each world size: 1 in this process, the others in one gloo world each."""
    out = {1: run_single(_checks(1), workdir)}
    for world in WORLDS[1:]:
        out[world] = run_world(world, _checks(world), workdir)
    return out


@pytest.mark.parametrize(
    ("world", "check"), [(w, c) for w in WORLDS for c in names(_checks(w))], ids=lambda v: str(v)
)
def test_backward(worlds: dict[int, WorldResults], world: int, check: str) -> None:
    worlds[world].assert_ok(check)
