"""`tprt finetune` / `tprt merge-lora` end to end on a tiny model at TP 2 (the local launcher).

LoRA and full runs on a tiny memorisable dataset: the loss goes down, the outputs are written
and load (the adapter in PEFT, giving the logits of our model with the adapter; the full
fine-tune through `tp_to_hf` in transformers, giving our model's logits; the merged checkpoint
like PEFT). A run killed with SIGKILL and resumed logs exactly the losses of an uninterrupted
run (fp32). --lr 1e30 stops with the step named and the last good checkpoint kept. Bad input:
one line on stderr, exit non-zero, nothing written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tprt.cli.main import main
from tprt.distributed.context import TPContext
from tprt.checkpoint.loading import load_model
from tprt.train import checkpointing as ckpt
from tprt.train.plot import read_metrics
from train_fixtures import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
ANSWER = "The capital of France is Paris."
QUESTIONS = ["What is the capital of France?", "Which city is the capital of France?", "France's capital?",
             "Name the capital of France.", "Tell me the capital of France."]
PROMPTS = ([5, 17, 42, 99, 3, 250, 7], [11, 12, 13, 200])  # uneven on purpose


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from convert.api import hf_to_tp

    root = tmp_path_factory.mktemp("finetune")
    hf, tp2 = make_tiny_model(root, tp=2)
    tp1 = root / "gqa-tp1"
    hf_to_tp(hf, tp1, 1)
    data = root / "data.jsonl"
    recs = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ANSWER}]} for q in QUESTIONS]
    recs += [{"prompt": "Hello there!", "completion": " Hello world."}, {"text": "The quick brown fox jumps."}]
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return {"root": root, "hf": hf, "tp1": tp1, "tp2": tp2, "data": data}


def _args(s: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["finetune", "--model", str(s["tp2"]), "--data", str(s["data"]), "--out", str(out), "--seq-len", "64",
            "--batch-size", "2", "--no-progress", *extra]


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]


def _logits(model: torch.nn.Module, vocab: int) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([p]))[0, :, :vocab].float() for p in PROMPTS]


def _hf_logits(model: torch.nn.Module) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].float() for p in PROMPTS]


def _close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float = 1e-4) -> bool:
    return all(float((x - y).abs().max()) <= tol * float(y.abs().max()) for x, y in zip(a, b))


# ----------------------------------------------------------------------------- LoRA


@pytest.fixture(scope="module")
def lora_run(setup: dict[str, Path]) -> Path:
    out = setup["root"] / "lora"
    rc = main(_args(setup, out, "--lora-rank", "4", "--lora-targets", "q,k,v,o,gate,up,down", "--lr", "3e-2",
                    "--steps", "12", "--save-every", "4", "--keep-checkpoints", "2", "--eval-fraction", "0.2",
                    "--eval-every", "6"))
    assert rc == 0
    return out


def test_lora_run_learns_and_writes_its_outputs(lora_run: Path) -> None:
    losses = _losses(lora_run)
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < 0.5 * losses[0], losses
    records = read_metrics(lora_run / "metrics.jsonl")
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "eval_loss"} <= set(records[0])
    assert [r["step"] for r in records if r["eval_loss"] is not None] == [6, 12]
    assert (lora_run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [s for s, _ in ckpt.complete_checkpoints(lora_run)] == [8, 12]  # --keep-checkpoints 2
    assert {p.name for p in (lora_run / "adapter").iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}


def test_peft_loads_the_adapter_with_our_logits(setup: dict[str, Path], lora_run: Path) -> None:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from convert.api import tp_to_hf
    from tprt.lora.attach import attach
    from tprt.lora.peft_io import read_adapter

    base_hf = setup["root"] / "base-export-hf"
    if not base_hf.exists():
        tp_to_hf(setup["tp2"], base_hf)
    peft = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base_hf, dtype=torch.float32),
                                     str(lora_run / "adapter")).eval()
    ours = load_model(setup["tp1"], TPContext.single(), dtype="fp32")
    base_logits = _logits(ours, ours.config.vocab_size)
    attach(ours, read_adapter(ours, lora_run / "adapter", TPContext.single()))
    theirs = _hf_logits(peft)
    assert _close(_logits(ours, ours.config.vocab_size), theirs)
    assert not _close(base_logits, theirs, 1e-2)  # the adapter changed something


def test_merge_lora_matches_peft(setup: dict[str, Path], lora_run: Path) -> None:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from convert.api import tp_to_hf, verify

    merged = setup["root"] / "merged-tp2"
    assert main(["merge-lora", "--model", str(setup["tp2"]), "--adapter", str(lora_run / "adapter"),
                 "--out", str(merged)]) == 0
    assert verify(merged) == []
    tp_to_hf(merged, setup["root"] / "merged-hf")
    merged_hf = LlamaForCausalLM.from_pretrained(setup["root"] / "merged-hf", dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32),
                                     str(lora_run / "adapter")).eval()
    assert _close(_hf_logits(merged_hf), _hf_logits(peft))


# ----------------------------------------------------------------------------- full


def test_full_finetune_exports_a_tp_checkpoint_transformers_loads(setup: dict[str, Path]) -> None:
    from transformers import LlamaForCausalLM

    from convert.api import reshard, tp_to_hf, verify

    out = setup["root"] / "full"
    assert main(_args(setup, out, "--full", "--lr", "3e-3", "--steps", "8", "--grad-accum", "2")) == 0
    losses = _losses(out)
    assert len(losses) == 8 and sum(losses[-3:]) / 3 < 0.7 * losses[0], losses
    assert verify(out / "model") == []
    reshard(out / "model", setup["root"] / "full-tp1", 1)
    ours = load_model(setup["root"] / "full-tp1", TPContext.single())
    tp_to_hf(out / "model", setup["root"] / "full-hf")
    hf = LlamaForCausalLM.from_pretrained(setup["root"] / "full-hf", dtype=torch.float32).eval()
    base = LlamaForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32).eval()
    assert _close(_logits(ours, ours.config.vocab_size), _hf_logits(hf))
    assert not _close(_hf_logits(base), _hf_logits(hf), 1e-2)


# ----------------------------------------------------------------------------- resume, NaN


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tprt.cli", *args]


def _logged_steps(out: Path) -> int:
    """Complete lines in the run's metrics log (a line is written whole, after its step)."""
    path = out / "metrics.jsonl"
    return path.read_text().count("\n") if path.is_file() else 0


