"""Outputs of fine-tuning: a full fine-tune as a TP checkpoint, a LoRA adapter in the layout
Hugging Face PEFT loads, and adapters applied to (or merged into) a loaded model.

- `write_tp_checkpoint`: every TP rank writes its own rank file (its slice of each tensor under
  its HF name, the fused q/k/v and gate/up rows split back per
  `tprt.parallel.sharding.hf_sources`) in the base checkpoint's dtype and manifest format;
  rank 0 writes the manifest, config and tokenizer.
  The result can be loaded by `tprt`, resharded, or exported with `tprt-convert tp-to-hf`.
- `write_adapter`: adapter_model.safetensors + adapter_config.json (PEFT names, full A/B).

Reading an adapter directory for a loaded model, to attach it unmerged (`tprt generate
--adapter`), is `tprt.lora.peft_io.read_adapter`.

Every output directory is written under a temporary sibling name and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tprt.checkpoint.format import TOKENIZER_FILES, FileEntry, Manifest, TPCheckpoint, rank_file_name, write_manifest
from tprt.distributed.context import TPContext
from tprt.distributed.pipeline_mesh import PipelineMesh
from tprt.errors import CheckpointError
from tprt.checkpoint.fsutil import fsync_dir, write_text_atomic
from tprt.parallel.sharding import hf_sources
from tprt.model.llama import TPLlamaForCausalLM
from tprt.checkpoint.safetensors_io import DTYPES, StreamingSafetensorsWriter
from tprt.distributed.together import run_together

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _rank_tensors(state: Mapping[str, torch.Tensor], manifest: Manifest) -> dict[str, torch.Tensor]:
    """HF name -> this rank's slice, split out of the fused parameters of `state` (a model's
    state dict; adapters left out)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if ".adapter." in name or name.endswith(".adapter"):
            continue
        row = 0
        for src in hf_sources(name):
            if src not in manifest.tensors:
                raise CheckpointError(f"tensor {src!r} (from parameter {name}) is not in the base manifest")
            rows = manifest.local_shape(src)[0]
            out[src] = value[row : row + rows]
            row += rows
        if row != value.shape[0]:
            raise CheckpointError(f"parameter {name}: {value.shape[0]} rows, the manifest's tensors give {row}")
    missing = set(manifest.tensors) - set(out)
    if missing:
        raise CheckpointError(f"the model holds no value for manifest tensors {sorted(missing)[:3]}")
    return out


def _write_rank_file(path: Path, tensors: Mapping[str, torch.Tensor], manifest: Manifest) -> tuple[int, str]:
    """One rank file, in the manifest's dtype per tensor; returns (size, sha256)."""
    names = sorted(tensors)
    entries = [(n, manifest.tensors[n].dtype, manifest.local_shape(n)) for n in names]
    writer = StreamingSafetensorsWriter(path, entries, metadata={"format": "pt"})
    try:
        for n in names:
            dtype = DTYPES[manifest.tensors[n].dtype][0]
            t = tensors[n].detach().to(device="cpu", dtype=dtype).contiguous()
            writer.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def _copy_small_files(base: Path, dst: Path, listed: Mapping[str, FileEntry]) -> None:
    """config.json, the tokenizer files and any other shared file the manifest lists, verbatim."""
    for name in sorted({"config.json", *TOKENIZER_FILES, *listed}):
        if (base / name).is_file():
            shutil.copyfile(base / name, dst / name)
            with open(dst / name, "rb") as f:
                os.fsync(f.fileno())


def _staging_dir(out: Path, ctx: TPContext) -> Path:
    """A temporary sibling of `out`, made by the main rank and named to every rank."""
    holder: list[Any] = [None]

    def make() -> None:
        if ctx.is_main:
            out.parent.mkdir(parents=True, exist_ok=True)
            holder[0] = tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent)

    run_together(make, f"creating the staging directory for {out}")
    if dist.is_initialized():
        dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])


def _publish(tmp: Path, out: Path) -> None:
    """Renames a finished temporary directory onto `out` (replacing it), fsyncing both levels."""
    os.chmod(tmp, 0o755)
    fsync_dir(tmp)
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    fsync_dir(out.parent)


