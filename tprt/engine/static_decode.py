"""Decode with static shapes, replayed from CUDA graphs on GPU (one graph per batch-size bucket).

A decode step's Python and kernel-launch overhead is what separates a small model's decode from
the memory-bandwidth floor on a GPU. With static shapes the whole forward (every layer, its
all-reduces over NCCL, the LM head) is captured once per bucket and replayed with one launch:

- inputs live in fixed buffers: ids [max_batch, 1], positions [max_batch, 1];
- the batch is padded to a bucket (1, 2, 4, 8, ...); padding row b writes its key/value at
  position max_seq_len - 1 of slot b, which no sequence has reached (a sequence that has is
  decoding its last token in a real row) and no reused prefix holds (tprt.engine.prefix_cache: a
  sequence's last position is never computed), and the cache's rule holds: a position is always
  written before it is read;
- the attention always spans max_seq_len keys (the mask hides the future), so kv_len is static;
- rows must sit in slots 0..n-1 (the engine keeps them packed); otherwise the eager path runs.

Every rank executes the same plans, so every rank captures the same buckets in the same order
(capture includes the collectives). On CPU the same static forward runs eagerly, which is how
the tests check it; CUDA graphs are used only on CUDA devices.
"""

from __future__ import annotations

import logging

import torch

from tprt.model.kv_cache import KVCache
from tprt.model.llama import TPLlamaForCausalLM

log = logging.getLogger("tprt")


def buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to max_batch (included)."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class StaticDecode:
    """Decode steps for packed rows (slots 0..n-1), on static buffers; graphs when on CUDA."""

    def __init__(self, model: TPLlamaForCausalLM, cache: KVCache, max_batch: int, use_graphs: bool | None = None):
        self.model, self.cache = model, cache
        device = model.tp.device
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.buckets = buckets(max_batch)
        self.ids = torch.zeros(max_batch, 1, dtype=torch.long, device=device)  # [max_batch, 1]
        self.positions = torch.zeros(max_batch, 1, dtype=torch.long, device=device)  # [max_batch, 1]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.failed = False  # capture failed once: stay eager

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _forward(self, batch: int) -> torch.Tensor:
        """The static forward over the first `batch` buffer rows -> [batch, local_vocab]."""
        local = self.model(self.ids[:batch], self.positions[:batch], self.cache, slots=None,
                           kv_len=self.cache.max_seq_len)  # [batch, 1, local_vocab]
        return local[:, 0]

    @torch.inference_mode()
    def run(self, tokens: list[int], starts: list[int]) -> torch.Tensor:
        """Local logits [n, local_vocab] of rows 0..n-1 (slot i, input tokens[i] at starts[i]);
        collective over the TP group."""
        n = len(tokens)
        batch = self.bucket(n)
        device = self.ids.device
        self.ids[:n, 0].copy_(torch.tensor(tokens, dtype=torch.long), non_blocking=device.type == "cuda")
        self.positions[:n, 0].copy_(torch.tensor(starts, dtype=torch.long), non_blocking=device.type == "cuda")
        self.ids[n:batch] = 0
        self.positions[n:batch] = self.cache.max_seq_len - 1
        if not self.use_graphs or self.failed:
            return self._forward(batch)[:n]
        if batch not in self.graphs:
            self._capture(batch)
            if self.failed:
                return self._forward(batch)[:n]
        graph, out = self.graphs[batch]
        graph.replay()
        return out[:n]

    def _capture(self, batch: int) -> None:
        """Warms up on a side stream, then captures the static forward for `batch` rows."""
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # NCCL watchdog thread
                out = self._forward(batch)
            self.graphs[batch] = (graph, out)
        except RuntimeError as e:  # e.g. a collective that cannot be captured: fall back, loudly
            log.warning("CUDA graph capture of decode batch %d failed, running eagerly: %s", batch, e)
            self.failed = True
