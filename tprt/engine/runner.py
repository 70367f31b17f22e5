"""Executes a `StepPlan` on one rank: identical on every rank of the TP group.

The runner owns this rank's model and KV cache. For each batch of the plan it runs one forward
call (prefill: right-padded chunks, logits of each row's last real token only; decode: each row's
tokens, one or several, with logits for every one of them, so a drafted token can be checked) and
returns either the full-vocabulary logits, gathered to TP rank 0 only (the rank that samples; the
others get None and never hold a vocabulary-wide tensor), or the argmax ids on every rank (which
exchange one (value, id) pair per position and rank).

The runner prepares the model for inference once, in the open: on CPU (`cpu_prepack`) the linear
layers get packed methods (`tprt.cpu.fast_linear.prepack`) and the compiled one-row decode
layers are swapped in (`tprt.cpu.native_layers.install_native_layers`). It holds the pool of
adapters served side by side (`adapters`, tprt.lora.routing) and routes each batch's rows through
it before the forward call.

Each row of a batch carries its block table (tprt.model.kv_cache); the runner pads the tables
into one [rows, blocks] tensor with the scratch block, where padding tokens write.

On CPU a step that decodes a single row runs its few torch ops on `one_row_threads` torch
threads (1 by default) while its GEMVs and fused layer halves stream the weights on the native
kernels' own pool (tprt.cpu.native.set_threads: every thread given); so does a single row of a
last token and a short draft (at most STACK_MAX_ROWS tokens: speculative decoding's batch-1
verification, whose torch ops are as small, and which more OpenMP threads spinning against the
native pool slowed several-fold on a busy machine); every other step runs on the caller's
thread count.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tprt.cpu.fast_linear import prepack
from tprt.cpu.native import STACK_MAX_ROWS
from tprt.cpu.native_layers import install_native_layers
from tprt.errors import ConfigError
from tprt.lora.routing import AdapterSlots
from tprt.model.kv_cache import SCRATCH_BLOCK, KVCache, kv_bytes_per_position
from tprt.model.llama import TPLlamaForCausalLM
from tprt.engine.plan import BatchPlan, StepPlan
from tprt.engine.static_decode import StaticDecode


@dataclass(frozen=True)
class BatchResult:
    """A batch's output, one row per position that returns one (prefill: each row's last token;
    decode: every token of every row, rows in order): `logits` [n, vocab] float32 when the plan
    asked for them (on TP rank 0; None on the others), else `ids` [n]."""

    ids: torch.Tensor | None
    logits: torch.Tensor | None


@dataclass(frozen=True)
class StepResult:
    prefill: BatchResult | None
    decode: BatchResult | None


class ModelRunner:
    """This rank's model and paged KV cache, driven by plans."""

    def __init__(self, model: TPLlamaForCausalLM, n_blocks: int, block_size: int, max_batch: int, max_seq_len: int,
                 cache_dtype: torch.dtype | None = None, cpu_prepack: bool = True,
                 static_decode: bool | None = None, one_row_threads: int | None = None,
                 kv_scales: torch.Tensor | None = None) -> None:
        self.model = model
        if cpu_prepack:  # no-ops off CPU: packed matmuls, then the compiled one-row decode layers
            prepack(model, one_row_threads=one_row_threads)
            install_native_layers(model)
        # The adapters served side by side (tprt.lora.routing); each batch's rows are routed to them.
        self.adapters = AdapterSlots(model)
        self.device = model.tp.device
        self.cache: KVCache = model.new_cache(n_blocks, block_size, cache_dtype, kv_scales)
        self._arange = torch.arange(max_seq_len, device=self.device)
        if static_decode is None:
            static_decode = self.device.type == "cuda"
        # Decode batches on static shapes (CUDA graphs on GPU); see tprt.engine.static_decode.
        self.static = StaticDecode(model, self.cache, max_batch, max_seq_len) if static_decode else None
        self.one_row_threads = one_row_threads if self.device.type == "cpu" else None

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Runs the plan's prefill and decode; collective over the TP group."""
        with self.threads_for(plan):
            prefill = self._prefill(plan.prefill) if plan.prefill is not None else None
            decode = self._decode(plan.decode) if plan.decode is not None else None
        return StepResult(prefill, decode)

    @contextmanager
    def threads_for(self, plan: StepPlan) -> Iterator[None]:
        """One-row decode steps on `one_row_threads`; the caller's thread count is restored after
        (setting it takes microseconds and keeps oneDNN's packed weights)."""
        threads = torch.get_num_threads()
        one_row = (plan.prefill is None and plan.decode is not None and plan.decode.rows == 1
                   and plan.decode.width <= STACK_MAX_ROWS)
        if not one_row or self.one_row_threads is None or self.one_row_threads >= threads:
            yield
            return
        torch.set_num_threads(self.one_row_threads)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def _route(self, batch: BatchPlan) -> None:
        """Tells the adapter pool which adapter each row of the batch uses."""
        if self.adapters.installed:
            self.adapters.route(batch.adapters, self.device)
        elif any(batch.adapters):
            raise RuntimeError("the plan routes rows to adapters but none is installed on this rank")

    def _tables(self, batch: BatchPlan) -> torch.Tensor:
        """The rows' block tables as one [rows, longest] int64 tensor, padded with the scratch block."""
        width = max(len(t) for t in batch.tables)
        rows = [list(t) + [SCRATCH_BLOCK] * (width - len(t)) for t in batch.tables]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _prefill(self, batch: BatchPlan) -> BatchResult:
        self._route(batch)
        width = batch.width
        rows = [list(t) + [0] * (width - len(t)) for t in batch.tokens]
        ids = torch.tensor(rows, dtype=torch.long, device=self.device)  # [rows, width]
        starts = torch.tensor(batch.starts, dtype=torch.long, device=self.device)
        positions = starts[:, None] + self._arange[:width]  # [rows, width]; padding continues the count
        last = torch.tensor([len(t) - 1 for t in batch.tokens], dtype=torch.long, device=self.device)
        local = self.model(ids, positions, self.cache, tables=self._tables(batch), kv_len=batch.kv_len,
                           logits_index=last, starts=batch.starts)  # [rows, local_vocab]
        return self._finish(local, batch.full_logits)

    def _decode(self, batch: BatchPlan) -> BatchResult:
        """Each row's tokens at positions start, start + 1, ...: logits (or ids) for every one of
        them, the rows' positions in order ([sum of the rows' token counts, ...])."""
        self._route(batch)
        width = batch.width
        if width == 1:
            # A CUDA graph replays the layers as captured: only when no adapter acts on these rows.
            if self.static is not None and not self.model.has_adapters():
                local = self.static.run([t[0] for t in batch.tokens], list(batch.starts), batch.tables)
                return self._finish(local, batch.full_logits)  # [rows, local_vocab]
            ids = torch.tensor(batch.tokens, dtype=torch.long, device=self.device)  # [rows, 1]
            positions = torch.tensor(batch.starts, dtype=torch.long, device=self.device)[:, None]  # [rows, 1]
            local = self.model(ids, positions, self.cache, tables=self._tables(batch),
                               kv_len=batch.kv_len)  # [rows, 1, local_vocab]
            return self._finish(local[:, 0], batch.full_logits)
        # Rows of several tokens (a last token and a draft): right-padded like a prefill chunk,
        # causal within each row; the padding's logits are dropped.
        ids = torch.tensor([list(t) + [0] * (width - len(t)) for t in batch.tokens], dtype=torch.long,
                           device=self.device)  # [rows, width]
        starts = torch.tensor(batch.starts, dtype=torch.long, device=self.device)
        positions = starts[:, None] + self._arange[:width]  # [rows, width]
        local = self.model(ids, positions, self.cache, tables=self._tables(batch), kv_len=batch.kv_len,
                           starts=batch.starts, decode=True)  # [rows, width, local_vocab]
        real = [r * width + j for r, t in enumerate(batch.tokens) for j in range(len(t))]
        local = local.reshape(-1, local.shape[-1])[torch.tensor(real, device=self.device)]
        return self._finish(local, batch.full_logits)

    def _finish(self, local: torch.Tensor, full: bool) -> BatchResult:
        """local [rows, local_vocab] -> float32 logits gathered to TP rank 0 (None elsewhere: only
        rank 0 samples), or argmax ids on every rank; collective."""
        if full:
            logits = self.model.gather_logits_to_first(local)
            return BatchResult(None, None if logits is None else logits.float())
        return BatchResult(self.model.greedy(local), None)


def free_memory_tokens(model: TPLlamaForCausalLM, fraction: float | None,
                       cache_dtype: torch.dtype | None = None, static_scales: bool = False) -> int | None:
    """With a gpu_memory_fraction on CUDA: the KV positions that fit in that share of the device
    memory free now (after the weights), the smallest over the TP ranks so every rank's pool is
    the same (collective: every rank sizes its pool with it). None otherwise."""
    tp = model.tp
    if fraction is None or tp.device.type != "cuda":
        return None
    if not 0 < fraction <= 1:
        raise ConfigError(f"gpu_memory_fraction must be in (0, 1], got {fraction}")
    cfg, dtype = model.config, cache_dtype or model.default_cache_dtype()
    per_head = kv_bytes_per_position(dtype, cfg.head_dim, static_scales)
    per_token = cfg.num_hidden_layers * 2 * model.layout.local_kv_heads * per_head
    free, _ = torch.cuda.mem_get_info(tp.device)
    tokens = torch.tensor([int(free * fraction) // per_token], device=tp.device)
    if tp.world_size > 1:
        torch.distributed.all_reduce(tokens, op=torch.distributed.ReduceOp.MIN, group=tp.group)
    return int(tokens)
