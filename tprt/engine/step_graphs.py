"""Steps on static shapes, replayed from CUDA graphs on GPU, one graph per bucket of tokens.

A decode step of a small batch costs the GPU less than launching its kernels from Python does.
With static shapes the whole decoder stack (every layer, its all-reduces, the adapters' deltas) is
captured once per key and replayed with one launch; the final norm, the LM head on the tokens
that return logits, and sampling run after it, eagerly (so no graph holds a vocabulary-wide
output, and grammar masks never enter one). A key (`GraphKey`) is:

- `tokens`: the step's token count rounded up to a bucket (1, 2, 4, 8, then multiples of 16);
- `width`: 1 for plain decode rows, else the longest row a graph takes (1 + the drafted tokens
  of a verifying row); `--cuda-graphs decode` takes one-token rows only, `all` verifying rows and
  rows as short too (a short prompt's chunk);
- `adapters`: 0, or the count of adapters the step mixes rounded up to 1, 2, 4
  (tprt.lora.routing.AdapterSlots.route_static: each token's delta through a one-hot of its
  group, so one graph serves any routing of that many adapters);
- `kv_len`: for backends that attend over a fixed key count (the torch reference), the smallest
  bucket (256, 512, ... max_seq_len) holding every row's positions; 0 for the Triton kernel,
  which reads each row's length on the device.

Inputs live in fixed device buffers (`StaticInputs`), filled by two host-to-device copies before
each replay. Padding tokens form one-token rows at position 0 whose tables are all scratch block
(they write only there, which no sequence reads); row slots past those are empty (length 0).

Every rank runs the same batches, so every rank captures the same keys in the same order (a
capture records the collectives too). Graphs with adapters are dropped when the installed set
changes (the staged buffers are reallocated then). Off CUDA the same static steps run eagerly
in place of replays: how the tests check the bookkeeping, buffers and padding on the CPU
(and tests/test_scale_sim.py the key buckets, on the meta device).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tprt.engine.graph_buckets import MAX_GRAPH_ADAPTERS, adapter_buckets, kv_buckets, token_buckets
from tprt.lora.routing import BASE, AdapterSlots
from tprt.model.attention import AttentionBackend, StaticRows, check_batch
from tprt.model.batch import TokenBatch
from tprt.model.kv_cache import SCRATCH_BLOCK, KVCache, blocks_for
from tprt.model.llama import TPLlamaForCausalLM

log = logging.getLogger("tprt")

@dataclass(frozen=True, order=True)
class GraphKey:
    """What one captured graph is for (module docstring)."""

    tokens: int
    width: int
    adapters: int
    kv_len: int


class StaticInputs:
    """The graphs' device inputs: `max_tokens` token slots and as many row slots. `ints` holds the
    per-token and per-row vectors back to back for one copy; `tables` each row slot's blocks."""

    def __init__(self, max_tokens: int, blocks: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        self.ints = torch.zeros(7 * max_tokens + 1, dtype=torch.long, device=device)
        self.tables = torch.full((max_tokens, blocks), SCRATCH_BLOCK, dtype=torch.long, device=device)

    def _vector(self, i: int, tokens: int) -> torch.Tensor:
        """The i-th vector of a step of `tokens` slots (each vector is laid out for that count)."""
        return self.ints[i * tokens : (i + 1) * tokens]

    def ids(self, tokens: int) -> torch.Tensor:
        return self._vector(0, tokens)

    def rows(self, key: GraphKey) -> StaticRows:
        """The attention backend's view of the buffers for `key` (fixed addresses per key)."""
        t = key.tokens
        return StaticRows(
            positions=self._vector(1, t), write_blocks=self._vector(2, t)[:, None],
            write_offsets=self._vector(3, t)[:, None], starts=self._vector(4, t), lens=self._vector(5, t),
            query_starts=self.ints[6 * t : 7 * t + 1], tables=self.tables[:t], width=key.width, kv_len=key.kv_len)

    def fill(self, batch: TokenBatch, tokens: int, block_size: int) -> None:
        """Writes `batch` padded to `tokens` slots (module docstring) into the buffers."""
        n, r = batch.num_tokens, batch.num_rows
        pad, empty = tokens - n, n - r  # padding rows of one token each, then empty row slots
        positions = list(batch.positions) + [0] * pad
        row_of = [row for row, k in enumerate(batch.lens) for _ in range(k)]
        blocks = [batch.tables[row][p // block_size] for row, p in zip(row_of, batch.positions)] + [SCRATCH_BLOCK] * pad
        ints = (list(batch.tokens) + [0] * pad + positions + blocks + [p % block_size for p in positions]
                + list(batch.starts) + [0] * (pad + empty)
                + list(batch.lens) + [1] * pad + [0] * empty
                + list(batch.query_starts) + list(range(n + 1, tokens + 1)) + [tokens] * empty)
        device = self.ints.device
        cuda = device.type == "cuda"
        self.ints[: 7 * tokens + 1].copy_(torch.tensor(ints, dtype=torch.long), non_blocking=cuda)
        width = blocks_for(batch.kv_len, block_size)  # entries past a row's positions are never read
        table = [list(t[:width]) + [SCRATCH_BLOCK] * (width - len(t[:width])) for t in batch.tables]
        table += [[SCRATCH_BLOCK] * width] * (tokens - r)
        self.tables[:tokens, :width].copy_(torch.tensor(table, dtype=torch.long), non_blocking=cuda)


class StepGraphs:
    """Steps whose shape a graph covers, on static buffers; CUDA graphs on CUDA (module docstring)."""

    def __init__(self, model: TPLlamaForCausalLM, cache: KVCache, attention: AttentionBackend, adapters: AdapterSlots,
                 max_tokens: int, max_width: int, max_seq_len: int, use_graphs: bool | None = None,
                 max_adapters: int = MAX_GRAPH_ADAPTERS) -> None:
        self.model, self.cache, self.attention, self.adapters = model, cache, attention, adapters
        self.max_width = max_width
        device = model.tp.device
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.token_buckets = token_buckets(max_tokens)
        self.kv_buckets = kv_buckets(max_seq_len) if attention.static_needs_kv_len else [0]
        self.adapter_buckets = adapter_buckets(max_adapters)
        self.inputs = StaticInputs(max_tokens, blocks_for(max_seq_len, cache.block_size), device)
        adapters.reserve_static(max_tokens, max_adapters)
        self.graphs: dict[GraphKey, Callable[[], torch.Tensor]] = {}  # key -> replay: hidden [tokens, hidden]
        self.adapter_version = adapters.version  # graphs with adapters were captured at this version
        self.pool: Any = None  # the graphs' shared memory pool (CUDA: torch.cuda.graph_pool_handle())
        self.failed = False  # a capture failed once: stay eager

    @property
    def max_tokens(self) -> int:
        return self.token_buckets[-1]

    def key_for(self, batch: TokenBatch) -> GraphKey | None:
        """The graph `batch` runs in, or None when none covers it (run it eagerly)."""
        width = batch.max_query_len
        if width > self.max_width or batch.num_tokens > self.max_tokens or self.failed:
            return None
        adapters = len(set(batch.adapters) - {BASE})
        groups = next((g for g in self.adapter_buckets if g >= adapters), None)
        if groups is None or (adapters and not self.adapters.installed):
            return None
        tokens = next(b for b in self.token_buckets if b >= batch.num_tokens)
        kv_len = next(k for k in self.kv_buckets if k >= batch.kv_len) if self.kv_buckets != [0] else 0
        return GraphKey(tokens, 1 if width == 1 else self.max_width, groups, kv_len)

    def run(self, batch: TokenBatch, key: GraphKey) -> torch.Tensor | None:
        """The hidden states [batch.num_tokens, hidden] (before the final norm) of `batch` run as
        `key`; None when an adapter attached outside the slots (a training LoRA) acts: the graph
        would replay without it, so the caller runs the batch eagerly. Collective over the TP group."""
        self.adapters.route((BASE,), self.inputs.ints.device)  # no slot acts: has_adapters() sees the others
        if self.model.has_adapters():
            return None
        self.adapters.route_static(batch.token_adapters(), key.tokens, key.adapters)
        if self.adapters.version != self.adapter_version:  # the staged buffers were reallocated
            self.graphs = {k: g for k, g in self.graphs.items() if not k.adapters}
            self.adapter_version = self.adapters.version
        check_batch(batch, self.cache)  # the buffers are filled from the tables: rows inside their blocks
        self.inputs.fill(batch, key.tokens, self.cache.block_size)
        replay = self.graphs.get(key)
        if replay is None:
            replay = self._capture(key)
            if replay is None:
                return self._forward(key)[: batch.num_tokens]
            self.graphs[key] = replay
        return replay()[: batch.num_tokens]

    def _forward(self, key: GraphKey) -> torch.Tensor:
        """The static forward of `key` over the buffers -> hidden [key.tokens, hidden]. Reads
        nothing but the key, the buffers and the staged adapters: what a replay repeats."""
        step = self.attention.static(self.cache, self.inputs.rows(key))
        return self.model.forward_hidden(self.inputs.ids(key.tokens), attention=step)

    def _capture(self, key: GraphKey) -> Callable[[], torch.Tensor] | None:
        """The replay of `key`: a CUDA graph on CUDA (warmed up on a side stream, captured into the
        graphs' shared pool), else the static forward itself. None when capture fails (stays
        eager from then on, loudly)."""
        if not self.use_graphs:
            return lambda: self._forward(key)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(key)
            torch.cuda.current_stream().wait_stream(stream)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):  # NCCL watchdog thread
                out = self._forward(key)
        except RuntimeError as e:  # e.g. a collective that cannot be captured: fall back, loudly
            log.warning("CUDA graph capture of %s failed, running eagerly from now on: %s", key, e)
            self.failed = True
            return None

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        log.debug("captured a CUDA graph for %s", key)
        return replay