def write_tp_checkpoint(model: TPLlamaForCausalLM, ctx: TPContext, base: Path, out: Path,
                        provenance: Mapping[str, Any] | None = None,
                        tensors: Mapping[str, torch.Tensor] | None = None,
                        stages: PipelineMesh | None = None) -> Path:
    """Writes the model as a TP checkpoint shaped like `base` (same TP, dtype, manifest format).
    `tensors`: the values to write instead of `model.state_dict()` (a sharded model's, gathered).
    `stages`: `model` is a pipeline stage; the first stage gathers its pipeline's tensors (the
    whole TP rank's) and writes the rank file.

    Collective over the world: the TP ranks of DP rank 0 (and of the first stage) each write
    their rank file."""
    ckpt = TPCheckpoint(base)
    manifest = ckpt.manifest
    tmp = _staging_dir(out, ctx)
    own = tensors if tensors is not None else model.state_dict()
    state = _gather_stages(own, stages) if stages is not None and ctx.dp_rank == 0 else own
    try:
        def write_shard() -> tuple[str, FileEntry] | None:
            if ctx.dp_rank != 0 or state is None:
                return None
            fname = rank_file_name(ctx.rank, manifest.tp_size)
            size, sha = _write_rank_file(tmp / fname, _rank_tensors(state, manifest), manifest)
            return fname, FileEntry(ctx.rank, size, sha)

        entry = run_together(write_shard, f"writing {out}")
        entries: list[Any] = [entry]
        if ctx.dp_rank == 0 and ctx.world_size > 1:
            entries = [None] * ctx.world_size
            dist.all_gather_object(entries, entry, group=ctx.group)
        def publish() -> None:
            if not ctx.is_main:
                return
            shared = {k: v for k, v in manifest.files.items() if v.rank < 0}  # e.g. files every rank reads
            files = dict(e for e in entries if e is not None)
            extra = {**manifest.extra, "finetuned_from": str(base), **(provenance or {})}
            new = Manifest(manifest.tp_size, manifest.vocab_size, manifest.padded_vocab_size, manifest.dtype,
                           manifest.tensors, {**shared, **files}, manifest.hf_weight_map, extra)
            _copy_small_files(base, tmp, shared)
            write_manifest(tmp, new)
            _publish(tmp, out)

        run_together(publish, f"writing {out}")
    except BaseException:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _gather_stages(state: Mapping[str, torch.Tensor], stages: PipelineMesh) -> dict[str, torch.Tensor] | None:
    """Every stage's `state` of this pipeline (host copies), merged on its first stage (a
    tensor two stages hold, tied embeddings, taken from the first); None on the other stages.
    Collective over the pipeline."""
    host = {k: v.detach().to("cpu") for k, v in state.items()}
    parts: list[Any] = [None] * stages.stages if stages.stage_index == 0 else []
    dist.gather_object(host, parts or None, dst=stages.pipeline[0], group=stages.pp_group)
    if stages.stage_index != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update({k: v for k, v in part.items() if k not in merged})
    return merged


def write_adapter(model: TPLlamaForCausalLM, ctx: TPContext, out: Path, config: Mapping[str, Any],
                  stages: PipelineMesh | None = None) -> Path:
    """adapter_model.safetensors + adapter_config.json in `out` (PEFT layout); collective (the
    full A/B matrices are gathered to rank 0, which writes them; `stages`: from every pipeline
    stage's layers)."""
    from safetensors.torch import save_file

    from tprt.lora.attach import attached
    from tprt.lora.peft_io import lora_state_dict

    state = lora_state_dict(attached(model), ctx)
    if stages is not None and ctx.rank == 0 and ctx.dp_rank == 0:
        state = _gather_stages(state, stages) or {}

    def write() -> None:
        if not ctx.is_main:
            return
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            wpath = tmp / ADAPTER_WEIGHTS
            save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(wpath),
                      metadata={"format": "pt"})
            with open(wpath, "rb") as f:
                os.fsync(f.fileno())
            write_text_atomic(tmp / ADAPTER_CONFIG, json.dumps(dict(config), indent=2) + "\n")
            _publish(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    run_together(write, f"writing {out}")
    return out
