"""What a LoRA adapter targets and its hyper-parameters, validated; PEFT's names for the targets.

Targets are short names of a Llama layer's projections (q, k, v, o, gate, up, down); Hugging
Face's module names (q_proj, ...) are accepted wherever targets are given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tprt.errors import ValidationError
from tprt.parallel.sharding import LAYER_LINEARS


def target_name(module: str) -> str:
    """The short target name of an HF linear module: self_attn.q_proj -> q."""
    return module.split(".")[1].removesuffix("_proj")


# Short target name -> HF module, in canonical order (the runtime's row order, tprt.parallel.sharding).
HF_MODULES = {target_name(m): m for parts in LAYER_LINEARS.values() for m in parts}
TARGETS = tuple(HF_MODULES)


def normalize_targets(targets: Sequence[str]) -> tuple[str, ...]:
    """Short target names (q, ..., down) in canonical order; HF names (q_proj, ...) are accepted."""
    if isinstance(targets, str):
        targets = [t for t in targets.replace(",", " ").split() if t]
    if not targets:
        raise ValidationError("lora_targets", f"no LoRA target given; allowed: {', '.join(TARGETS)}")
    out = set()
    for t in targets:
        short = t.removesuffix("_proj")
        if short not in TARGETS:
            raise ValidationError(
                "lora_targets",
                f"unknown LoRA target {t!r}; allowed: {', '.join(TARGETS)} (or {', '.join(hf_names(TARGETS))})",
            )
        out.add(short)
    return tuple(t for t in TARGETS if t in out)


def hf_names(targets: Sequence[str]) -> list[str]:
    """HF module names (q_proj, ...) of short targets, as PEFT's `target_modules`."""
    return [HF_MODULES[t].split(".")[1] for t in targets]


MAX_ALPHA = 1e6  # as a job's lora_alpha (serve/jobs/spec.py): more only overflows the scaled update


def check_hparams(rank: int, alpha: float, dropout: float) -> None:
    """ValidationError naming the field unless rank >= 1, 0 < alpha <= MAX_ALPHA and 0 <= dropout < 1."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValidationError("lora_rank", f"LoRA rank must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= MAX_ALPHA:
        raise ValidationError("lora_alpha", f"LoRA alpha must be a number in (0, {MAX_ALPHA:g}], got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValidationError("lora_dropout", f"LoRA dropout must be in [0, 1), got {dropout!r}")


@dataclass(frozen=True)
class LoRASettings:
    """A LoRA fine-tune's adapter (--lora-rank, --lora-alpha, --lora-dropout, --lora-targets) and
    the adapter it starts from (--init-adapter; None: B = 0, the base model's function)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "k", "v", "o")
    init: Path | None = None
