"""CPU decode through tprt's compiled kernels (`tprt.cpu.native`), as layers and a decoder stack
swapped into a model.

`install_native_layers(model)` replaces the model's reference modules (tprt.model.llama) with the
subclasses below, over the same parameters and submodules, and its stack with the native one.
Each runs its kernel only for the inference step it was written for and otherwise falls back to
the reference math:

- `NativeRMSNorm`: any call with autograd off, in one compiled call;
- `NativeAttention`: a step whose rows hold one token each, with autograd off over a float32 or
  int8 KV cache (`tprt.cpu.native.supports_cache`; int8 is quantized on write, read as int8 in
  the loop): RoPE, the cache write and q in float32 in one call, attention over the cache in
  another (the step's, tprt.cpu.native_attention under the native backend);
- `NativeGeGLUMLP` (Gemma): any call with autograd off, its tanh-gelu(gate) * up in one compiled call;
- `NativeDecoderLayer`: a step of one token with autograd off and no adapter acting on the half: each half
  (its norm included) in one call giving this rank's partial product, which the row-parallel
  layer all-reduces; the attention half also needs a float32 or int8 cache. A half gets its kernel only
  where `tprt.cpu.fast_linear.prepack` chose the native GEMV for both of its linears, so call
  this after `prepack`.
- `NativeDecodeStack` (the model's `stack`): where every layer has both halves' kernels,
  a step of 1 to 8 tokens over the paged cache (any rows: decode, verifying, short prompt
  chunks) with autograd off, a float32 or int8 cache and no adapter acting runs every layer in one compiled call,
  with the all-reduces between halves in C through the TP group's shared-memory all-reduce where
  TP > 1 (so not where the group has none: ranks on several hosts). One token gets the halves' bits.
  Other steps run the layers one by one.

Nothing is installed unless `tprt.cpu.fast_linear.supported(model)`, nor where the kernels are
unavailable (no C compiler, another dtype): the model then keeps the reference modules.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tprt.cpu import native
from tprt.cpu.fast_linear import one_row_native, supported
from tprt.model.llama import MLP, Attention, DecoderLayer, LayerStack, RMSNorm, Step, TPLlamaForCausalLM
from tprt.parallel.layers import adapted

Kernel = Callable[..., torch.Tensor]


class NativeRMSNorm(RMSNorm):
    """RMSNorm computed by `kernel` (tprt.cpu.native.rms_norm_kernel) whenever autograd is off."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype | None, unit_offset: bool, kernel: Kernel) -> None:
        super().__init__(size, eps, dtype, unit_offset)
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return super().forward(x)
        return self.kernel(x)


