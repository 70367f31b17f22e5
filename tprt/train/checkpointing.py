"""Training checkpoints: written atomically by every rank together, resumed from the newest.

Layout under the run's output directory:

    checkpoints/step-00000040/
        train_state.json              step, data position, run config (written last, by rank 0)
        trainer.pt                    scheduler state (rank 0)
        weights-tp00000.safetensors   trainable parameters of TP rank 0 (full: its shard; LoRA: its
        optim-tp00000.pt              adapter shard) and its optimizer state; DP rank 0 writes them
                                      (over pipeline stages, each stage's: weights-tp00000-pp001...)
        rng-00000.pt                  torch and Python RNG states of global rank 0, one per rank
        dcp-tp00000/                  a sharded full fine-tune (FSDP, `tprt.train.fsdp`) instead of
                                      weights-/optim-: TP rank 0's parameters and optimizer state
                                      through torch.distributed.checkpoint, each DP rank writing its
                                      own shards; loadable at another DP degree (DCP reshards)

A checkpoint is written into a hidden sibling (`.tmp-step-...`), every file fsynced, and renamed
into place by rank 0 once all ranks are done, then the directory is fsynced. A crash at any
moment leaves at most a hidden temporary directory (removed by the next save or resume) and
never touches the complete checkpoints; only those with train_state.json are ever read. After a
successful save the oldest complete checkpoints beyond `keep` are deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tprt.checkpoint.format import MANIFEST_NAME
from tprt.distributed.context import TPContext
from tprt.distributed.together import run_together
from tprt.errors import CheckpointError, ConfigError
from tprt.checkpoint.fsutil import fsync_dir, write_text_atomic

CHECKPOINTS = "checkpoints"
STATE_FILE = "train_state.json"
PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
# Run-config fields a resume must share with the checkpoint, in the order they are checked.
MUST_MATCH = ("tp", "pp", "model_fingerprint", "method", "lora_rank", "lora_alpha", "lora_targets",
              "seq_len", "data_digest", "seed", "dtype", "objective", "beta", "dpo_loss", "label_smoothing",
              "rpo_alpha", "init_adapter")


def model_fingerprint(model_dir: Path) -> str:
    """sha256 of the TP checkpoint's config.json and manifest: the same model wherever it lies."""
    h = hashlib.sha256()
    for name in ("config.json", MANIFEST_NAME):
        h.update((model_dir / name).read_bytes())
    return h.hexdigest()


def step_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def complete_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `out`, oldest first."""
    root = out / CHECKPOINTS
    found: list[tuple[int, Path]] = []
    if not root.is_dir():
        return found
    for p in root.iterdir():
        digits = p.name[len(PREFIX):]
        if p.name.startswith(PREFIX) and digits.isdigit() and (p / STATE_FILE).is_file():
            found.append((int(digits), p))
    return sorted(found)


def latest_checkpoint(out: Path) -> Path | None:
    found = complete_checkpoints(out)
    return found[-1][1] if found else None


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class ShardedState:
    """What a sharded (FSDP) run saves through torch.distributed.checkpoint: state dicts of
    DTensors, and the DP group whose ranks write (and read) the shards of one TP rank."""

    state: dict[str, Any]
    dp_group: dist.ProcessGroup


def dcp_dir(path: Path, tp_rank: int) -> Path:
    return path / f"dcp-tp{tp_rank:05d}"


@dataclass
class TrainState:
    """Everything a checkpoint holds that is the same on every rank."""

    step: int
    data: dict[str, int]  # BatchStream.state_dict()
    run: dict[str, Any]  # the run config (model, TP, hyper-parameters)
    scheduler: dict[str, Any]


def shard_suffix(ctx: TPContext, stage: int | None) -> str:
    """The name part of a TP rank's (and pipeline stage's) weights and optimizer files."""
    return f"tp{ctx.rank:05d}" + ("" if stage is None else f"-pp{stage:03d}")


def save_checkpoint(
    out: Path, ctx: TPContext, state: TrainState, weights: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any], keep: int, sharded: ShardedState | None = None, stage: int | None = None,
) -> Path:
    """Writes checkpoint `state.step`; collective over the world (every rank must call it).
    With `sharded`, every rank writes its DCP shards instead of DP rank 0 writing `weights` and
    `optimizer_state`. `stage`: this rank's pipeline stage, whose files these are."""
    from safetensors.torch import save_file

    root = out / CHECKPOINTS
    tmp = root / f"{TMP_PREFIX}{state.step:08d}"
    final = root / step_name(state.step)

    def prepare() -> None:
        if ctx.is_main:
            root.mkdir(parents=True, exist_ok=True)
            remove_partial(out)
            tmp.mkdir()

    def write_shard() -> None:
        _torch_save(rng_state(), tmp / f"rng-{ctx.global_rank:05d}.pt")
        if sharded is not None:
            import torch.distributed.checkpoint as dcp

            # DCP's file writer fsyncs each file it writes (sync_files defaults to True).
            dcp.save(sharded.state, checkpoint_id=dcp_dir(tmp, ctx.rank), process_group=sharded.dp_group)
        elif ctx.dp_rank == 0:
            wpath = tmp / f"weights-{shard_suffix(ctx, stage)}.safetensors"
            save_file({k: v.detach().contiguous() for k, v in weights.items()}, str(wpath))
            _fsync_file(wpath)
            _torch_save(dict(optimizer_state), tmp / f"optim-{shard_suffix(ctx, stage)}.pt")

    def complete() -> None:
        if ctx.is_main:
            _torch_save({"scheduler": state.scheduler}, tmp / "trainer.pt")
            doc = {"step": state.step, "data": state.data, "run": state.run}
            write_text_atomic(tmp / STATE_FILE, json.dumps(doc, indent=1) + "\n")
            fsync_dir(tmp)
            if final.exists():  # an older run's checkpoint of the same step: replaced as a whole
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(root)
            prune(out, keep)

    for section in (prepare, write_shard, complete):
        run_together(section, "saving the checkpoint")
    return final


