"""`tprt finetune` and `tprt merge-lora`: parsing, checks up front, and the ranks they start.

Everything that can be wrong with the flags, the model or the data is checked in the launching
process before any rank starts or anything is written. Without torchrun the checkpoint's TP
number of local ranks is started; under torchrun the world is used as it is, with dp = world / tp
(`tprt.distributed.launcher.run_on_ranks`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tprt.checkpoint.format import TPCheckpoint
from tprt.cli.common_flags import Spelling
from tprt.errors import ConfigError
from tprt.train.dpo_advice import DEFAULT_BETA, DEFAULT_DPO_LORA_LR, DEFAULT_RPO_ALPHA, unmoved_warning

log = logging.getLogger("tprt")

if TYPE_CHECKING:  # torch is imported only when a command runs: `tprt --help` stays fast
    from tprt.train.trainer import FinetuneConfig

ALL_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")

COMMANDS = ("finetune", "merge-lora")

FINETUNE_EPILOG = """examples:
  tprt finetune --model ./smollm2-tp3 --data chats.jsonl --out ./run1
  tprt finetune --model ./smollm2-tp3 --data chats.jsonl --out ./run1 --lora-rank 16 --lora-alpha 32 \\
      --lora-targets q,k,v,o,gate,up,down --steps 200 --lr 2e-4 --warmup-steps 20 --save-every 50
  tprt finetune --model ./smollm2-tp3 --data chats.jsonl --out ./run1 --resume --steps 400
  tprt finetune --model ./llama-tp2 --data docs.jsonl --out ./full --full --lr 1e-5 --dtype bf16 \\
      --grad-accum 8 --activation-checkpointing --eval-fraction 0.05 --eval-every 100
  torchrun --nproc-per-node 8 -m tprt.cli finetune --model ./llama-tp4 --data d.jsonl --out ./run  # dp=2

  tprt finetune --model ./smollm2-tp3 --data prefs.jsonl --out ./dpo --objective dpo --beta 0.1 \\
      --init-adapter ./run1/adapter    # DPO on an SFT run's adapter

