"""Tensor-parallel layers: the only callers of `tprt.parallel.mappings`.

Weights are stored as in Hugging Face, [out, in], holding this rank's slice:

- ColumnParallelLinear: rows [out_local, in]; input copied to every rank, output stays split.
- RowParallelLinear: columns [out, in_local]; input already split, partial outputs all-reduced.
- VocabParallelEmbedding: vocabulary rows [vocab_local, hidden] of the padded vocabulary.
- VocabParallelLMHead: vocabulary rows [vocab_local, hidden]; logits of padding rows are -inf.

The linear layers and the LM head compute their product through one `LinearMethod` each
(`method`): `DENSE` (F.linear) as built, a CPU-packed one once `tprt.cpu.fast_linear.prepack`
chose it for the loaded weights. A LoRA adapter (tprt.lora) joins a linear layer as its
`adapter` submodule, attached and detached explicitly.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tprt.distributed.context import TPContext
from tprt.parallel.mappings import copy_to_region, gather_from_region, gather_to_first, reduce_from_region


class LinearMethod(Protocol):
    """How a linear layer computes x @ W^T from its weight W [out, in], chosen once the weights are
    loaded (`tprt.cpu.fast_linear.prepack` picks a faster one on CPU). It must give the same
    gradients as F.linear whenever autograd records the product."""

    def apply(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...


class DenseLinear:
    """F.linear on the weight itself: every layer's method until a faster one is chosen."""

    def apply(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


DENSE = DenseLinear()  # stateless: one instance serves every layer


def adapted(*linears: ColumnParallelLinear | RowParallelLinear) -> bool:
    """Whether an adapter acts on any of these layers in the coming forward call: any attached
    one, except a routed set (tprt.lora.routing.AdapterSet) none of whose members has rows routed to it."""
    for linear in linears:
        adapter = linear.adapter
        if adapter is not None and getattr(adapter, "applies", lambda: True)():
            return True
    return False


def _empty(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    # Allocated on the ambient device: build under `torch.device("meta")` and load with assign.
    return nn.Parameter(torch.empty(*shape, dtype=dtype))


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local^T, where W_local is this rank's block of output rows (no bias).

    The output stays split over the TP group; a fused layer's rows are whatever the loader put
    there (e.g. [q_r; k_r; v_r]), each part a whole block of this rank's features.
    """

    def __init__(self, in_features: int, local_out_features: int, ctx: TPContext, dtype: torch.dtype | None = None):
        super().__init__()
        self.tp = ctx
        self.weight = _empty(local_out_features, in_features, dtype=dtype)
        self.method: LinearMethod = DENSE
        # `adapter(x, y) -> y'` (LoRA, attached by tprt.lora): x as copied to this rank, y this rank's rows.
        self.adapter: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_region(x, self.tp)
        y = self.method.apply(x, self.weight)
        return y if self.adapter is None else self.adapter(x, y)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_local @ W_local^T, where W_local is this rank's block of input columns."""

    def __init__(self, local_in_features: int, out_features: int, ctx: TPContext, dtype: torch.dtype | None = None):
        super().__init__()
        self.tp = ctx
        self.weight = _empty(out_features, local_in_features, dtype=dtype)
        self.method: LinearMethod = DENSE
        # `adapter(x, y) -> y'` (LoRA, attached by tprt.lora) on this rank's split input and partial
        # output, so its own partial product joins the same all-reduce.
        self.adapter: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """All-reduces the partial products over the TP group."""
        y = self.method.apply(x, self.weight)
        if self.adapter is not None:
            y = self.adapter(x, y)
        return reduce_from_region(y, self.tp)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The all-reduce of `forward`, for a partial product computed elsewhere (tprt.cpu.native)."""
        return reduce_from_region(partial, self.tp)


class VocabParallelEmbedding(nn.Module):
    """Embedding of a vocabulary split by rows: each rank looks up the ids it holds, gives zeros
    for the others, and the all-reduce assembles every id's row from the one rank holding it."""

    def __init__(self, padded_vocab_size: int, hidden_size: int, ctx: TPContext, dtype: torch.dtype | None = None):
        super().__init__()
        if padded_vocab_size % ctx.world_size:
            raise ValueError(f"padded vocabulary {padded_vocab_size} does not split over TP={ctx.world_size}")
        self.tp = ctx
        self.local_vocab = padded_vocab_size // ctx.world_size
        self.vocab_start = ctx.rank * self.local_vocab
        self.weight = _empty(self.local_vocab, hidden_size, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[...] token ids -> [..., hidden]; all-reduces over the TP group."""
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)  # a fresh tensor; the backward needs only the ids
        return reduce_from_region(out, self.tp)


class VocabParallelLMHead(nn.Module):
    """Local logits over this rank's rows of the padded vocabulary; padding rows give -inf.

    When `tied`, the weight is the embedding's (same split, same rows) and owns no parameter here.
    """

    def __init__(
        self,
        hidden_size: int,
        padded_vocab_size: int,
        vocab_size: int,
        ctx: TPContext,
        tied: VocabParallelEmbedding | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.tp = ctx
        self.vocab_size = vocab_size
        self.local_vocab = padded_vocab_size // ctx.world_size
        self.vocab_start = ctx.rank * self.local_vocab
        # Columns of this rank's logits that are real tokens; the rest is padding.
        self.local_valid = max(0, min(self.local_vocab, vocab_size - self.vocab_start))
        self._tied = [tied] if tied is not None else []  # a list, so the embedding is not a submodule
        self.weight: nn.Parameter | None = None if tied else _empty(self.local_vocab, hidden_size, dtype=dtype)
        self.method: LinearMethod = DENSE

    def head_weight(self) -> torch.Tensor:
        if self._tied:
            return self._tied[0].weight
        assert self.weight is not None
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., local_vocab] logits of this rank's vocabulary rows."""
        logits = self.method.apply(copy_to_region(x, self.tp), self.head_weight())
        if self.local_valid < self.local_vocab:
            logits[..., self.local_valid :] = float("-inf")
        return logits

    def gather(self, local_logits: torch.Tensor) -> torch.Tensor:
        """[..., local_vocab] -> [..., vocab_size]: all-gathers over the TP group, drops padding."""
        return gather_from_region(local_logits, self.tp)[..., : self.vocab_size]

    def gather_to_first(self, local_logits: torch.Tensor) -> torch.Tensor | None:
        """[..., local_vocab] -> [..., vocab_size] on TP rank 0 only (padding dropped), None on the
        others: gathers to rank 0, the one that samples."""
        full = gather_to_first(local_logits, self.tp)
        return None if full is None else full[..., : self.vocab_size]

    def argmax(self, local_logits: torch.Tensor) -> torch.Tensor:
        """[..., local_vocab] -> [...] global token ids of the largest logit (the lowest id on a
        tie, like torch.argmax over the full vocabulary); all-gathers one (value, id) per rank."""
        idx = local_logits.max(dim=-1).indices  # [...]; the same ids as argmax, 4x faster in bf16 on CPU
        if self.tp.world_size == 1:
            return idx
        value = local_logits.gather(-1, idx.unsqueeze(-1)).to(torch.float64)  # [..., 1]
        gid = (idx + self.vocab_start).unsqueeze(-1).to(torch.float64)  # [..., 1], exact below 2**53
        pairs = gather_from_region(torch.cat((value, gid), dim=-1), self.tp)  # [..., 2 * tp]
        pairs = pairs.unflatten(-1, (self.tp.world_size, 2))  # [..., tp, 2]
        best = pairs[..., 0].argmax(dim=-1, keepdim=True)  # [..., 1]: first rank holding the max
        return pairs[..., 1].gather(-1, best).squeeze(-1).to(torch.long)
