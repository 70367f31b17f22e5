"""Decode with static shapes, replayed from CUDA graphs on GPU (one graph per batch-size and
key-length bucket).

A decode step's Python and kernel-launch overhead is what separates a small model's decode from
the memory-bandwidth floor on a GPU. With static shapes the whole forward (every layer, its
all-reduces over NCCL, the LM head) is captured once per pair of buckets and replayed with one launch:

- inputs live in fixed buffers: ids [max_batch], positions [max_batch] and the block
  tables [max_batch, blocks of max_seq_len] (tprt.model.kv_cache), static inputs of the graph;
- the batch is padded to a bucket (1, 2, 4, 8, ...); a padding row's table is all scratch block
  and its position 0, so it writes only into the scratch block, which no sequence reads;
- the attention spans a bucket of keys (256, 512, ... up to max_seq_len: the smallest holding
  every row's position; the mask hides the future), so kv_len, and the blocks gathered, are
  static per graph. Not max_seq_len always: with a long context each step would read every
  row's whole table, however short the sequences (at 128K, 16 rows of 70B at TP 8: 86 GB a step).

Every rank executes the same plans, so every rank captures the same buckets in the same order
(capture includes the collectives). Off CUDA the same static forward runs eagerly, which is how
the tests check it (and tests/test_scale_sim.py the key buckets, on the meta device); CUDA graphs
are used only on CUDA devices.
"""

from __future__ import annotations

import logging

import torch

from tprt.model.attention import AttentionBackend, TorchAttention
from tprt.model.kv_cache import SCRATCH_BLOCK, KVCache, blocks_for
from tprt.model.llama import TPLlamaForCausalLM

log = logging.getLogger("tprt")


def buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to max_batch (included)."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def kv_buckets(max_seq_len: int, smallest: int = 256) -> list[int]:
    """smallest, 2 * smallest, ... below max_seq_len, then max_seq_len (included)."""
    out, k = [], smallest
    while k < max_seq_len:
        out.append(k)
        k *= 2
    return out + [max_seq_len]


class StaticDecode:
    """Decode steps on static buffers; graphs when on CUDA."""

    def __init__(self, model: TPLlamaForCausalLM, cache: KVCache, max_batch: int, max_seq_len: int,
                 use_graphs: bool | None = None, attention: AttentionBackend | None = None):
        self.model, self.cache = model, cache
        self.attention = attention or TorchAttention()
        device = model.tp.device
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.buckets = buckets(max_batch)
        self.kv_buckets = kv_buckets(max_seq_len)  # key lengths attended over
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=device)  # [max_batch]
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)  # [max_batch]
        width = blocks_for(max_seq_len, cache.block_size)
        self.tables = torch.full((max_batch, width), SCRATCH_BLOCK, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (batch, kv_len)
        self.failed = False  # capture failed once: stay eager

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def kv_bucket(self, kv_len: int) -> int:
        return next(k for k in self.kv_buckets if k >= kv_len)

    def _forward(self, batch: int, kv_len: int) -> torch.Tensor:
        """The static forward over the first `batch` buffer rows, attending over `kv_len` keys
        -> [batch, local_vocab]."""
        step = self.attention.decode(self.cache, self.positions[:batch], self.tables[:batch], kv_len)
        return self.model(self.ids[:batch], attention=step)  # [batch, local_vocab]

    @torch.inference_mode()
    def run(self, tokens: list[int], starts: list[int], tables: tuple[tuple[int, ...], ...]) -> torch.Tensor:
        """Local logits [n, local_vocab] of n rows (input tokens[i] at starts[i], blocks
        tables[i]); collective over the TP group."""
        n = len(tokens)
        batch, kv_len = self.bucket(n), self.kv_bucket(max(starts) + 1)
        device = self.ids.device
        cuda = device.type == "cuda"
        width = self.tables.shape[1]
        padded = [list(t) + [SCRATCH_BLOCK] * (width - len(t)) for t in tables]
        self.ids[:n].copy_(torch.tensor(tokens, dtype=torch.long), non_blocking=cuda)
        self.positions[:n].copy_(torch.tensor(starts, dtype=torch.long), non_blocking=cuda)
        self.tables[:n].copy_(torch.tensor(padded, dtype=torch.long), non_blocking=cuda)
        self.ids[n:batch] = 0
        self.positions[n:batch] = 0
        self.tables[n:batch] = SCRATCH_BLOCK
        if not self.use_graphs or self.failed:
            return self._forward(batch, kv_len)[:n]
        if (batch, kv_len) not in self.graphs:
            self._capture(batch, kv_len)
            if self.failed:
                return self._forward(batch, kv_len)[:n]
        graph, out = self.graphs[batch, kv_len]
        graph.replay()
        return out[:n]

    def _capture(self, batch: int, kv_len: int) -> None:
        """Warms up on a side stream, then captures the static forward for `batch` rows over `kv_len` keys."""
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(batch, kv_len)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # NCCL watchdog thread
                out = self._forward(batch, kv_len)
            self.graphs[batch, kv_len] = (graph, out)
        except RuntimeError as e:  # e.g. a collective that cannot be captured: fall back, loudly
            log.warning("CUDA graph capture of decode batch %d over %d keys failed, running eagerly: %s",
                        batch, kv_len, e)
            self.failed = True
