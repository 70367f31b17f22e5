"""A preallocated KV cache for continuous batching: one slot per live sequence.

Layout: one tensor [n_layers, n_slots, 2 (k, v), n_local_kv_heads, max_seq_len, head_dim] (this
rank's kv heads only), so one indexed write stores a step's k and v and one gather reads them.
A sequence owns a slot from `allocate()` until `release()` (or the engine's own bookkeeping);
the token at position p of the sequence in slot s has its k and v at [layer, s, :, :, p].
Nothing records lengths: the model writes each token at its position before attending, and a
query at position p sees cache positions <= p only, so whatever an earlier owner (or a padding
token) left beyond a sequence's length is never read before it is overwritten. The engine keeps
lengths (it knows them anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import groupby

import torch
import torch.nn.functional as F

from tprt.errors import TprtError
from tprt.cpu.hugepages import huge_tensors


# The most elements a prefill's attention mask holds (64 MiB in float32): a chunk whose mask
# [chunk, kv_len] would be larger attends in blocks of queries (2048 x 128K keys: blocks of 128).
MASK_ELEMENTS = 1 << 24


class CacheFullError(TprtError):
    """Every slot is taken, or a position is past the cache's max_seq_len."""


class KVCache:
    """k/v storage for `n_slots` sequences of up to `max_seq_len` tokens, for every layer."""

    def __init__(
        self,
        n_layers: int,
        n_slots: int,
        n_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (n_layers, n_slots, 2, n_kv_heads, max_seq_len, head_dim)
        # [layer, slot, k/v, kv_head, position, head_dim]; on CPU on huge pages (attention streams it).
        # Zeros, not empty: masked-out entries still enter SDPA's weighted sum (with weight 0),
        # and 0 * NaN from uninitialised memory would poison the output.
        if torch.device(device).type == "cpu":
            self.kv = huge_tensors([shape], dtype)[0].zero_()
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.n_slots = n_slots
        self.max_seq_len = max_seq_len
        # Key positions 0..max_seq_len-1, sliced each step to build the attention mask.
        self.key_positions = torch.arange(max_seq_len, device=device)
        self._free = list(range(n_slots - 1, -1, -1))  # a stack: the lowest slot is handed out first

    @property
    def n_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free slot for a new sequence."""
        if not self._free:
            raise CacheFullError(f"KV cache full: all {self.n_slots} slots are in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        """Returns `slot` to the pool; its contents need no clearing."""
        if not 0 <= slot < self.n_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def k(self) -> torch.Tensor:
        """[layer, slot, kv_head, position, head_dim] view of the keys."""
        return self.kv[:, :, 0]

    @property
    def v(self) -> torch.Tensor:
        """[layer, slot, kv_head, position, head_dim] view of the values."""
        return self.kv[:, :, 1]

    def nbytes(self) -> int:
        return self.kv.nbytes

    def prepare(
        self, positions: torch.Tensor, slots: torch.Tensor | None = None, kv_len: int | None = None,
        starts: tuple[int, ...] | None = None,
    ) -> CacheStep:
        """What every layer needs for one forward step, built once: the write indices and the mask.

        positions [batch, seq]: each token's position in its sequence (right padding continues
        the count; padding must stay below max_seq_len). slots [batch]: each row's slot, None for
        row b -> slot b. kv_len: 1 + the largest position in the batch (computed, with a host
        sync, when not given; the engine knows it). starts: when row b's positions are
        starts[b], starts[b] + 1, ... (a prefill chunk; found by itself on CPU), the mask is one
        staircase of at most MASK_ELEMENTS, whatever the rows, chunk and context (`CacheStep.attend`).
        """
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        if kv_len > self.max_seq_len:
            raise CacheFullError(f"position {kv_len - 1} is past the KV cache's max_seq_len={self.max_seq_len}")
        if positions.device.type == "cpu":
            self._check_in_range(positions, slots, kv_len)
        if slots is None:
            rows = torch.arange(positions.shape[0], device=positions.device)[:, None]  # [batch, 1]
        else:
            rows = slots[:, None]  # [batch, 1]: broadcasts against positions [batch, seq]
        if starts is None and positions.device.type == "cpu" and positions.shape[1] > 1:
            starts = self._chunk_starts(positions)
        if starts is not None:  # a prefill of consecutive positions: the mask is one staircase
            return self._staircase_step(rows, slots, positions, kv_len, starts)
        hidden = self.key_positions[:kv_len] > positions[:, None, :, None]  # [batch, 1, seq, kv_len]
        return CacheStep(rows=rows, slots=slots, positions=positions, kv_len=kv_len, mask=self._additive(hidden))

    def _staircase_step(self, rows: torch.Tensor, slots: torch.Tensor | None, positions: torch.Tensor,
                        kv_len: int, starts: tuple[int, ...]) -> CacheStep:
        """The mask of a chunk whose row b holds positions starts[b], starts[b] + 1, ...: one
        staircase T [block, width], T[i, c] hidden when c > corner + i, of which each row's (or
        query block's) mask is a view (`CacheStep.attend`). When the chunk's whole mask fits in
        MASK_ELEMENTS, block = the chunk and every row attends over all kv_len keys, as it would
        under a mask per row; otherwise queries go in blocks over the keys up to the block's end."""
        seq, spread = positions.shape[1], max(starts) - min(starts)
        if seq * (kv_len + spread) <= MASK_ELEMENTS:
            block, width, corner = seq, kv_len + spread, max(starts)
        else:
            block = min(seq, max(1, MASK_ELEMENTS // kv_len))
            width, corner = kv_len, kv_len - block
        keys = torch.arange(width, device=positions.device)
        stairs = keys > keys[corner : corner + block, None]  # [block, width]
        return CacheStep(rows=rows, slots=slots, positions=positions, kv_len=kv_len,
                         mask=self._additive(stairs), starts=starts, corner=corner)

    def _additive(self, hidden: torch.Tensor) -> torch.Tensor:
        """0 where attention is allowed, -inf where `hidden`, in the cache dtype (SDPA would
        otherwise convert a bool mask into a new float one in every layer)."""
        mask = torch.zeros(hidden.shape, dtype=self.kv.dtype, device=hidden.device)
        return mask.masked_fill_(hidden, float("-inf"))

    @staticmethod
    def _chunk_starts(positions: torch.Tensor) -> tuple[int, ...] | None:
        """On the host: each row's first position when every row holds consecutive positions."""
        first = positions[:, :1]
        if not bool((positions == first + torch.arange(positions.shape[1])).all()):
            return None
        return tuple(first.reshape(-1).tolist())

    def _check_in_range(self, positions: torch.Tensor, slots: torch.Tensor | None, kv_len: int) -> None:
        """Once per step on CPU, where the native decode path (tprt.cpu.native.rope_cache_kernel)
        writes into the cache through raw pointers: no layer may write outside it. (On GPU the
        checks would cost a device sync per step, and CUDA-graph capture forbids them.)"""
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= kv_len):
            raise ValueError(f"positions must lie in [0, kv_len={kv_len})")
        rows = positions.shape[0] if slots is None else slots.numel()
        if slots is None and rows > self.n_slots:
            raise ValueError(f"{rows} rows without slots, but the cache has {self.n_slots} slots")
        if slots is not None and rows and (int(slots.min()) < 0 or int(slots.max()) >= self.n_slots):
            raise ValueError(f"slots must lie in [0, {self.n_slots})")

    def update(self, layer: int, kv: torch.Tensor, step: CacheStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes kv [batch, seq, 2, n_kv_heads, head_dim] (keys, then values) at each token's
        (slot, position) and returns `read(layer, step)`."""
        self.kv[layer][step.rows, :, :, step.positions] = kv  # [slot, k/v, kv_head, position, head_dim]
        return self.read(layer, step)

    def read(self, layer: int, step: CacheStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's keys and values up to kv_len, each [batch, n_kv_heads, kv_len, head_dim]."""
        cache = self.kv[layer]  # [slot, k/v, kv_head, position, head_dim]
        if step.slots is None:
            both = cache[: step.rows.shape[0], :, :, : step.kv_len]  # a view, no copy
        else:
            both = cache[:, :, :, : step.kv_len].index_select(0, step.slots)  # [batch, k/v, kv_head, kv_len, head_dim]
        return both[:, 0], both[:, 1]


@dataclass(frozen=True)
class CacheStep:
    """One forward step's view of the cache, shared by every layer."""

    rows: torch.Tensor  # [batch, 1] slot of each row, for writing
    slots: torch.Tensor | None  # [batch] slot of each row; None: row b is slot b
    positions: torch.Tensor  # [batch, seq] position of each token
    kv_len: int  # keys 0..kv_len-1 are read
    # Additive (0 where attention is allowed, -inf elsewhere): [batch, 1, seq, kv_len], or with
    # `starts` a staircase [block, kv_len] whose bottom-right corner every query block slices.
    mask: torch.Tensor
    starts: tuple[int, ...] | None = None  # row b's positions are starts[b], starts[b] + 1, ...
    corner: int = 0  # with `starts`: the staircase's first row hides the keys after `corner`

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> torch.Tensor:
        """SDPA of q [batch, heads, seq, head_dim] over k, v [batch, kv_heads, kv_len, head_dim]
        under the mask. With `starts`, per run of rows sharing a start and per block of queries,
        over the keys up to the block's last position: those after it are hidden from every
        query of the block, so leaving them out changes no value, and a block's mask is a view
        of the staircase. (One call when the rows share a start and the chunk fits one block.)"""
        if self.starts is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=enable_gqa)
        block, seq = self.mask.shape[0], q.shape[2]
        runs, lo = [], 0
        for start, rows in groupby(self.starts):
            hi = lo + len(list(rows))
            parts = []
            for a in range(0, seq, block):
                n = min(block, seq - a)
                keys = self.kv_len if block == seq else start + a + n  # blocks: up to the block's last position
                first = self.corner + block - n - start - a  # the column of key 0 in the staircase
                mask = self.mask[block - n :, first : first + keys]  # [n, keys]
                parts.append(F.scaled_dot_product_attention(q[lo:hi, :, a : a + n], k[lo:hi, :, :keys],
                                                            v[lo:hi, :, :keys], attn_mask=mask, enable_gqa=enable_gqa))
            runs.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
            lo = hi
        return runs[0] if len(runs) == 1 else torch.cat(runs, dim=0)

    # For tprt.cpu.native's decode kernels, which index by raw pointer: built once per step, not per layer.
    @cached_property
    def flat_rows(self) -> torch.Tensor:
        """[batch] int64, contiguous: each row's slot."""
        return self.rows.reshape(-1).to(torch.int64).contiguous()

    @cached_property
    def flat_positions(self) -> torch.Tensor:
        """[batch * seq] int64, contiguous: each token's position."""
        return self.positions.reshape(-1).to(torch.int64).contiguous()