def test_resume_after_sigkill_repeats_the_loss_curve_exactly(setup: dict[str, Path]) -> None:
    steps, save_every, kill_after = 40, 4, 6
    common = ["--lora-rank", "4", "--lora-dropout", "0.1", "--lr", "5e-3", "--steps", str(steps),
              "--save-every", str(save_every), "--seed", "3"]
    ref = setup["root"] / "ref"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(_cli(*_args(setup, ref, *common)), check=True, env=env, capture_output=True, timeout=180)
    out = setup["root"] / "killed"
    proc = subprocess.Popen(_cli(*_args(setup, out, *common)), env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Step 6's line is logged after the checkpoint of step 4 is complete (a step logs, then
        # saves): killed now, the run is past a checkpoint and far from its last step.
        deadline = time.monotonic() + 120
        while _logged_steps(out) < kill_after and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # every rank at once
        proc.wait()
    assert kill_after <= _logged_steps(out) < steps and not (out / "adapter").exists(), "not killed mid-run"
    assert ckpt.latest_checkpoint(out) is not None
    assert main(_args(setup, out, *common, "--resume")) == 0
    assert _losses(out) == _losses(ref)
    assert len(_losses(ref)) == steps


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(
        setup: dict[str, Path], capfd: pytest.CaptureFixture[str]) -> None:
    out = setup["root"] / "nan"
    rc = main(_args(setup, out, "--full", "--lr", "1e30", "--steps", "6", "--save-every", "1"))
    err = capfd.readouterr().err.strip().splitlines()[-1]
    assert rc != 0
    assert "step 2: " in err and ("nan" in err or "inf" in err) and "step-00000001" in err, err
    assert [s for s, _ in ckpt.complete_checkpoints(out)] == [1]
    assert not (out / "model").exists()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1]


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("line, extra, match", [
    ('{"text": "ok"}\n{"text": "broken\n', [], r"data\.jsonl:2: not valid JSON"),
    ('{"title": "x"}\n', [], r"data\.jsonl:1: expected a 'text'"),
    ("\n", [], r"data\.jsonl: no examples"),
    ('{"text": "' + "The quick brown fox " * 20 + '"}\n', ["--no-truncate"], r"more than --seq-len 64.*--no-truncate"),
    ('{"text": "ok"}\n', ["--lora-targets", "q,x"], r"--lora-targets must be"),
    ('{"text": "ok"}\n', ["--full", "--lora-alpha", "4"], r"--lora-alpha cannot be used with --full"),
])
def test_bad_input_is_one_line_and_writes_nothing(setup: dict[str, Path], tmp_path: Path, line: str,
                                                  extra: list[str], match: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import re

    data = tmp_path / "data.jsonl"
    data.write_text(line)
    out = tmp_path / "out"
    args = _args(setup, out, *extra)
    args[args.index("--data") + 1] = str(data)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(match, err), err
    assert not out.exists()


def test_resume_into_another_model_or_tp_is_refused(setup: dict[str, Path], lora_run: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    args = _args(setup, lora_run, "--lora-rank", "4", "--lora-targets", "q,k,v,o,gate,up,down", "--resume")
    other = list(args)
    other[other.index("--model") + 1] = str(setup["tp1"])
    assert main(other) == 2
    err = capsys.readouterr().err
    assert "--resume:" in err and "TP degree 2, this run has 1" in err, err
    _, other_tp2 = make_tiny_model(setup["root"] / "other", tp=2, seed=5)
    args[args.index("--model") + 1] = str(other_tp2)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "was trained from model" in err and str(setup["tp2"]) in err, err


# ----------------------------------------------------------------------------- DP x TP


def _cli_rank(args: list[str]) -> int:
    """One rank of a torchrun-style world (RANK/WORLD_SIZE set by the launcher) running the CLI."""
    return main(args)


def test_dp2_x_tp2_equals_tp2_with_accumulation(setup: dict[str, Path]) -> None:
    """World 4 = dp 2 x tp 2, one row per rank and micro-batch, against dp 1 accumulating two
    micro-batches of one row (with activation checkpointing): the same global batches, so the
    same losses and adapter."""
    from safetensors.torch import load_file

    from tprt.distributed.launcher import launch_local

    common = ["--lora-rank", "4", "--lr", "1e-2", "--steps", "4", "--batch-size", "1"]
    dp = setup["root"] / "dp2"
    assert launch_local(4, _cli_rank, (_args(setup, dp, *common),), timeout_s=240) == [0, 0, 0, 0]
    acc = setup["root"] / "accum2"  # and recomputing activations in the backward changes nothing
    assert main(_args(setup, acc, *common, "--grad-accum", "2", "--activation-checkpointing")) == 0
    assert torch.allclose(torch.tensor(_losses(dp)), torch.tensor(_losses(acc)), rtol=1e-5, atol=0)
    a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (dp, acc))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)


