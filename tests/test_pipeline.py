"""Pipeline-parallel training (issue 44): stages over PP ranks, each a TP group, micro-batches on
torch's 1F1B schedule (tprt.train.pipeline), against a single-process transformers run in fp32.

Worlds of PP 2 x TP 1, PP 2 x TP 2, PP 4 x TP 1 and PP 4 x TP 2 (tests/mp.py) train the "gqa"
model of tests/test_backward_tp.py with 5 layers (stages of uneven length; untied embeddings) on
its batches of four uneven rows, in as many micro-batches as stages and in four:

- full fine-tuning: the loss (1e-5) and every parameter's gradient on every stage (1e-4, sliced
  by the TP rules) equal transformers'; N steps of AdamW with global-norm clipping give its
  losses, norms and weights;
- LoRA: each stage's adapter gradients equal those of the whole model on the same TP group
  without stages, from the same initialisation;
- each stage holds only its layers (the embedding on the first, the head on the last) and reads
  only their tensors;
- tied embeddings: the first and the last stage each hold the matrix, their gradients summed;
- in the world of 8, a [dp 2, pp 2, tp 2] mesh: each replica trains half the rows, and the
  averaged gradients and steps are still transformers'.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from mp import Checks, WorldResults, names, run_world
from test_backward_tp import (HP, MAX_NORM, MIN_LR_RATIO, N_STEPS, WARMUP, _reference, assert_rel, local_slice)
from helpers import make_hf_llama
from tprt.checkpoint.loading import load_model, load_stage
from tprt.distributed.context import TPContext
from tprt.model.config import ModelConfig
from tprt.model.stage import AbsentLayer
from tprt.parallel.sharding import hf_sources
from tprt.parallel.stages import stages
from tprt.train.optim import AdamW, warmup_cosine
from tprt.train.pipeline import PipelineMesh, PipelineTrainer, pipeline_mesh, sync_and_clip
from tprt.train.step import compute_loss

NAME = "gqa"
TIED = "tied"  # the first and the last stage each hold the embedding matrix
MESHES = {2: [(2, 1)], 4: [(2, 2), (4, 1)], 8: [(4, 2)]}  # world -> (pp, tp) meshes run in it
_MESHES: dict[tuple[int, int, int], PipelineMesh] = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from convert.api import hf_to_tp

    root = tmp_path_factory.mktemp("pipeline")
    for i, name in enumerate((NAME, TIED)):
        hf_dir = make_hf_llama(root / f"{name}-hf", name, seed=10 + i, num_hidden_layers=5)  # split 3+2, 2+1+1+1
        for tp in (1, 2):
            hf_to_tp(hf_dir, root / f"{name}-tp{tp}", tp)
        torch.save(_reference(hf_dir, ModelConfig.from_file(hf_dir / "config.json").vocab_size),
                   root / f"{name}-ref.pt")
    return root


def _mesh(pp: int, tp: int, dp: int = 1) -> PipelineMesh:
    if (pp, tp, dp) not in _MESHES:
        _MESHES[(pp, tp, dp)] = pipeline_mesh(tp, pp, dp)
    return _MESHES[(pp, tp, dp)]


def _stage(workdir: Path, mesh: PipelineMesh, requires_grad: bool, name: str = NAME) -> Any:
    tp = mesh.tp.world_size
    n_layers = ModelConfig.from_file(workdir / f"{name}-tp{tp}" / "config.json").num_hidden_layers
    stage = stages(n_layers, mesh.stages)[mesh.stage_index]
    return load_stage(workdir / f"{name}-tp{tp}", mesh.tp, stage, "fp32", requires_grad).train()


def _slice(ours: Any, hf: dict[str, torch.Tensor], pname: str) -> torch.Tensor:
    return torch.cat([local_slice(src, hf[src], ours) for src in hf_sources(pname)])


def check_full(ctx: TPContext, workdir: Path, pp: int, tp: int, micro: int, dp: int = 1, name: str = NAME) -> None:
    """Full fine-tuning: the first step's loss and gradients, then N_STEPS of AdamW, equal
    transformers' on every stage (with `dp` replicas each training its share of the rows)."""
    mesh = _mesh(pp, tp, dp)
    ref = torch.load(workdir / f"{name}-ref.pt")
    n = len(ref["batches"][0][0]) // dp
    rows = slice(mesh.tp.dp_rank * n, (mesh.tp.dp_rank + 1) * n)
    model = _stage(workdir, mesh, requires_grad=True, name=name)
    held = {n for n, _ in model.named_parameters()}
    st = model.stage
    tied = model.config.tie_word_embeddings
    assert ("embed_tokens.weight" in held) == (st.first or (tied and st.last))
    assert ("lm_head.weight" in held) == (st.last and not tied)
    assert all(isinstance(layer, AbsentLayer) == (i not in st.layers) for i, layer in enumerate(model.layers))
    trainer = PipelineTrainer(model, mesh, micro)
    ids, labels = ref["batches"][0]
    loss = trainer.step(ids[rows], labels[rows])
    if st.last:
        assert loss is not None and abs(loss - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (loss, ref["loss"])
    sync_and_clip(model, mesh, float("inf"))
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert_rel(p.grad, _slice(model, ref["grads"], pname), f"stage {st.index}: grad of {pname}", 1e-4)
    # N_STEPS from the start, as the reference took them
    model = _stage(workdir, mesh, requires_grad=True, name=name)
    trainer = PipelineTrainer(model, mesh, micro)
    opt = AdamW([p for p in model.parameters()], **HP)
    sched = warmup_cosine(opt, WARMUP, N_STEPS, MIN_LR_RATIO)
    for i, (ids, labels) in enumerate(ref["batches"]):
        opt.zero_grad(set_to_none=True)
        loss = trainer.step(ids[rows], labels[rows])
        norm = sync_and_clip(model, mesh, MAX_NORM)
        assert abs(norm - ref["norms"][i]) <= 1e-5 * ref["norms"][i], (i, norm, ref["norms"][i])
        if st.last:
            assert loss is not None and abs(loss - ref["losses"][i]) <= 1e-5 * abs(ref["losses"][i]), (i, loss)
        opt.step()
        sched.step()
    for pname, p in model.named_parameters():
        assert_rel(p.detach(), _slice(model, ref["params"], pname), f"stage {st.index}: weight {pname}", 1e-4)


def check_lora(ctx: TPContext, workdir: Path, pp: int, tp: int, micro: int) -> None:
    """LoRA on q,k,v,o,down: each stage's adapter gradients equal the whole model's on the same
    TP group, from the same initialisation."""
    from tprt.lora.attach import apply_lora

    mesh = _mesh(pp, tp)
    ref = torch.load(workdir / f"{NAME}-ref.pt")
    ids, labels = ref["batches"][1]
    targets = ("q", "k", "v", "o", "down")
    whole = load_model(workdir / f"{NAME}-tp{tp}", mesh.tp, "fp32").train()
    apply_lora(whole, targets, 4, 8.0)
    loss_sum, n = compute_loss(whole, ids, labels)
    (loss_sum / n).backward()
    want = {name: p.grad for name, p in whole.named_parameters() if p.grad is not None}
    model = _stage(workdir, mesh, requires_grad=False)
    params = apply_lora(model, targets, 4, 8.0)  # type: ignore[arg-type]
    trainer = PipelineTrainer(model, mesh, micro)
    loss = trainer.step(ids, labels)
    if model.stage.last:
        assert loss is not None and abs(loss - float(loss_sum / n)) <= 1e-5 * float(loss_sum / n)
    assert params and all(p.grad is not None for p in params)
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert_rel(p.grad, want[name], f"stage {model.stage.index}: grad of {name}", 1e-4)
    assert sum(p.grad is not None for p in model.parameters()) == len(params)


PROMPTS = [[3, 17, 9, 41, 5, 22, 8], [7, 1], [30, 2, 19, 4, 11], [12, 6, 25, 14, 9, 3, 18, 27, 2, 5, 40]]


CANCELLED = "1-1"  # cancelled after the third step, in flight where steps are


def _generate(engine: Any, params: list[Any]) -> tuple[dict[str, Any], int] | None:
    """Rank 0: every prompt with each of `params` through `engine` -> its completions and the
    most steps it had in flight; the other ranks follow and get None."""
    from tprt.engine.core import Completion

    if not engine.is_driver:
        engine.follow()
        return None
    done: dict[str, Completion] = {}
    most = 0
    launch = engine._launch

    def launch_counted(schedule: Any) -> Any:
        nonlocal most
        most = max(most, len(engine._in_flight) + 1)  # in flight once this one is launched
        return launch(schedule)

    engine._launch = launch_counted
    with engine:
        for i, prompt in enumerate(PROMPTS):
            for j, sp in enumerate(params):
                engine.add(prompt, sp, f"{i}-{j}")
        steps = 0
        while engine.has_work:
            for event in engine.step():
                done.setdefault(event.request_id, Completion(event.request_id)).add(event)
            steps += 1
            if steps == 3:
                assert engine.cancel(CANCELLED)
    return done, most


def check_generate(ctx: TPContext, workdir: Path, pp: int, tp: int, micro: int | None) -> None:
    """Generation over pipeline stages gives the whole model's tokens: greedy (argmax ids passed
    back) and seeded sampling with logprobs (full logits passed back), prompts prefilled in
    chunks and decoded together, one step in flight per stage (a request cancelled while its
    step is in flight ends there), against the same TP group's engine without stages."""
    from tprt.engine.core import Engine, EngineConfig
    from tprt.engine.sampling import SamplingParams

    mesh = _mesh(pp, tp)
    params = [SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=20, seed=5, max_new_tokens=7, logprobs=True, top_logprobs=3,
                             ignore_eos=True)]
    config = EngineConfig(max_batch=8, max_seq_len=32, token_budget=12, cpu_prepack=False, pipeline_microbatches=micro)
    whole = None
    if mesh.stage_index == 0:  # the reference: the same TP group, the whole model, no stages
        model = load_model(workdir / f"{NAME}-tp{tp}", mesh.tp, "fp32")
        whole = _generate(Engine(model, None, config, eos_token_ids=[]), params)
    torch.distributed.barrier()
    stage = stages(ModelConfig.from_file(workdir / f"{NAME}-tp{tp}" / "config.json").num_hidden_layers, pp)
    model = load_stage(workdir / f"{NAME}-tp{tp}", mesh.tp, stage[mesh.stage_index], "fp32")
    engine = Engine(model, None, config, eos_token_ids=[], pipeline=mesh)
    assert engine.runner.cache.kv.shape[0] == len(stage[mesh.stage_index].layers)  # its layers' cache only
    assert engine.steps_in_flight == pp
    out = _generate(engine, params)
    if whole is None or out is None:
        return
    (whole, _), (piped, in_flight) = whole, out
    assert in_flight >= 2, in_flight  # stages worked on different steps (as many as the rows allow)
    assert sorted(piped) == sorted(whole) and len(whole) == len(PROMPTS) * len(params)
    assert piped[CANCELLED].finish_reason == "cancelled" and whole[CANCELLED].finish_reason == "cancelled"
    for rid, want in whole.items():
        got = piped[rid]
        if rid == CANCELLED:  # cancelled at another point of its life: what it got is the same prefix
            n = min(len(got.token_ids), len(want.token_ids))
            assert got.token_ids[:n] == want.token_ids[:n]
            continue
        assert got.token_ids == want.token_ids, (rid, got.token_ids, want.token_ids)
        assert len(want.token_ids) == (9 if rid.endswith("-0") else 7)
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4), rid
        assert [[t for t, _ in row] for row in got.top_logprobs] == [[t for t, _ in row] for row in want.top_logprobs]


