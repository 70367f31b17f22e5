"""The tensor-parallel Llama-family causal LM (Llama, Mistral, Qwen2/3, Gemma 2/3: the config's
deltas, tprt.model.config). Reads like the single-device model: the parallel layers hide the TP
(one all-reduce after attention, one after the MLP, one in the embedding).

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
from tprt.parallel.mappings import gather_sequence
from tprt.model.sdpa import attention_math


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 and scaled in the input dtype (as transformers);
    `unit_offset` (Gemma): scaled by 1 + weight, all in float32, rounded once at the end."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unit_offset:
            scale = 1.0 + self.weight.float()
            return F.rms_norm(x.to(torch.float32), self.weight.shape, scale, self.eps).to(x.dtype)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op, same math
        # Normalised in float32 and rounded before the weight scales it, bit for bit as transformers
        # (passing the weight to the fused op would round once, after the scaling).
        return self.weight * F.rms_norm(x.to(torch.float32), self.weight.shape, None, self.eps).to(x.dtype)


class Step:
    """What every layer needs for one forward call, computed once: RoPE angles (and the windowed
    layers' own, where their rope base differs: Gemma 3) and, in inference over the paged cache,
    the step's attention (tprt.model.attention.AttentionStep)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionStep | None = None,
                 local: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.cos = cos  # [batch, seq, 1, head_dim]
        self.sin = sin  # [batch, seq, 1, head_dim], first half negated (see rope_angles)
        self.attention = attention
        self.local = local  # (cos, sin) of the windowed layers; None: theirs are cos and sin

    def angles(self, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of a layer: its own where it is windowed (`local`) and has some."""
        return self.local if local and self.local is not None else (self.cos, self.sin)


class Attention(nn.Module):
    """GQA self-attention over this rank's heads; the o_proj all-reduce completes it."""

    def __init__(self, cfg: ModelConfig, layout: TPLayout, ctx: TPContext, layer: int, dtype: torch.dtype | None,
                 method: LinearMethod = DENSE):
        super().__init__()
        self.layer = layer
        self.cache_layer = layer  # its index in the KV cache (a pipeline stage's cache holds its layers only)
        self.n_heads = layout.local_heads
        self.n_kv = layout.local_kv_heads
        self.head_dim = cfg.head_dim
        self.gqa = self.n_heads != self.n_kv
        self.window = cfg.window_of(layer)
        self.softcap = cfg.attn_logit_softcapping
        self.query_scale = cfg.query_scale  # query_pre_attn_scalar's scaling, made through the queries (Gemma)
        qkv_rows = (self.n_heads + 2 * self.n_kv) * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, qkv_rows, ctx, dtype, method, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.n_heads * cfg.head_dim, cfg.hidden_size, ctx, dtype, method,
                                        bias=cfg.o_bias)
        # Qwen3, Gemma 3: each head of q and k RMS-normalised before RoPE (one weight over head_dim, replicated).
        offset = cfg.gemma_block
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, offset) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [batch, seq, hidden] -> [batch, seq, hidden]; all-reduces over the TP group. Over
        the paged cache a step's tokens come as x [tokens, 1, hidden]. Under sequence
        parallelism x and the output hold this rank's seq / TP positions; q, k, v all of them."""
        nh, nkv = self.n_heads, self.n_kv
        qkv = self.qkv_proj(x)
        batch, seq = qkv.shape[:2]
        qkv = qkv.view(batch, seq, nh + 2 * nkv, self.head_dim)  # [batch, seq, nh + 2 nkv, head_dim]
        cos, sin = step.angles(self.window is not None)
        if self.q_norm is not None and self.k_norm is not None:  # new q and k tensors: rotated out of place
            q, k, v = qkv.split((nh, nkv, nkv), dim=2)
            q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        elif torch.is_grad_enabled():  # out of place, so the backward has no slice copies
            q, k, v = qkv.split((nh, nkv, nkv), dim=2)  # [batch, seq, heads, head_dim] each
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # inference: q and k rotated in place, k/v stay views of the projection
            apply_rope_(qkv[:, :, : nh + nkv], cos, sin)
            q, k, v = qkv.split((nh, nkv, nkv), dim=2)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        if step.attention is None:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [batch, heads, seq, head_dim]
            if self.window is not None and seq > self.window:  # a band: causal, and the last `window` keys only
                i = torch.arange(seq, device=x.device)
                band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - self.window)
                out = attention_math(q, k, v, band, gqa=self.gqa, softcap=self.softcap)
            else:
                out = attention_math(q, k, v, causal=seq > 1, gqa=self.gqa, softcap=self.softcap)
            out = out.transpose(1, 2)
        else:  # the step's tokens: [tokens, heads, head_dim] each ([1, tokens] under sequence parallelism)
            n = step.attention.tokens  # a sequence-parallel step's padding (if any) is left out
            q, k, v = q.flatten(0, 1)[:n], k.flatten(0, 1)[:n], v.flatten(0, 1)[:n]
            out = step.attention.attend(self.cache_layer, q, k, v).to(x.dtype)
            if n < batch * seq:
                out = F.pad(out, (0, 0, 0, 0, 0, batch * seq - n))
        return self.o_proj(out.reshape(batch, seq, nh * self.head_dim))


