"""TP LoRA against Hugging Face PEFT on the same base weights, at TP 1, 2 and 4.

The parent builds PEFT models (LoraConfig(init_lora_weights=False): B is random, so every
gradient is meaningful) on tiny checkpoints and records: full logits, loss and every LoRA
gradient on one batch; the losses, clipped norms and final A/B of a few AdamW steps; and the
merged (merge_and_unload) weights. Each TP rank then loads PEFT's adapter state into
`apply_lora` adapters (sliced by `load_lora_state_dict`) and checks:

- logits, loss and each LoRA gradient (sliced to this rank by the TP rules) after sync_gradients;
  the base model gets no gradient; replicated factors are identical on every rank;
- AdamW steps with clipping give PEFT's losses, norms and, gathered by `lora_state_dict`, factors;
- `merge_lora` gives PEFT's merged weights and the unmerged logits.

The cases cover every target, a q-only adapter on the fused qkv (k/v rows untouched), kv heads
replicated over ranks at TP 4 (rope_pad: 2 kv heads) and tied embeddings. The trained adapter
of each rank-0 is written in PEFT's layout (adapter_config) and loaded by PeftModel in the parent.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from dpo_checks import RUNS as DPO_RUNS, check_dpo_steps
from helpers import FAMILY_CONFIGS, make_hf_llama, make_hf_model
from mp import Checks, WorldResults, names, run_single, run_world
from test_backward_tp import (
    HP, MIN_LR_RATIO, N_STEPS, WARMUP, assert_rel, assert_replicas_identical, compare_to_ref,
    local_slice, make_batch,
)
from tprt.model.config import ModelConfig
from tprt.distributed.context import TPContext
from tprt.errors import CheckpointError, ConfigError, ValidationError
from tprt.checkpoint.loading import load_model
from tprt.model.llama import TPLlamaForCausalLM
from tprt.train.grads import clip_grad_norm, sync_gradients
from tprt.cpu.fast_linear import prepack
from tprt.lora.attach import apply_lora, attach, attached, build_lora, detach
from tprt.lora.config import HF_MODULES
from tprt.lora.merge import merge_lora
from tprt.lora.peft_io import adapter_config, load_lora_state_dict, lora_state_dict, read_adapter, read_adapter_config
from tprt.train.optim import AdamW, WarmupCosine, warmup_cosine
from tprt.train.step import compute_loss, enable_sequence_parallel

CASES: dict[str, tuple[str, tuple[str, ...], int, float]] = {  # name -> (config, targets, rank, alpha)
    "gqa-all": ("gqa", ("q", "k", "v", "o", "gate", "up", "down"), 4, 8.0),
    "gqa-q": ("gqa", ("q",), 4, 16.0),
    "rope_pad-kv": ("rope_pad", ("k", "v", "o", "down"), 2, 4.0),
    "tied-mlp": ("tied", ("q", "gate", "up"), 8, 8.0),
    # beyond Llama: q/k/v biases (and k/v replicated at TP 4); q/k norms with o/q/k/v biases;
    "qwen2-attn": ("qwen2", ("q", "k", "v", "o"), 2, 4.0),
    "qwen3-all": ("qwen3", ("q", "k", "v", "o", "gate", "up", "down"), 4, 8.0),
    # Gemma: soft-capped scores and logits, GeGLU, the extra norms; q/k norms and two rope bases
    "gemma2-all": ("gemma2", ("q", "k", "v", "o", "gate", "up", "down"), 4, 8.0),
    "gemma3-kv-up": ("gemma3", ("k", "v", "up"), 4, 4.0),
}
CONFIG_SEEDS = {"gqa": 20, "rope_pad": 21, "tied": 22, "qwen2": 23, "qwen3": 24, "gemma2": 25, "gemma3": 26}
# Adapters served side by side in one batch (tprt.lora.routing) on the gqa model: different ranks
# and target sets. name -> (targets, rank, alpha)
MIXED: dict[str, tuple[tuple[str, ...], int, float]] = {
    "all-r4": (("q", "k", "v", "o", "gate", "up", "down"), 4, 8.0),
    "q-r2": (("q",), 2, 4.0),
    "kvo-down-r8": (("k", "v", "o", "down"), 8, 16.0),
    "mlp-r3": (("gate", "up"), 3, 6.0),
}
MIXED_ROWS = (0, 1, 2, 3, 4, 2)  # each row's adapter: 0 the base model, i MIXED's i-th
TPS = (1, 2, 4)
LR = 5e-3


def _peft_config(targets: tuple[str, ...], rank: int, alpha: float) -> Any:
    from peft import LoraConfig

    modules = [HF_MODULES[t].split(".")[1] for t in targets]
    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules,  # type: ignore[arg-type]
                      lora_dropout=0.0, init_lora_weights=False)


def _peft_key(name: str) -> str:
    """PEFT parameter name -> its saved name (no adapter name)."""
    return name.replace(".default.weight", ".weight")


# ----------------------------------------------------------------------------- setup (parent only)


def _reference(hf_dir: Path, case: str) -> dict[str, Any]:
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    _, targets, rank, alpha = CASES[case]
    torch.manual_seed(len(case))
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                           _peft_config(targets, rank, alpha))
    vocab = model.config.vocab_size
    batches = [make_batch(100 + s, vocab) for s in range(N_STEPS)]
    ids, labels = batches[0]
    ref: dict[str, Any] = {"state": {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}}
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    ref["logits"], ref["loss"] = out.logits.detach(), out.loss.item()
    params = [p for p in model.parameters() if p.requires_grad]
    ref["grads"] = {_peft_key(n): p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    # half the first gradient's norm: clipping is active (asserted below)
    ref["max_norm"] = max_norm = 0.5 * float(torch.linalg.vector_norm(torch.stack([g.norm() for g in ref["grads"].values()])))
    opt = torch.optim.AdamW(params, **{**HP, "lr": LR})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(WARMUP, N_STEPS, MIN_LR_RATIO))
    ref["losses"], ref["norms"] = [], []
    for ids, labels in batches:
        opt.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        ref["norms"].append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        ref["losses"].append(loss.item())
        opt.step()
        sched.step()
    assert sum(n > max_norm for n in ref["norms"]) >= 2, f"clipping would not be active: norms {ref['norms']}"
    ref["trained"] = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    ref["batches"] = batches
    merged = get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                            _peft_config(targets, rank, alpha))
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(merged, ref["state"])
    ref["merged"] = {n: p.detach().clone() for n, p in merged.merge_and_unload().named_parameters()}
    return ref


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from convert.api import hf_to_tp

    root = tmp_path_factory.mktemp("lora")
    for name in sorted({c for c, *_ in CASES.values()}):
        make = make_hf_model if name in FAMILY_CONFIGS else make_hf_llama
        hf_dir = make(root / f"{name}-hf", name, seed=CONFIG_SEEDS[name])
        for tp in TPS:
            hf_to_tp(hf_dir, root / f"{name}-tp{tp}", tp)
    for case, (name, *_) in CASES.items():
        torch.save(_reference(root / f"{name}-hf", case), root / f"{case}-ref.pt")
    torch.save(_mixed_reference(root / "gqa-hf", root / "mixed"), root / "mixed-ref.pt")
    return root


def _mixed_reference(hf_dir: Path, out: Path) -> dict[str, Any]:
    """PEFT's logits of each MIXED_ROWS row with its adapter alone (random A and B, saved with
    save_pretrained under out/<name>), and the plain model's for base rows."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ids = torch.randint(3, base.config.vocab_size, (len(MIXED_ROWS), 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = base(input_ids=ids).logits
    logits = plain.clone()
    for i, (name, (targets, rank, alpha)) in enumerate(MIXED.items(), start=1):
        torch.manual_seed(i)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                               _peft_config(targets, rank, alpha))
        model.save_pretrained(out / name)
        rows = [r for r, a in enumerate(MIXED_ROWS) if a == i]
        with torch.no_grad():
            logits[rows] = model(input_ids=ids[rows]).logits
    return {"ids": ids, "logits": logits, "plain": plain}


