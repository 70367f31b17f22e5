"""The devices `tprt plan` knows: memory per device, and HBM bandwidth for decode projections."""

from __future__ import annotations

import os
from dataclasses import dataclass

from tprt.errors import ConfigError

GIB = 1 << 30


@dataclass(frozen=True)
class Device:
    name: str
    kind: str  # "cuda" or "cpu": decides what the runtime allocates (tprt.plan.memory)
    memory_bytes: int  # usable by one rank
    hbm_bytes_per_s: float | None = None  # measured streaming bandwidth (None: not modelled)


# Memory as torch.cuda.get_device_properties reports it (a little under the marketing size);
# bandwidth is what a streaming kernel reaches, ~90% of the datasheet figure.
GPUS = {
    "h100-80gb": Device("h100-80gb", "cuda", 85_520_809_984, 3.0e12),  # SXM5, 3.35 TB/s datasheet
    "h200-141gb": Device("h200-141gb", "cuda", 150_754_820_096, 4.3e12),  # 4.8 TB/s datasheet
    "a100-80gb": Device("a100-80gb", "cuda", 85_089_960_960, 1.8e12),  # SXM4, 2.04 TB/s datasheet
    "a100-40gb": Device("a100-40gb", "cuda", 42_505_273_344, 1.4e12),  # SXM4, 1.56 TB/s datasheet
}
NAMES = (*GPUS, "cpu")


def host_memory_bytes() -> int:
    """This machine's physical memory (MemTotal), for `--device cpu`."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device(name: str, memory_gib: float | None = None, ranks_per_host: int = 1) -> Device:
    """A known device, its memory overridden by `memory_gib` when given. On CPU the ranks share
    the host: each gets MemTotal / ranks_per_host."""
    if name == "cpu":
        found = Device("cpu", "cpu", host_memory_bytes() // max(1, ranks_per_host))
    elif name in GPUS:
        found = GPUS[name]
    else:
        raise ConfigError(f"--device {name!r} is not known; expected one of {', '.join(NAMES)}")
    if memory_gib is not None:
        if not memory_gib > 0:
            raise ConfigError(f"--device-memory must be positive (GiB), got {memory_gib}")
        found = Device(found.name, found.kind, int(memory_gib * GIB), found.hbm_bytes_per_s)
    return found