class NativeAttention(Attention):
    """Attention whose plain decode steps (every row one token) over a float32 or int8 cache run
    `rope_cache` (RoPE, the cache write and q in float32 in one call) and then attend through the
    step (`AttentionStep.attend_cached`: tprt's decode kernel under the native backend)."""

    def __init__(self, model: TPLlamaForCausalLM, layer: int, rope_cache: Kernel) -> None:
        super().__init__(model.config, model.layout, model.tp, layer, model.dtype)
        self.rope_cache = rope_cache

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        attention = step.attention
        if (torch.is_grad_enabled() or attention is None or not attention.single_tokens
                or not native.supports_cache(attention.cache)):
            return super().forward(x, step)
        tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(tokens, 1, self.n_heads + 2 * self.n_kv, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3, Gemma 3: each q and k head normalised first
            nh, nkv = self.n_heads, self.n_kv
            qkv[:, :, :nh] = self.q_norm(qkv[:, :, :nh])
            qkv[:, :, nh : nh + nkv] = self.k_norm(qkv[:, :, nh : nh + nkv])
        cos, sin = step.angles(self.window is not None)
        q32 = self.rope_cache(qkv, cos, sin, attention.cache, attention.token_rows, self.cache_layer)
        if self.query_scale != 1.0:  # Gemma's query_pre_attn_scalar, as the reference scales q
            q32 = q32 * self.query_scale
        out = attention.attend_cached(self.cache_layer, q32[:, :, 0], x.dtype)  # [tokens, nh, head_dim]
        return self.o_proj(out.reshape(tokens, 1, self.n_heads * self.head_dim))


class NativeGeGLUMLP(MLP):
    """Gemma's MLP whose inference calls run tanh-gelu(gate) * up in one compiled call
    (tprt.cpu.native.gelu_glu_kernel; torch's gelu in bf16 took twice as long, and the product
    another pass)."""

    def __init__(self, model: TPLlamaForCausalLM, kernel: Kernel) -> None:
        super().__init__(model.config, model.tp, model.dtype)
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return super().forward(x)
        return self.down_proj(self.kernel(self.gate_up_proj(x)))


class NativeDecoderLayer(DecoderLayer):
    """A decoder layer whose one-token steps run each half it has a kernel for in one call
    (tprt.cpu.native.attention_decode_kernel / mlp_decode_kernel), unless an adapter acts on it."""

    def __init__(self, model: TPLlamaForCausalLM, layer: int, attention_half: Kernel | None,
                 mlp_half: Kernel | None) -> None:
        super().__init__(model.config, model.layout, model.tp, layer, model.dtype)
        self.attention_half = attention_half
        self.mlp_half = mlp_half

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        attn, mlp, attention = self.self_attn, self.mlp, step.attention
        gemma = self.post_feedforward_layernorm is not None  # each half's output normalised before its add
        one_row = x.numel() == x.shape[-1] and not torch.is_grad_enabled()  # one token
        if (one_row and self.attention_half is not None and attention is not None
                and native.supports_cache(attention.cache) and not adapted(attn.qkv_proj, attn.o_proj)):
            cos, sin = step.angles(attn.window is not None)
            partial = self.attention_half(x, cos, sin, attention.cache, attention.token_rows, attn.cache_layer)
            out = attn.o_proj.reduce(partial)
            out = out if attn.o_proj.bias is None else out + attn.o_proj.bias
        else:
            out = attn(self.input_layernorm(x), step)
        h = x + (self.post_attention_layernorm(out) if gemma else out)
        if one_row and self.mlp_half is not None and not adapted(mlp.gate_up_proj, mlp.down_proj):
            out = mlp.down_proj.reduce(self.mlp_half(h))
        else:
            out = mlp(self.pre_feedforward_layernorm(h) if self.pre_feedforward_layernorm is not None
                      else self.post_attention_layernorm(h))
        return h + (self.post_feedforward_layernorm(out) if self.post_feedforward_layernorm is not None else out)


class NativeDecodeStack(LayerStack):
    """A decoder stack running `kernel` (tprt.cpu.native.decode_stack_kernel) for steps over the
    paged cache of up to `max_rows` tokens (STACK_MAX_ROWS; STACK_MAX_Q8_ROWS for an int8 model,
    whose batched products take any count) and the layers one by one for the others. Every token
    goes in as a one-token row with its row's block table at its own position
    (`AttentionStep.token_rows`): the kernel writes every token's keys and values in a layer (its
    heads section) before any token attends (the next section), so a row of several tokens (a
    prompt chunk, a last token and a draft) sees its own earlier tokens of this step, and each
    token attends to positions up to its own only."""

    def __init__(self, model: TPLlamaForCausalLM, kernel: Kernel, max_rows: int = native.STACK_MAX_ROWS) -> None:
        self.kernel = kernel
        self.max_rows = max_rows
        self.linears = model.linears()

    def __call__(self, layers: nn.ModuleList, h: torch.Tensor, step: Step) -> torch.Tensor:
        attention = step.attention
        if (attention is None or h.shape[0] > self.max_rows or h.shape[1] != 1 or torch.is_grad_enabled()
                or not native.supports_cache(attention.cache) or adapted(*self.linears)):
            return super().__call__(layers, h, step)
        return self.kernel(h, step.cos, step.sin, attention.cache, attention.token_rows, step.local)


def install_native_stack(model: TPLlamaForCausalLM) -> NativeDecodeStack | None:
    """Makes `model.stack` a NativeDecodeStack where every layer is a NativeDecoderLayer with
    both halves and the TP group (if any) all-reduces through shared memory; returns it, or None
    (the model then gets the reference `LayerStack`) where it does not apply."""
    model.stack = LayerStack()
    layers = list(model.layers)
    shm = model.tp.shm
    if not all((isinstance(layer, NativeDecoderLayer) and layer.attention_half is not None
                and layer.mlp_half is not None) or _int8_native(layer) for layer in layers) or (
            model.tp.world_size > 1 and shm is None):
        return None
    weights: list[tuple[torch.Tensor, ...]] = []
    scales: list[tuple[torch.Tensor | None, ...]] = []
    for layer in layers:
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        weights.append((layer.input_layernorm.weight, attn.qkv_proj.weight, attn.o_proj.weight,
                        mlp_norm(layer).weight, mlp.gate_up_proj.weight, mlp.down_proj.weight))
        s = [x.method.base.stack_scales(x) for x in linears]
        scales.append((None, s[0], s[1], None, s[2], s[3]))
    first = layers[0]
    assert isinstance(first, DecoderLayer)
    all_reduce = None
    if model.tp.world_size > 1:
        assert shm is not None
        all_reduce = (*shm.c_function(), shm.check)
    any_int8 = any(x is not None for layer_scales in scales for x in layer_scales)
    # Gemma: each layer's norms of its attention's and its MLP's outputs; None for other blocks
    sandwich: list[tuple[torch.Tensor, torch.Tensor]] | None = [
        (layer.post_attention_layernorm.weight, layer.post_feedforward_layernorm.weight)
        for layer in layers if isinstance(layer, DecoderLayer) and layer.post_feedforward_layernorm is not None] or None
    kernel = native.decode_stack_kernel(weights, first.input_layernorm.eps, first.self_attn.n_heads,
                                        first.self_attn.n_kv, all_reduce, scales if any_int8 else None,
                                        [layer_extras(layer) for layer in layers],
                                        [attention_shape(layer) for layer in layers], sandwich)
    if kernel is None:
        return None
    model.stack = stack = NativeDecodeStack(model, kernel, native.stack_max_rows(scales if any_int8 else None))
    return stack


def attention_shape(layer: nn.Module) -> native.AttentionShape:
    """A layer's departures from Llama's attention, as the kernels take them (its window, the
    scores' scale and soft-cap, Gemma's norms)."""
    assert isinstance(layer, DecoderLayer)
    attn = layer.self_attn
    scale = None if attn.query_scale == 1.0 else attn.query_scale * attn.head_dim ** -0.5
    return native.AttentionShape(attn.window, scale, attn.softcap, layer.post_feedforward_layernorm is not None)


def mlp_norm(layer: DecoderLayer) -> RMSNorm:
    """The norm of a layer's MLP input: Gemma's pre_feedforward_layernorm, Llama's post_attention_layernorm."""
    return layer.pre_feedforward_layernorm if layer.pre_feedforward_layernorm is not None \
        else layer.post_attention_layernorm


def layer_extras(layer: nn.Module) -> native.Extras:
    """A layer's deltas from Llama's block that the kernels take: (q/k/v bias, q norm, k norm,
    o bias), None where absent."""
    assert isinstance(layer, DecoderLayer)
    attn = layer.self_attn
    return (attn.qkv_proj.bias, None if attn.q_norm is None else attn.q_norm.weight,
            None if attn.k_norm is None else attn.k_norm.weight, attn.o_proj.bias)


def _int8_native(layer: nn.Module) -> bool:
    """A decoder layer whose four projections all hold compiled int8 products (tprt.cpu.quant_linear):
    the whole-stack kernel takes it without per-half kernels (it reads the int8 weights itself)."""
    return isinstance(layer, DecoderLayer) and all(
        x.method.base.stack_scales(x) is not None
        for x in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))


