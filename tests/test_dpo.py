"""DPO: the loss against the formula, sequence log-probabilities against full log-softmax,
preference data refused by line, and `tprt finetune --method dpo` runs (LoRA, full on the FSDP
path, SFT then DPO, DP x accumulation, resume). TP agreement: tests/dpo_checks.py in
test_lora.py's worlds."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tprt.cli.main import main
from tprt.distributed.context import TPContext
from tprt.errors import ValidationError
from tprt.train import checkpointing as ckpt
from tprt.train.dpo import dpo_loss, sequence_logps
from tprt.train.plot import read_metrics
from train_fixtures import make_tiny_model

QUESTIONS = ["What is the capital of France?", "Say hello.", "Name a brown animal.", "What jumps over the dog?",
             "Who is lazy?", "Count to three.", "Greet the world.", "Answer briefly.", "Where is Paris?",
             "Hello there!"]
GOOD, BAD = "The quick brown fox.", "HELLO WORLD!!!"


def pair(question: str, good: str, bad: str) -> dict:
    return {"input": {"messages": [{"role": "user", "content": question}]},
            "preferred_output": [{"role": "assistant", "content": good}],
            "non_preferred_output": [{"role": "assistant", "content": bad}]}


def write_pairs(path: Path, questions: list[str]) -> Path:
    path.write_text("".join(json.dumps(pair(q, GOOD, f"{BAD} {i}")) + "\n" for i, q in enumerate(questions)))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dpo")
    _, tp1 = make_tiny_model(root, tp=1)
    return {"root": root, "tp1": tp1, "data": write_pairs(root / "prefs.jsonl", QUESTIONS[:8]),
            "held_out": write_pairs(root / "held_out.jsonl", QUESTIONS[8:])}


def _args(s: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["finetune", "--model", str(s["tp1"]), "--data", str(s["data"]), "--out", str(out), "--seq-len", "96",
            "--batch-size", "2", "--no-progress", "--objective", "dpo", "--beta", "0.5",
            "--rpo-alpha", "0", *extra]  # pure DPO (its formulas are checked), unless extra says otherwise


# ----------------------------------------------------------------------------- the formula


def _reference_loss(pc: float, pr: float, rc: float, rr: float, beta: float, kind: str, eps: float) -> float:
    """The published formulas, re-derived in float64 with math."""
    h = (pc - rc) - (pr - rr)
    if kind == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    log_sigmoid = lambda z: -math.log1p(math.exp(-z)) if z >= 0 else z - math.log1p(math.exp(z))  # noqa: E731
    return -(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h)


@pytest.mark.parametrize("kind,eps,beta", [("sigmoid", 0.0, 0.1), ("sigmoid", 0.2, 0.5), ("ipo", 0.0, 0.1),
                                           ("sigmoid", 0.0, 2.0)])
def test_loss_equals_the_formula(kind: str, eps: float, beta: float) -> None:
    gen = torch.Generator().manual_seed(7)
    pc, pr, rc, rr = (-40 * torch.rand(16, generator=gen, dtype=torch.float64) for _ in range(4))
    loss, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta, kind, eps)
    for i in range(16):
        want = _reference_loss(*(float(t[i]) for t in (pc, pr, rc, rr)), beta, kind, eps)
        assert abs(float(loss[i]) - want) <= 1e-6 * max(1.0, abs(want)), (i, float(loss[i]), want)
    assert torch.allclose(chosen, beta * (pc - rc)) and torch.allclose(rejected, beta * (pr - rr))
    with pytest.raises(ValueError, match="unknown DPO loss"):
        dpo_loss(pc, pr, rc, rr, beta, "hinge")


def test_rpo_adds_the_preferred_answers_nll_per_token() -> None:
    """RPO (TRL's rpo_alpha): the pair's DPO loss plus alpha x -log pi(y_w | x) / |y_w|."""
    gen = torch.Generator().manual_seed(3)
    pc, pr, rc, rr = (-40 * torch.rand(8, generator=gen, dtype=torch.float64) for _ in range(4))
    tokens = torch.randint(1, 30, (8,), generator=gen)
    loss, _, _ = dpo_loss(pc, pr, rc, rr, 0.1, "sigmoid", 0.1, rpo_alpha=0.5, chosen_tokens=tokens)
    for i in range(8):
        want = _reference_loss(*(float(t[i]) for t in (pc, pr, rc, rr)), 0.1, "sigmoid", 0.1)
        want += 0.5 * -float(pc[i]) / int(tokens[i])
        assert abs(float(loss[i]) - want) <= 1e-6 * max(1.0, abs(want)), (i, float(loss[i]), want)
    with pytest.raises(ValueError, match="chosen_tokens"):
        dpo_loss(pc, pr, rc, rr, 0.1, rpo_alpha=1.0)


def test_rpo_run_raises_the_preferred_answer_and_resumes_only_with_the_same_alpha(
        setup: dict[str, Path], tmp_path: Path) -> None:
    """Pure DPO may lower both answers; with --rpo-alpha the preferred one's log-probability rises
    (its reward, beta x the log-ratio to the reference, ends positive)."""
    out = tmp_path / "rpo"
    args = _args(setup, out, "--lr", "1e-2", "--steps", "6", "--rpo-alpha", "1.0", "--save-every", "3")
    assert main(args) == 0
    records = _metrics(out)
    assert records[0]["loss"] > math.log(2) + 0.5  # the NLL term is in the loss from the first step
    assert records[-1]["rewards_chosen"] > 0 and records[-1]["reward_accuracy"] == 1.0
    shutil.rmtree(out / "checkpoints" / "step-00000006")
    assert main([*args, "--resume"]) == 0
    assert _metrics(out)[-1]["loss"] == pytest.approx(records[-1]["loss"], rel=1e-5, abs=1e-7)
    shutil.rmtree(out / "checkpoints" / "step-00000006")
    assert main([*args[:-4], "--rpo-alpha", "0.5", "--save-every", "3", "--resume"]) != 0  # another alpha: refused
    assert main(["finetune", "--model", str(setup["tp1"]), "--data", str(setup["data"]), "--out",
                 str(tmp_path / "sft"), "--rpo-alpha", "1"]) != 0  # needs --objective dpo


def test_sequence_logps_sum_the_full_log_softmax_over_targets(setup: dict[str, Path]) -> None:
    """Rows of uneven length and targets: our TP sum equals log_softmax of the gathered logits."""
    from tprt.checkpoint.loading import load_model

    model = load_model(setup["tp1"], TPContext.single(), dtype="fp32").eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 300, (3, 12), generator=gen)
    labels = torch.full_like(ids, -100)
    labels[0, 4:12], labels[1, 2:5], labels[2, 9:10] = ids[0, 4:12], ids[1, 2:5], ids[2, 9:10]
    with torch.no_grad():
        ours = sequence_logps(model, ids, labels)
        logp = torch.log_softmax(model.gather_logits(model(ids)).double()[:, :-1], dim=-1)  # [3, 11, vocab]
    target = labels[:, 1:]
    want = torch.where(target != -100, logp.gather(-1, target.clamp(min=0)[..., None])[..., 0], 0.0).sum(-1)
    assert torch.allclose(ours.double(), want, rtol=1e-5, atol=1e-4), (ours, want)


# ----------------------------------------------------------------------------- data


BAD_LINES = {
    "no preferred": ({"input": {"messages": [{"role": "user", "content": "Hi"}]},
                      "non_preferred_output": [{"role": "assistant", "content": "x"}]}, "missing 'preferred_output'"),
    "no non-preferred": ({"input": {"messages": [{"role": "user", "content": "Hi"}]},
                          "preferred_output": [{"role": "assistant", "content": "x"}]},
                         "missing 'non_preferred_output'"),
    "identical": (pair("Hi", "Same answer.", "Same answer."), "are identical"),
    "prompt differs": ({**pair("Hi", "a", "b"), "non_preferred_output": [
        {"role": "user", "content": "Another question"}, {"role": "assistant", "content": "b"}]},
        "has role 'user'; outputs hold assistant messages only"),
    "no room": (pair("word " * 80, "a", "b"), "leaving no room for the completions"),
    "unknown role": ({**pair("Hi", "a", "b"), "input": {"messages": [{"role": "oracle", "content": "Hi"}]}},
                     r"input.messages\[0\] has role 'oracle'; expected one of system, user, assistant, tool"),
    "no input": ({"preferred_output": [], "non_preferred_output": []}, "expected 'input' with 'messages'"),
    "output not a list": ({**pair("Hi", "a", "b"), "preferred_output": "a"}, "must be a non-empty list"),
}


@pytest.mark.parametrize("case", BAD_LINES)
def test_bad_pairs_are_refused_by_line(setup: dict[str, Path], tmp_path: Path, case: str) -> None:
    from tprt.text.tokenizer import Tokenizer
    from tprt.train.preference import prepare_preferences

    line, message = BAD_LINES[case]
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps(pair("Hello", GOOD, BAD)) + "\n\n" + json.dumps(line) + "\n")
    with pytest.raises(ValidationError, match=f"p.jsonl:3: .*{message}") as e:
        prepare_preferences(data, Tokenizer.from_dir(setup["tp1"]), 64, 0)
    assert "\n" not in str(e.value)


def test_cli_refuses_bad_pairs_before_writing(setup: dict[str, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps(pair("Hello", GOOD, GOOD)) + "\n")
    out = tmp_path / "out"
    s = {**setup, "data": data}
    assert main(_args(s, out)) != 0
    assert "p.jsonl:1: preferred_output and non_preferred_output are identical" in capsys.readouterr().err
    assert not out.exists()
    assert main(_args(setup, tmp_path / "o2", "--method", "sft")) != 0  # --beta without dpo
    assert "--beta needs --objective dpo" in capsys.readouterr().err


def test_pairs_are_adjacent_rows_with_the_prompt_unscored(setup: dict[str, Path]) -> None:
    from tprt.text.tokenizer import Tokenizer
    from tprt.train.preference import prepare_preferences

    tok = Tokenizer.from_dir(setup["tp1"])
    data = prepare_preferences(setup["data"], tok, 64, 0)
    assert data.pairs and len(data.train) == 16 and data.n_examples == 8
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True))
    for r in range(0, 16, 2):
        good, bad = data.train.labels[r], data.train.labels[r + 1]
        first = [int((row != -100).nonzero()[0]) for row in (good, bad)]
        assert first[0] == first[1] >= len(prompt) - 1  # scoring starts after the shared prompt
        assert tok.decode([int(t) for t in good if t != -100]).startswith(GOOD)
        assert tok.decode([int(t) for t in bad if t != -100]).startswith(BAD)


# ----------------------------------------------------------------------------- runs


def _metrics(out: Path) -> list[dict]:
    return read_metrics(out / "metrics.jsonl")


@pytest.fixture(scope="module")
def lora_run(setup: dict[str, Path]) -> Path:
    out = setup["root"] / "lora"
    assert main(_args(setup, out, "--lora-targets", "q,k,v,o,gate,up,down", "--lr", "1e-2", "--steps", "6",
                      "--eval-data", str(setup["held_out"]), "--eval-every", "3", "--save-every", "3")) == 0
    return out


def test_lora_dpo_learns_the_preference_and_logs_rewards(lora_run: Path) -> None:
    records = _metrics(lora_run)
    assert [r["step"] for r in records] == list(range(1, 7))
    first, last = records[0], records[-1]
    assert abs(first["loss"] - math.log(2)) < 1e-4  # the adapter starts at zero: policy == reference
    assert last["loss"] < 0.1 and last["reward_accuracy"] == 1.0 and last["reward_margin"] > 1.0
    assert last["rewards_chosen"] - last["rewards_rejected"] == pytest.approx(last["reward_margin"], rel=1e-6)
    assert [r["step"] for r in records if r["eval_loss"] is not None] == [3, 6]
    assert last["eval_reward_accuracy"] == 1.0 and last["eval_reward_margin"] > 0
    assert (lora_run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (lora_run / "adapter" / "adapter_model.safetensors").is_file()


def test_resume_repeats_the_dpo_curve(setup: dict[str, Path], lora_run: Path, tmp_path: Path) -> None:
    """The run without its last checkpoint and outputs resumes from step 3 to the same steps."""
    out = tmp_path / "again"
    shutil.copytree(lora_run, out)
    shutil.rmtree(out / "checkpoints" / "step-00000006")
    shutil.rmtree(out / "adapter")
    args = _args(setup, out, "--lora-targets", "q,k,v,o,gate,up,down", "--lr", "1e-2", "--steps", "6",
                 "--eval-data", str(setup["held_out"]), "--eval-every", "3", "--save-every", "3", "--resume")
    assert main(args) == 0
    for a, b in zip(_metrics(lora_run), _metrics(out), strict=True):
        assert a.keys() == b.keys()
        for key in ("loss", "reward_margin", "eval_reward_accuracy"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
    assert main([*args[:-1], "--beta", "0.3", "--resume"]) != 0  # another beta: refused


def test_sft_then_dpo_starts_from_the_adapter_as_reference(setup: dict[str, Path], tmp_path: Path) -> None:
    """DPO on an SFT run's adapter: the reference is that adapter (precomputed), so the first
    step's rewards are 0 although the policy is far from the base."""
    sft_data = tmp_path / "sft.jsonl"
    sft_data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                         {"role": "assistant", "content": BAD}]}) + "\n"
                                for q in QUESTIONS))
    sft = tmp_path / "sft"
    assert main(["finetune", "--model", str(setup["tp1"]), "--data", str(sft_data), "--out", str(sft),
                 "--seq-len", "64", "--lora-rank", "4", "--lr", "2e-2", "--steps", "4", "--no-progress"]) == 0
    dpo = tmp_path / "dpo"
    assert main(_args(setup, dpo, "--init-adapter", str(sft / "adapter"), "--lr", "1e-2", "--steps", "3")) == 0
    records = _metrics(dpo)
    assert abs(records[0]["reward_margin"]) < 1e-4 and abs(records[0]["loss"] - math.log(2)) < 1e-4
    assert records[-1]["reward_margin"] > records[0]["reward_margin"]
    cfg = json.loads((dpo / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4  # the starting adapter's rank, not the default 8
    assert main(_args(setup, tmp_path / "x", "--init-adapter", str(sft / "adapter"), "--lora-rank", "8")) != 0


def _cli_rank(args: list[str]) -> int:
    return main(args)


def test_full_dpo_dp2_on_fsdp_equals_accumulation_and_resumes(setup: dict[str, Path], tmp_path: Path) -> None:
    """Full DPO (FSDP path, reference log-probabilities precomputed): dp 2 equals dp 1 with two
    accumulated micro-batches, and a resumed run repeats the curve."""
    from tprt.distributed.launcher import launch_local

    common = ["--full", "--lr", "1e-3", "--steps", "4", "--batch-size", "1", "--dpo-loss", "ipo", "--save-every", "2"]
    dp = tmp_path / "dp2"
    assert launch_local(2, _cli_rank, (_args(setup, dp, *common),), timeout_s=240) == [0, 0]
    acc = tmp_path / "acc"
    assert main(_args(setup, acc, *common, "--grad-accum", "2")) == 0
    for a, b in zip(_metrics(dp), _metrics(acc), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["reward_margin"] == pytest.approx(
            b["reward_margin"], rel=1e-4, abs=1e-6)
    assert _metrics(acc)[-1]["reward_margin"] > 0
    shutil.rmtree(acc / "checkpoints" / "step-00000004")
    shutil.rmtree(acc / "model")
    before = _metrics(acc)
    assert main(_args(setup, acc, *common, "--grad-accum", "2", "--resume")) == 0
    assert [s for s, _ in ckpt.complete_checkpoints(acc)] == [2, 4]
    for a, b in zip(before, _metrics(acc), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_dpo_defaults_move_the_model_and_a_hollow_success_is_warned_of(setup: dict[str, Path]) -> None:
    """The defaults (rpo_alpha 1.0 for DPO at every front end; none for SFT), and the warning when
    reward accuracy is high while the preferred answers became less likely (issue 38: accuracy
    1.0, chosen reward -2.8 on the rejected side... and an unchanged model)."""
    from serve.jobs.preference import dpo_hyperparameters
    from tprt.cli.finetune import config_from_args
    from tprt.cli.main import build_parser
    from tprt.train.dpo_advice import DEFAULT_RPO_ALPHA, unmoved_warning

    parser = build_parser()
    base = ["finetune", "--model", str(setup["tp1"]), "--data", str(setup["data"]), "--out", "o"]
    dpo = config_from_args(parser.parse_args([*base, "--method", "dpo"])).dpo
    assert dpo is not None and dpo.rpo_alpha == DEFAULT_RPO_ALPHA == 1.0
    dpo = config_from_args(parser.parse_args([*base, "--method", "dpo", "--rpo-alpha", "0"])).dpo
    assert dpo is not None and dpo.rpo_alpha == 0.0
    assert config_from_args(parser.parse_args(base)).dpo is None  # SFT: no DPO settings at all
    assert dpo_hyperparameters({}, "dpo")["rpo_alpha"] == 1.0 and dpo_hyperparameters({}, "supervised") == {}
    hollow = {"reward_accuracy": 1.0, "rewards_chosen": -2.8, "rewards_rejected": -9.2}
    warning = unmoved_warning(hollow)
    assert warning is not None and "preferred answers became less likely" in warning and "rpo_alpha" in warning
    assert unmoved_warning({**hollow, "rewards_chosen": 0.4}) is None  # the preferred answers rose
    assert unmoved_warning({**hollow, "reward_accuracy": 0.6}) is None
    # held-out metrics, when there are some, are the ones read
    assert unmoved_warning({**hollow, "eval_reward_accuracy": 1.0, "eval_rewards_chosen": 0.2}) is None
    assert "held-out" in (unmoved_warning({"eval_reward_accuracy": 0.95, "eval_rewards_chosen": -1.0}) or "")