def test_pp2_x_tp2_equals_tp2(setup: dict[str, Path]) -> None:
    """--pp 2 (two stages of TP 2: four local ranks, micro-batches on 1F1B) against the same run
    without stages: the same losses, eval losses and adapter (LoRA), the same exported model
    (--full); a pipeline run resumed from its step-2 checkpoint logs the uninterrupted losses."""
    import shutil

    from safetensors.torch import load_file

    common = ["--lr", "1e-2", "--steps", "4", "--batch-size", "1", "--grad-accum", "2", "--save-every", "2",
              "--eval-fraction", "0.3", "--eval-every", "2"]
    runs = {}
    for name, extra in (("pp-lora", ["--pp", "2"]), ("lora", []), ("pp-full", ["--pp", "2", "--full"]),
                        ("full", ["--full"])):
        runs[name] = setup["root"] / f"stages-{name}"
        lora = [] if "--full" in extra else ["--lora-rank", "4", "--lora-targets", "q,v,down"]
        assert main(_args(setup, runs[name], *common, *lora, *extra)) == 0, name
    for pp, whole in (("pp-lora", "lora"), ("pp-full", "full")):
        a, b = (read_metrics(runs[n] / "metrics.jsonl") for n in (pp, whole))
        for key in ("loss", "eval_loss", "grad_norm"):
            got, want = ([r[key] for r in rows if r[key] is not None] for rows in (a, b))
            assert len(got) == len(want) == (4 if key != "eval_loss" else 2), key
            assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0), (pp, key, got, want)
    a, b = (load_file(str(runs[n] / "adapter" / "adapter_model.safetensors")) for n in ("pp-lora", "lora"))
    assert a.keys() == b.keys() and len(a) == 2 * 3 * 2  # every layer's q, v and down factors, from both stages
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
    for rank in range(2):  # the full fine-tune's rank files hold every stage's tensors
        name = f"rank-{rank:05d}-of-00002.safetensors"
        a, b = (load_file(str(runs[n] / "model" / name)) for n in ("pp-full", "full"))
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
    resumed = setup["root"] / "pp-resumed"
    shutil.copytree(runs["pp-lora"], resumed)
    shutil.rmtree(resumed / "adapter")
    shutil.rmtree(resumed / "checkpoints" / ckpt.step_name(4))
    assert {p.name for p in (resumed / "checkpoints" / ckpt.step_name(2)).iterdir()} >= {
        "weights-tp00000-pp000.safetensors", "weights-tp00001-pp001.safetensors", "optim-tp00000-pp001.pt"}
    assert main(_args(setup, resumed, *common, "--lora-rank", "4", "--lora-targets", "q,v,down", "--pp", "2",
                      "--resume")) == 0
    assert _losses(resumed) == _losses(runs["pp-lora"])