def _checks(world: int) -> Checks:
    out: list[tuple[str, Any]] = []
    for pp, tp in MESHES[world]:
        for micro in sorted({pp, 4}):  # 1F1B takes at least one micro-batch per stage; a batch has 4 rows
            out.append((f"pp{pp}-tp{tp}-m{micro}-full", partial(check_full, pp=pp, tp=tp, micro=micro)))
        out.append((f"pp{pp}-tp{tp}-lora", partial(check_lora, pp=pp, tp=tp, micro=pp)))
        out.append((f"pp{pp}-tp{tp}-tied-full", partial(check_full, pp=pp, tp=tp, micro=pp, name=TIED)))
        for micro in (None, 1, 3):  # None: the default (these small steps stay whole)
            out.append((f"pp{pp}-tp{tp}-generate-m{micro}", partial(check_generate, pp=pp, tp=tp, micro=micro)))
    if world == 8:  # DP x PP x TP: two replicas of a [pp 2, tp 2] pipeline, two rows each
        out.append(("dp2-pp2-tp2-full", partial(check_full, pp=2, tp=2, micro=2, dp=2)))
    return out


@pytest.fixture(scope="module")
def worlds(workdir: Path) -> dict[int, WorldResults]:
    return {world: run_world(world, _checks(world), workdir) for world in MESHES}


@pytest.mark.parametrize(("world", "check"), [(w, c) for w in MESHES for c in names(_checks(w))],
                         ids=lambda v: str(v))
def test_pipeline(worlds: dict[int, WorldResults], world: int, check: str) -> None:
    worlds[world].assert_ok(check)
