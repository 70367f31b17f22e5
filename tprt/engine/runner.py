"""Executes a step's `TokenBatch` on one rank: identical on every rank of the TP group.

The runner owns this rank's model, its KV cache and its attention backend
(tprt.model.attention: tprt's compiled kernels on CPU where they run, else the torch
reference). Every step is one forward call over the batch's flat tokens, whatever its rows are
(prompt chunks, plain decode rows, verifying rows of a last token and a draft): the backend
builds the step's attention once, every layer uses it, and the LM head runs only on the tokens
that return logits. It returns either their full-vocabulary logits, gathered to TP rank 0 only
(the rank that samples; the others get None and never hold a vocabulary-wide tensor), or their
argmax ids on every rank (which exchange one (value, id) pair per token and rank).

The runner prepares the model for inference once, in the open: on CPU (`cpu_prepack`) the linear
layers get packed methods (`tprt.cpu.fast_linear.prepack`) and the compiled decode layers are
swapped in (`tprt.cpu.native_layers.install_native_layers`). It holds the pool of adapters
served side by side (`adapters`, tprt.lora.routing) and routes each token through its row's.
On CUDA, steps of decode and verifying rows (with their adapters) replay CUDA graphs keyed by
their token count (tprt.engine.step_graphs, `cuda_graphs`); the LM head and sampling follow.

On CPU a step of one row of at most STACK_MAX_ROWS tokens (batch-1 decode, its verification)
runs its few torch ops on `one_row_threads` torch threads (1 by default) while its GEMVs and
fused layers stream the weights on the native kernels' own pool (tprt.cpu.native.set_threads:
every thread given): more OpenMP threads spinning against the native pool slowed such steps
several-fold on a busy machine. Every other step runs on the caller's thread count.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tprt.cpu.fast_linear import prepack
from tprt.cpu.native import STACK_MAX_ROWS
from tprt.cpu.native_layers import install_native_layers
from tprt.distributed.context import TPContext, log0
from tprt.distributed.protocol import Tag, receive_header, receive_step
from tprt.errors import ConfigError
from tprt.lora.routing import AdapterSlots
from tprt.model.attention import backend as attention_backend
from tprt.model.batch import TokenBatch
from tprt.model.kv_cache import KVCache, kv_bytes_per_position
from tprt.model.llama import TPLlamaForCausalLM
from tprt.engine.graph_buckets import GRAPH_MODES, graph_max_tokens, graph_widths
from tprt.engine.step_graphs import StepGraphs

if TYPE_CHECKING:
    from tprt.engine.config import EngineConfig


@dataclass(frozen=True)
class StepResult:
    """The step's tokens that return logits (`TokenBatch.logits_indices`, rows in order): `logits`
    [n, vocab] float32 when the batch asked for them (on TP rank 0; None on the others), else
    `ids` [n]; both None when no token returns logits."""

    ids: torch.Tensor | None
    logits: torch.Tensor | None


@dataclass(frozen=True)
class RunnerConfig:
    """How a runner prepares its model and cache (tprt.engine.config.EngineConfig has the why of each)."""

    cache_dtype: torch.dtype | None = None  # KV storage; None: the model's default_cache_dtype
    kv_scales: torch.Tensor | None = None  # an int8 cache's static scales
    cpu_prepack: bool = True  # CPU: packed weights and the compiled decode layers
    one_row_threads: int | None = None  # CPU: torch threads for one-row steps of a few tokens
    attention: str = "auto"  # the attention backend (tprt.model.attention.backend)
    # Steps on static shapes (tprt.engine.step_graphs.GRAPH_MODES): auto is all on CUDA, off
    # elsewhere; elsewhere decode and all run the static steps eagerly (how the tests check them).
    cuda_graphs: str = "auto"
    max_draft: int = 0  # drafted tokens per verifying row at most (its graphs' row width is 1 + this)
    sequence_parallel_tokens: int = 0  # steps of at least this many tokens run sequence-parallel; 0: none


class ModelRunner:
    """This rank's model and paged KV cache, driven by token batches."""

    def __init__(self, model: TPLlamaForCausalLM, n_blocks: int, block_size: int, max_batch: int, max_seq_len: int,
                 config: RunnerConfig = RunnerConfig()) -> None:
        self.model = model
        model.sequence_parallel_tokens = config.sequence_parallel_tokens
        if config.cpu_prepack:  # no-ops off CPU: packed matmuls, then the compiled decode layers
            prepack(model, one_row_threads=config.one_row_threads)
            install_native_layers(model)
        # The adapters served side by side (tprt.lora.routing); each batch's tokens are routed to them.
        self.adapters = AdapterSlots(model)
        self.device = model.tp.device
        self.cache: KVCache = model.new_cache(n_blocks, block_size, config.cache_dtype, config.kv_scales)
        self.attention = attention_backend(config.attention, self.device, self.cache)
        log0(model.tp, "attention: the %s backend (--attention-backend %s)", self.attention.name, config.attention)
        if self.device.type == "cuda" and self.attention.name == "torch":
            log0(model.tp, "attention: the torch reference gathers each row's KV blocks every layer; install Triton "
                 "for the paged kernels (--attention-backend triton)", level=logging.WARNING)
        self.graphs = self._graphs(config, max_batch, max_seq_len)
        self.one_row_threads = config.one_row_threads if self.device.type == "cpu" else None

    def _graphs(self, config: RunnerConfig, max_batch: int, max_seq_len: int) -> StepGraphs | None:
        """The static steps `config.cuda_graphs` asks for (tprt.engine.step_graphs), said at start-up."""
        mode = config.cuda_graphs
        if mode not in GRAPH_MODES:
            raise ConfigError(f"cuda_graphs must be one of {', '.join(GRAPH_MODES)}, got {mode!r}")
        if mode == "auto":
            mode = "all" if self.device.type == "cuda" else "off"
        if mode == "off":
            return None
        width = graph_widths(mode, config.max_draft)
        graphs = StepGraphs(self.model, self.cache, self.attention, self.adapters, graph_max_tokens(max_batch, width),
                            width, max_seq_len)
        log0(self.model.tp, "CUDA graphs (--cuda-graphs %s): steps of up to %d tokens in rows of up to %d, mixing "
             "up to %d adapters, %s", config.cuda_graphs, graphs.max_tokens, graphs.max_width, graphs.adapter_buckets[-1],
             "captured per bucket on first use" if graphs.use_graphs else "run eagerly on static buffers (no CUDA)")
        return graphs

    @torch.inference_mode()
    def execute(self, batch: TokenBatch) -> StepResult:
        """Runs the batch's one forward call; collective over the TP group."""
        with self.threads_for(batch):
            key = self.graphs.key_for(batch) if self.graphs is not None else None
            hidden = self.graphs.run(batch, key) if self.graphs is not None and key is not None else None
            if hidden is not None:  # the decoder stack replayed; the LM head on the tokens that return logits
                if not batch.num_logits:
                    return StepResult(None, None)
                if batch.num_logits != batch.num_tokens:
                    hidden = hidden.index_select(0, torch.tensor(batch.logits_indices, device=self.device))
                return self._finish(self.model.logits(hidden), batch.full_logits)
            self._route(batch)
            ids = torch.tensor(batch.tokens, dtype=torch.long, device=self.device)  # [tokens]
            step = self.attention.prepare(batch, self.cache)
            if not batch.num_logits:  # prompt chunks that do not end their prompt
                self.model.forward_hidden(ids, attention=step)
                return StepResult(None, None)
            return self._finish(self.model(ids, attention=step), batch.full_logits)  # [logits, local_vocab]

    def follow(self, tp: TPContext) -> Tag:
        """On TP ranks other than 0: executes rank 0's batches (and waits through its keepalives)
        until it sends anything else; returns that message's tag: EXIT after the engine's
        `close()`, or COMMAND (tprt.distributed.ranks.follower_loop receives and runs it)."""
        while True:
            header = receive_header(tp)
            if header.tag is Tag.STEP:
                self.execute(TokenBatch.decode_from(receive_step(header, tp)))
            elif header.tag is not Tag.KEEPALIVE:
                return header.tag

    @contextmanager
    def threads_for(self, batch: TokenBatch) -> Iterator[None]:
        """One-row steps of a few tokens on `one_row_threads`; the caller's thread count is
        restored after (setting it takes microseconds and keeps oneDNN's packed weights)."""
        threads = torch.get_num_threads()
        one_row = batch.num_rows == 1 and batch.num_tokens <= STACK_MAX_ROWS
        if not one_row or self.one_row_threads is None or self.one_row_threads >= threads:
            yield
            return
        torch.set_num_threads(self.one_row_threads)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def _route(self, batch: TokenBatch) -> None:
        """Tells the adapter pool which adapter each token of the batch uses."""
        if self.adapters.installed:
            self.adapters.route(batch.token_adapters(), self.device)
        elif batch.adapters and any(batch.adapters):
            raise RuntimeError("the batch routes rows to adapters but none is installed on this rank")

    def _finish(self, local: torch.Tensor, full: bool) -> StepResult:
        """local [n, local_vocab] -> float32 logits gathered to TP rank 0 (None elsewhere: only
        rank 0 samples), or argmax ids on every rank; collective."""
        if full:
            logits = self.model.gather_logits_to_first(local)
            return StepResult(None, None if logits is None else logits.float())
        return StepResult(self.model.greedy(local), None)