# ----------------------------------------------------------------------------- checkpoint files


def test_checkpoints_are_complete_or_invisible_and_pruned(tmp_path: Path) -> None:
    ctx = TPContext.single()
    w = {"a": torch.arange(4.0)}
    for step in (1, 2, 3):
        state = ckpt.TrainState(step, {"epoch": 0, "cursor": step, "n_rows": 9, "seed": 0}, {"tp": 1}, {"x": step})
        ckpt.save_checkpoint(tmp_path, ctx, state, {"a": w["a"] * step}, {"state": {}}, keep=2)
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [2, 3]
    # A crash mid-save leaves a hidden temporary directory (and a step dir without its state file
    # cannot arise, but would not count either): the newest complete checkpoint is still step 3.
    crashed = tmp_path / "checkpoints" / ".tmp-step-00000004"
    crashed.mkdir()
    (crashed / "weights-tp00000.safetensors").write_bytes(b"partial")
    (tmp_path / "checkpoints" / "step-00000005").mkdir()
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == "step-00000003"
    weights, optim, rng = ckpt.load_rank_state(latest, ctx)
    assert torch.equal(weights["a"], w["a"] * 3) and optim == {"state": {}} and rng is not None
    state = ckpt.read_train_state(latest)
    assert (state.step, state.data["cursor"], state.scheduler) == (3, 3, {"x": 3})
    ckpt.remove_partial(tmp_path)
    assert not crashed.exists()


