"""The run's metrics log (metrics.jsonl, one JSON object per step) and its loss-curve PNG."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tprt.checkpoint.fsutil import write_bytes_atomic

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


class MetricsLog:
    """Appends one line per record to `out/metrics.jsonl` (rank 0 only), flushed at once so a
    crash loses nothing already logged."""

    def __init__(self, out: Path) -> None:
        self.path = out / METRICS_FILE

    def truncate_after(self, step: int) -> None:
        """Drops records of steps after `step` (a resumed run redoes them)."""
        kept = [r for r in read_metrics(self.path) if int(r.get("step", 0)) <= step]
        write_bytes_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode())

    def write(self, record: Mapping[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics log (none when it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(metrics_path: Path, png: Path) -> Path:
    """Training loss per step (and evaluation loss where measured) as a PNG, with matplotlib's
    Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        if train:
            ax.plot(*zip(*train), label="train loss", linewidth=1.2)
        if evals:
            ax.plot(*zip(*evals), "o-", label="eval loss", linewidth=1.2, markersize=4)
        ax.set_xlabel("step")
        dpo = [(r["step"], r["reward_accuracy"]) for r in records if r.get("reward_accuracy") is not None]
        ax.set_ylabel("DPO loss (per pair)" if dpo else "loss (nats/token)")
        ax.set_title("tprt finetune")
        ax.grid(alpha=0.3)
        if train or evals:
            ax.legend(loc="upper left")
        if dpo:  # a DPO run: its reward accuracy on a second axis
            acc = ax.twinx()
            acc.plot(*zip(*dpo), color="tab:green", linewidth=1.0, alpha=0.7, label="reward accuracy")
            held = [(r["step"], r["eval_reward_accuracy"]) for r in records
                    if r.get("eval_reward_accuracy") is not None]
            if held:
                acc.plot(*zip(*held), "s", color="tab:green", markersize=4, label="held-out reward accuracy")
            acc.set_ylim(-0.02, 1.02)
            acc.set_ylabel("reward accuracy")
            acc.legend(loc="upper right")
        tmp = png.with_name(f".{png.name}.tmp-{os.getpid()}.png")
        fig.savefig(tmp)
        os.replace(tmp, png)
    finally:
        plt.close(fig)
    return png
