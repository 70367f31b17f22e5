"""Builds this rank's model on the meta device and fills it from the rank's mmapped files.

The decoder's linear layers are built with the checkpoint's weight format (`WEIGHT_FORMATS`,
tprt.parallel.layers), whose `LinearMethod` creates their parameters; the loader then goes
through the method for each of them (`load_weight`, then `process_after_loading` once all hold
their values). Only rank r's files are opened; each parameter is allocated once, already in its
final dtype and device, and filled from zero-copy views of the file (q/k/v and gate/up are
copied into their fused parameter piece by piece, as `tprt.parallel.sharding.hf_sources` lists
them), so no rank ever holds more than its own shard.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from tprt.checkpoint.format import MANIFEST_NAME, Manifest, RankFiles, TPCheckpoint
from tprt.model.config import ModelConfig, TPLayout
from tprt.distributed.context import TPContext
from tprt.errors import CheckpointError, ConfigError
from tprt.cpu.hugepages import huge_tensors
from tprt.model.llama import TPLlamaForCausalLM
from tprt.model.stage import TPLlamaStage
from tprt.parallel.stages import Stage
from tprt.parallel.layers import WEIGHT_FORMATS, LinearMethod, ParallelLinear, copy_rows
from tprt.checkpoint.safetensors_io import DTYPES
from tprt.quant import methods as _quantized  # noqa: F401 - registers the quantized weight formats
from tprt.parallel.sharding import hf_sources

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "f32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "f16": torch.float16, "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """fp32 / bf16 / fp16 (or the torch dtype itself); anything else is a one-line error."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES.values():
            raise ConfigError(f"--dtype {dtype} is not supported; expected fp32, bf16 or fp16")
        return dtype
    try:
        return _DTYPE_NAMES[dtype.lower()]
    except KeyError:
        raise ConfigError(f"--dtype {dtype!r} is not supported; expected fp32, bf16 or fp16") from None


def layout_of(manifest: Manifest, cfg: ModelConfig) -> TPLayout:
    """The TP layout the checkpoint was written with (vocabulary padding as the manifest says)."""
    return TPLayout(
        tp=manifest.tp_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        vocab_size=manifest.vocab_size,
        padded_vocab_size=manifest.padded_vocab_size,
    )


def check_tp(ckpt: TPCheckpoint, ctx: TPContext) -> None:
    """The checkpoint must be sharded for exactly this TP world."""
    if ckpt.tp_size != ctx.world_size:
        raise CheckpointError(
            f"{ckpt.path / MANIFEST_NAME}: checkpoint is sharded for tp_size={ckpt.tp_size} but this run has "
            f"{ctx.world_size} TP rank(s); run with {ckpt.tp_size} ranks or reshard it with `tprt-convert reshard`"
        )


def load_model(
    path: str | Path,
    ctx: TPContext,
    dtype: str | torch.dtype | None = None,
    requires_grad: bool = False,
) -> TPLlamaForCausalLM:
    """This rank's shard of the model in TP checkpoint `path`, on `ctx.device`.

    `dtype` (fp32, bf16, fp16) casts on load; None keeps the checkpoint's. Parameters are frozen
    unless `requires_grad`. Errors (wrong TP size, missing or mis-shaped tensors) are one line.
    """
    return _load(path, ctx, dtype, requires_grad,
                 lambda cfg, layout, dt, method: TPLlamaForCausalLM(cfg, layout, ctx, dtype=dt, method=method))


def load_stage(path: str | Path, ctx: TPContext, stage: Stage, dtype: str | torch.dtype | None = None,
               requires_grad: bool = False) -> TPLlamaStage:
    """This rank's shard of pipeline stage `stage` of TP checkpoint `path` (tprt.model.stage):
    only the stage's tensors are read from the rank files, which every stage's TP rank r shares.
    Otherwise as `load_model`."""
    return _load(path, ctx, dtype, requires_grad,
                 lambda cfg, layout, dt, method: TPLlamaStage(cfg, layout, ctx, stage, dtype=dt, method=method))


M = TypeVar("M", bound=nn.Module)


def _load(path: str | Path, ctx: TPContext, dtype: str | torch.dtype | None, requires_grad: bool,
          build: Callable[[ModelConfig, TPLayout, torch.dtype, LinearMethod], M]) -> M:
    """The model `build` makes on the meta device, its parameters read from `path`'s rank file."""
    ckpt = TPCheckpoint(path)
    check_tp(ckpt, ctx)
    target = parse_dtype(dtype) if dtype is not None else _manifest_dtype(ckpt)
    method = weight_format(ckpt)
    if requires_grad and method.frozen:
        raise ConfigError(f"{ckpt.path}: its weights are {method.name} (frozen); full fine-tuning needs a "
                          "float checkpoint, or train a LoRA adapter on this one")
    with torch.device("meta"):
        model = build(ckpt.config, layout_of(ckpt.manifest, ckpt.config), target, method)
    files = ckpt.open_rank(ctx.rank)
    try:
        # Frozen weights share one huge-page block; trainable ones stay separate tensors (the
        # safetensors writer of training checkpoints refuses tensors that share storage).
        state = _rank_state(model, files, ckpt.path, ctx.device, one_block=not requires_grad)
    finally:
        files.close()
    model.load_state_dict(state, strict=True, assign=True)
    for layer in model.modules():
        if isinstance(layer, ParallelLinear):
            layer.method.process_after_loading(layer)
    model.requires_grad_(requires_grad)
    return model.eval()


