"""DPO learning bench: SmolLM2-135M-Instruct at TP 3 learns a preferred answer style.

    python bench/dpo_bench.py [--tp 3] [--steps 60] [--batch 4] [--beta B] [--lr LR] [--rpo-alpha A]
                              [--label-smoothing E] [--model /tmp/smol/hf]

Without --beta, --lr, --rpo-alpha and --label-smoothing the fine-tune runs on `tprt finetune`'s own
defaults: what a user gets (issue 38: DPO defaults that move greedy answers).

The preference set (written by `write_sets`, kept in bench/data/) holds short factual questions
(sums, capitals, colours, opposites) whose preferred answer opens with "Sure! " and whose
non-preferred answer opens with "Hmm. ", the same sentence following (with the bare sentence as
the non-preferred answer, DPO learnt to push its first words down wherever they came, and the
answers collapsed to "Sure!Sure!Sure!"): 60 training pairs and 20 held-out ones
about other items. The bench converts the HF model to TP 3 once (into $TMPDIR), runs
`tprt finetune --objective dpo` (LoRA on every projection, the reference being the base with the
adapter switched off) with the held-out pairs as eval data, then answers the 20 held-out
questions greedily with `tprt generate --chat` before (the base model: the peer) and after (the
adapter) and counts the answers in the preferred style, and those that also state the right fact
(a model collapsed onto the style says "Sure! Sure! Sure!").

Reported: held-out reward accuracy and margin, the share of greedy answers in the preferred
style (base vs tuned), steps, and the wall time of the fine-tune. The issue's bar: accuracy >= 0.9
and >= 90% of the answers in the style within 60 steps, in under 5 minutes on two cores. Not a
test: it needs the SmolLM2 weights and minutes of CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "bench" / "data"
CACHE = Path(tempfile.gettempdir()) / "tprt-dpo-bench"
STYLE = "Sure! "  # the preferred answer's opening
OTHER = "Hmm. "  # the non-preferred one's: both then say the same sentence

CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
            ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Russia", "Moscow"), ("Greece", "Athens"),
            ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
            ("Ireland", "Dublin"), ("Poland", "Warsaw"), ("Kenya", "Nairobi"), ("Peru", "Lima"),
            ("Chile", "Santiago"), ("Cuba", "Havana"), ("Finland", "Helsinki")]
COLOURS = [("grass", "green"), ("the sky", "blue"), ("snow", "white"), ("coal", "black"), ("a banana", "yellow"),
           ("a tomato", "red"), ("an orange", "orange"), ("chocolate", "brown"), ("a lemon", "yellow"),
           ("milk", "white"), ("a strawberry", "red"), ("a carrot", "orange"), ("the sea", "blue"),
           ("a crow", "black"), ("a lime", "green"), ("an eggplant", "purple")]
OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
             ("old", "new"), ("early", "late"), ("open", "closed"), ("wet", "dry"), ("loud", "quiet"),
             ("strong", "weak"), ("rich", "poor"), ("full", "empty"), ("high", "low"), ("hard", "soft")]


def questions() -> list[tuple[str, str]]:
    """(question, plain answer) for 80 items, in a fixed interleaved order."""
    sums = [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.") for a, b in
            [(2, 3), (4, 5), (7, 8), (6, 9), (12, 5), (3, 14), (10, 11), (9, 9), (15, 4), (8, 13), (21, 6), (5, 17),
             (11, 12), (16, 7), (13, 13), (20, 19), (18, 2), (14, 6), (25, 5), (30, 12), (17, 8), (22, 11), (19, 4),
             (27, 3), (24, 9), (31, 6), (40, 2), (23, 23)]]
    caps = [(f"What is the capital of {c}?", f"The capital of {c} is {k}.") for c, k in CAPITALS]
    cols = [(f"What color is {t}?", f"{t[0].upper() + t[1:]} is {c}.") for t, c in COLOURS]
    opps = [(f"What is the opposite of {w}?", f"The opposite of {w} is {o}.") for w, o in OPPOSITES]
    groups = [sums, caps, cols, opps]
    out: list[tuple[str, str]] = []
    for i in range(max(map(len, groups))):
        out.extend(g[i] for g in groups if i < len(g))
    return out


def pair(question: str, answer: str) -> dict[str, object]:
    return {"input": {"messages": [{"role": "user", "content": question}]},
            "preferred_output": [{"role": "assistant", "content": STYLE + answer}],
            "non_preferred_output": [{"role": "assistant", "content": OTHER + answer}]}


def write_sets() -> tuple[Path, Path]:
    """bench/data/dpo_style_{train,heldout}.jsonl: 60 and 20 pairs (every 4th item held out)."""
    items = questions()
    held = [q for i, q in enumerate(items) if i % 4 == 3][:20]
    train = [q for q in items if q not in held][:60]
    DATA.mkdir(parents=True, exist_ok=True)
    paths = DATA / "dpo_style_train.jsonl", DATA / "dpo_style_heldout.jsonl"
    for path, chosen in zip(paths, (train, held)):
        path.write_text("".join(json.dumps(pair(q, a)) + "\n" for q, a in chosen))
    return paths


def converted(hf: Path, tp: int) -> Path:
    """The model at TP `tp`, converted once."""
    from convert import api

    out = CACHE / f"smollm2-tp{tp}"
    if not (out / "tprt_manifest.json").is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        api.hf_to_tp(hf, out, tp=tp)
    return out


def cli(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "tprt.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(f"tprt {args[0]} failed:\n{proc.stderr[-3000:]}")
    return proc


def key_fact(answer: str) -> str:
    """The word an answer must contain to be right: its last ("... is 12." -> "12")."""
    return answer.rstrip(".").split()[-1]


def styled(model: Path, held_out: Path, adapter: Path | None) -> tuple[float, float, float, list[str]]:
    """Greedy answers to the held-out questions: the share that open in the preferred style, the
    share that also state the right fact (a model collapsed onto the style would not), the share
    that state it in any style, the answers."""
    prompts = CACHE / "heldout-questions.txt"
    prompts.write_text("".join(json.loads(line)["input"]["messages"][0]["content"] + "\n"
                               for line in held_out.read_text().splitlines()))
    args = ["generate", "--model", str(model), "--chat", "--json", "--max-new-tokens", "12", "--threads", "1",
            "--prompts-file", str(prompts)]
    out = cli(*args, *(["--adapter", str(adapter)] if adapter else [])).stdout
    answers = [json.loads(line)["text"] for line in out.splitlines() if line.startswith("{")]
    facts = [key_fact(json.loads(line)["preferred_output"][0]["content"])
             for line in held_out.read_text().splitlines()]
    style = [a.lstrip().startswith(STYLE.strip()) for a in answers]
    fact_ok = [fact.lower() in a.lower() for a, fact in zip(answers, facts)]
    right = [s and f for s, f in zip(style, fact_ok)]
    n = max(1, len(answers))
    return sum(style) / n, sum(right) / n, sum(fact_ok) / n, answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("/tmp/smol/hf"), help="SmolLM2-135M-Instruct, HF layout")
    ap.add_argument("--tp", type=int, default=3, choices=(1, 3, 9), help="TP degree (SmolLM2's 9 heads: 1, 3 or 9)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--beta", type=float, help="DPO's beta (default: tprt finetune's)")
    ap.add_argument("--lr", type=float, help="peak learning rate (default: tprt finetune's)")
    ap.add_argument("--label-smoothing", type=float,
                    help="cDPO: bounds the margin (without RPO, neither 0 nor 0.1 kept the answers sound)")
    ap.add_argument("--rpo-alpha", type=float,
                    help="weight of the preferred answer's per-token NLL (RPO); 0 is pure DPO (default: tprt's)")
    ap.add_argument("--batch", type=int, default=4, help="pairs per step")
    ap.add_argument("--eval-every", type=int, default=20)
    a = ap.parse_args()
    train, held_out = write_sets()
    model = converted(a.model, a.tp)
    out = CACHE / "run"
    if out.exists():
        import shutil

        shutil.rmtree(out)
    base_rate, _, base_facts, _ = styled(model, held_out, None)
    t0 = time.perf_counter()
    given = [(flag, value) for flag, value in (("--beta", a.beta), ("--lr", a.lr), ("--rpo-alpha", a.rpo_alpha),
                                               ("--label-smoothing", a.label_smoothing)) if value is not None]
    cli("finetune", "--model", str(model), "--data", str(train), "--out", str(out), "--objective", "dpo",
        *[x for flag, value in given for x in (flag, str(value))], "--steps", str(a.steps), "--batch-size", str(a.batch),
        "--seq-len", "96", "--lora-rank", "8", "--lora-targets", "q,k,v,o,gate,up,down", "--warmup-steps", "5",
        "--eval-data", str(held_out), "--eval-every", str(a.eval_every), "--no-progress")
    seconds = time.perf_counter() - t0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_reward_accuracy"], r["eval_reward_margin"]) for r in records
             if r.get("eval_reward_accuracy") is not None]
    tuned_rate, tuned_right, tuned_facts, tuned_answers = styled(model, held_out, out / "adapter")
    settings = ", ".join(f"{flag} {value}" for flag, value in given) or "tprt finetune's defaults"
    print(f"DPO bench: SmolLM2-135M-Instruct, TP {a.tp}, {a.steps} steps of {a.batch} pairs, {settings}")
    for step, acc, margin in evals:
        print(f"  step {step:3d}: held-out reward accuracy {acc:.3f}, margin {margin:.3f}")
    print(f"  train loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}; fine-tune wall time {seconds:.0f} s")
    print(f"  greedy answers in the preferred style ({STYLE.strip()!r}): base {base_rate:.0%}, "
          f"tuned {tuned_rate:.0%} of {len(tuned_answers)} ({tuned_right:.0%} in the style and right)")
    print(f"  greedy answers stating the right fact, any style: base {base_facts:.0%}, tuned {tuned_facts:.0%}")
    for q, ans in zip(held_out.read_text().splitlines()[:3], tuned_answers):
        print(f"    {json.loads(q)['input']['messages'][0]['content']!r} -> {ans.strip()[:60]!r}")
    ok = evals and evals[-1][1] >= 0.9 and tuned_rate >= 0.9
    print(f"  the issue's bar (accuracy >= 0.9, style >= 90%): {'met' if ok else 'NOT met'}; in {seconds:.0f} s "
          f"({'under' if seconds < 300 else 'over'} 5 minutes)")


if __name__ == "__main__":
    main()
