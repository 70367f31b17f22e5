"""Tensor-parallel LoRA modules: adapters on the fused, sharded projections that compute exactly
what Hugging Face PEFT computes on the unsharded model.

A LoRA on a weight W [out, in] adds `scale * B (A x)` with A [r, in], B [out, r], scale = alpha / r.

- **Column-parallel base** (q, k, v, gate, up; fused per rank as [q_r; k_r; v_r], [gate_r; up_r]):
  A is replicated, B holds this rank's rows of the target, and the delta is added to the target's
  rows of the fused output only (a q-only LoRA leaves k/v rows alone). The adapter reads the
  input after the base layer's copy-to-region, so the input gradient is summed by the base's own
  all-reduce; each rank's A gradient is then a share of the whole (only its rows of B
  contribute) and `sync_gradients` sums it over the TP group. B rows of a replicated kv head
  (TP > n_kv_heads) are summed over the ranks holding that head, like the base k/v rows.
- **Row-parallel base** (o, down): A holds this rank's input columns, B is replicated. The
  delta `scale * B (A_r x_r)` is added to the rank's partial output *before* the base's
  all-reduce, which sums the shares into `scale * B (A x)`: no extra collective. B's gradient is
  a share (x_r only) and is summed over the TP group by `sync_gradients`.

A module acts as `adapter(x, y) -> y'` on its base layer's product, wrapped around the layer's
linear method (tprt.lora.method); `tprt.lora.attach` builds, attaches and detaches them. With dropout > 0 the masks come from
each rank's RNG: seed the TP ranks alike for the column adapters' masks to agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Segment:
    """One target's rows [start, stop) in this rank's (fused) column-parallel output."""

    target: str
    start: int
    stop: int


class _LoRA(nn.Module):
    """Common state: per-target A and B (ParameterDicts keyed by short target name)."""

    def __init__(self, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.rank = rank
        self.alpha = alpha
        self.scale = alpha / rank
        self.dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()

    @property
    def targets(self) -> list[str]:
        return list(self.lora_A.keys())

    def applies(self) -> bool:
        """An attached module adds its delta to every call (tprt.lora.method.Adapter)."""
        return True

    def delta(self, target: str, x: torch.Tensor) -> torch.Tensor:
        """scale * B (A dropout(x)) for one target: [..., in] -> [..., rows of B]."""
        z = F.linear(self.dropout(x), self.lora_A[target])  # [..., rank]
        return F.linear(z, self.lora_B[target]) * self.scale


class ColumnLoRA(_LoRA):
    """LoRA on a column-parallel layer: A [rank, in] replicated, B [rows, rank] this rank's rows of
    its target; the delta goes to the target's rows of the fused output."""

    def __init__(self, rank: int, alpha: float, dropout: float, segments: Sequence[Segment]) -> None:
        super().__init__(rank, alpha, dropout)
        self.segments = {s.target: s for s in segments}

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x [..., in] as copied to this rank; y [..., local_out] the base output (updated in place
        when autograd is off)."""
        if not torch.is_grad_enabled():
            for t, seg in self.segments.items():
                y[..., seg.start : seg.stop] += self.delta(t, x)
            return y
        # Under autograd one out-of-place add of the concatenated deltas: in-place adds into row
        # slices would each cost a CopySlices and a zero-filled gradient of all of y.
        pieces, at = [], 0
        for t, seg in sorted(self.segments.items(), key=lambda item: item[1].start):
            if seg.start > at:
                pieces.append(y.new_zeros(*y.shape[:-1], seg.start - at))
            pieces.append(self.delta(t, x))
            at = seg.stop
        if at < y.shape[-1]:
            pieces.append(y.new_zeros(*y.shape[:-1], y.shape[-1] - at))
        return y + torch.cat(pieces, dim=-1)

    @torch.no_grad()
    def merge_into(self, weight: torch.Tensor) -> None:
        for t, seg in self.segments.items():
            w = weight[seg.start : seg.stop]
            w.copy_(w.float() + self.scale * (self.lora_B[t].float() @ self.lora_A[t].float()))


class RowLoRA(_LoRA):
    """LoRA on a row-parallel layer: A [rank, in_local] this rank's input columns, B [out, rank]
    replicated; the delta joins the rank's partial output before the base's all-reduce."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x [..., in_local]; y [..., out] this rank's partial base output (before the all-reduce)."""
        for t in self.lora_A:
            y = y + self.delta(t, x)
        return y

    @torch.no_grad()
    def merge_into(self, weight: torch.Tensor) -> None:
        for t in self.lora_A:
            weight.copy_(weight.float() + self.scale * (self.lora_B[t].float() @ self.lora_A[t].float()))


LoRAModule = ColumnLoRA | RowLoRA