def weight_format(ckpt: TPCheckpoint) -> LinearMethod:
    """The linear method of the checkpoint's weight format (manifest `extra.weight_format`,
    "dense" when absent)."""
    name = ckpt.manifest.extra.get("weight_format", "dense")
    make = WEIGHT_FORMATS.get(name)
    if make is None:
        raise CheckpointError(f"{ckpt.path / MANIFEST_NAME}: weight_format {name!r} is not supported "
                              f"(expected one of {sorted(WEIGHT_FORMATS)})")
    try:
        return make(ckpt.manifest.extra, str(ckpt.path / MANIFEST_NAME))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def shared_twin(model: TPLlamaForCausalLM) -> TPLlamaForCausalLM:
    """A second model over the same weight tensors, frozen: its own modules (so LoRA adapters,
    train mode or activation checkpointing set on it leave `model` alone) but no second copy of
    the weights. Linear layers also share the weight methods under `model`'s (`method.base`:
    packed copies, the other big allocation, from `tprt.cpu.fast_linear.prepack`). The twin is
    built of the reference modules and stack: neither `model`'s native decode path nor its
    adapters are carried over."""
    with torch.device("meta"):
        twin = TPLlamaForCausalLM(model.config, model.layout, model.tp, dtype=model.dtype,
                                  method=model.weight_method)
    source = model.state_dict()  # detached tensors sharing storage with model's parameters
    twin.load_state_dict({name: source[name] for name in twin.state_dict()}, strict=True, assign=True)
    twin.requires_grad_(False)
    theirs = dict(model.named_modules())
    for name, module in twin.named_modules():
        if isinstance(module, ParallelLinear):
            source_layer = theirs[name]
            assert isinstance(source_layer, ParallelLinear)
            module.method = source_layer.method.base
    return twin.eval()


def _manifest_dtype(ckpt: TPCheckpoint) -> torch.dtype:
    dt = DTYPES.get(ckpt.manifest.dtype, (None, 0))[0]
    if dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise CheckpointError(f"{ckpt.path / MANIFEST_NAME}: dtype {ckpt.manifest.dtype!r} is not F32, BF16 or F16")
    assert dt is not None
    return dt


def _rank_state(
    model: nn.Module, files: RankFiles, path: Path, device: torch.device, one_block: bool = False,
) -> dict[str, torch.Tensor]:
    """Our parameter name -> a freshly allocated tensor holding this rank's values, in the dtype
    the parameter was created with (the model's for the dense format), filled by its layer's linear
    method where it has one. With `one_block` on CPU the tensors are views of one buffer on huge
    pages per dtype (`tprt.cpu.hugepages`): decode streams them faster."""
    state: dict[str, torch.Tensor] = {}
    params = model.state_dict(keep_vars=True)
    outs = _allocate([(tuple(p.shape), p.dtype) for p in params.values()], device, one_block)
    for (name, param), out in zip(params.items(), outs):
        pieces, row = [], 0
        for src_name in hf_sources(name):
            if src_name not in files.manifest.tensors:
                raise CheckpointError(f"{path / MANIFEST_NAME}: tensor {src_name!r} missing (needed for {name})")
            src = files.tensor(src_name)
            rows = src.shape[0]
            if tuple(src.shape[1:]) != tuple(param.shape[1:]) or row + rows > param.shape[0]:
                raise CheckpointError(
                    f"{path}: tensor {src_name!r} has rank-{files.rank} shape {list(src.shape)}; "
                    f"the model expects rows of shape {list(param.shape[1:])} filling {list(param.shape)} ({name})"
                )
            pieces.append(src)
            row += rows
        if row != param.shape[0]:
            raise CheckpointError(
                f"{path}: tensors {hf_sources(name)} give {row} rows on rank {files.rank}; "
                f"{name} needs {param.shape[0]}"
            )
        owner_name, _, local = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if isinstance(owner, ParallelLinear) and local != "bias":  # a bias is dense whatever the weight's format
            owner.method.load_weight(owner, local, out, pieces)  # casts and moves on the way
        else:
            copy_rows(out, pieces)
        state[name] = out
    return state


def _allocate(specs: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device,
              one_block: bool) -> list[torch.Tensor]:
    """Uninitialised tensors of these (shape, dtype)s; with `one_block` on CPU, carved from one
    huge-page buffer per dtype."""
    if not (one_block and device.type == "cpu"):
        return [torch.empty(shape, dtype=dt, device=device) for shape, dt in specs]
    outs: dict[int, torch.Tensor] = {}
    for dt in dict.fromkeys(dt for _, dt in specs):
        where = [i for i, (_, d) in enumerate(specs) if d == dt]
        outs.update(zip(where, huge_tensors([specs[i][0] for i in where], dt)))
    return [outs[i] for i in range(len(specs))]