# ----------------------------------------------------------------------------- helpers (every rank)


def _lora_model(ctx: TPContext, workdir: Path, case: str,
                sp: bool = False) -> tuple[TPLlamaForCausalLM, list[torch.nn.Parameter], dict[str, Any]]:
    """The base model with the case's adapters holding PEFT's initial factors; its params; the
    reference (`sp`: under sequence parallelism)."""
    name, targets, rank, alpha = CASES[case]
    ref: dict[str, Any] = torch.load(workdir / f"{case}-ref.pt")
    model = load_model(workdir / f"{name}-tp{ctx.world_size}", ctx).train()
    enable_sequence_parallel(model, sp)
    params = apply_lora(model, targets, rank, alpha)
    prepack(model, tune=False)  # as the trainer does: on CPU the frozen base runs from packed copies
    load_lora_state_dict(attached(model), ref["state"], ctx)
    return model, params, ref


def _peft_name(model: TPLlamaForCausalLM, our_name: str) -> tuple[str, str]:
    """Our adapter parameter name (layers.N.<base>.adapter.lora_X.<target>) -> (PEFT key, the HF
    weight whose TP rule slices it: B by the base's rows, A by a row-parallel base's columns)."""
    parts = our_name.split(".")
    layer, factor, target = int(parts[1]), parts[-2], parts[-1]
    module = f"model.layers.{layer}.{HF_MODULES[target]}.weight"
    key = f"base_model.model.{module.removesuffix('.weight')}.{factor}.weight"
    row_parallel = target in ("o", "down")
    if factor == "lora_B" and not row_parallel:
        return key, module
    if factor == "lora_A" and row_parallel:
        return key, module
    return key, "replicated.norm"  # replicated: local_slice keeps the whole tensor


