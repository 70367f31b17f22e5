"""DPO over TP ranks: a few steps of LoRA-DPO and full DPO on token-id pairs (no tokenizer), run
as a check in test_lora.py's worlds (TP 1, 2, 4); rank 0 writes the losses and rewards of every
step and of the held-out evaluation, which the test compares across TP degrees."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tprt.distributed.context import TPContext
from tprt.train.data import Dataset, Document, pack

STEPS = 5
RUNS = {  # name -> the settings that differ: (full, DPO loss, label smoothing, lr)
    "lora-sigmoid": (False, "sigmoid", 0.1, 2e-2),
    "full-ipo": (True, "ipo", 0.0, 1e-3),
}


def token_pairs(vocab: int, n_pairs: int, seed: int) -> list[Document]:
    """Preferred and non-preferred completions of random prompts, uneven lengths, interleaved."""
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for i in range(n_pairs):
        prompt = torch.randint(3, vocab, (3 + i % 3,), generator=gen).tolist()
        for k in range(2):
            completion = torch.randint(3, vocab, (2 + (i + k) % 4,), generator=gen).tolist()
            docs.append(Document(prompt + completion, [False] * len(prompt) + [True] * len(completion)))
    return docs


def pair_dataset(vocab: int) -> Dataset:
    rows = pack(token_pairs(vocab, 6, seed=3), 32, 0, per_example=True)
    held_out = pack(token_pairs(vocab, 3, seed=4), 32, 0, per_example=True)
    return Dataset(rows, held_out, "pairs", pairs=True)


def check_dpo_steps(ctx: TPContext, workdir: Path) -> None:
    """STEPS steps (two micro-batches of one pair each, accumulated) and a held-out evaluation."""
    from tprt.checkpoint.format import TPCheckpoint
    from tprt.lora.config import LoRASettings
    from tprt.train.dpo import DPOConfig
    from tprt.train.trainer import FinetuneConfig, OptimSettings, Trainer

    model = workdir / f"gqa-tp{ctx.world_size}"
    vocab = TPCheckpoint(model).config.vocab_size
    out: dict[str, list[dict[str, float]]] = {}
    for name, (full, loss, smoothing, lr) in RUNS.items():
        cfg = FinetuneConfig(model=model, data=model / "manifest.json", out=workdir / f"dpo-{name}-tp{ctx.world_size}",
                             full=full, lora=LoRASettings(4, 8.0, targets=("q", "k", "v", "o", "gate", "up", "down")),
                             dpo=DPOConfig(beta=0.5, loss=loss, label_smoothing=smoothing),
                             optim=OptimSettings(lr=lr, max_grad_norm=1.0), steps=STEPS, batch_size=1, grad_accum=2,
                             seq_len=32, progress=False)
        trainer = Trainer(cfg, ctx, pair_dataset(vocab))
        records = []
        for _ in range(STEPS):
            loss, grad_norm = trainer.train_step()
            records.append({"loss": loss, "grad_norm": grad_norm, **trainer.step_metrics})
        with torch.no_grad():
            records.append({"eval_loss": trainer.evaluate() or 0.0, **trainer.eval_metrics})
        assert records[-2]["reward_margin"] > records[0]["reward_margin"], f"{name}: the margin did not grow"
        out[name] = records
    if ctx.rank == 0:
        (workdir / f"dpo-tp{ctx.world_size}.json").write_text(json.dumps(out))
