"""The tensor-parallel Llama causal LM. Reads like the single-device model: the parallel layers
hide the TP (one all-reduce after attention, one after the MLP, one in the embedding).

Per rank: q heads [r * H/TP, (r+1) * H/TP); kv heads as the manifest places them (split, or with
TP > n_kv each rank holds kv head r // (TP / n_kv)). q/k/v and gate/up are fused per rank at load
time: qkv_proj rows are [q_r; k_r; v_r] and gate_up_proj rows [gate_r; up_r].

Every module here has one forward: the math. Other paths are chosen in the open, never through
a slot the forward consults: each linear layer's `LinearMethod` (tprt.parallel.layers: the weight
format, CPU-packed copies from `tprt.cpu.fast_linear.prepack`, LoRA from `tprt.lora`); for CPU
decode, subclasses of RMSNorm, Attention and DecoderLayer that run compiled kernels for one-row
steps (swapped in by `tprt.cpu.native_layers.install_native_layers`); and the decoder stack
(`stack`), the one object that runs the layers: `LayerStack` (the reference), `CheckpointedStack`
(training: activations recomputed in the backward) or the CPU native stack (every layer of a
decode step in one compiled call, `tprt.cpu.native_layers.NativeDecodeStack`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tprt.model.config import ModelConfig, TPLayout
from tprt.distributed.context import TPContext
from tprt.errors import ConfigError
from tprt.model.attention import AttentionStep
from tprt.model.kv_cache import KVCache
from tprt.parallel.layers import (DENSE, ColumnParallelLinear, LinearMethod, RowParallelLinear,
                                  VocabParallelEmbedding, VocabParallelLMHead, adapted)
from tprt.model.rope import apply_rope, apply_rope_, inv_frequencies, rope_angles


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 and scaled in the input dtype (as transformers)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op, same math
        # Normalised in float32 and rounded before the weight scales it, bit for bit as transformers
        # (passing the weight to the fused op would round once, after the scaling).
        return self.weight * F.rms_norm(x.to(torch.float32), self.weight.shape, None, self.eps).to(x.dtype)


class Step:
    """What every layer needs for one forward call, computed once: RoPE angles and, in inference
    over the paged cache, the step's attention (tprt.model.attention.AttentionStep)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionStep | None = None):
        self.cos = cos  # [batch, seq, 1, head_dim]
        self.sin = sin  # [batch, seq, 1, head_dim], first half negated (see rope_angles)
        self.attention = attention


class Attention(nn.Module):
    """GQA self-attention over this rank's heads; the o_proj all-reduce completes it."""

    def __init__(self, cfg: ModelConfig, layout: TPLayout, ctx: TPContext, layer: int, dtype: torch.dtype | None,
                 method: LinearMethod = DENSE):
        super().__init__()
        self.layer = layer
        self.n_heads = layout.local_heads
        self.n_kv = layout.local_kv_heads
        self.head_dim = cfg.head_dim
        self.gqa = self.n_heads != self.n_kv
        self.window = cfg.sliding_window
        qkv_rows = (self.n_heads + 2 * self.n_kv) * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, qkv_rows, ctx, dtype, method, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.n_heads * cfg.head_dim, cfg.hidden_size, ctx, dtype, method,
                                        bias=cfg.o_bias)
        # Qwen3: each head of q and k RMS-normalised before RoPE (one weight over head_dim, replicated).
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [batch, seq, hidden] -> [batch, seq, hidden]; all-reduces over the TP group. Over
        the paged cache a step's tokens come as x [tokens, 1, hidden]."""
        batch, seq, _ = x.shape
        nh, nkv = self.n_heads, self.n_kv
        qkv = self.qkv_proj(x).view(batch, seq, nh + 2 * nkv, self.head_dim)  # [batch, seq, nh + 2 nkv, head_dim]
        if self.q_norm is not None and self.k_norm is not None:  # new q and k tensors: rotated out of place
            q, k, v = qkv.split((nh, nkv, nkv), dim=2)
            q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, step.cos, step.sin), apply_rope(k, step.cos, step.sin)
        elif torch.is_grad_enabled():  # out of place, so the backward has no slice copies
            q, k, v = qkv.split((nh, nkv, nkv), dim=2)  # [batch, seq, heads, head_dim] each
            q, k = apply_rope(q, step.cos, step.sin), apply_rope(k, step.cos, step.sin)
        else:  # inference: q and k rotated in place, k/v stay views of the projection
            apply_rope_(qkv[:, :, : nh + nkv], step.cos, step.sin)
            q, k, v = qkv.split((nh, nkv, nkv), dim=2)
        if step.attention is None:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [batch, heads, seq, head_dim]
            if self.window is not None and seq > self.window:  # a band: causal, and the last `window` keys only
                i = torch.arange(seq, device=x.device)
                band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - self.window)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=self.gqa)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=seq > 1, enable_gqa=self.gqa)
            out = out.transpose(1, 2)
        else:  # the step's tokens: [tokens, heads, head_dim] each
            out = step.attention.attend(self.layer, q[:, 0], k[:, 0], v[:, 0]).to(x.dtype)
        return self.o_proj(out.reshape(batch, seq, nh * self.head_dim))


