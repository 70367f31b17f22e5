"""Shared test fixtures: tiny Hugging Face Llama checkpoints written by transformers itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Tiny configurations that together cover what the TP rules must handle.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # GQA: 8 query heads, 4 kv heads -> split at TP 1/2/4, replicated at TP 8
    "gqa": dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
                vocab_size=256, num_hidden_layers=2),
    # kv replication already at TP 4 and 8; vocab not a multiple of anything (padding); llama3 rope
    "rope_pad": dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2,
                     vocab_size=250, num_hidden_layers=2,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # tied embeddings, MHA, explicit head_dim different from hidden/heads
    "tied": dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=8,
                 head_dim=16, vocab_size=300, num_hidden_layers=2, tie_word_embeddings=True),
}


def make_hf_llama(path: Path, name: str = "gqa", dtype: torch.dtype = torch.float32, seed: int = 0,
                  max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Writes a randomly initialised LlamaForCausalLM with transformers' own save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs: dict[str, Any] = dict(max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    kwargs.update(TINY_CONFIGS[name])
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kwargs))
    with torch.no_grad():  # HF's init leaves norms at exactly 1.0; perturb so tests see them
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model = model.to(dtype)
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **save_kwargs)
    return path


# Llama-family architectures beyond Llama (tprt.model.config.ARCHITECTURES), each on a tiny config
# that hits its deltas: Qwen2's q/k/v biases with GQA and a large rope theta; Qwen3's q/k norms
# with an explicit head_dim that differs from hidden / heads (and o_proj/q/k/v biases through
# attention_bias), both tied; Mistral's sliding window.
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2", dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2,
                            vocab_size=256, num_hidden_layers=2, rope_theta=1000000.0, tie_word_embeddings=True,
                            use_sliding_window=False)),
    "qwen3": ("Qwen3", dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
                            head_dim=16, vocab_size=256, num_hidden_layers=2, attention_bias=True,
                            tie_word_embeddings=True, use_sliding_window=False)),
    # a sliding window of 6 positions, shorter than every prompt with its continuation
    "mistral": ("Mistral", dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2,
                                vocab_size=256, num_hidden_layers=2, sliding_window=6, tie_word_embeddings=False)),
    # Gemma: windowed, global, windowed layers (a window of 6), an explicit head_dim, a
    # query_pre_attn_scalar that is not head_dim; Gemma 2's soft-caps low enough to bend these
    # small scores and logits; Gemma 3's q/k norms, local rope base and linearly scaled global rope.
    "gemma2": ("Gemma2", dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2,
                              head_dim=16, vocab_size=256, num_hidden_layers=3, sliding_window=6,
                              query_pre_attn_scalar=24, attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
                              initializer_range=0.15)),
    "gemma3": ("Gemma3Text", dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
                                  head_dim=16, vocab_size=256, num_hidden_layers=3, sliding_window=6,
                                  sliding_window_pattern=2, query_pre_attn_scalar=32,
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                   "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 10000.0}})),
}


def make_hf_model(path: Path, family: str, dtype: torch.dtype = torch.float32, seed: int = 0,
                  **overrides: Any) -> Path:
    """Writes a randomly initialised model of FAMILY_CONFIGS[family] with transformers' own
    save_pretrained; biases and norms perturbed so the tests see them."""
    import transformers

    prefix, config = FAMILY_CONFIGS[family]
    kwargs: dict[str, Any] = dict(max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    kwargs.update(config)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model_class = getattr(transformers, f"{prefix.removesuffix('Text')}ForCausalLM")
    model = model_class(getattr(transformers, f"{prefix}Config")(**kwargs))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    return path


def force_native_decode(model: Any, stack: bool = True) -> list[int]:
    """Gives every decoder layer of `model` its fused one-row halves (tprt.cpu.native) whatever
    prepack's timing chose, and with `stack` the one-call decode of every layer on top
    (tprt.cpu.native_layers.install_native_stack); without, clears it (the per-half path).
    Returns counters [half calls, stack calls] that the wrapped kernels advance (zeros, and
    nothing changed, where the native kernels are unavailable)."""
    from tprt.cpu import native
    from tprt.cpu.native_layers import (attention_shape, install_native_stack, layer_extras, mlp_norm, native_norm,
                                        use_native_halves)
    from tprt.model.llama import LayerStack

    calls = [0, 0]

    def counted(fn: Any, i: int) -> Any:
        def run(*a: Any) -> Any:
            calls[i] += 1
            return fn(*a)
        return run

    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        a = native.attention_decode_kernel(layer.input_layernorm.weight, layer.input_layernorm.eps,
                                           attn.qkv_proj.weight, attn.o_proj.weight, attn.n_heads, attn.n_kv,
                                           layer_extras(layer), attention_shape(layer))
        norm = mlp_norm(layer)
        m = native.mlp_decode_kernel(norm.weight, norm.eps, mlp.gate_up_proj.weight, mlp.down_proj.weight,
                                     model.config.gemma_block)
        if a is not None and m is not None:
            use_native_halves(model, i, counted(a, 0), counted(m, 0))
            if model.config.gemma_block:  # the norms of the halves' outputs, as the stack computes them
                new = model.layers[i]
                new.post_attention_layernorm = native_norm(new.post_attention_layernorm)
                new.post_feedforward_layernorm = native_norm(new.post_feedforward_layernorm)
    model.stack = LayerStack()
    if stack and (native_stack := install_native_stack(model)) is not None:
        native_stack.kernel = counted(native_stack.kernel, 1)
    return calls


def rule_chain(limit: int) -> tuple[str, int]:
    """The longest chain of rules (`a: b`, `b: c`, ...) whose Lark text fits in `limit` bytes."""
    import itertools
    import string

    names = ("".join(t) for n in itertools.count(1) for t in itertools.product(string.ascii_lowercase, repeat=n))
    lines, prev = ["start: a"], next(names)
    size = len(lines[0]) + 1
    while True:
        line = f"{prev}: {(name := next(names))}"
        if size + len(line) + 1 + len(f'{name}: "x"\n') > limit:
            break
        lines.append(line)
        size, prev = size + len(line) + 1, name
    lines.append(f'{prev}: "x"')
    return "\n".join(lines) + "\n", len(lines)


def forward_rows(model: Any, cache: Any, rows: list[list[int]], starts: list[int], tables: Any,
                 backend: Any = None) -> list[torch.Tensor]:
    """One forward call over a TokenBatch of `rows` (row r's tokens at starts[r], starts[r] + 1,
    ..., through its block table `tables[r]`, a list or an int tensor row): each row's
    full-vocabulary logits [tokens, vocab], float32 (`backend`: an attention backend, the torch
    reference by default)."""
    from tprt.model.attention import TorchAttention
    from tprt.model.batch import BatchRow, TokenBatch

    table_rows = [tuple(int(b) for b in t) for t in tables]
    batch = TokenBatch.of([BatchRow(t, s, tuple(r), len(r)) for t, s, r in zip(table_rows, starts, rows)])
    step = (backend or TorchAttention()).prepare(batch, cache)
    local = model(torch.tensor(batch.tokens, device=cache.kv.device), attention=step)  # [tokens, local_vocab]
    full = model.gather_logits(local)[..., : model.config.vocab_size].float()
    return list(full.split([len(r) for r in rows]))


def chunk_rows(batch: Any) -> list[int]:
    """The rows of a TokenBatch that are prompt chunks of several tokens (fewer logits than tokens)."""
    return [r for r in range(batch.num_rows) if batch.logits[r] < batch.lens[r]]


def decode_rows(batch: Any) -> list[int]:
    """The rows of a TokenBatch that decode (logits for every token: a last token and any draft).
    A one-token chunk that ends its prompt looks the same; tests that use this avoid them."""
    return [r for r in range(batch.num_rows) if batch.logits[r] == batch.lens[r]]