class MLP(nn.Module):
    """SwiGLU (GeGLU for Gemma) over this rank's slice of the intermediate features; down_proj all-reduces."""

    def __init__(self, cfg: ModelConfig, ctx: TPContext, dtype: torch.dtype | None, method: LinearMethod = DENSE):
        super().__init__()
        local = cfg.intermediate_size // ctx.world_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * local, ctx, dtype, method)
        self.down_proj = RowParallelLinear(local, cfg.hidden_size, ctx, dtype, method)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [batch, seq, hidden] -> [batch, seq, hidden]; all-reduces over the TP group."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [batch, seq, intermediate / TP] each
        return self.down_proj((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: TPLayout, ctx: TPContext, layer: int, dtype: torch.dtype | None,
                 method: LinearMethod = DENSE):
        super().__init__()
        offset = cfg.gemma_block
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, offset)
        self.self_attn = Attention(cfg, layout, ctx, layer, dtype, method)
        # Llama's norm of the MLP's input; Gemma's of the attention's output, the MLP's input having its own.
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, offset)
        self.mlp = MLP(cfg, ctx, dtype, method)
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if cfg.gemma_block:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, offset)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        if self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None:  # Gemma
            h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), step))
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        h = x + self.self_attn(self.input_layernorm(x), step)
        return h + self.mlp(self.post_attention_layernorm(h))