class MLP(nn.Module):
    """SwiGLU over this rank's slice of the intermediate features; down_proj all-reduces."""

    def __init__(self, cfg: ModelConfig, ctx: TPContext, dtype: torch.dtype | None, method: LinearMethod = DENSE):
        super().__init__()
        local = cfg.intermediate_size // ctx.world_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * local, ctx, dtype, method)
        self.down_proj = RowParallelLinear(local, cfg.hidden_size, ctx, dtype, method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [batch, seq, hidden] -> [batch, seq, hidden]; all-reduces over the TP group."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [batch, seq, intermediate / TP] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: TPLayout, ctx: TPContext, layer: int, dtype: torch.dtype | None,
                 method: LinearMethod = DENSE):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, layout, ctx, layer, dtype, method)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, ctx, dtype, method)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), step)
        return h + self.mlp(self.post_attention_layernorm(h))


class LayerStack:
    """The decoder stack: runs the layers one after another. The reference, and the base of the
    other stacks, which fall back to it for the steps they do not take. Not a module: it owns no
    parameters (the model's `layers` hold them, under their checkpoint names)."""

    def __call__(self, layers: nn.ModuleList, h: torch.Tensor, step: Step) -> torch.Tensor:
        """h [batch, seq, hidden] through every layer."""
        for layer in layers:
            h = layer(h, step)
        return h


class CheckpointedStack(LayerStack):
    """Training's stack: under autograd each layer keeps only its input and recomputes its
    activations in the backward (torch.utils.checkpoint, non-reentrant), repeating its
    collectives there in the same order on every rank."""

    def __call__(self, layers: nn.ModuleList, h: torch.Tensor, step: Step) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return super().__call__(layers, h, step)
        for layer in layers:
            h = checkpoint(layer, h, step, use_reentrant=False)
        return h


