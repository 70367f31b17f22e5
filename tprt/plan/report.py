"""`tprt plan`'s output: a per-rank table with a verdict, or one JSON object."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from tprt.plan.advice import suggestions
from tprt.plan.memory import KINDS, MemoryPlan, ServeWorkload

GIB = 1 << 30
_LABELS = {
    "weights": "weights", "packed_weights": "CPU packed weight copies", "kv_cache": "KV cache",
    "activations": "activations (peak)", "cuda_graphs": "CUDA graphs", "gradients": "gradients", "optimizer_states": "optimizer states (AdamW)",
    "master_weights": "fp32 master weights", "draft_model": "draft model (rank 0 only)",
    "framework_reserve": "framework reserve",
}


def _model_line(plan: MemoryPlan) -> str:
    c, lay = plan.model, plan.layout
    kv = (f"kv heads replicated x{lay.kv_replication}" if lay.kv_replication > 1
          else f"{lay.local_kv_heads} kv head(s) per rank")
    return (f"model: {c.architecture}, {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
            f"{c.num_attention_heads} heads / "
            f"{c.num_key_value_heads} kv heads, vocab {c.vocab_size} (padded {lay.padded_vocab_size}), "
            f"{'tied' if c.tie_word_embeddings else 'untied'} embeddings; at TP={plan.tp}: {kv}, "
            f"{plan.params_per_rank / 1e9:.3f} B parameters per rank")


def _workload_line(plan: MemoryPlan) -> str:
    w = plan.workload
    if isinstance(w, ServeWorkload):
        return (f"workload: serve, {plan.dtype} weights, {plan.kv_dtype} KV cache, max_seq_len {plan.max_seq_len}, "
                f"max_batch_size {w.max_batch_size}, token_budget {w.token_budget}")
    method = "full" if w.full else f"LoRA rank {w.lora_rank} on {','.join(w.lora_targets)}"
    if w.full and w.sharded:
        method += f", FSDP over dp {plan.dp}" + (", optimizer offloaded to the host" if w.offload_optimizer else "")
    batch = f"batch_size {w.batch_size} pairs (DPO: {w.rows} rows)" if w.dpo else f"batch_size {w.batch_size}"
    return (f"workload: finetune ({method}), {plan.dtype}, {batch} x seq_len {w.seq_len} per "
            f"micro-batch, grad_accum {w.grad_accum}, activation checkpointing "
            f"{'on' if w.activation_checkpointing else 'off'}, sequence parallelism "
            f"{'on' if w.sequence_parallel else 'off'}; {plan.trainable_params_per_rank / 1e6:.2f} M "
            "trainable parameters per rank")


def text(plan: MemoryPlan) -> str:
    pp = f" x PP={plan.pp}" if plan.pp > 1 else ""
    lines = [f"tprt plan: TP={plan.tp}{pp} x DP={plan.dp} ({plan.tp * plan.pp * plan.dp} devices), {plan.device.name} "
             f"({plan.device_bytes / GIB:.1f} GiB per rank)", _model_line(plan), _workload_line(plan), "",
             f"  {'per rank' + (' (the fullest stage)' if plan.pp > 1 else ''):<28}{'GiB':>10}"]
    for kind in KINDS:
        if plan.per_rank_bytes[kind]:
            lines.append(f"  {_LABELS[kind]:<28}{plan.per_rank_bytes[kind] / GIB:>10.2f}")
    peak, dev = plan.peak_bytes_per_rank, plan.device_bytes
    lines.append(f"  {'total (peak)':<28}{peak / GIB:>10.2f}   of {dev / GIB:.2f} ({100 * peak / dev:.0f}%)")
    host = plan.extra.get("host_bytes_per_rank", 0)
    if host:
        lines.append(f"  {'host memory (offloaded)':<28}{host / GIB:>10.2f}   fp32 shards, their gradients and "
                     f"AdamW state; {host * plan.tp * plan.dp / GIB:.0f} GiB over the {plan.tp * plan.dp} ranks")
    for st in plan.extra.get("stages", ()):
        first, stop = st["layers"]
        label = f"stage {st['stage']} (layers {first}-{stop - 1})"
        lines.append(f"  {label:<28}{st['peak_bytes_per_rank'] / GIB:>10.2f}")
    lines.append("")
    kv = plan.kv_bytes_per_token_per_rank
    if isinstance(plan.workload, ServeWorkload):
        tokens = plan.max_kv_tokens or 0
        lines.append(f"KV cache: {kv / 1024:.1f} KiB per token per rank ({plan.kv_dtype}); the engine allocates "
                     f"{plan.workload.max_batch_size} x {plan.max_seq_len} tokens = "
                     f"{plan.per_rank_bytes['kv_cache'] / GIB:.2f} GiB")
        lines.append(f"beside everything else, {tokens} KV tokens fit: {tokens // (plan.max_seq_len or 1)} "
                     f"sequences of {plan.max_seq_len} tokens")
        if "kv_tokens_gained" in plan.extra:
            e = plan.extra
            lines.append(f"{e['weight_dtype']} weights: {plan.weights_bytes_per_rank / 1e9:.2f} GB per rank instead of "
                         f"{e['dense_weights_bytes_per_rank'] / 1e9:.2f} GB; the {e['weights_saved_bytes_per_rank'] / 1e9:.2f} "
                         f"GB freed hold {e['kv_tokens_gained']} more KV tokens per rank")
        ahead = plan.extra.get("speculative_kv_positions")
        if ahead:
            lines.append(f"speculative decoding: {plan.workload.num_speculative_tokens} drafted tokens per row, up to "
                         f"{ahead} KV positions written ahead at once (from the pool; given back when rejected)")
            suffix = plan.extra.get("suffix_cache_host_bytes", 0)
            lines.append(f"  with --speculative suffix, rank 0 also keeps recent outputs: at most "
                         f"{suffix / 2**20:.0f} MiB of host memory, all adapters together")
        if "max_kv_tokens_bf16" in plan.extra:
            lines.append(_kv_gain_line(plan, tokens))
        if "cuda_graph_token_buckets" in plan.extra:
            e = plan.extra
            buckets = e["cuda_graph_token_buckets"]
            lines.append(f"CUDA graphs (--cuda-graphs {e['cuda_graphs']}): steps of 1 to {buckets[-1]} tokens in "
                         f"{len(buckets)} buckets, rows of up to {e['cuda_graph_row_width']} token(s), mixing "
                         f"{'/'.join(map(str, e['cuda_graph_adapter_buckets']))} adapters; up to "
                         f"{len(buckets) * len(e['cuda_graph_adapter_buckets'])} graphs, captured on first use, "
                         f"{plan.per_rank_bytes['cuda_graphs'] / 2**20:.0f} MiB per rank")
    verdict = (f"FITS, {(dev - peak) / GIB:.1f} GiB to spare per rank" if plan.fits
               else f"DOES NOT FIT: {(peak - dev) / GIB:.1f} GiB over per rank")
    lines.append(f"verdict: {verdict}")
    advice = suggestions(plan)
    if advice:
        lines.append("what would fit:" if not plan.fits else "room:")
        lines += [f"  - {s}" for s in advice]
    return "\n".join(lines)


def _workload_json(plan: MemoryPlan) -> dict[str, Any]:
    out = asdict(plan.workload)
    d = getattr(plan.workload, "draft", None)
    if d is not None:  # the draft model's config: its size is what matters here
        out["draft"] = {"num_hidden_layers": d.num_hidden_layers, "hidden_size": d.hidden_size,
                        "vocab_size": d.vocab_size}
    return out


def _kv_gain_line(plan: MemoryPlan, tokens: int) -> str:
    """This KV dtype against a bf16 cache: bytes per token and the KV tokens that fit, gained or lost."""
    bf16_bytes, bf16_tokens = plan.extra["kv_bytes_per_token_per_rank_bf16"], plan.extra["max_kv_tokens_bf16"] or 0
    gained = tokens - bf16_tokens
    ratio = f" (x{tokens / bf16_tokens:.2f})" if bf16_tokens else ""
    return (f"vs a bf16 KV cache ({bf16_bytes / 1024:.1f} KiB per token per rank): {gained:+d} KV tokens{ratio}, "
            f"{tokens // (plan.max_seq_len or 1) - bf16_tokens // (plan.max_seq_len or 1):+d} sequences")


def as_json(plan: MemoryPlan) -> dict[str, Any]:
    """The plan as one JSON object (the keys `tprt plan --json` promises, and the inputs)."""
    serving = isinstance(plan.workload, ServeWorkload)
    max_tokens = plan.max_kv_tokens
    return {
        "fits": plan.fits,
        "per_rank_bytes": dict(plan.per_rank_bytes),
        "peak_bytes_per_rank": plan.peak_bytes_per_rank,
        "device_bytes": plan.device_bytes,
        "weights_bytes_per_rank": plan.weights_bytes_per_rank,
        "kv_bytes_per_token_per_rank": plan.kv_bytes_per_token_per_rank,
        "max_kv_tokens": max_tokens,
        "max_sequences": max_tokens // (plan.max_seq_len or 1) if serving and max_tokens is not None else None,
        "suggestions": suggestions(plan),
        "tp": plan.tp,
        "pp": plan.pp,
        "stages": plan.extra.get("stages"),
        "dp": plan.dp,
        "device": plan.device.name,
        "workload": {"kind": "serve" if serving else "finetune", **_workload_json(plan)},
        "dtype": plan.dtype,
        "kv_dtype": plan.kv_dtype,
        "max_seq_len": plan.max_seq_len,
        "params_per_rank": plan.params_per_rank,
        "trainable_params_per_rank": plan.trainable_params_per_rank,
        "padded_vocab_size": plan.layout.padded_vocab_size,
        "kv_replication": plan.layout.kv_replication,
        **plan.extra,
    }