def _take_over(new: nn.Module, old: nn.Module) -> None:
    """Gives `new` (built on the meta device) `old`'s own parameters and submodules: the swap
    shares every tensor and each child's state (its linear method, any adapter it wraps)."""
    for name, param in old.named_parameters(recurse=False):
        setattr(new, name, param)
    for name, child in old.named_children():
        setattr(new, name, child)


def native_norm(norm: RMSNorm) -> RMSNorm:
    """`norm` as a NativeRMSNorm over the same weight (itself where the kernels are unavailable)."""
    kernel = native.rms_norm_kernel(norm.weight, norm.eps, norm.unit_offset)
    if kernel is None:
        return norm
    with torch.device("meta"):
        new = NativeRMSNorm(norm.weight.shape[0], norm.eps, norm.weight.dtype, norm.unit_offset, kernel)
    _take_over(new, norm)
    return new


def install_native_layers(model: TPLlamaForCausalLM) -> None:
    """Swaps the native modules above into `model` where their kernels are available (see the
    module docstring); a no-op unless `supported(model)`. Blocks that are not Llama's exactly
    (Qwen's biases and q/k norms, Mistral's windows, Gemma's norms, scaled queries, GeGLU,
    soft-capping and local angles) get the same: the kernels take the deltas (`layer_extras`,
    `attention_shape`). For inference: call after `prepack`."""
    if not supported(model):
        return
    gemma = model.config.gemma_block
    rope_cache = native.rope_cache_kernel(model.dtype)
    geglu = native.gelu_glu_kernel(model.dtype) if model.config.hidden_act == "gelu_pytorch_tanh" else None
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        layer.input_layernorm = native_norm(layer.input_layernorm)
        layer.post_attention_layernorm = native_norm(layer.post_attention_layernorm)
        if layer.pre_feedforward_layernorm is not None and layer.post_feedforward_layernorm is not None:  # Gemma
            layer.pre_feedforward_layernorm = native_norm(layer.pre_feedforward_layernorm)
            layer.post_feedforward_layernorm = native_norm(layer.post_feedforward_layernorm)
        if attn.q_norm is not None and attn.k_norm is not None:  # Qwen3, Gemma 3: over each head, in one call
            attn.q_norm, attn.k_norm = native_norm(attn.q_norm), native_norm(attn.k_norm)
        if rope_cache is not None:
            with torch.device("meta"):
                new_attn = NativeAttention(model, attn.layer, rope_cache)
            _take_over(new_attn, attn)
            layer.self_attn = new_attn
        if geglu is not None:
            with torch.device("meta"):
                new_mlp = NativeGeGLUMLP(model, geglu)
            _take_over(new_mlp, mlp)
            layer.mlp = new_mlp
        attention_half = mlp_half = None
        if one_row_native(attn.qkv_proj, attn.o_proj):
            norm = layer.input_layernorm
            attention_half = native.attention_decode_kernel(norm.weight, norm.eps, attn.qkv_proj.weight,
                                                            attn.o_proj.weight, attn.n_heads, attn.n_kv, layer_extras(layer),
                                                            attention_shape(layer))
        if one_row_native(mlp.gate_up_proj, mlp.down_proj):
            norm = mlp_norm(layer)
            mlp_half = native.mlp_decode_kernel(norm.weight, norm.eps, mlp.gate_up_proj.weight, mlp.down_proj.weight,
                                                gemma)
        if attention_half is not None or mlp_half is not None:
            use_native_halves(model, i, attention_half, mlp_half)
    model.norm = native_norm(model.norm)
    install_native_stack(model)


def use_native_halves(model: TPLlamaForCausalLM, index: int, attention_half: Kernel | None,
                      mlp_half: Kernel | None) -> NativeDecoderLayer:
    """Swaps decoder layer `index` of `model` for a NativeDecoderLayer running these halves
    (tprt.cpu.native.attention_decode_kernel / mlp_decode_kernel of that layer's weights) over
    the same submodules; returns it."""
    layer = model.layers[index]
    with torch.device("meta"):
        new = NativeDecoderLayer(model, index, attention_half, mlp_half)
    _take_over(new, layer)
    model.layers[index] = new
    return new