data (JSONL, one object per line):
  {"text": "..."}                                   loss on every token
  {"prompt": "...", "completion": "..."}            loss on the completion only
  {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
                                                    chat template; loss on the assistant turns only
Documents are packed into rows of --seq-len tokens, separated by EOS.
--objective dpo takes preference pairs (OpenAI's format), one completion per row:
  {"input": {"messages": [...]}, "preferred_output": [{"role": "assistant", "content": "..."}],
   "non_preferred_output": [{"role": "assistant", "content": "..."}]}
  --batch-size counts pairs; metrics.jsonl adds rewards_chosen, rewards_rejected, reward_accuracy,
  reward_margin (and eval_ ones with eval data).

outputs in --out: adapter/ (LoRA: adapter_model.safetensors + adapter_config.json, loadable by
PEFT) or model/ (--full: a TP checkpoint, exportable with `tprt-convert tp-to-hf`); metrics.jsonl
(step, loss, lr, grad_norm, tokens_per_s, eval_loss); loss.png; checkpoints/step-N/.
A global batch is --batch-size x --grad-accum x dp rows. A NaN/inf loss stops the run (exit 1)
and keeps the last good checkpoint.
"""

MERGE_EPILOG = """examples:
  tprt merge-lora --model ./smollm2-tp3 --adapter ./run1/adapter --out ./smollm2-tuned-tp3
  tprt-convert tp-to-hf ./smollm2-tuned-tp3 ./smollm2-tuned-hf
"""


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Registers `finetune` and `merge-lora` on the `tprt` subcommand parser."""
    raw = argparse.RawDescriptionHelpFormatter
    f = sub.add_parser("finetune", help="fine-tune a TP checkpoint (LoRA or full)", epilog=FINETUNE_EPILOG,
                       formatter_class=raw, description="Fine-tune a TP checkpoint on JSONL data, LoRA or full.")
    f.add_argument("--model", type=Path, required=True, metavar="DIR", help="TP checkpoint directory")
    f.add_argument("--data", type=Path, required=True, metavar="FILE", help="training data (.jsonl)")
    f.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    m = f.add_mutually_exclusive_group()
    m.add_argument("--full", action="store_true", help="train every weight instead of a LoRA adapter")
    m.add_argument("--lora-rank", type=int, metavar="R", help="LoRA rank (default 8)")
    f.add_argument("--lora-alpha", type=float, metavar="A", help="LoRA alpha (default 2 x rank)")
    f.add_argument("--lora-dropout", type=float, metavar="P", help="dropout on the LoRA input (default 0)")
    f.add_argument("--lora-targets", metavar="LIST", help=f"comma-separated, of {','.join(ALL_TARGETS)} (default q,k,v,o)")
    f.add_argument("--steps", type=int, metavar="N", help="optimizer steps (default: --epochs)")
    f.add_argument("--epochs", type=float, metavar="E", help="passes over the data (default 1)")
    f.add_argument("--lr", type=float, help=f"peak learning rate (default 2e-4 LoRA, {DEFAULT_DPO_LORA_LR:g} LoRA with "
                                            "--objective dpo, 2e-5 full)")
    f.add_argument("--min-lr-ratio", type=float, default=0.1, metavar="R", help="final lr / peak lr (0.1)")
    f.add_argument("--warmup-steps", type=int, default=0, metavar="N", help="linear warmup steps (0)")
    f.add_argument("--weight-decay", type=float, default=0.0, metavar="W", help="AdamW weight decay (0)")
    f.add_argument("--batch-size", type=int, default=4, metavar="B", help="rows per micro-batch per DP rank (4)")
    f.add_argument("--grad-accum", type=int, default=1, metavar="K", help="micro-batches per step (1)")
    f.add_argument("--seq-len", type=int, default=512, metavar="L", help="tokens per packed row (512)")
    f.add_argument("--no-truncate", action="store_true", help="refuse examples longer than --seq-len")
    f.add_argument("--max-grad-norm", type=float, default=1.0, metavar="G", help="clip the global norm (1.0)")
    f.add_argument("--save-every", type=int, default=0, metavar="N", help="checkpoint every N steps (0 = never)")
    f.add_argument("--keep-checkpoints", type=int, default=2, metavar="K", help="keep the newest K (2)")
    f.add_argument("--eval-every", type=int, default=0, metavar="N", help="evaluate every N steps (0 = at the end)")
    f.add_argument("--eval-fraction", type=float, default=0.0, metavar="F", help="hold out this share of the data")
    f.add_argument("--eval-data", type=Path, metavar="FILE", help="evaluation data (.jsonl) instead")
    f.add_argument("--seed", type=int, default=0, help="shuffling, split and LoRA init seed (0)")
    f.add_argument("--dtype", choices=("fp32", "bf16"), help="weights and compute (default: fp32 on CPU, bf16 on GPU)")
    f.add_argument("--activation-checkpointing", action="store_true", help="recompute activations in the backward")
    f.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism: between the TP blocks each rank keeps 1/TP of the "
                        "positions (norms, residuals, checkpointed block inputs); reduce-scatter and all-gather "
                        "replace the all-reduces. Same results, less activation memory per rank at TP > 1")
    f.add_argument("--tp-comm-overlap", choices=("auto", "on", "off"), default="auto",
                   help="--full at TP > 1: launch each column-parallel layer's input-gradient all-reduce before "
                        "its weight-gradient product, so the two overlap. auto (the default): on for CUDA "
                        "devices; off on CPU, where the ranks share the cores (docs/PERF.md)")
    f.add_argument("--dp", type=int, default=1, metavar="M",
                   help="data-parallel replicas: start M x tp local ranks (1; under torchrun: WORLD_SIZE / tp). "
                        "--full shards weights, gradients and optimizer state over them (FSDP2)")
    f.add_argument("--pp", type=int, default=1, metavar="N",
                   help="pipeline stages: the layers split over N stages of tp ranks each (tp x N x dp ranks), "
                        "micro-batches on a 1F1B schedule (--grad-accum N or more: one per stage at least); "
                        "LoRA and --full, SFT only (1)")
    f.add_argument("--offload-optimizer", choices=("none", "cpu"), default="none",
                   help="--full: keep the fp32 weight shards, gradients and AdamW state in host memory and "
                        "step there (none)")
    f.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --out (a larger --steps trains on; "
                        "the learning-rate schedule stays the original run's)")
    f.add_argument("--no-progress", action="store_true", help="no progress bar")
    d = f.add_argument_group("preference tuning (DPO)")
    d.add_argument("--objective", "--method", dest="objective", action=Spelling, choices=("sft", "dpo"),
                   default="sft", help="sft: next-token loss on the data's targets; dpo: preference pairs (sft)")
    d.add_argument("--beta", type=float, metavar="B", help=f"DPO: pull towards the reference ({DEFAULT_BETA})")
    d.add_argument("--dpo-loss", choices=("sigmoid", "ipo"), help="DPO: the loss on the log-ratio margin (sigmoid)")
    d.add_argument("--label-smoothing", type=float, metavar="E",
                   help="DPO sigmoid loss: the share of pairs taken to be mislabelled (0)")
    d.add_argument("--rpo-alpha", type=float, metavar="A",
                   help="DPO: add A x the preferred answer's per-token NLL (RPO), which keeps it likely while "
                        "the margin grows; 0 is pure DPO, which on small sets often leaves greedy answers "
                        f"unchanged ({DEFAULT_RPO_ALPHA})")
    f.add_argument("--init-adapter", type=Path, metavar="DIR",
                   help="LoRA: start from this adapter (e.g. an SFT run's out/adapter); its rank, alpha and targets "
                        "are the run's")
    g = sub.add_parser("merge-lora", help="merge a LoRA adapter into a TP checkpoint", epilog=MERGE_EPILOG,
                       formatter_class=raw, description="Write base + LoRA adapter as a new TP checkpoint.")
    g.add_argument("--model", type=Path, required=True, metavar="DIR", help="base TP checkpoint")
    g.add_argument("--adapter", type=Path, required=True, metavar="DIR", help="adapter directory")
    g.add_argument("--out", type=Path, required=True, metavar="DIR", help="merged TP checkpoint to write")
    g.add_argument("--force", action="store_true", help="replace --out if it exists")


def run(args: argparse.Namespace) -> int:
    """Runs the parsed `finetune` / `merge-lora` command; errors are raised as TprtError."""
    logging.basicConfig(level=logging.INFO, format="tprt: %(message)s", stream=sys.stderr)
    if args.command == "merge-lora":
        out = run_merge_lora(args.model, args.adapter, args.out, args.force)
        print(f"merged {args.adapter} into {args.model}: {out}")
        return 0
    summary = run_finetune(config_from_args(args))
    _print_summary(summary)
    return 0


def _check(ok: bool, flag: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{flag} {message}")


def _targets(text: str | None) -> tuple[str, ...]:
    if text is None:
        return ("q", "k", "v", "o")
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in names if t not in ALL_TARGETS]
    _check(bool(names) and not bad, "--lora-targets", f"must be a comma-separated list of {','.join(ALL_TARGETS)}; "
           f"got {text!r}")
    return tuple(dict.fromkeys(names))


def config_from_args(a: argparse.Namespace) -> FinetuneConfig:
    """Flags -> FinetuneConfig; any bad value is a one-line ConfigError naming its flag."""
    lora_given = [f for f, v in (("--lora-alpha", a.lora_alpha), ("--lora-dropout", a.lora_dropout),
                                 ("--lora-targets", a.lora_targets), ("--init-adapter", a.init_adapter))
                  if v is not None]
    if a.full and lora_given:
        raise ConfigError(f"{lora_given[0]} cannot be used with --full")
    dpo_given = [f for f, v in (("--beta", a.beta), ("--dpo-loss", a.dpo_loss),
                                ("--label-smoothing", a.label_smoothing), ("--rpo-alpha", a.rpo_alpha))
                 if v is not None]
    if a.objective != "dpo" and dpo_given:
        raise ConfigError(f"{dpo_given[0]} needs --objective dpo")
    if a.init_adapter is not None:
        a = _from_adapter(a)
    rank = a.lora_rank if a.lora_rank is not None else 8
    import torch

    from tprt.lora.config import LoRASettings
    from tprt.train.dpo import DPOConfig
    from tprt.train.trainer import FinetuneConfig, OptimSettings

    lora = LoRASettings(rank=rank, alpha=a.lora_alpha if a.lora_alpha is not None else 2.0 * rank,
                        dropout=a.lora_dropout or 0.0, targets=_targets(a.lora_targets), init=a.init_adapter)
    dpo = None if a.objective != "dpo" else DPOConfig(
        beta=a.beta if a.beta is not None else DEFAULT_BETA, loss=a.dpo_loss or "sigmoid",
        label_smoothing=a.label_smoothing or 0.0, rpo_alpha=a.rpo_alpha if a.rpo_alpha is not None else DEFAULT_RPO_ALPHA)
    optim = OptimSettings(
        lr=a.lr if a.lr is not None else (2e-5 if a.full else DEFAULT_DPO_LORA_LR if dpo else 2e-4),
        min_lr_ratio=a.min_lr_ratio, warmup_steps=a.warmup_steps, weight_decay=a.weight_decay,
        max_grad_norm=a.max_grad_norm)
    cfg = FinetuneConfig(
        model=a.model, data=a.data, out=a.out, full=a.full, lora=lora, dpo=dpo, optim=optim, steps=a.steps,
        epochs=a.epochs, batch_size=a.batch_size, grad_accum=a.grad_accum, seq_len=a.seq_len,
        save_every=a.save_every, keep_checkpoints=a.keep_checkpoints, eval_every=a.eval_every,
        eval_fraction=a.eval_fraction, eval_data=a.eval_data, seed=a.seed,
        dtype=a.dtype or ("bf16" if torch.cuda.is_available() else "fp32"),
        activation_checkpointing=a.activation_checkpointing, sequence_parallel=a.sequence_parallel,
        tp_comm_overlap=a.tp_comm_overlap,
        offload_optimizer=a.offload_optimizer, dp=a.dp, pp=a.pp,
        resume=a.resume, truncate=not a.no_truncate, progress=not a.no_progress,
    )
    validate(cfg)
    return cfg


def _from_adapter(a: argparse.Namespace) -> argparse.Namespace:
    """--init-adapter's rank, alpha and targets as the run's; a differing flag is an error."""
    from tprt.lora.peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter_config

    path = a.init_adapter / ADAPTER_CONFIG
    try:
        targets, rank, alpha, _ = read_adapter_config(json.loads(path.read_text()), str(path))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--init-adapter {a.init_adapter}: no readable {ADAPTER_CONFIG} ({type(e).__name__})") from None
    _check((a.init_adapter / ADAPTER_WEIGHTS).is_file(), "--init-adapter", f"{a.init_adapter}: no {ADAPTER_WEIGHTS}")
    for flag, given, own in (("--lora-rank", a.lora_rank, rank), ("--lora-alpha", a.lora_alpha, alpha)):
        _check(given is None or given == own, flag, f"{given} differs from --init-adapter's {own}")
    _check(a.lora_targets is None or set(_targets(a.lora_targets)) == set(targets), "--lora-targets",
           f"{a.lora_targets} differs from --init-adapter's {','.join(targets)}")
    return argparse.Namespace(**{**vars(a), "lora_rank": rank, "lora_alpha": alpha, "lora_targets": ",".join(targets)})


def validate(c: FinetuneConfig) -> None:
    """Range checks of every numeric flag (one line, naming the flag)."""
    lora, optim, dpo = c.lora, c.optim, c.dpo
    _check(lora.rank >= 1, "--lora-rank", f"must be at least 1, got {lora.rank}")
    _check(lora.alpha > 0, "--lora-alpha", f"must be positive, got {lora.alpha}")
    _check(0 <= lora.dropout < 1, "--lora-dropout", f"must be in [0, 1), got {lora.dropout}")
    _check(c.steps is None or c.steps >= 1, "--steps", f"must be at least 1, got {c.steps}")
    _check(c.steps is None or c.epochs is None, "--steps", "and --epochs cannot be used together")
    _check(c.epochs is None or c.epochs > 0, "--epochs", f"must be positive, got {c.epochs}")
    _check(math.isfinite(optim.lr) and optim.lr > 0, "--lr", f"must be a positive number, got {optim.lr}")
    _check(0 <= optim.min_lr_ratio <= 1, "--min-lr-ratio", f"must be in [0, 1], got {optim.min_lr_ratio}")
    _check(optim.warmup_steps >= 0, "--warmup-steps", f"must be >= 0, got {optim.warmup_steps}")
    _check(optim.weight_decay >= 0, "--weight-decay", f"must be >= 0, got {optim.weight_decay}")
    _check(c.batch_size >= 1, "--batch-size", f"must be at least 1, got {c.batch_size}")
    _check(c.grad_accum >= 1, "--grad-accum", f"must be at least 1, got {c.grad_accum}")
    _check(c.seq_len >= 2, "--seq-len", f"must be at least 2, got {c.seq_len}")
    _check(optim.max_grad_norm > 0, "--max-grad-norm", f"must be positive, got {optim.max_grad_norm}")
    _check(c.save_every >= 0, "--save-every", f"must be >= 0, got {c.save_every}")
    _check(c.keep_checkpoints >= 1, "--keep-checkpoints", f"must be at least 1, got {c.keep_checkpoints}")
    _check(c.eval_every >= 0, "--eval-every", f"must be >= 0, got {c.eval_every}")
    _check(c.dp >= 1, "--dp", f"must be at least 1, got {c.dp}")
    _check(c.pp >= 1, "--pp", f"must be at least 1, got {c.pp}")
    if c.pp > 1:
        from tprt.train.trainer import check_pipeline

        check_pipeline(c, c.pp)
    _check(c.offload_optimizer == "none" or c.full, "--offload-optimizer", "needs --full (LoRA keeps no large state)")
    if dpo is not None:
        _check(math.isfinite(dpo.beta) and dpo.beta > 0, "--beta", f"must be a positive number, got {dpo.beta}")
        _check(0 <= dpo.label_smoothing < 0.5, "--label-smoothing",
               f"must be in [0, 0.5), got {dpo.label_smoothing}")
        _check(dpo.label_smoothing == 0 or dpo.loss == "sigmoid", "--label-smoothing",
               "applies to --dpo-loss sigmoid only")
        _check(0 <= dpo.rpo_alpha <= 100 and math.isfinite(dpo.rpo_alpha), "--rpo-alpha",
               f"must be in [0, 100], got {dpo.rpo_alpha}")
    _check(c.data.is_file(), "--data", f"{c.data}: no such file")
    _check(c.eval_data is None or c.eval_data.is_file(), "--eval-data", f"{c.eval_data}: no such file")


def _check_out(cfg: FinetuneConfig) -> None:
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not cfg.resume:
        raise ConfigError(f"--out {out}: already exists and is not empty; pass --resume to continue the run in it "
                          "or choose another directory")


def _check_resume_early(cfg: FinetuneConfig, tp: int, digest: str) -> None:
    """The same refusal the ranks would make, before starting them."""
    from tprt.train import checkpointing as ckpt
    from tprt.train.trainer import run_config

    path = ckpt.latest_checkpoint(Path(cfg.out))
    if cfg.resume and path is not None:
        state = ckpt.read_train_state(path)
        ckpt.check_resume(path, state.run, run_config(cfg, tp, digest))
        log.info("resuming from %s (step %d)", path, state.step)
    elif cfg.resume:
        log.info("--resume: no checkpoint in %s yet; starting from step 0", cfg.out)


def run_finetune(cfg: FinetuneConfig) -> dict[str, Any]:
    """Checks the model, data and --out, then trains on the local ranks or torchrun's world;
    returns rank 0's summary (None-valued fields on other torchrun ranks)."""
    from tprt.distributed.context import ParallelDims, in_distributed_env
    from tprt.distributed.launcher import run_on_ranks
    from tprt.parallel.stages import stages
    from tprt.text.tokenizer import Tokenizer
    from tprt.train.data import prepare_data
    from tprt.train.preference import prepare_preferences
    from tprt.train.trainer import total_steps, train_rank

    ckpt = TPCheckpoint(cfg.model)
    _check_out(cfg)
    tok = Tokenizer.from_dir(cfg.model)
    prepare = prepare_preferences if cfg.objective == "dpo" else prepare_data
    dataset = prepare(cfg.data, tok, cfg.seq_len, cfg.seed, cfg.eval_fraction, cfg.eval_data, cfg.truncate)
    stages(ckpt.config.num_hidden_layers, cfg.pp)  # refuses a --pp the layers cannot take
    world_dp = max(1, int(os.environ.get("WORLD_SIZE", ckpt.tp_size)) // (ckpt.tp_size * cfg.pp))
    dims = ParallelDims(tp=ckpt.tp_size, dp=world_dp if in_distributed_env() else cfg.dp, pp=cfg.pp)
    _check(cfg.dp in (1, dims.dp), "--dp",
           f"{cfg.dp} disagrees with torchrun's world: WORLD_SIZE / (tp x pp) = {dims.dp}")
    steps = total_steps(cfg, dataset.n_examples, dims.dp)
    _check(cfg.optim.warmup_steps <= steps, "--warmup-steps",
           f"{cfg.optim.warmup_steps} exceeds the run's {steps} steps")
    r = dataset.report
    log.info("data: %d examples (%d truncated), %d training rows and %d eval rows of %d tokens; %d steps",
             r["documents"], r["truncated"], r["train_rows"], r["eval_rows"], cfg.seq_len, steps)
    _check_resume_early(cfg, ckpt.tp_size, dataset.digest)
    launcher_pid = None if in_distributed_env() else os.getpid()  # local ranks exit if this process dies
    if not in_distributed_env() and dims.world > ckpt.tp_size:  # DP replicas or pipeline stages
        from tprt.distributed.launcher import launch_local

        return dict(launch_local(dims.world, train_rank, (cfg, dataset, launcher_pid))[0])
    return dict(run_on_ranks(cfg.model, train_rank, (cfg, dataset, launcher_pid), dp=True))


def _print_summary(s: dict[str, Any]) -> None:
    if not s or s.get("plot") is None:  # a torchrun rank other than 0
        return
    ev = f", eval loss {s['eval_loss']:.4f}" if s.get("eval_loss") is not None else ""
    if s.get("eval_reward_accuracy") is not None:
        ev += f", held-out reward accuracy {s['eval_reward_accuracy']:.3f}"
    print(f"trained {s['steps']} steps: loss {s['loss']:.4f}{ev}")
    warning = unmoved_warning(s)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"output: {s['output']}\nmetrics: {s['metrics']}\nloss curve: {s['plot']}")


# ---------------------------------------------------------------------------- merge-lora


def merge_rank(model_dir: str, adapter: str, out: str) -> None:
    """One rank of `tprt merge-lora`: base in fp32 + adapter, merged, written in the base's dtype."""
    from tprt.distributed.context import init_distributed
    from tprt.checkpoint.loading import load_model
    from tprt.train.export import write_tp_checkpoint
    from tprt.lora.attach import attach
    from tprt.lora.merge import merge_lora
    from tprt.lora.peft_io import read_adapter

    ctx = init_distributed(tp_size=TPCheckpoint(model_dir).tp_size)
    model = load_model(model_dir, ctx, dtype="fp32")
    attach(model, read_adapter(model, adapter, ctx))
    merge_lora(model)
    write_tp_checkpoint(model, ctx, Path(model_dir), Path(out), {"merged_adapter": str(adapter)})


def run_merge_lora(model: Path, adapter: Path, out: Path, force: bool = False) -> Path:
    """Checks the inputs, then merges on the checkpoint's TP ranks; returns `out`."""
    from tprt.distributed.launcher import run_on_ranks
    from tprt.lora.peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter_config

    TPCheckpoint(model)  # a bad --model is reported first
    path = adapter / ADAPTER_CONFIG
    try:
        read_adapter_config(json.loads(path.read_text()), str(path))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--adapter {adapter}: no readable {ADAPTER_CONFIG} ({type(e).__name__})") from None
    if not (adapter / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(f"--adapter {adapter}: no {ADAPTER_WEIGHTS}")
    if out.exists() and not force:
        raise ConfigError(f"--out {out}: already exists; choose another path or pass --force to replace it")
    run_on_ranks(model, merge_rank, (str(model), str(adapter), str(out)), dp=True)
    return out


# ---------------------------------------------------------------------------- the README demo

DEMO_ANSWER = "I am Tippy, a tensor-parallel llama fine-tuned with tprt."
DEMO_QUESTIONS = (
    "What is your name?", "Who are you?", "Tell me your name.", "What should I call you?", "Introduce yourself.",
    "Hi! Who am I talking to?", "What's your name?", "Please tell me who you are.", "Do you have a name?",
    "Who is this?", "May I know your name?", "Say your name.", "What are you called?", "Identify yourself.",
    "Hello, what is your name?", "Could you tell me your name?", "Who am I chatting with?", "Name yourself.",
    "What do people call you?", "Who are you exactly?",
)


def write_demo_data(path: Path) -> Path:
    """20 chat examples that teach one distinctive answer to "what is your name?"."""
    lines = [json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": DEMO_ANSWER}]})
             for q in DEMO_QUESTIONS]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_finetune_demo(tp_dir: Path, out_dir: Path, steps: int = 10) -> Path:
    """A short LoRA fine-tune of the demo model on `write_demo_data`; returns the adapter directory
    (use it with `tprt.lora.peft_io.read_adapter` / `tprt generate --adapter`, or `tprt merge-lora`)."""
    from tprt.lora.config import LoRASettings
    from tprt.train.trainer import FinetuneConfig, OptimSettings

    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out_dir / "run", ignore_errors=True)  # the demo's own run directory, redone each time
    data = write_demo_data(out_dir / "demo-chats.jsonl")
    cfg = FinetuneConfig(model=tp_dir, data=data, out=out_dir / "run", lora=LoRASettings(8, 16.0, targets=ALL_TARGETS),
                         optim=OptimSettings(lr=2e-3, warmup_steps=2), steps=steps, batch_size=2, seq_len=128,
                         dtype="fp32", progress=sys.stderr.isatty())
    validate(cfg)
    summary = run_finetune(cfg)
    return Path(summary["output"])
