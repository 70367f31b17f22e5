"""The training loss of the TP model and the knobs of its forward/backward.

`compute_loss` scores next-token predictions with the vocab-parallel cross-entropy: each rank
keeps the logits of its vocabulary block and the full-vocabulary logits are never gathered.
Labels follow transformers' convention: aligned with `input_ids` (labels[:, t] is the token at
t, -100 where it is not a target), and the logits at position t are scored against labels[:, t + 1].
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tprt.distributed.context import TPContext
from tprt.model.llama import CheckpointedStack, DecoderLayer, LayerStack, TPLlamaForCausalLM
from tprt.parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from tprt.parallel.spec import TPSpec, set_spec


def compute_loss(
    model: TPLlamaForCausalLM,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the per-token cross-entropy, number of target tokens) of a batch.

    input_ids, labels [batch, seq]; positions [batch, seq] or None for 0..seq-1. The LM head runs
    only on positions whose next label is a target. `loss_sum / n_tokens` equals transformers'
    `LlamaForCausalLM(input_ids, labels=labels).loss`. loss_sum is a float32 scalar (identical on
    every TP rank), n_tokens an int64 scalar. Collective over the TP group (forward and backward).
    """
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels {list(labels.shape)} and input_ids {list(input_ids.shape)} differ in shape")
    h = model.forward_hidden(input_ids, positions)  # [batch, seq, hidden]
    target = labels[:, 1:].reshape(-1).to(h.device)  # [batch * (seq - 1)]
    keep = target != IGNORE_INDEX
    n_tokens = keep.sum()
    hidden = h[:, :-1].reshape(-1, h.shape[-1])[keep]  # [n_tokens, hidden]
    if hidden.shape[0] == 0:  # no target in the batch: a zero that still reaches every parameter
        return h.sum() * 0.0, n_tokens
    local_logits = model.lm_head(model.norm(hidden))  # [n_tokens, local_vocab]
    loss = vocab_parallel_cross_entropy(local_logits, target[keep], model.tp, vocab_size=model.config.vocab_size)
    return loss.sum(), n_tokens


def global_token_count(n_tokens: torch.Tensor, dp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`n_tokens` summed over the DP group (all-reduce; a copy of it without one)."""
    total = n_tokens.detach().clone()
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=dp_group)
    return total


def dp_loss(
    loss_sum: torch.Tensor, n_tokens: torch.Tensor, ctx: TPContext, dp_group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to call backward on, mean loss over the whole DP batch, detached).

    The first is `loss_sum * dp_size / global_tokens`: once `sync_gradients` averages the DP
    replicas' gradients, they are the gradient of the token mean over the whole batch (every
    token weighted alike, however unevenly the batch split). `dp_group` defaults to
    `ctx.dp_group`; all-reduces two scalars over it.
    """
    group = dp_group if dp_group is not None else ctx.dp_group
    dp_size = dist.get_world_size(group) if group is not None else 1
    total = global_token_count(n_tokens, group).clamp(min=1).to(loss_sum.dtype)
    mean = loss_sum.detach().clone()
    if group is not None and dp_size > 1:
        dist.all_reduce(mean, op=dist.ReduceOp.SUM, group=group)
    return loss_sum * dp_size / total, mean / total


def enable_sequence_parallel(model: TPLlamaForCausalLM, enabled: bool = True) -> None:
    """Megatron's sequence parallelism: outside the TP blocks (the norms, residual adds and the
    embedding's output) each TP rank keeps seq / TP of the positions. The embedding's and every
    row-parallel layer's all-reduce becomes a reduce-scatter along the sequence, every
    column-parallel layer's input an all-gather (and their conjugates in the backward), and the
    last hidden states are gathered whole for the LM head: the activations kept between blocks
    take 1 / TP of the memory for the same communication volume. A sequence that does not split
    over TP is padded at its end inside the forward. The decoder's norms (and o_proj's bias) then
    see a share of the positions: their gradients are summed over TP (`sync_gradients`).

    Applies to calls without an attention step (training, DPO, scoring); call before attaching
    LoRA or sharding over DP, which record the parameters' layouts."""
    model.sequence_parallel = enabled
    model.embed_tokens.sequence_parallel = enabled
    for linear in model.linears():
        linear.sequence_parallel = enabled
    for layer in model.decoder_layers:
        assert isinstance(layer, DecoderLayer)
        norms = [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                 layer.post_feedforward_layernorm]
        params = [n.weight for n in norms if n is not None]
        if layer.self_attn.o_proj.bias is not None:
            params.append(layer.self_attn.o_proj.bias)
        for p in params:  # a share of the positions each: summed over TP (plain replicated without)
            set_spec(p, TPSpec(replicated=True, partial_grad=enabled))


def enable_tp_comm_overlap(model: TPLlamaForCausalLM, enabled: bool = True) -> None:
    """Megatron's overlap of the TP backward's communication: every column-parallel layer whose
    dense weight trains computes its input's gradient first, launches its all-reduce (under
    sequence parallelism its reduce-scatter, and keeps only its chunk of the input) and computes
    the weight's gradient while it travels (tprt.parallel.overlap). LoRA's frozen base has no
    weight gradient to hide the collective behind: it keeps the plain path."""
    for layer in model.decoder_layers:
        assert isinstance(layer, DecoderLayer)
        layer.self_attn.qkv_proj.overlap_comm = enabled
        layer.mlp.gate_up_proj.overlap_comm = enabled


def enable_activation_checkpointing(model: TPLlamaForCausalLM, enabled: bool = True) -> None:
    """Recompute each decoder block's activations during the backward (torch.utils.checkpoint,
    non-reentrant) instead of keeping them: memory per block drops to its input. The recomputation
    repeats the block's collectives in the backward, in the same order on every rank: the model's
    stack becomes a `CheckpointedStack` (or the reference `LayerStack` again)."""
    model.stack = CheckpointedStack() if enabled else LayerStack()
