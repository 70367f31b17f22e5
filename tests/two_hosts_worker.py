"""One rank of tests/test_two_hosts.py, started by torchrun inside a network namespace: a
[pp 2, tp 2] pipeline whose stages are the two hosts, trained two full fine-tuning steps; the
last stage's first TP rank writes the losses and gradient norms to OUT (argv[2])."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tprt.checkpoint.loading import load_stage
from tprt.model.config import ModelConfig
from tprt.parallel.stages import stages
from tprt.train.optim import AdamW
from tprt.train.pipeline import PipelineTrainer, pipeline_mesh, sync_and_clip


def main() -> None:
    checkpoint, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = pipeline_mesh(tp=2, pp=2)
    cfg = ModelConfig.from_file(checkpoint / "config.json")
    stage = stages(cfg.num_hidden_layers, 2)[mesh.stage_index]
    model = load_stage(checkpoint, mesh.tp, stage, "fp32", requires_grad=True).train()
    trainer = PipelineTrainer(model, mesh, n_microbatches=2)
    opt = AdamW(list(model.parameters()), lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)  # the test's HP
    batches = torch.load(checkpoint.parent / "batches.pt")
    losses, norms = [], []
    for ids, labels in batches:
        opt.zero_grad(set_to_none=True)
        loss = trainer.step(ids, labels)
        norms.append(sync_and_clip(model, mesh, float("inf")))
        opt.step()
        losses.append(loss)
    if stage.last and mesh.tp.rank == 0:
        out.write_text(json.dumps({"losses": losses, "norms": norms, "host_rank": dist.get_rank()}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