def _compare_lora(model: TPLlamaForCausalLM, ref: dict[str, torch.Tensor], grads: bool, tol: float) -> int:
    """Every adapter parameter (or its gradient) against this rank's slice of PEFT's."""
    n = 0
    for our_name, p in model.named_parameters():
        if "adapter" not in our_name:
            continue
        key, rule = _peft_name(model, our_name)
        value = p.grad if grads else p.detach()
        assert value is not None, f"{our_name}: no gradient"
        assert_rel(value, local_slice(rule, ref[key], model), f"{'grad of ' if grads else ''}{key}", tol)
        n += 1
    return n


# ----------------------------------------------------------------------------- checks (every rank)


def check_forward_backward(ctx: TPContext, workdir: Path, case: str, sp: bool = False) -> None:
    """Logits, loss and every LoRA gradient equal PEFT's; the base is frozen; replicas agree;
    lora_state_dict gives back exactly the state that was loaded."""
    model, params, ref = _lora_model(ctx, workdir, case, sp)
    ids, labels = ref["batches"][0]
    with torch.no_grad():
        assert_rel(model.gather_logits(model(ids)), ref["logits"], "logits", 1e-5)
    loss_sum, n_tokens = compute_loss(model, ids, labels)
    assert abs(float(loss_sum.detach() / n_tokens) - ref["loss"]) <= 1e-5 * ref["loss"]
    (loss_sum / n_tokens).backward()
    sync_gradients(model, ctx)
    assert all(p.grad is None for n, p in model.named_parameters() if "adapter" not in n), "the base got gradients"
    assert _compare_lora(model, ref["grads"], grads=True, tol=1e-4) == len(params) == len(ref["grads"])
    assert_replicas_identical(model, ctx)
    state = lora_state_dict(attached(model), ctx)
    if ctx.rank == 0:
        assert state.keys() == ref["state"].keys()
        assert all(torch.equal(state[k], ref["state"][k]) for k in state), "round trip changed a factor"
    else:
        assert state == {}


