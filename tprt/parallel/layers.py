"""Tensor-parallel layers: the only callers of `tprt.parallel.mappings`.

Weights are stored as in Hugging Face, [out, in], holding this rank's slice:

- ColumnParallelLinear: rows [out_local, in]; input copied to every rank, output stays split.
- RowParallelLinear: columns [out, in_local]; input already split, partial outputs all-reduced.
- VocabParallelEmbedding: vocabulary rows [vocab_local, hidden] of the padded vocabulary.
- VocabParallelLMHead: vocabulary rows [vocab_local, hidden]; logits of padding rows are -inf.

The linear layers and the LM head own no weight logic: each holds one `LinearMethod` (`method`)
that creates the layer's parameters, fills them from this rank's checkpoint tensors, post-processes
them once loaded and computes the product. `DENSE` (F.linear) is every layer's method as built; the
CPU-packed one (`tprt.cpu.fast_linear.FastLinear`) and LoRA (`tprt.lora.method.LoRAMethod`, which
wraps another method) replace it in the open, never through a slot the forward consults.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from tprt.distributed.context import TPContext
from tprt.parallel.mappings import (copy_to_region, gather_from_region, gather_from_sequence, gather_to_first,
                                    reduce_from_region, reduce_scatter_to_sequence)


def copy_rows(dest: torch.Tensor, pieces: Sequence[torch.Tensor]) -> None:
    """Fills `dest` with `pieces` stacked along dim 0, casting on the way (the loader checked that
    they fill it exactly)."""
    row = 0
    for piece in pieces:
        dest[row : row + piece.shape[0]].copy_(piece)
        row += piece.shape[0]


class LinearMethod:
    """How a linear layer holds its weights and computes y = x @ W^T, as vLLM's linear methods do.

    The lifecycle, in order: `create_weights` registers the parameters the format needs on the
    layer (on the meta device at build time; their names are the checkpoint's); the loader calls
    `load_weight` for each of them with a fresh tensor of that parameter's shape and dtype and this
    rank's checkpoint tensors for it (`tprt.checkpoint.loading`); `process_after_loading` derives
    what the format computes from (packed copies, ...); `apply` computes the product. Any method
    must give F.linear's gradients whenever autograd records the product.

    A method that wraps another (LoRA: `tprt.lora.method`) sets `inner`; `base` is the innermost
    one, which owns the layer's weight.

    What a format can do is asked of its method, never found out with `isinstance` outside
    tprt/parallel and tprt/quant: `frozen`, `cpu_method` / `cpu_head_method` (its products on
    tprt's compiled CPU kernels), `one_row_native` and `stack_scales` (what a fused decode stack
    reads of it), `tunable`. A new format (int4, GPU kernels) answers them in its own class.
    """

    inner: LinearMethod | None = None
    name = "dense"  # the format's name, for messages
    frozen = False  # its weights are not trained (a quantized format): full fine-tuning and LoRA merges refuse
    tunable = False  # tprt.cpu.fast_linear times its one-row kernels per weight shape

    def cpu_method(self) -> LinearMethod | None:
        """This format's products on tprt's compiled CPU kernels (tprt.cpu.fast_linear.prepack
        gives a layer this method, then `process_after_loading`); None: the layer keeps this one."""
        return None

    def cpu_head_method(self) -> LinearMethod | None:
        """The LM head's method on the CPU kernels when the decoder's layers are in this format
        (None: the head keeps its dense weight and gets the dense format's `cpu_method`)."""
        return None

    @property
    def one_row_native(self) -> bool:
        """Whether one-row products run tprt's own GEMV on the layer's dense weight (what the
        fused one-row layer halves read, tprt.cpu.native_layers)."""
        return False

    def stack_scales(self, layer: ParallelLinear) -> torch.Tensor | None:
        """The per-group scales of int8 weights that the fused decode stack reads as stored
        (tprt.cpu.native.decode_stack_kernel); None: it does not read this format as stored."""
        return None

    def create_weights(self, layer: ParallelLinear, out_features: int, in_features: int,
                       dtype: torch.dtype | None) -> None:
        raise NotImplementedError

    def load_weight(self, layer: ParallelLinear, name: str, dest: torch.Tensor,
                    pieces: Sequence[torch.Tensor]) -> None:
        """Fills `dest` (allocated like the layer's parameter `name`) from this rank's checkpoint
        tensors for it, in row order (e.g. the q, k and v slices of a fused qkv_proj)."""
        copy_rows(dest, pieces)

    def process_after_loading(self, layer: ParallelLinear) -> None:
        """Called once the layer's parameters hold their values (and again whenever they change)."""

    def apply(self, layer: ParallelLinear, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def adapts(self) -> bool:
        """Whether an adapter adds to the product in the coming forward call (fused kernels that
        read the weight directly must then step aside)."""
        return False

    @property
    def base(self) -> LinearMethod:
        return self if self.inner is None else self.inner.base


class DenseLinear(LinearMethod):
    """The dense format: one parameter `weight` [out, in] in the model's dtype; F.linear on it."""

    def create_weights(self, layer: ParallelLinear, out_features: int, in_features: int,
                       dtype: torch.dtype | None) -> None:
        # Allocated on the ambient device: build under `torch.device("meta")` and load with assign.
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def apply(self, layer: ParallelLinear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight_matrix())

    def cpu_method(self) -> LinearMethod | None:
        from tprt.cpu.fast_linear import FastLinear  # packed copies and tprt's GEMVs, timed per shape

        return FastLinear()


DENSE = DenseLinear()  # stateless: one instance serves every layer

# The one registry of weight formats, by the name a checkpoint's manifest gives them
# (`extra["weight_format"]`; absent: "dense"): each builds the method the loader makes the
# decoder's linear layers with from the manifest's `extra` (a format's options, e.g. int8's group
# size), naming `where` (the manifest) in a ConfigError. A new format is a LinearMethod subclass
# registered here (tprt.quant registers int8 and fp8) plus one converter rule that writes its
# tensors (docs/DESIGN.md, "Adding a weight format").
WeightFormat = Callable[[Mapping[str, Any], str], LinearMethod]
WEIGHT_FORMATS: dict[str, WeightFormat] = {"dense": lambda extra, where: DENSE}


def set_base_method(layer: ParallelLinear, method: LinearMethod) -> None:
    """Gives `layer` the weight method `method` under whatever wraps its current one (a LoRA
    stays on top of a newly packed base)."""
    if layer.method.inner is None:
        layer.method = method
        return
    outer = layer.method
    while outer.inner is not None and outer.inner.inner is not None:
        outer = outer.inner
    outer.inner = method


def adapted(*linears: ParallelLinear) -> bool:
    """Whether an adapter acts on any of these layers in the coming forward call."""
    return any(linear.method.adapts() for linear in linears)


class ParallelLinear(nn.Module):
    """What the column-, row- and vocabulary-parallel products share: the TP context, a
    `LinearMethod` that owns the weights, and `adapter`, where a wrapping method (tprt.lora)
    registers its module so that its parameters are named `<layer>.adapter.*` (forward never
    reads it)."""

    def __init__(self, ctx: TPContext, method: LinearMethod) -> None:
        super().__init__()
        self.tp = ctx
        self.method = method
        self.adapter: nn.Module | None = None
        # Megatron's sequence parallelism (tprt.train.step.enable_sequence_parallel): the input
        # (column-parallel) is all-gathered along the sequence, the output (row-parallel) reduce-scattered.
        self.sequence_parallel = False

    def weight_matrix(self) -> torch.Tensor:
        """The dense [out, in] weight the product multiplies by."""
        return cast(torch.Tensor, self.weight)


class ColumnParallelLinear(ParallelLinear):
    """y_local = x @ W_local^T (+ b_local), where W_local is this rank's block of output rows and
    b_local the same rows of the bias, when the layer has one (Qwen2's q/k/v).

    The output stays split over the TP group; a fused layer's rows are whatever the loader put
    there (e.g. [q_r; k_r; v_r]), each part a whole block of this rank's features.
    """

    weight: nn.Parameter  # created by the method (the dense format's; another format adds its own)
    bias: nn.Parameter | None  # [local_out], always dense: a format quantizes the weight only

    def __init__(self, in_features: int, local_out_features: int, ctx: TPContext, dtype: torch.dtype | None = None,
                 method: LinearMethod = DENSE, bias: bool = False) -> None:
        super().__init__(ctx, method)
        method.create_weights(self, local_out_features, in_features, dtype)
        self.bias = nn.Parameter(torch.empty(local_out_features, dtype=dtype)) if bias else None
        # A trained dense weight's backward overlaps the input gradient's collective with the
        # weight gradient's product (tprt.parallel.overlap; tprt.train.step.enable_tp_comm_overlap).
        self.overlap_comm = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.overlap_comm and self.tp.world_size > 1 and isinstance(self.method, DenseLinear) \
                and self.weight.requires_grad and torch.is_grad_enabled():
            from tprt.parallel.overlap import column_parallel_dense

            return column_parallel_dense(x, self.weight, self.bias, self.tp, self.sequence_parallel)
        x = gather_from_sequence(x, self.tp) if self.sequence_parallel else copy_to_region(x, self.tp)
        y = self.method.apply(self, x)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(ParallelLinear):
    """y = sum over ranks of x_local @ W_local^T, where W_local is this rank's block of input columns.

    A wrapping method's own partial product (a LoRA's) joins the same all-reduce."""

    weight: nn.Parameter  # created by the method (the dense format's; another format adds its own)
    bias: nn.Parameter | None  # [out], replicated: added once, after the all-reduce

    def __init__(self, local_in_features: int, out_features: int, ctx: TPContext, dtype: torch.dtype | None = None,
                 method: LinearMethod = DENSE, bias: bool = False) -> None:
        super().__init__(ctx, method)
        method.create_weights(self, out_features, local_in_features, dtype)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """All-reduces the partial products over the TP group (then adds the bias); under
        sequence parallelism reduce-scatters them along the sequence instead."""
        y = self.reduce(self.method.apply(self, x))
        return y if self.bias is None else y + self.bias

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The all-reduce (or reduce-scatter) of `forward`, also for a partial product computed
        elsewhere (tprt.cpu.native)."""
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(partial, self.tp)
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
        # Allocated on the ambient device: build under `torch.device("meta")` and load with assign.
        self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden_size, dtype=dtype))
        self.sequence_parallel = False  # reduce-scatter the rows along the sequence instead

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[...] token ids -> [..., hidden]; all-reduces over the TP group."""
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)  # a fresh tensor; the backward needs only the ids
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.tp)
        return reduce_from_region(out, self.tp)


class VocabParallelLMHead(ParallelLinear):
    """Local logits over this rank's rows of the padded vocabulary (soft-capped where the model
    says); padding rows give -inf.

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
        softcap: float | None = None,
    ):
        super().__init__(ctx, DENSE)
        self.vocab_size = vocab_size
        self.softcap = softcap  # logits -> cap * tanh(logit / cap) (Gemma 2); None: as they come
        self.local_vocab = padded_vocab_size // ctx.world_size
        self.vocab_start = ctx.rank * self.local_vocab
        # Columns of this rank's logits that are real tokens; the rest is padding.
        self.local_valid = max(0, min(self.local_vocab, vocab_size - self.vocab_start))
        self._tied = [tied] if tied is not None else []  # a list, so the embedding is not a submodule
        self.weight: nn.Parameter | None = None
        if not tied:
            self.method.create_weights(self, self.local_vocab, hidden_size, dtype)

    def weight_matrix(self) -> torch.Tensor:
        if self._tied:
            return self._tied[0].weight
        assert self.weight is not None
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., local_vocab] logits of this rank's vocabulary rows."""
        logits = self.method.apply(self, copy_to_region(x, self.tp))
        if self.softcap is not None and torch.is_grad_enabled():
            logits = torch.tanh(logits / self.softcap) * self.softcap
        elif self.softcap is not None:  # in place: the logits are the step's largest tensor
            logits = logits.div_(self.softcap).tanh_().mul_(self.softcap)
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