def decoder_linears(layers: nn.ModuleList) -> list[ColumnParallelLinear | RowParallelLinear]:
    """The projections of `layers` (DecoderLayers), in layer order: qkv, o, gate_up, down."""
    out: list[ColumnParallelLinear | RowParallelLinear] = []
    for layer in layers:
        assert isinstance(layer, DecoderLayer)
        out += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return out


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
    """This rank's shard of a Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3:
    the config's deltas, tprt.model.config.ModelConfig); build on the meta device and load with
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
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.gemma_block)
        tied = self.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = VocabParallelLMHead(cfg.hidden_size, layout.padded_vocab_size, cfg.vocab_size, ctx, tied, dtype,
                                           softcap=cfg.final_logit_softcapping)
        # Derived, never loaded: plain float32 attributes on the real device even under meta.
        self.inv_freq = inv_frequencies(cfg, device=ctx.device)
        self.local_inv_freq = None if cfg.local_rope_theta is None else inv_frequencies(cfg, ctx.device, local=True)
        # What runs the layers: the reference until training or CPU decode swaps in another (module docstring).
        self.stack: LayerStack = LayerStack()
        # Megatron's sequence parallelism for calls without an attention step (training, scoring):
        # between the TP blocks each rank keeps seq / TP positions (tprt.train.step.enable_sequence_parallel).
        self.sequence_parallel = False
        # And for inference steps over the paged cache of at least this many tokens (prefill; 0:
        # never): the step's tokens split over the TP ranks between the blocks the same way.
        self.sequence_parallel_tokens = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def has_adapters(self) -> bool:
        """True when an adapter (e.g. LoRA) acts on some layer in the coming forward call: any
        attached one, or a `tprt.lora.routing.AdapterSet` with rows routed to one of its members
        (`LinearMethod.adapts`)."""
        return adapted(*self.linears())

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The decoder layers this rank runs, in order (a pipeline stage's are a slice)."""
        return self.layers

    @property
    def held_layers(self) -> range:
        """The indices of the decoder layers this rank holds (its KV cache's layers, in order)."""
        return range(self.config.num_hidden_layers)

    def linears(self) -> list[ColumnParallelLinear | RowParallelLinear]:
        """Every decoder layer's projections (the layers adapters attach to), in layer order."""
        return decoder_linears(self.decoder_layers)

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
        heads, layers = self.layout.kv_heads_of(self.tp.rank), self.held_layers
        fixed = None if kv_scales is None else kv_scales[layers.start : layers.stop, :, heads.start : heads.stop]
        return KVCache(
            len(layers), n_blocks, self.layout.local_kv_heads, block_size,
            self.config.head_dim, dtype or self.default_cache_dtype(), self.tp.device, self.default_cache_dtype(),
            fixed, self.config.windows[layers.start : layers.stop], self.config.attn_logit_softcapping,
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
        if attention is not None and self._split_step(attention):
            return self._sequence_parallel_step(input_ids, attention)
        if attention is not None:
            if positions is not None:
                raise ValueError("positions come from the attention step")
            input_ids, positions = input_ids.reshape(-1, 1), attention.positions[:, None]  # [tokens, 1]
        elif positions is None:
            batch, seq = input_ids.shape
            positions = torch.arange(seq, device=device).expand(batch, seq)  # [batch, seq]
        else:
            positions = positions.to(device, non_blocking=True)
        split = self.sequence_parallel and attention is None and self.tp.world_size > 1
        seq = input_ids.shape[1]
        if split and seq % self.tp.world_size:  # padded at the end: causal attention keeps it out of the rest
            pad = self.tp.world_size - seq % self.tp.world_size
            input_ids, positions = F.pad(input_ids, (0, pad)), F.pad(positions, (0, pad))
        h = self._embed(input_ids)  # [batch, seq, hidden] (seq / TP of it under sequence parallelism)
        h = self._run_layers(h, positions, attention)
        if split:
            return gather_sequence(h, self.tp)[:, :seq]
        return h if attention is None else h[:, 0]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding's hidden states; Gemma's scaled by sqrt(hidden), rounded to the dtype
        first (as transformers)."""
        h = self.embed_tokens(input_ids)
        if self.config.gemma_block:
            h = h * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype).item()
        return h

    def _run_layers(self, h: torch.Tensor, positions: torch.Tensor, attention: AttentionStep | None) -> torch.Tensor:
        """h through this rank's decoder layers, their RoPE angles at `positions` computed once."""
        cos, sin = rope_angles(positions, self.inv_freq, h.dtype)
        local = None if self.local_inv_freq is None else rope_angles(positions, self.local_inv_freq, h.dtype)
        return self.stack(self.decoder_layers, h, Step(cos, sin, attention, local))

    def _split_step(self, attention: AttentionStep) -> bool:
        """Whether this step over the paged cache runs sequence-parallel: an eager step (not a
        static one replayed from a graph) of prompt tokens or several-token rows, of at least
        `sequence_parallel_tokens` tokens. The same on every rank (the same batch)."""
        return (0 < self.sequence_parallel_tokens <= attention.tokens and self.tp.world_size > 1
                and attention.batch is not None and not attention.single_tokens
                and not self.has_adapters())  # (adapters route the step's tokens unsplit)

    def _sequence_parallel_step(self, input_ids: torch.Tensor, attention: AttentionStep) -> torch.Tensor:
        """A step's tokens as one sequence [1, tokens], padded to split over TP, through the
        layers with Megatron's sequence parallelism (each rank normalises and adds residuals for
        1/TP of the tokens; attention and the KV cache see every token, the padding left out):
        the step's hidden states [tokens, hidden], gathered whole."""
        n, tp = attention.tokens, self.tp.world_size
        pad = -n % tp
        ids = F.pad(input_ids.reshape(1, -1), (0, pad))
        positions = F.pad(attention.positions[None, :], (0, pad))
        split = [self.embed_tokens, *self.linears()]
        before = [module.sequence_parallel for module in split]
        for module in split:
            module.sequence_parallel = True
        try:
            h = self._run_layers(self._embed(ids), positions, attention)  # [1, (tokens + pad) / TP, hidden]
        finally:
            for module, was in zip(split, before):
                module.sequence_parallel = was
        return gather_sequence(h, self.tp)[0, :n]

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