def check_steps(ctx: TPContext, workdir: Path, case: str) -> None:
    """AdamW + clipping on the LoRA factors: PEFT's losses, norms and final factors. Rank 0
    writes the trained adapter in PEFT's layout, with our logits, for the parent to load."""
    from safetensors.torch import save_file

    model, params, ref = _lora_model(ctx, workdir, case)
    opt = AdamW(params, **{**HP, "lr": LR})
    sched = warmup_cosine(opt, WARMUP, N_STEPS, MIN_LR_RATIO)
    for i, (ids, labels) in enumerate(ref["batches"]):
        opt.zero_grad(set_to_none=True)
        loss_sum, n_tokens = compute_loss(model, ids, labels)
        (loss_sum / n_tokens).backward()
        sync_gradients(model, ctx)
        norm = clip_grad_norm(params, ref["max_norm"], ctx)
        assert abs(norm - ref["norms"][i]) <= 1e-5 * ref["norms"][i], f"step {i} norm {norm} != {ref['norms'][i]}"
        assert abs(float(loss_sum.detach() / n_tokens) - ref["losses"][i]) <= 1e-5 * ref["losses"][i], f"step {i} loss"
        opt.step()
        sched.step()
    _compare_lora(model, ref["trained"], grads=False, tol=1e-4)
    assert_replicas_identical(model, ctx, "weight")
    state = lora_state_dict(attached(model), ctx)
    with torch.no_grad():
        logits = model.gather_logits(model(ref["batches"][0][0]))
    if ctx.rank == 0:
        out = workdir / f"{case}-tp{ctx.world_size}-adapter"
        out.mkdir()
        save_file(state, str(out / "adapter_model.safetensors"))
        name, targets, rank, alpha = CASES[case]
        cfg = adapter_config(targets, rank, alpha, 0.0, str(workdir / f"{name}-hf"))
        (out / "adapter_config.json").write_text(json.dumps(cfg))
        torch.save(logits, out / "logits.pt")


def check_merge(ctx: TPContext, workdir: Path, case: str) -> None:
    """merge_lora folds the adapters into PEFT's merge_and_unload weights; logits unchanged."""
    model, _, ref = _lora_model(ctx, workdir, case)
    ids = ref["batches"][0][0]
    with torch.no_grad():
        before = model.gather_logits(model(ids))
        adapted = len(attached(model).pieces)
        assert adapted and merge_lora(model) == adapted
        after = model.gather_logits(model(ids))
    assert not attached(model).pieces and not any(".adapter" in n for n, _ in model.named_parameters())
    assert_rel(after, before, "merged vs unmerged logits", 1e-5)
    compare_to_ref(model, ref["merged"], "weight", 1e-6)


def check_mixed_batch(ctx: TPContext, workdir: Path) -> None:
    """One batch of base rows and rows of four adapters (different ranks and targets, read from
    PEFT's save_pretrained): every row's logits equal that row run alone with its adapter, and
    PEFT's on the unsharded model."""
    from tprt.lora.routing import AdapterSlots

    ref = torch.load(workdir / "mixed-ref.pt")
    model = load_model(workdir / f"gqa-tp{ctx.world_size}", ctx).eval()
    prepack(model, tune=False)  # as the server's runner does
    pool = AdapterSlots(model)
    for i, name in enumerate(MIXED, start=1):
        pool.install(i, read_adapter(model, workdir / "mixed" / name, ctx))
    ids = ref["ids"]
    with torch.no_grad():
        # MIXED_ROWS pads its groups and has a base row; the second routing has neither (every row
        # in exactly one full group: the deltas go back by a gather instead of a scatter-add); the
        # third has full groups and base rows after them (no padding, yet not every row grouped).
        for rows in (MIXED_ROWS, (3, 1, 1, 3, 2, 2), (2, 2, 3, 3, 0, 0)):
            pool.route(rows, ctx.device)
            mixed = model.gather_logits(model(ids))
            for r, adapter in enumerate(rows):
                pool.route([adapter], ids.device)
                alone = model.gather_logits(model(ids[r : r + 1]))[0]
                assert_rel(mixed[r], alone, f"row {r} (adapter {adapter}) of {rows} vs alone", 1e-5)
                if rows == MIXED_ROWS:
                    assert_rel(mixed[r], ref["logits"][r], f"row {r} (adapter {adapter}) vs PEFT", 1e-5)
                    changed = (mixed[r] - ref["plain"][r]).abs().max().item()
                    assert (changed > 1e-3) == (adapter != 0), f"row {r}: adapter {adapter} changed {changed:.1e}"


