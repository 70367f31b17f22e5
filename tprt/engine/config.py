"""The engine's settings (`EngineConfig`), what the runner takes of them (`RunnerConfig`), and
the sizes derived from them: the KV pool's blocks and the context per sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tprt.engine.runner import RunnerConfig
from tprt.engine.settings import DEFAULT_BLOCK_SIZE
from tprt.engine.speculative import SpeculativeConfig
from tprt.errors import ConfigError

DEFAULT_MAX_SEQ_LEN = 2048


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 16  # sequences admitted at once (prefilling or decoding)
    max_seq_len: int | None = None  # tokens per sequence (prompt + output); None: min(model's, 2048)
    token_budget: int = 2048  # tokens per step: every decode row's tokens plus prefill chunks
    seed: int | None = None  # base seed for sampled requests without their own seed
    cache_dtype: torch.dtype | None = None  # KV cache storage (int8, float8_e4m3fn: quantized); None: the model's
    # An int8 cache's static scales, model-wide [layers, 2, kv heads] (tprt.model.kv_scales); None:
    # a scale per head vector.
    kv_scales: torch.Tensor | None = None
    cpu_prepack: bool = True  # CPU bf16 weights: repack for oneDNN (faster decode, 2x weight memory)
    # Steps on static shapes, replayed from CUDA graphs (tprt.engine.step_graphs): off, decode
    # (one-token rows), all (verifying rows too), auto (all on CUDA, off elsewhere; elsewhere the
    # static steps run eagerly).
    cuda_graphs: str = "auto"
    # CPU: torch threads for steps of one row of a few tokens (None: leave the thread count alone).
    # The compiled kernels run on their own thread pool (tprt.cpu.native.set_threads), and torch's
    # threads would only add OpenMP fork/joins to the few small ops left (docs/PERF.md). Other
    # steps use the caller's thread count.
    one_row_threads: int | None = 1
    # Share the KV blocks of common prompt prefixes (tprt.engine.prefix_cache).
    prefix_cache: bool = True
    kv_cache_tokens: int | None = None  # KV positions in the pool; None: see gpu_memory_fraction
    kv_block_size: int = DEFAULT_BLOCK_SIZE  # positions per KV block
    # CUDA, without kv_cache_tokens: the pool takes this share of the device memory free after the
    # weights (the smallest over the TP ranks). Otherwise (and off CUDA) the pool holds
    # max_batch x max_seq_len positions, as many as one slot per sequence would.
    gpu_memory_fraction: float | None = None
    # Speculative decoding (tprt.engine.speculative): rank 0 drafts tokens for decoding rows and
    # verifies them in one step; None: off.
    speculative: SpeculativeConfig | None = None
    # Threads that compute constrained rows' masks while the forward pass runs, on cores it leaves
    # free (the launcher says how many: tprt.cpu.threads.spare_cores); 0: after the pass, only
    # where a mask changes the choice (tprt.engine.structured).
    mask_threads: int = 0
    # Attention over the paged cache (tprt.model.attention.ATTENTION_BACKENDS): auto picks tprt's
    # compiled CPU kernels where they run, else the torch reference.
    attention_backend: str = "auto"
    # Pipeline stages (tprt.engine.stage_runner): each step's rows in this many micro-batches
    # passed along the stages; None: up to 4 per stage while each holds 256 tokens or more.
    pipeline_microbatches: int | None = None
    # Steps launched before the oldest is collected (tprt.engine.core); None: one per stage (one
    # with speculative decoding).
    pipeline_steps_in_flight: int | None = None
    # Megatron's sequence parallelism in steps of at least this many tokens (prefill): between the
    # TP blocks each rank keeps 1/TP of the step's tokens (tprt.model.llama); 0: off.
    sequence_parallel_tokens: int = 0

    def runner(self) -> RunnerConfig:
        """What the runner takes of these settings."""
        return RunnerConfig(self.cache_dtype, self.kv_scales, self.cpu_prepack, self.one_row_threads,
                            self.attention_backend, self.cuda_graphs,
                            self.speculative.num_tokens if self.speculative is not None else 0,
                            self.sequence_parallel_tokens)


def kv_pool_blocks(config: EngineConfig, max_seq_len: int, free_memory_tokens: int | None = None) -> int:
    """Blocks in the KV pool (scratch included): enough for kv_cache_tokens (else for
    `free_memory_tokens`, else for max_batch x max_seq_len), which must hold one sequence of
    max_seq_len (so the oldest admitted sequence can always finish)."""
    if config.kv_block_size < 1:
        raise ConfigError(f"kv_block_size must be at least 1, got {config.kv_block_size}")
    tokens = config.kv_cache_tokens or free_memory_tokens or config.max_batch * max_seq_len
    if tokens < max_seq_len:
        raise ConfigError(f"kv_cache_tokens={tokens} cannot hold one sequence of max_seq_len={max_seq_len}")
    return -(-tokens // config.kv_block_size) + 1


def context_length(config: EngineConfig, model_max: int) -> int:
    """Tokens per sequence: the config's, within the model's max_position_embeddings (the
    config's other counts checked on the way)."""
    if config.one_row_threads is not None and config.one_row_threads < 1:
        raise ConfigError(f"one_row_threads must be at least 1 or None, got {config.one_row_threads}")
    for name in ("max_batch", "token_budget"):
        if getattr(config, name) < 1:
            raise ConfigError(f"{name} must be at least 1, got {getattr(config, name)}")
    if config.mask_threads < 0:
        raise ConfigError(f"mask_threads must be at least 0, got {config.mask_threads}")
    if config.max_seq_len is None:
        return min(model_max, DEFAULT_MAX_SEQ_LEN)
    if not 2 <= config.max_seq_len <= model_max:
        raise ConfigError(f"max_seq_len must be in [2, {model_max}] (the model's max_position_embeddings), "
                          f"got {config.max_seq_len}")
    return config.max_seq_len
