"""tprt: tensor-parallel checkpoints and runtime for Llama models."""

import os

# torch's CPU allocator puts buffers of 2 MiB and more on transparent huge pages when this is set
# before torch loads (it is read once, at import): the oneDNN-packed weight copies and other
# large buffers then stream faster, as our weights and KV cache do (tprt.cpu.hugepages; docs/PERF.md).
# Set THP_MEM_ALLOC_ENABLE=0 to opt out; without effect if torch was imported before tprt.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
