"""Settings the commands share, each defining its own flags once: the KV cache and the
scheduler as `tprt serve` takes them (its ServeConfig nests them; `EngineConfig` is what the
engine is built with). Torch-free, so building a parser imports no torch."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tprt.engine.graph_buckets import GRAPH_MODES
from tprt.errors import ConfigError

DEFAULT_BLOCK_SIZE = 16  # positions per KV block
KV_CACHE_DTYPE_HELP = ("KV cache storage: auto (the model dtype; float32 for bf16 on CPU), bf16, fp32, int8 or fp8 "
                       "(e4m3); int8/fp8 keep a scale per head and token and hold about 2x the tokens of bf16")


def add_kv_cache_flags(group: Any, default: str | None = "auto", help_dtype: str = KV_CACHE_DTYPE_HELP) -> None:
    """--kv-cache-dtype and --kv-scales (tprt generate, tprt serve, tprt score)."""
    group.add_argument("--kv-cache-dtype", default=default, metavar="{auto,bf16,fp32,int8,fp8}", help=help_dtype)
    group.add_argument("--kv-scales", type=Path, metavar="FILE",
                       help="static int8 KV scales from `tprt calibrate-kv` (implies --kv-cache-dtype int8): nothing "
                            "stored per token, exactly 2x the tokens of bf16")


ATTENTION_BACKEND_NAMES = ("auto", "torch", "native", "triton")  # tprt.model.attention.ATTENTION_BACKENDS


def add_attention_flag(group: Any) -> None:
    """--attention-backend (tprt generate, tprt score, tprt serve)."""
    group.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKEND_NAMES,
                       help="how attention reads the paged KV cache: auto (Triton's paged kernels on CUDA, tprt's "
                            "compiled kernels on a CPU, else torch; the choice is logged at start-up), triton, "
                            "native (CPU), torch (the reference: gathers each row's blocks)")


def add_graphs_flag(group: Any) -> None:
    """--cuda-graphs (tprt generate, tprt serve)."""
    group.add_argument("--cuda-graphs", default="auto", choices=GRAPH_MODES,
                       help="replay steps from CUDA graphs captured per bucket of tokens: all (decode and "
                            "verifying rows, with their adapters; auto on CUDA), decode (one-token rows only), off "
                            "(auto elsewhere). Steps with prompt chunks, or wider than 512 tokens, run eagerly")


SEQUENCE_PARALLEL_TOKENS = 256  # --sequence-parallel without a count: steps of at least this many tokens


def add_sequence_parallel_flag(group: Any) -> None:
    """--sequence-parallel [N] (tprt generate, tprt serve)."""
    group.add_argument("--sequence-parallel", type=int, nargs="?", const=SEQUENCE_PARALLEL_TOKENS, default=0,
                       metavar="N",
                       help="Megatron's sequence parallelism in prefill: steps of at least N tokens (default "
                            f"{SEQUENCE_PARALLEL_TOKENS}) keep 1/TP of their tokens per rank between the TP blocks "
                            "(reduce-scatter and all-gather instead of all-reduce); the same outputs. Off by default")


@dataclass(frozen=True)
class CacheSettings:
    """The paged KV cache: its storage, its pool and prefix sharing."""

    dtype: str = "auto"  # --kv-cache-dtype (tprt.model.kv_cache.KV_CACHE_DTYPES)
    scales: Path | None = None  # --kv-scales: static int8 scales (tprt.model.kv_scales); implies int8
    tokens: int | None = None  # --kv-cache-tokens: positions per rank; None: see gpu_memory_fraction
    block_size: int = DEFAULT_BLOCK_SIZE  # --kv-block-size
    gpu_memory_fraction: float | None = None  # --gpu-memory-fraction (CUDA): the pool's share of free memory
    prefix_cache: bool = True  # --no-prefix-cache turns sharing of prompt prefixes off
    attention: str = "auto"  # --attention-backend: how attention reads the cache (tprt.model.attention)

    FLAGS = ("kv_cache_dtype", "kv_scales", "kv_cache_tokens", "kv_block_size", "gpu_memory_fraction", "prefix_cache",
             "attention_backend")

    @staticmethod
    def add_flags(group: Any) -> None:
        group.add_argument("--kv-cache-tokens", type=int, metavar="N",
                           help="KV cache positions per rank, shared by all sequences in blocks (default: on CUDA "
                                "--gpu-memory-fraction of the free memory, else max batch size x max seq len)")
        group.add_argument("--kv-block-size", type=int, default=DEFAULT_BLOCK_SIZE, metavar="N",
                           help=f"positions per KV cache block ({DEFAULT_BLOCK_SIZE})")
        add_kv_cache_flags(group)
        add_attention_flag(group)
        group.add_argument("--gpu-memory-fraction", type=float, metavar="F",
                           help="CUDA: share of the device memory free after the weights that the KV cache takes (0.9)")
        group.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                           help="prefill every prompt in full (default: a prompt starting with whole KV blocks another "
                                "sequence holds or left cached, e.g. a shared system prompt or an earlier turn, "
                                "shares them)")

    def check(self) -> None:
        """One-line ConfigErrors naming the flag (the dtype and scales: tprt.model.kv_scales.kv_cache_flags)."""
        _at_least_one(("--kv-cache-tokens", self.tokens), ("--kv-block-size", self.block_size))
        if self.gpu_memory_fraction is not None and not 0 < self.gpu_memory_fraction <= 1:
            raise ConfigError(f"--gpu-memory-fraction must be in (0, 1], got {self.gpu_memory_fraction}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CacheSettings:
        return cls(args.kv_cache_dtype, args.kv_scales, args.kv_cache_tokens, args.kv_block_size,
                   args.gpu_memory_fraction, args.prefix_cache, args.attention_backend)


@dataclass(frozen=True)
class SchedulerSettings:
    """How many sequences run at once, how long each may be, and how many tokens a step takes."""

    max_batch_size: int | None = None  # --max-batch-size; None: the device's default
    max_seq_len: int | None = None  # --max-seq-len; None: min(the model's, 2048)
    token_budget: int = 2048  # --token-budget
    cuda_graphs: str = "auto"  # --cuda-graphs (tprt.engine.step_graphs)
    sequence_parallel: int = 0  # --sequence-parallel: steps of at least this many tokens split; 0: off

    FLAGS = ("max_batch_size", "max_seq_len", "token_budget", "cuda_graphs", "sequence_parallel")

    @staticmethod
    def add_flags(group: Any) -> None:
        group.add_argument("--max-batch-size", type=int, metavar="N",
                           help="running sequences at once (default: 256 on a GPU, 16 on CPU)")
        group.add_argument("--max-seq-len", type=int, metavar="N", help="tokens per request (default: min(model's, 2048))")
        group.add_argument("--token-budget", type=int, default=2048, metavar="N", help="tokens per engine step (2048)")
        add_graphs_flag(group)
        add_sequence_parallel_flag(group)

    def check(self) -> None:
        """One-line ConfigErrors naming the flag (max_seq_len against the model: the engine)."""
        _at_least_one(("--max-batch-size", self.max_batch_size), ("--token-budget", self.token_budget))
        check_sequence_parallel(self.sequence_parallel)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SchedulerSettings:
        return cls(args.max_batch_size, args.max_seq_len, args.token_budget, args.cuda_graphs, args.sequence_parallel)


def check_sequence_parallel(tokens: int) -> None:
    if tokens < 0:
        raise ConfigError(f"--sequence-parallel takes a number of tokens of at least 1 (0: off), got {tokens}")


def _at_least_one(*flags: tuple[str, int | None]) -> None:
    for flag, value in flags:
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