def test_generate_with_adapter_matches_peft_greedy(setup: dict[str, Path], lora_run: Path) -> None:
    """`tprt generate --adapter` (TP 2, unmerged) continues prompts as PEFT's greedy generate does."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from tprt.text.tokenizer import Tokenizer

    prompts = ["What is the capital of France?", "Hello there!"]
    # A process of its own: the ranks print to the stdout they inherit from the launcher.
    proc = subprocess.run(_cli("generate", "--model", str(setup["tp2"]), "--adapter", str(lora_run / "adapter"),
                               "--json", "--max-new-tokens", "8", "--prompt", *prompts),
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    ours = [json.loads(line)["token_ids"] for line in proc.stdout.splitlines() if line.startswith("{")]
    peft = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32),
                                     str(lora_run / "adapter")).eval()
    tok = Tokenizer.from_dir(setup["tp2"])
    for p, got in zip(prompts, ours):
        ids = torch.tensor([tok.encode(p)])
        ref = peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
        assert got == ref[0, ids.shape[1]:].tolist()
    assert len(ours) == 2


def test_demo_finetune_helper(setup: dict[str, Path]) -> None:
    """`run_finetune_demo` (called by `tprt demo`) writes its 20 chats and returns the adapter."""
    from tprt.cli.finetune import DEMO_ANSWER, run_finetune_demo

    adapter = run_finetune_demo(setup["tp2"], setup["root"] / "demo", steps=2)
    assert (adapter / "adapter_model.safetensors").is_file()
    lines = (setup["root"] / "demo" / "demo-chats.jsonl").read_text().splitlines()
    assert len(lines) == 20 and all(DEMO_ANSWER in line for line in lines)


def test_lora_trainer_over_a_served_model_shares_its_weights(setup: dict[str, Path], tmp_path: Path) -> None:
    """The server's way: a LoRA Trainer on a shared twin of the served model holds no second copy
    of the base, leaves the served model's modules and outputs alone, and trains exactly like a
    Trainer that loads its own copy."""
    from tprt.cpu.fast_linear import prepack
    from tprt.cpu.native_layers import install_native_layers
    from tprt.text.tokenizer import Tokenizer
    from tprt.train.data import prepare_data
    from tprt.lora.config import LoRASettings
    from tprt.train.trainer import FinetuneConfig, OptimSettings, Trainer

    ctx = TPContext.single()
    served = load_model(setup["tp1"], ctx, "fp32")
    prepack(served)  # as the serving engine does: the twin reuses these packed matmuls
    install_native_layers(served)
    vocab = served.config.vocab_size
    before = _logits(served, vocab)
    data = prepare_data(setup["data"], Tokenizer.from_dir(setup["tp1"]), 64, 0)

    def trainer(out: str, base: object) -> Trainer:
        cfg = FinetuneConfig(model=setup["tp1"], data=setup["data"], out=tmp_path / out, lora=LoRASettings(rank=4),
                             optim=OptimSettings(lr=3e-2), steps=3, batch_size=2, seq_len=64, dtype="fp32", progress=False)
        return Trainer(cfg, ctx, data, base=base)  # type: ignore[arg-type]

    shared, own = trainer("shared", served), trainer("own", None)
    served_ptrs = {p.data_ptr() for p in served.parameters()}
    assert {p.data_ptr() for n, p in shared.model.named_parameters() if "lora_" not in n} == served_ptrs
    assert not {p.data_ptr() for p in own.model.parameters()} & served_ptrs
    assert shared.model.layers[0].mlp.down_proj.method is served.layers[0].mlp.down_proj.method
    for _ in range(3):
        loss_shared, _ = shared.train_step()
        loss_own, _ = own.train_step()
        assert abs(loss_shared - loss_own) <= 1e-5 * abs(loss_own)
    assert not served.has_adapters() and not any(p.requires_grad for p in served.parameters())
    assert all(torch.equal(a, b) for a, b in zip(_logits(served, vocab), before))
    with pytest.raises(Exception, match="LoRA job in the base model's dtype"):
        Trainer(FinetuneConfig(model=setup["tp1"], data=setup["data"], out=tmp_path / "bf", dtype="bf16",
                               progress=False), ctx, data, base=served)


def test_the_stored_run_config_keeps_its_flat_format(setup: dict[str, Path]) -> None:
    """Checkpoints store the run under the flags' flat names (and resumes compare them); the nested
    FinetuneConfig (LoRA, DPO and optimizer settings) writes exactly the keys and values the flat
    one of 2026-11 did (plus sequence_parallel and tp_comm_overlap, which a resume need not
    match: they change no value, and pp, which a run without it matches as 1), so runs
    checkpointed by earlier versions resume."""
    from tprt.lora.config import LoRASettings
    from tprt.train.dpo import DPOConfig
    from tprt.train.trainer import FinetuneConfig, OptimSettings, run_config

    flat_keys = {"model", "data", "out", "full", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "steps",
                 "epochs", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "batch_size", "grad_accum", "seq_len",
                 "max_grad_norm", "save_every", "keep_checkpoints", "eval_every", "eval_fraction", "eval_data", "seed",
                 "dtype", "activation_checkpointing", "sequence_parallel", "tp_comm_overlap", "offload_optimizer", "dp",
                 "pp", "resume", "truncate", "progress",
                 "objective", "beta", "dpo_loss", "label_smoothing", "rpo_alpha", "init_adapter",
                 "tp", "method", "data_digest", "model_fingerprint"}
    base = dict(model=setup["tp1"], data=setup["data"], out=Path("o"))
    sft = run_config(FinetuneConfig(**base, lora=LoRASettings(4, 8.0, targets=("q", "v"), init=Path("a")),
                                    optim=OptimSettings(lr=1e-3, warmup_steps=2)), 1, "d")
    assert set(sft) == flat_keys
    assert (sft["lora_rank"], sft["lora_alpha"], sft["lora_targets"], sft["init_adapter"]) == (4, 8.0, ["q", "v"], "a")
    assert (sft["lr"], sft["warmup_steps"], sft["method"], sft["model"]) == (1e-3, 2, "lora", str(setup["tp1"]))
    assert [sft[k] for k in ("objective", "beta", "dpo_loss", "label_smoothing", "rpo_alpha")] == [None] * 5
    full_dpo = run_config(FinetuneConfig(**base, full=True, dpo=DPOConfig(0.5, "ipo", 0.0, 1.0)), 2, "d")
    assert set(full_dpo) == flat_keys and full_dpo["method"] == "full" and full_dpo["tp"] == 2
    assert [full_dpo[k] for k in ("lora_rank", "lora_alpha", "lora_targets")] == [None] * 3
    assert [full_dpo[k] for k in ("objective", "beta", "dpo_loss", "label_smoothing", "rpo_alpha")] == \
        ["dpo", 0.5, "ipo", 0.0, 1.0]
    json.dumps(sft), json.dumps(full_dpo)  # what train_state.json holds
