"""The memory planner behind `tprt plan`: bytes per rank by kind for serving or fine-tuning a
model at a TP degree, from its parameter shapes (`shapes`) and how tprt allocates (`memory`).

    from tprt.plan import FinetuneWorkload, ServeWorkload, device, plan_memory, rank_parameters
    plan = plan_memory(ModelConfig.from_file("config.json"), 8, ServeWorkload(max_seq_len=8192), device("h100-80gb"))
    plan.per_rank_bytes, plan.peak_bytes_per_rank, plan.fits, plan.max_kv_tokens

Torch-free: planning a 405B model is arithmetic.
"""

from tprt.plan.devices import Device, device
from tprt.plan.memory import FinetuneWorkload, MemoryPlan, ServeWorkload, plan_memory
from tprt.plan.shapes import layout_for, lora_parameters, rank_parameters

__all__ = ["Device", "FinetuneWorkload", "MemoryPlan", "ServeWorkload", "device", "layout_for", "lora_parameters",
           "plan_memory", "rank_parameters"]
