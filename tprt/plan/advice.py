"""What would make a plan fit (or how far a fitting one stretches), each with its numbers."""

from __future__ import annotations

from dataclasses import replace

from tprt.plan.memory import FinetuneWorkload, MemoryPlan, ServeWorkload, plan_memory
from tprt.plan.shapes import allowed_tp

GIB = 1 << 30


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _replan(plan: MemoryPlan, workload: ServeWorkload | FinetuneWorkload, tp: int | None = None) -> MemoryPlan:
    return plan_memory(plan.model, tp or plan.tp, workload, plan.device, plan.dp, plan.vocab_align)


def _higher_tp(plan: MemoryPlan) -> str | None:
    """The smallest larger TP degree at which the workload fits, or the largest one's need."""
    larger = [tp for tp in allowed_tp(plan.model) if tp > plan.tp]
    for tp in larger:
        other = _replan(plan, plan.workload, tp)
        if other.fits:
            return f"--tp {tp}: {gib(other.peak_bytes_per_rank)} per rank ({tp * plan.dp} devices)"
    if larger:
        other = _replan(plan, plan.workload, larger[-1])
        return f"no TP degree fits alone: even --tp {larger[-1]} (the most the heads allow) needs {gib(other.peak_bytes_per_rank)} per rank"
    return None


def suggestions(plan: MemoryPlan) -> list[str]:
    if isinstance(plan.workload, ServeWorkload):
        return _serve(plan, plan.workload)
    return _finetune(plan, plan.workload)


def _serve(plan: MemoryPlan, w: ServeWorkload) -> list[str]:
    out: list[str] = []
    tokens = plan.max_kv_tokens or 0
    seq = plan.max_seq_len or 1
    if plan.fits:
        out.append(f"the free memory holds {tokens} KV tokens: --max-batch-size {tokens // seq} at --max-seq-len {seq}")
        return out
    if tokens >= seq:
        out.append(f"fewer sequences: --max-batch-size {tokens // seq} at --max-seq-len {seq} fits")
    if tokens >= w.max_batch_size * 2:
        out.append(f"a shorter context: --max-seq-len {tokens // w.max_batch_size} at --max-batch-size {w.max_batch_size} fits")
    if plan.kv_dtype == "fp32":
        half = _replan(plan, replace(w, kv_dtype="bf16"))
        out.append(f"--kv-cache-dtype bf16: the cache halves, {gib(half.peak_bytes_per_rank)} per rank"
                   + ("" if half.fits else " (still too much)"))
    if plan.dtype == "fp32":
        bf16 = _replan(plan, replace(w, dtype="bf16"))
        out.append(f"--dtype bf16: {gib(bf16.peak_bytes_per_rank)} per rank" + ("" if bf16.fits else " (still too much)"))
    higher = _higher_tp(plan)
    if higher:
        out.append(higher)
    return out


def _finetune(plan: MemoryPlan, w: FinetuneWorkload) -> list[str]:
    if plan.fits:
        return []
    out: list[str] = []
    parts, peak = plan.per_rank_bytes, plan.peak_bytes_per_rank
    if w.full:
        lora = _replan(plan, replace(w, full=False, lora_rank=16, sharded=False, offload_optimizer=False))
        out.append(f"LoRA instead of full (rank 16 on {','.join(lora.workload.lora_targets)}): "  # type: ignore[union-attr]
                   f"{gib(lora.peak_bytes_per_rank)} per rank" + ("" if lora.fits else " (still too much)"))
        states = parts["optimizer_states"]
        bf16_states = peak - states // 2
        out.append(f"bf16 optimizer states (not in tprt yet): -{gib(states // 2)}, {gib(bf16_states)} per rank"
                   + ("" if bf16_states <= plan.device_bytes else " (still too much)"))
        if not w.offload_optimizer:
            off = _replan(plan, replace(w, sharded=True, offload_optimizer=True))
            out.append(f"--offload-optimizer cpu: {gib(off.peak_bytes_per_rank)} per rank on the device, "
                       f"{gib(off.extra['host_bytes_per_rank'])} per rank in host memory"
                       + ("" if off.fits else " (still too much)"))
        if w.sharded:
            more = plan_memory(plan.model, plan.tp, w, plan.device, 2 * plan.dp, plan.vocab_align)
            out.append(f"--dp {2 * plan.dp} (FSDP shards the state over twice the ranks): "
                       f"{gib(more.peak_bytes_per_rank)} per rank" + ("" if more.fits else " (still too much)"))
    if not w.activation_checkpointing:
        ac = _replan(plan, replace(w, activation_checkpointing=True))
        out.append(f"--activation-checkpointing: activations {gib(parts['activations'])} -> "
                   f"{gib(ac.per_rank_bytes['activations'])}, {gib(ac.peak_bytes_per_rank)} per rank"
                   + ("" if ac.fits else " (still too much)"))
    if not w.sequence_parallel and plan.tp > 1:
        sp = _replan(plan, replace(w, sequence_parallel=True))
        out.append(f"--sequence-parallel: activations {gib(parts['activations'])} -> "
                   f"{gib(sp.per_rank_bytes['activations'])}, {gib(sp.peak_bytes_per_rank)} per rank"
                   + ("" if sp.fits else " (still too much)"))
    if w.batch_size > 1:
        one = _replan(plan, replace(w, batch_size=1, grad_accum=w.grad_accum * w.batch_size))
        out.append(f"--batch-size 1 --grad-accum {w.grad_accum * w.batch_size} (the same global batch): "
                   f"{gib(one.peak_bytes_per_rank)} per rank" + ("" if one.fits else " (still too much)"))
    higher = _higher_tp(plan)
    if higher:
        out.append(higher)
    return out