def remove_partial(out: Path) -> None:
    """Deletes temporary directories a crashed save left behind (rank 0 only)."""
    root = out / CHECKPOINTS
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)


def prune(out: Path, keep: int) -> None:
    """Keeps the newest `keep` complete checkpoints (all when keep <= 0)."""
    if keep <= 0:
        return
    for _, path in complete_checkpoints(out)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def read_train_state(path: Path) -> TrainState:
    """train_state.json and trainer.pt of checkpoint `path`."""
    try:
        doc = json.loads((path / STATE_FILE).read_text())
        extra = torch.load(path / "trainer.pt", weights_only=False)
        return TrainState(int(doc["step"]), dict(doc["data"]), dict(doc["run"]), dict(extra["scheduler"]))
    except (OSError, json.JSONDecodeError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{path}: unreadable training checkpoint ({type(e).__name__}: {e})") from None


def check_resume(path: Path, saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Refuses to resume checkpoint `path` into a run that differs in model, TP or method; the
    error names the first field that differs."""
    for key in MUST_MATCH:
        # a DPO run saved before --rpo-alpha existed ran without the term
        old = 0.0 if key == "rpo_alpha" and saved.get("objective") == "dpo" else None
        old = 1 if key == "pp" else old  # runs before pipeline stages had one
        if saved.get(key, old) == current.get(key):
            continue
        if key == "model_fingerprint":
            raise ConfigError(
                f"--resume: {path} was trained from model {saved.get('model')} (a different config/manifest); "
                f"this run's --model is {current.get('model')}"
            )
        flag = {"tp": "TP degree", "method": "method (--full / --lora-rank)"}.get(key, "--" + key.replace("_", "-"))
        raise ConfigError(f"--resume: {path} was written with {flag} {saved.get(key)!r}, this run has {current.get(key)!r}")


def load_rank_state(path: Path, ctx: TPContext, stage: int | None = None,
                    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any] | None]:
    """This rank's (trainable weights, optimizer state, RNG state or None when the checkpoint was
    written by a world without this global rank); `stage`: its pipeline stage's."""
    from safetensors.torch import load_file

    wpath = path / f"weights-{shard_suffix(ctx, stage)}.safetensors"
    opath = path / f"optim-{shard_suffix(ctx, stage)}.pt"
    for p in (wpath, opath):
        if not p.is_file():
            raise CheckpointError(f"{p}: missing from the checkpoint (needed by TP rank {ctx.rank})")
    weights = load_file(str(wpath), device=str(ctx.device))
    optim = torch.load(opath, map_location=ctx.device, weights_only=False)
    return weights, optim, load_rng(path, ctx)


def load_rng(path: Path, ctx: TPContext) -> dict[str, Any] | None:
    """This global rank's RNG state, or None when the checkpoint's world had no such rank."""
    rpath = path / f"rng-{ctx.global_rank:05d}.pt"
    return torch.load(rpath, weights_only=False) if rpath.is_file() else None


def load_sharded(path: Path, ctx: TPContext, state: dict[str, Any], dp_group: dist.ProcessGroup) -> None:
    """Fills `state` (DTensor state dicts, as `ShardedState.state`) in place from the DCP shards of
    this TP rank, whatever DP degree wrote them; collective over `dp_group`."""
    import torch.distributed.checkpoint as dcp

    where = dcp_dir(path, ctx.rank)
    if not where.is_dir():
        raise CheckpointError(f"{where}: missing from the checkpoint (a sharded full fine-tune needs it; "
                              "was it written by a LoRA run or an older tprt?)")
    dcp.load(state, checkpoint_id=where, process_group=dp_group)