def free_memory_tokens(model: TPLlamaForCausalLM, config: EngineConfig, ranks: TPContext | None = None) -> int | None:
    """With a gpu_memory_fraction on CUDA and no kv_cache_tokens: the KV positions that fit in
    that share of the device memory free now (after the weights), the smallest over `ranks` (the
    TP group by default; a pipeline's every rank) so every rank's pool is the same (collective:
    every rank sizes its pool with it). None otherwise."""
    tp, fraction = ranks or model.tp, config.gpu_memory_fraction
    if config.kv_cache_tokens is not None or fraction is None or tp.device.type != "cuda":
        return None
    if not 0 < fraction <= 1:
        raise ConfigError(f"gpu_memory_fraction must be in (0, 1], got {fraction}")
    cfg, dtype = model.config, config.cache_dtype or model.default_cache_dtype()
    per_head = kv_bytes_per_position(dtype, cfg.head_dim, config.kv_scales is not None)
    per_token = len(model.held_layers) * 2 * model.layout.local_kv_heads * per_head
    free, _ = torch.cuda.mem_get_info(tp.device)
    tokens = torch.tensor([int(free * fraction) // per_token], device=tp.device)
    if tp.world_size > 1:
        torch.distributed.all_reduce(tokens, op=torch.distributed.ReduceOp.MIN, group=tp.group)
    return int(tokens)