CHECKS: Checks = [
    ("mixed_batch", check_mixed_batch),
    ("dpo_steps", check_dpo_steps),
    *((f"{c}-{kind}", partial(fn, case=c)) for c in CASES
      for kind, fn in (("forward_backward", check_forward_backward), ("steps", check_steps), ("merge", check_merge))),
    # Sequence parallelism (issue 44): Llama's block, and Gemma's extra norms on the split positions.
    *((f"{c}-sp-forward_backward", partial(check_forward_backward, case=c, sp=True)) for c in ("gqa-all", "gemma2-all")),
]


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def worlds(workdir: Path) -> dict[int, WorldResults]:
    out = {1: run_single(CHECKS, workdir)}
    for tp in TPS[1:]:
        out[tp] = run_world(tp, CHECKS, workdir)
    return out


@pytest.mark.parametrize("check", names(CHECKS))
@pytest.mark.parametrize("tp", TPS)
def test_lora_tp(worlds: dict[int, WorldResults], tp: int, check: str) -> None:
    worlds[tp].assert_ok(check)


@pytest.mark.parametrize("tp", TPS[1:])
def test_dpo_losses_and_rewards_agree_over_tp(worlds: dict[int, WorldResults], workdir: Path, tp: int) -> None:
    """LoRA-DPO (sigmoid, label smoothing, adapter-off reference) and full DPO (IPO, precomputed
    reference): every step's loss, grad norm and rewards, and the held-out ones, equal TP 1's."""
    for world in (1, tp):
        worlds[world].assert_ok("dpo_steps")
    one, many = (json.loads((workdir / f"dpo-tp{w}.json").read_text()) for w in (1, tp))
    assert set(one) == set(many) == set(DPO_RUNS)
    for run in DPO_RUNS:
        for step, (a, b) in enumerate(zip(one[run], many[run], strict=True)):
            assert a.keys() == b.keys(), (run, step)
            for key in a:
                if key.endswith("reward_accuracy") and abs(a[key.replace("accuracy", "margin")]) < 1e-3:
                    continue  # the first step's rewards are rounding noise around 0: a count of ties
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (run, step, key, a[key], b[key])


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("case", CASES)
def test_trained_adapter_loads_in_peft(worlds: dict[int, WorldResults], workdir: Path, tp: int, case: str) -> None:
    """The adapter written from lora_state_dict + adapter_config loads with PeftModel.from_pretrained
    and gives our logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    worlds[tp].assert_ok(f"{case}-steps")
    out = workdir / f"{case}-tp{tp}-adapter"
    base = AutoModelForCausalLM.from_pretrained(workdir / f"{CASES[case][0]}-hf", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out).eval()
    ids = torch.load(workdir / f"{case}-ref.pt")["batches"][0][0]
    with torch.no_grad():
        assert_rel(model(ids).logits, torch.load(out / "logits.pt"), "PEFT logits of our adapter", 1e-5)


# ----------------------------------------------------------------------------- single process


def _tp1(workdir: Path, name: str = "gqa") -> TPLlamaForCausalLM:
    return load_model(workdir / f"{name}-tp1", TPContext.single())


def test_grouping_gathers_back_only_when_every_row_is_grouped() -> None:
    """The deltas go back by a gather only when every row of the batch is in a group exactly once;
    with base rows left over (even after full groups) they are scattered, so base rows get nothing."""
    from tprt.lora.routing import Grouped

    cpu = torch.device("cpu")
    every = Grouped.of({1: [1, 2], 2: [0, 3]}, 4, cpu)
    assert every.inverse is not None and every.perm[every.inverse].tolist() == [0, 1, 2, 3] and every.mask is None
    for rows, n in (({1: [0]}, 2), ({2: [0, 1], 3: [2, 3]}, 6)):
        assert Grouped.of(rows, n, cpu).inverse is None, (rows, n)
    padded = Grouped.of({1: [0, 2, 3], 2: [1]}, 4, cpu)
    assert padded.inverse is None and padded.mask is not None and padded.mask.view(-1).tolist() == [1, 1, 1, 1, 0, 0]


def test_unknown_target_is_named(workdir: Path) -> None:
    model = _tp1(workdir)
    with pytest.raises(ValidationError, match=r"unknown LoRA target 'qkv'; allowed: q, k, v, o, gate, up, down") as e:
        apply_lora(model, ["q", "qkv"], 4, 8.0)
    assert e.value.field == "lora_targets" and "\n" not in str(e.value)
    assert not attached(model).pieces and all(p.requires_grad is False for p in model.parameters())
    with pytest.raises(ValidationError, match="lora_rank|rank must be"):
        apply_lora(model, ["q"], 0, 8.0)
    with pytest.raises(ValidationError, match="dropout"):
        apply_lora(model, ["q"], 4, 8.0, dropout=1.0)


def test_targets_accept_hf_names_and_apply_once(workdir: Path) -> None:
    model = _tp1(workdir)
    params = apply_lora(model, ["down_proj", "q_proj", "q"], 2, 4.0)
    assert len(params) == 2 * 2 * model.config.num_hidden_layers  # (A, B) x (q, down) per layer
    assert all(p.requires_grad for p in params)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"layers.{i}.{m}.adapter.lora_{f}.{t}" for i in range(2) for m, t in
        (("self_attn.qkv_proj", "q"), ("mlp.down_proj", "down")) for f in "AB"}
    with pytest.raises(ConfigError, match="already applied"):
        apply_lora(model, ["v"], 2, 4.0)


def test_fresh_adapter_is_identity_and_tp_independent(workdir: Path) -> None:
    """PEFT's init (B = 0) leaves the outputs unchanged; A's values do not depend on the TP degree."""
    model = _tp1(workdir)
    ids = make_batch(0, 256)[0]
    with torch.no_grad():
        before = model(ids)
        apply_lora(model, ["q", "o", "down"], 4, 8.0, seed=3)
        assert torch.equal(model(ids), before)
    state = lora_state_dict(attached(model), TPContext.single())
    a = state["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]
    assert a.shape == (4, 128) and 0 < a.abs().max() <= 1 / 128**0.5
    assert all(not v.any() for k, v in state.items() if "lora_B" in k)


def test_adapter_config_is_peft_loadable(workdir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, PeftConfig

    cfg = adapter_config(["gate", "q", "v"], 8, 16.0, 0.05, "/models/base")
    assert cfg["target_modules"] == ["q_proj", "v_proj", "gate_proj"] and cfg["r"] == 8
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    loaded = PeftConfig.from_pretrained(str(tmp_path))
    assert isinstance(loaded, LoraConfig) and loaded.lora_alpha == 16.0 and loaded.lora_dropout == 0.05
    assert set(loaded.target_modules or ()) == {"q_proj", "v_proj", "gate_proj"}
    assert read_adapter_config(cfg) == (("q", "v", "gate"), 8, 16.0, 0.05)
    with pytest.raises(ConfigError, match="field 'use_dora'=True is not supported"):
        read_adapter_config({**cfg, "use_dora": True})


def test_load_adapter_from_peft_save_pretrained(workdir: Path, tmp_path: Path) -> None:
    """A directory written by PEFT's save_pretrained is applied unmerged (tprt generate --adapter)."""
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(5)
    peft_model = get_peft_model(LlamaForCausalLM.from_pretrained(workdir / "tied-hf", dtype=torch.float32),
                                _peft_config(("k", "up", "down"), 4, 8.0))
    peft_model.save_pretrained(tmp_path / "adapter")
    ids = make_batch(1, 300)[0]
    model = load_model(workdir / "tied-tp1", TPContext.single())
    adapter = read_adapter(model, tmp_path / "adapter", TPContext.single())
    attach(model, adapter)
    assert len(adapter.parameters()) == 2 * 3 * 2 and adapter.targets == ("k", "up", "down")
    with torch.no_grad():
        assert_rel(model.gather_logits(model(ids)), peft_model.eval()(ids).logits, "logits", 1e-5)


