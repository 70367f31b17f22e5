"""Full fine-tuning with the training state sharded over the data-parallel ranks: torch's FSDP2
(`fully_shard` over the `dp` dimension of a [dp, tp] DeviceMesh) around our own TP layers.

Our TP layers hold plain tensors, each TP rank its own slice; FSDP2 shards each of those slices
over the DP ranks of its TP column (dim 0, as DTensors on the 1-D `dp` sub-mesh), all-gathers a
decoder block's slice right before the block runs (forward, and again in the backward), and
reduce-scatters its gradients (averaged over DP) right after. Parameters, gradients and AdamW's
moments therefore take 1/dp of their unsharded size on each rank.

- Mixed precision: the sharded parameters are float32 and are the optimizer's master weights;
  forward/backward run in the compute dtype (bf16 all-gathers), and gradients are
  reduce-scattered in float32 (summing bf16 gradients over ranks loses their low bits, as the
  previous DP all-reduce, which also summed in float32, avoided).
- Offload (`offload_optimizer="cpu"`): torch's CPUOffloadPolicy keeps the sharded float32
  parameters, their gradients and so AdamW's moments in host memory, and the update runs there.
- The TP part of gradient synchronisation (kv-row sums, replicated norms averaged) is elementwise,
  so it is done on each rank's DP shard after the reduce-scatter; the TP ranks of one DP rank hold
  the same rows of their slices. The global norm sums squares over DP shards and TP ranks
  (replicated values counted once) in one all-reduce over the world.

LoRA runs do not come here: their frozen base weights get no gradient or optimizer state, so
sharding them over DP would save only the bf16 base copy at the price of all-gathering every
layer twice a step, and the CPU path runs the base from oneDNN-packed full copies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from tprt.distributed.context import MESH_DIMS, TPContext
from tprt.errors import ConfigError
from tprt.model.llama import TPLlamaForCausalLM
from tprt.parallel.spec import TPSpec, get_spec, mark_tp_params
from tprt.train.grads import _all_reduce_flat, kv_group

OFFLOAD_CHOICES = ("none", "cpu")


class LossModel(nn.Module):
    """The model with `compute_loss` as its forward: FSDP2's root runs its hooks on `forward`, and
    the loss uses the final norm and LM head outside `TPLlamaForCausalLM.forward`."""

    def __init__(self, model: TPLlamaForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                per_sequence: bool = False) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """(loss sum, target tokens), or with `per_sequence` each row's summed log-probability
        of its targets (DPO, tprt.train.dpo)."""
        from tprt.train.step import compute_loss

        if per_sequence:
            from tprt.train.dpo import sequence_logps

            return sequence_logps(self.model, input_ids, labels)
        return compute_loss(self.model, input_ids, labels)


def make_mesh(ctx: TPContext) -> DeviceMesh:
    """The world as a [dp, tp] DeviceMesh, TP innermost as `init_distributed` lays it out; collective."""
    world, dims = dist.get_world_size(), ctx.dims
    if world != dims.world:
        raise ConfigError(f"world size {world} is not dp {dims.dp} x tp {dims.tp}")
    return init_device_mesh(ctx.device.type, dims.mesh_shape, mesh_dim_names=MESH_DIMS)


@dataclass
class ShardedModel:
    """A model wrapped by FSDP2 over the `dp` mesh, with the TP layout of each parameter by name."""

    root: LossModel
    ctx: TPContext
    dp_mesh: DeviceMesh
    specs: dict[str, TPSpec]  # parameter name (in `root.model`) -> TP layout

    @property
    def model(self) -> TPLlamaForCausalLM:
        return self.root.model

    def named_params(self) -> dict[str, nn.Parameter]:
        return dict(self.model.named_parameters())


def shard_model(model: TPLlamaForCausalLM, ctx: TPContext, mesh: DeviceMesh, compute_dtype: torch.dtype,
                offload_optimizer: str = "none") -> ShardedModel:
    """Wraps each decoder block, then the whole (embedding, final norm and LM head: tied weights
    stay in one unit), with `fully_shard` over mesh["dp"]. `model` must be float32 (the masters)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if offload_optimizer not in OFFLOAD_CHOICES:
        raise ConfigError(f"--offload-optimizer must be one of {', '.join(OFFLOAD_CHOICES)}, got {offload_optimizer!r}")
    mark_tp_params(model)
    specs = {name: get_spec(p) or TPSpec() for name, p in model.named_parameters()}
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    # Pinned host memory needs an accelerator; on a CPU-only machine the offload keeps its code path
    # (host-resident shards, the step on the host) with pageable memory.
    offload: OffloadPolicy = (CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
                              if offload_optimizer == "cpu" else OffloadPolicy())
    dp_mesh = mesh["dp"]
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, offload_policy=offload)
    root = LossModel(model)
    fully_shard(root, mesh=dp_mesh, mp_policy=mp, offload_policy=offload)
    return ShardedModel(root, ctx, dp_mesh, specs)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _row_offset(p: torch.Tensor, dp_rank: int) -> int:
    """First row of `p`'s full TP slice held by this DP rank (FSDP2 shards dim 0 in chunks of
    ceil(rows / dp))."""
    if not isinstance(p, DTensor):
        return 0
    rows, dp = p.shape[0], p.device_mesh.size()
    return min(rows, dp_rank * -(-rows // dp))


def _kv_local(spec: TPSpec, offset: int, n_rows: int) -> tuple[int, int] | None:
    """The kv rows of `spec` inside this shard, in shard coordinates (None when there are none)."""
    if spec.kv_rows is None or spec.kv_replication == 1:
        return None
    a, b = max(spec.kv_rows[0] - offset, 0), min(spec.kv_rows[1] - offset, n_rows)
    return (a, b) if a < b else None


def sync_tp_gradients(sm: ShardedModel) -> None:
    """After FSDP's reduce-scatter (the DP average): the TP part of `tprt.train.grads.sync_gradients`
    on each rank's shard. Collective over the TP group and the kv-head groups."""
    ctx = sm.ctx
    if ctx.world_size == 1:
        return
    kv: dict[int, list[torch.Tensor]] = {}
    partial: list[torch.Tensor] = []
    full: list[torch.Tensor] = []
    for name, p in sm.named_params().items():
        if p.grad is None:
            continue
        spec, g = sm.specs[name], local(p.grad)
        if spec.replicated:
            (partial if spec.partial_grad else full).append(g)
            continue
        rows = _kv_local(spec, _row_offset(p, ctx.dp_rank), g.shape[0])
        if rows is not None:
            kv.setdefault(spec.kv_replication, []).append(g[rows[0] : rows[1]])
    for rep in sorted(kv):
        _all_reduce_flat(kv[rep], kv_group(ctx, rep))
    _all_reduce_flat(partial, ctx.group)
    _all_reduce_flat(full, ctx.group, 1.0 / ctx.world_size)


def _sq(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, dtype=torch.float32).square()


def clip_sharded_grad_norm(sm: ShardedModel, max_norm: float) -> float:
    """Clips every gradient shard by the global norm of the unsharded model's gradient and returns
    that norm. Each value counted once: DP shards are disjoint, replicated TP values count on TP
    rank 0, kv rows on the first rank holding the head. One all-reduce over the world."""
    ctx = sm.ctx
    sq = torch.zeros((), dtype=torch.float32)
    grads: list[torch.Tensor] = []
    for name, p in sm.named_params().items():
        if p.grad is None:
            continue
        spec, g = sm.specs[name], local(p.grad)
        grads.append(g)
        if spec.replicated:
            if ctx.rank == 0:
                sq += _sq(g).cpu()
            continue
        rows = _kv_local(spec, _row_offset(p, ctx.dp_rank), g.shape[0])
        if rows is None or ctx.rank % spec.kv_replication == 0:
            sq += _sq(g).cpu()
        else:
            sq += (_sq(g[: rows[0]]) + _sq(g[rows[1] :])).cpu()
    total_sq = sq.to(ctx.device)
    dist.all_reduce(total_sq, op=dist.ReduceOp.SUM)
    total = total_sq.sqrt()
    coef = float((max_norm / (total + 1e-6)).clamp(max=1.0))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return float(total)


def full_state(sm: ShardedModel) -> dict[str, torch.Tensor]:
    """Name -> this TP rank's whole slice of every parameter (all-gathered over DP, float32);
    collective over the DP group. For the export (`tprt.train.export.write_tp_checkpoint`)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in sm.model.state_dict().items():
        out[name] = value.full_tensor() if isinstance(value, DTensor) else value
    return out


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state tensors held by this rank (the local shards of DTensors)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                t = local(value)
                total += t.numel() * t.element_size()
    return total


def state_dicts(sm: ShardedModel, optimizer: torch.optim.Optimizer) -> dict[str, Mapping[str, object]]:
    """{"model", "optim"}: sharded (DTensor) state keyed by parameter name, for torch.distributed.checkpoint."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(sm.root, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def load_state_dicts(sm: ShardedModel, optimizer: torch.optim.Optimizer, state: Mapping[str, Mapping[str, object]]) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(sm.root, optimizer, model_state_dict=dict(state["model"]),  # type: ignore[arg-type]
                   optim_state_dict=dict(state["optim"]))  # type: ignore[arg-type]