class TPLlamaForCausalLM(nn.Module):
    """This rank's shard of a Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3: the config's
    biases and q/k norms, tprt.model.config.ModelConfig); build on the meta device and load with
    `tprt.checkpoint.loading.load_model`. `method`: the weight format of the decoder's linear
    layers (their `LinearMethod` creates their parameters); the embedding and LM head are dense."""

    def __init__(self, cfg: ModelConfig, layout: TPLayout, ctx: TPContext, dtype: torch.dtype | None = None,
                 method: LinearMethod = DENSE):
        super().__init__()
        if layout.tp != ctx.world_size:
            raise ConfigError(f"the TP layout is for {layout.tp} ranks but the TP group has {ctx.world_size}")
        if cfg.intermediate_size % ctx.world_size:
            raise ConfigError(
                f"config.json: intermediate_size={cfg.intermediate_size} does not split over TP={ctx.world_size}"
            )
        self.config = cfg
        self.layout = layout
        self.tp = ctx
        self.embed_tokens = VocabParallelEmbedding(layout.padded_vocab_size, cfg.hidden_size, ctx, dtype)
        self.weight_method = method
        self.layers = nn.ModuleList(DecoderLayer(cfg, layout, ctx, i, dtype, method)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        tied = self.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = VocabParallelLMHead(cfg.hidden_size, layout.padded_vocab_size, cfg.vocab_size, ctx, tied, dtype)
        # Derived, never loaded: a plain float32 attribute on the real device even under meta.
        self.inv_freq = inv_frequencies(cfg, device=ctx.device)
        # What runs the layers: the reference until training or CPU decode swaps in another (module docstring).
        self.stack: LayerStack = LayerStack()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def has_adapters(self) -> bool:
        """True when an adapter (e.g. LoRA) acts on some layer in the coming forward call: any
        attached one, or a `tprt.lora.routing.AdapterSet` with rows routed to one of its members
        (`LinearMethod.adapts`)."""
        return adapted(*self.linears())

    def linears(self) -> list[ColumnParallelLinear | RowParallelLinear]:
        """Every decoder layer's projections (the layers adapters attach to), in layer order."""
        out: list[ColumnParallelLinear | RowParallelLinear] = []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            out += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        return out

    def default_cache_dtype(self) -> torch.dtype:
        """The model's dtype, except float32 for bf16/fp16 on CPU: CPU attention in reduced
        precision is 5-10x slower than in float32 (measured in docs/PERF.md), and a decode step
        of a small model spends more time there than the wider cache costs."""
        if self.tp.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16):
            return torch.float32
        return self.dtype

    def new_cache(self, n_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                  kv_scales: torch.Tensor | None = None) -> KVCache:
        """A zeroed paged KV cache of `n_blocks` blocks (block 0 is scratch) of `block_size`
        positions for this rank's kv heads (dtype: `default_cache_dtype()` when None). A quantized
        dtype (int8, FP8: tprt.model.kv_cache.QUANTIZED) stores that with scales and reads as
        `default_cache_dtype()`. kv_scales: static int8 scales, model-wide [layers, 2,
        num_key_value_heads] (tprt.model.kv_scales); this rank keeps its heads'."""
        heads = self.layout.kv_heads_of(self.tp.rank)
        fixed = None if kv_scales is None else kv_scales[:, :, heads.start : heads.stop]
        return KVCache(
            self.config.num_hidden_layers, n_blocks, self.layout.local_kv_heads, block_size,
            self.config.head_dim, dtype or self.default_cache_dtype(), self.tp.device, self.default_cache_dtype(),
            fixed, self.config.sliding_window,
        )

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                       attention: AttentionStep | None = None) -> torch.Tensor:
        """Hidden states before the final norm.

        Without `attention`: input_ids [batch, seq] -> [batch, seq, hidden], causal attention
        over the given tokens (positions [batch, seq] default to 0..seq-1). With it: a step over
        the paged KV cache (tprt.model.attention), input_ids [tokens] the step's flat tokens ->
        [tokens, hidden], each token attending to its row's positions up to its own.
        """
        # Index tensors built on the host (a caller's token ids, a test's) go where the weights
        # are; a no-op when they are there already.
        device = self.tp.device
        input_ids = input_ids.to(device, non_blocking=True)
        if attention is not None:
            if positions is not None:
                raise ValueError("positions come from the attention step")
            input_ids, positions = input_ids.reshape(-1, 1), attention.positions[:, None]  # [tokens, 1]
        elif positions is None:
            batch, seq = input_ids.shape
            positions = torch.arange(seq, device=device).expand(batch, seq)  # [batch, seq]
        else:
            positions = positions.to(device, non_blocking=True)
        h = self.embed_tokens(input_ids)  # [batch, seq, hidden]
        cos, sin = rope_angles(positions, self.inv_freq, h.dtype)
        h = self.stack(self.layers, h, Step(cos, sin, attention))
        return h if attention is None else h[:, 0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attention: AttentionStep | None = None) -> torch.Tensor:
        """This rank's logits over its vocabulary rows (padding rows -inf): [batch, seq,
        local_vocab] without `attention`; with it [n, local_vocab] for the step's tokens that
        return logits (`AttentionStep.logits_index`: a prompt chunk's last token, every token of
        a decode row), so a prefill builds no logits it does not need. `gather_logits` turns
        them into full-vocab logits."""
        h = self.forward_hidden(input_ids, positions, attention)
        if attention is not None and attention.logits_index is not None:
            h = h.index_select(0, attention.logits_index)  # [n, hidden]
        return self.logits(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states before the final norm [..., hidden] -> this rank's logits [..., local_vocab]."""
        return self.lm_head(self.norm(hidden))

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """[..., local_vocab] -> [..., vocab_size] on every rank (padding stripped); all-gathers."""
        return self.lm_head.gather(local_logits)

    def gather_logits_to_first(self, local_logits: torch.Tensor) -> torch.Tensor | None:
        """[..., local_vocab] -> [..., vocab_size] on TP rank 0, None on the other ranks; gathers."""
        return self.lm_head.gather_to_first(local_logits)

    def greedy(self, local_logits: torch.Tensor) -> torch.Tensor:
        """[..., local_vocab] -> [...] argmax token ids over the whole vocabulary, exchanging only
        each rank's best (value, id); all-gathers."""
        return self.lm_head.argmax(local_logits)