def test_load_state_errors_name_the_tensor(workdir: Path) -> None:
    ctx = TPContext.single()
    model = _tp1(workdir)
    with pytest.raises(ConfigError, match="no LoRA adapters"):
        load_lora_state_dict(attached(model), {}, ctx)
    adapter = build_lora(model, ["q"], 4, 8.0)
    state = lora_state_dict(adapter, ctx)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    with pytest.raises(CheckpointError, match=f"tensor '{key}' missing"):
        load_lora_state_dict(adapter, {k: v for k, v in state.items() if k != key}, ctx)
    with pytest.raises(CheckpointError, match=r"lora_B.weight' has shape \[64, 2\]; expected \[64, 4\]"):
        load_lora_state_dict(adapter, {**state, key: torch.zeros(64, 2)}, ctx)
    extra = key.replace("q_proj", "v_proj")
    with pytest.raises(CheckpointError, match="projections without an adapter, e.g. '.*v_proj.lora_B.weight'"):
        load_lora_state_dict(adapter, {**state, extra: torch.zeros(32, 4)}, ctx)
    load_lora_state_dict(adapter, {k.replace(".weight", ".default.weight"): v for k, v in state.items()}, ctx)


def test_dropout_only_in_training(workdir: Path) -> None:
    model = _tp1(workdir)
    apply_lora(model, ["q", "down"], 4, 8.0, dropout=0.5)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_()  # B nonzero, so the masks show in the output
        ids = make_batch(2, 256)[0]
        model.eval()
        assert torch.equal(model(ids), model(ids))
        model.train()
        assert not torch.equal(model(ids), model(ids))


