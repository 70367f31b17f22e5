"""All-reduce through shared memory for the TP ranks of one host, instead of gloo's TCP loopback.

gloo spends about 0.2 ms on an all-reduce of a decode step's few KiB, and a decoded token takes
two per layer; here the ranks of a TP group that all run on one host share a segment in /dev/shm
and sum through it (`shm_allreduce.c`: per-rank slots, sequence numbers, C atomics), as the CPU
backends of vLLM and DeepSpeed do. `tprt.distributed.context.init_distributed` sets one up for a
CPU gloo TP group whose ranks share a host (tprt's launcher, or torchrun ranks on one node);
`tprt.parallel.mappings` sends float32 and bfloat16 all-reduces through it and everything else
(other dtypes, other collectives, groups spanning hosts) through gloo. TPRT_SHM_ALLREDUCE=0
turns it off.

A rank that dies mid-collective ends its peers' wait with an error naming it (they check the
liveness of the peers they wait for every ~50 ms), never a hang; a live peer that never arrives
raises after the process group's timeout, as gloo would.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import tempfile
from functools import cache
from pathlib import Path

import torch
import torch.distributed as dist

from tprt.cpu.native import compile_library

SOURCE = Path(__file__).with_name("shm_allreduce.c")
SHM_DIR = Path("/dev/shm")
SLOT_BYTES = 1 << 20  # per rank and set of slots; larger tensors go through in chunks of this
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I = ctypes.c_void_p, ctypes.c_int64


@cache
def _library() -> ctypes.CDLL | None:
    lib = compile_library(SOURCE, "shared-memory all-reduce")
    if lib is None:
        return None
    lib.tprt_shm_register.argtypes, lib.tprt_shm_register.restype = [_P, _I], None
    lib.tprt_shm_all_reduce.argtypes = [_P, _I, _I, _I, ctypes.POINTER(ctypes.c_uint64), _P, _I, _I, ctypes.c_double]
    lib.tprt_shm_all_reduce.restype = _I
    return lib


class _Group(ctypes.Structure):
    """shm_allreduce.c's shm_group: one rank's attachment, for C callers."""
    _fields_ = [("base", _P), ("rank", _I), ("world", _I), ("slot_bytes", _I),
                ("seq", ctypes.POINTER(ctypes.c_uint64)), ("timeout_s", ctypes.c_double)]


def _host() -> str:
    """This host's identity: its name and this boot (two containers may share a hostname)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class ShmAllReduce:
    """One rank's attachment to its group's segment: `all_reduce(x)` sums x over the group in place.

    The segment holds a header line per rank (sequence number, pid), then two sets of
    `slot_bytes` slots per rank. It is unlinked as soon as every rank has mapped it, so nothing
    is left in /dev/shm however the ranks end."""

    def __init__(self, path: str, rank: int, world: int, timeout_s: float, pids: list[int],
                 slot_bytes: int = SLOT_BYTES) -> None:
        lib = _library()
        if lib is None:
            raise RuntimeError("shared-memory all-reduce: its C library is unavailable")
        self._lib, self.rank, self.world, self.timeout_s = lib, rank, world, timeout_s
        self.slot_bytes, self.pids = slot_bytes, pids
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, self.segment_bytes(world, slot_bytes))
        finally:
            os.close(fd)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._seq = ctypes.c_uint64(0)
        self._group: _Group | None = None  # made by c_function
        lib.tprt_shm_register(self._base, rank)

    @staticmethod
    def segment_bytes(world: int, slot_bytes: int = SLOT_BYTES) -> int:
        """Bytes of a segment: a 64-byte header line per rank, then two sets of slots."""
        return 64 * world + 2 * world * slot_bytes

    @staticmethod
    def create_segment(world: int, slot_bytes: int = SLOT_BYTES) -> str:
        """A new zeroed segment file in /dev/shm for `world` ranks; its path."""
        fd, path = tempfile.mkstemp(prefix="tprt-allreduce-", dir=SHM_DIR)
        try:
            os.ftruncate(fd, ShmAllReduce.segment_bytes(world, slot_bytes))
        finally:
            os.close(fd)
        return path

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """Whether `all_reduce` takes x: a CPU float32 or bfloat16 tensor (decided by dtype and
        device alone, so every rank of a collective takes the same path)."""
        return x.device.type == "cpu" and x.dtype in _DTYPES

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the group in place (every rank gets the same bits); returns x."""
        flat = x if x.is_contiguous() else x.contiguous()
        status = self._lib.tprt_shm_all_reduce(self._base, self.rank, self.world, self.slot_bytes,
                                               ctypes.byref(self._seq), flat.data_ptr(), flat.numel(),
                                               _DTYPES[x.dtype], self.timeout_s)
        self.check(status)
        if flat is not x:
            x.copy_(flat)
        return x

    def c_function(self) -> tuple[int, int]:
        """(address of a C function `int64_t f(void *ctx, void *data, int64_t n, int64_t dtype)`
        doing `all_reduce` on n values of dtype code 0 (float32) or 1 (bfloat16), address of its
        ctx) for compiled callers (tprt.cpu.native.decode_stack_kernel): they pass its non-zero
        returns to `check`. Both stay valid while this object lives."""
        if self._group is None:  # one, shared by every caller: a second would orphan the first's pointer
            self._group = _Group(self._base, self.rank, self.world, self.slot_bytes,
                                 ctypes.pointer(self._seq), self.timeout_s)
        function = ctypes.cast(self._lib.tprt_shm_all_reduce_group, ctypes.c_void_p).value
        assert function is not None
        return function, ctypes.addressof(self._group)

    def check(self, status: int) -> None:
        """Raises the error for a non-zero status of the C all-reduce."""
        if status > 0:
            peer = status - 1
            raise RuntimeError(f"shared-memory all-reduce: TP rank {peer} (pid {self.pids[peer]}) exited "
                               f"mid-collective; rank {self.rank} stops too")
        if status < 0:
            raise RuntimeError(f"shared-memory all-reduce: no answer from every TP rank within {self.timeout_s:g} s "
                               f"(rank {self.rank})")


def _sees(pid: int) -> bool:
    """Whether `pid` is a process this one can see (the liveness checks need it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


def for_group(group: dist.ProcessGroup, rank: int, world: int, timeout_s: float) -> ShmAllReduce | None:
    """This rank's attachment to a segment shared by the group's ranks, or None when they do not
    all run on this host, the C library or /dev/shm is missing on one of them, a rank cannot open
    the segment or see its peers' processes (containers sharing a host but not /dev/shm or pids),
    or TPRT_SHM_ALLREDUCE=0. Collective over `group` (gloo); every rank decides alike."""
    usable = os.environ.get("TPRT_SHM_ALLREDUCE", "1") != "0" and SHM_DIR.is_dir() and _library() is not None
    gathered: list[tuple[str, bool, int] | None] = [None] * world
    dist.all_gather_object(gathered, (_host(), usable, os.getpid()), group=group)
    facts = [f for f in gathered if f is not None]
    if len(facts) != world or len({host for host, _, _ in facts}) != 1 or not all(ok for _, ok, _ in facts):
        return None
    pids = [pid for _, _, pid in facts]
    path = [ShmAllReduce.create_segment(world) if rank == 0 else None]
    dist.broadcast_object_list(path, group=group, group_src=0)
    assert path[0] is not None
    shm: ShmAllReduce | None = None
    try:
        if all(_sees(pid) for pid in pids):
            shm = ShmAllReduce(path[0], rank, world, timeout_s, pids)
    except OSError:  # another /dev/shm than rank 0's
        shm = None
    attached: list[bool | None] = [None] * world
    try:
        dist.all_gather_object(attached, shm is not None, group=group)  # every rank has it mapped: the name can go
    finally:
        if rank == 0:
            os.unlink(path[0])
    return shm if all(attached) else None