def test_building_an_adapter_leaves_the_model_alone_and_detaching_restores_it(workdir: Path) -> None:
    """build_lora touches nothing of the model; attach changes its outputs (B nonzero), detach
    gives back the base model's outputs bit for bit, and the detached adapter attaches again."""
    model = _tp1(workdir)
    ids = make_batch(3, 256)[0]
    state = {n: p.clone() for n, p in model.state_dict().items()}
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad():
        before = model(ids)
        adapter = build_lora(model, ["q", "v", "o", "down"], 4, 8.0, seed=1)
        for p in adapter.parameters():
            p.normal_()
        assert not attached(model).pieces and all(linear.adapter is None for linear in model.linears())
        assert model.state_dict().keys() == state.keys()
        assert all(torch.equal(p, state[n]) for n, p in model.state_dict().items())
        assert {n: p.requires_grad for n, p in model.named_parameters()} == grads
        attach(model, adapter)
        with_adapter = model(ids)
        assert not torch.equal(with_adapter, before)
        with pytest.raises(ConfigError, match="already has an adapter"):
            attach(model, adapter)
        again = detach(model)
        assert [m for _, m in again.pieces] == [m for _, m in adapter.pieces]
        assert torch.equal(model(ids), before) and not attached(model).pieces
        attach(model, again)
        assert torch.equal(model(ids), with_adapter)
        with pytest.raises(ValueError, match="built for another model"):
            attach(_tp1(workdir), adapter)


def test_lora_does_not_import_training_code() -> None:
    """Serving loads adapters through tprt.lora: none of it pulls in tprt.train."""
    import subprocess
    import sys

    code = ("import sys, tprt.lora.attach, tprt.lora.merge, tprt.lora.peft_io, tprt.lora.routing; "
            "print(sorted(m for m in sys.modules if m.startswith('tprt.train')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
