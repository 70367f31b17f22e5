"""Per-rank memory of serving or fine-tuning a model at a TP degree, as tprt's runtime allocates it.

Every number is bytes on one rank, from the parameter shapes of `tprt.plan.shapes`:

- weights: every parameter the rank holds, in the compute dtype (`tprt.checkpoint.loading`).
- packed_weights: on CPU, `tprt.cpu.fast_linear.prepack` gives every linear layer and the LM head
  a oneDNN-reordered copy (serving, and the frozen base of a LoRA run). Serving also times the
  one-row kernels per weight shape and may keep a transposed copy as well, depending on which
  kernel wins on the machine, so two copies are counted; while timing a group of same-shape
  weights it holds one more copy of that group (the largest is counted). This transient is gone
  before the KV cache is allocated, so on CPU the sum is an upper bound of the peak by at most
  the cache and activations. GPUs keep no copy.
- kv_cache: the paged `KVCache` [layers, blocks, 2, local kv heads, block size, head_dim]:
  kv_cache_tokens positions (default max_batch_size x max_seq_len) in blocks, plus one scratch
  block, allocated whole when the engine starts; its dtype is the model's except float32 for
  bf16/fp16 on CPU (`TPLlamaForCausalLM.default_cache_dtype`), or `--kv-cache-dtype`: int8 and fp8
  store one byte per value and a bfloat16 scale per head vector (`tprt.model.kv_cache.QUANTIZED`)
  and read back in the compute dtype (float32 on CPU).
- activations: serving, the largest transient of one forward step of `token_budget` tokens
  (a layer's MLP or attention intermediates, the attention mask, the sampled rows' logits);
  fine-tuning, what autograd keeps for the backward of one micro-batch (per layer and token, the
  tensors our modules save; only the block inputs plus one block with activation checkpointing)
  and the loss's logits.
- gradients: one per trainable parameter, in its dtype; for low-precision parameters the fused
  AdamW update also converts gradients to float32, GRAD_CHUNK_BYTES at a time or one whole
  parameter when larger (the largest such chunk is counted here too).
- optimizer_states: AdamW's exp_avg and exp_avg_sq, float32 (`tprt.train.optim.AdamW`).
- master_weights: float32 copies of low-precision trainable parameters.
- cuda_graphs: serving on CUDA (`--cuda-graphs`, tprt.engine.step_graphs): the graphs' shared
  pool, as wide as the widest captured step's transient, plus the hidden states every graph
  holds as its output (each token bucket, for each count of mixed adapters), and the static
  input buffers (the block tables of every token slot).
- framework_reserve: what the runtime holds beyond tensors (CUDA context, NCCL and cuBLAS
  workspaces, allocator slack on GPU; oneDNN scratch and the compiled kernels on CPU).

The peak is their sum: the persistent parts plus the largest transient.

A sharded full fine-tune (`tprt finetune --full`: FSDP2 over dp, `tprt.train.fsdp`) holds each
parameter's float32 shard (ceil(rows / dp) of its TP slice: master_weights), its float32 gradient
shard and AdamW's two moments of the shard; weights are the compute-dtype copies FSDP all-gathers:
the root's (embedding, final norm, LM head, kept through the step) and two decoder blocks (the
running one and the prefetched next); gradients add one block's unsharded compute-dtype gradients
and their float32 copy for the reduce-scatter. With `offload_optimizer` the float32 shards, their
gradients and the moments live in host memory (`extra["host_bytes_per_rank"]`), not on the device.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field, replace
from typing import Any

from tprt.errors import ConfigError
from tprt.lora.config import TARGETS, normalize_targets
from tprt.model.config import ModelConfig, TPLayout
from tprt.plan.devices import Device
from tprt.parallel.stages import Stage, stages
from tprt.plan.shapes import layout_for, linear_weight_names, lora_parameters, numel, rank_parameters

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
# KV cache dtypes (--kv-cache-dtype): the float ones, and the quantized ones with a bfloat16 scale per
# head vector of each token (tprt.model.kv_cache.kv_bytes_per_position).
# int8-static: int8 with static scales per layer, k/v and head (serve's --kv-scales FILE), none per token.
KV_DTYPE_BYTES = {**DTYPE_BYTES, "int8": 1, "fp8": 1, "int8-static": 1}
KV_SCALE_BYTES = {"int8": 2, "fp8": 2}
DEFAULT_MAX_SEQ_LEN = 2048  # tprt.engine.core's default context (min with the model's)
GIB = 1 << 30
# Beyond tensors: CUDA context (~0.5 GiB), NCCL and cuBLAS workspaces, caching-allocator slack.
GPU_RESERVE = 2 * GIB
# On CPU, measured on the CI machine (tests/plan_checks.py, SmolLM2 at TP 1 and 3): 0-30 MiB of
# allocator and autograd bookkeeping (less when an engine ran before in the process), and ~90 MiB
# more, whatever the model's size, once oneDNN's packed matmuls run (its caches and scratch).
CPU_RESERVE = 16 << 20
CPU_ONEDNN_RESERVE = 80 << 20
# Fine-tuning: torch's optimizer step imports torch._dynamo, which imports Triton where it is
# installed: ~95 MiB more of the process (166 MiB against 71 without it, torch 2.13 on the CI
# machine). Counted where Triton is installed here (the plan is made where the job runs).
CPU_TRITON_RESERVE = 96 << 20
# tprt.train.optim.GRAD_CHUNK_BYTES (repeated: the planner is torch-free; a test holds them equal).
GRAD_CHUNK_BYTES = 64 << 20

KINDS = ("weights", "packed_weights", "kv_cache", "activations", "cuda_graphs", "gradients", "optimizer_states",
         "master_weights", "draft_model", "framework_reserve")


def dtype_name(dtype: str) -> str:
    """fp32, bf16 or fp16 from any of their usual spellings; anything else is a one-line error."""
    name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if name not in DTYPE_BYTES:
        raise ConfigError(f"dtype {dtype!r} is not supported; expected fp32, bf16 or fp16")
    return name


def kv_dtype_name(dtype: str) -> str:
    """A KV cache dtype: dtype_name's, or int8 / fp8 (e4m3) / int8-static; anything else is a one-line error."""
    name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if name not in KV_DTYPE_BYTES:
        raise ConfigError(f"--kv-cache-dtype {dtype!r} is not supported; expected fp32, bf16, fp16, int8, fp8 or int8-static")
    return name


@dataclass(frozen=True)
class ServeWorkload:
    """`tprt serve` / the engine (tprt.engine.core.EngineConfig)."""

    dtype: str | None = None  # compute dtype; None: the checkpoint's (config.json's torch_dtype)
    kv_dtype: str | None = None  # None: as the engine picks (the model's; float32 for bf16/fp16 on CPU)
    max_seq_len: int | None = None  # tokens per sequence; None: min(model's, 2048), as the engine
    max_batch_size: int = 16  # running sequences (EngineConfig.max_batch)
    kv_cache_tokens: int | None = None  # KV pool positions; None: max_batch_size x max_seq_len, as the engine
    kv_block_size: int = 16  # positions per KV block (EngineConfig.kv_block_size)
    token_budget: int = 2048  # tokens per step (EngineConfig.token_budget)
    cpu_prepack: bool = True  # EngineConfig.cpu_prepack
    weight_dtype: str | None = None  # "int8"/"fp8": the decoder's linear weights quantized (tprt.quant)
    weight_group_size: int | None = None  # int8: one float32 scale per this many input columns (None: per row)
    # Speculative decoding (tprt.engine.speculative): drafted tokens per row (0: off), and a draft
    # model's config (--speculative draft), whose weights and KV cache rank 0 alone holds.
    num_speculative_tokens: int = 0
    draft: ModelConfig | None = None
    cuda_graphs: str = "auto"  # --cuda-graphs (tprt.engine.graph_buckets.GRAPH_MODES); CUDA only


@dataclass(frozen=True)
class FinetuneWorkload:
    """`tprt finetune` (tprt.train.trainer.FinetuneConfig); batch_size is per DP rank and micro-batch."""

    full: bool = False
    lora_rank: int = 8
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o")
    dtype: str = "fp32"
    batch_size: int = 4
    seq_len: int = 512
    grad_accum: int = 1
    activation_checkpointing: bool = False
    sequence_parallel: bool = False  # --sequence-parallel: the decoder's norms and block inputs split over TP
    sharded: bool = False  # full: FSDP over dp as `tprt finetune --full` (False: replicated, the server's)
    offload_optimizer: bool = False  # sharded: fp32 shards, gradients and moments in host memory
    # DPO (tprt.train.dpo): batch_size counts preference pairs, each two rows (the preferred and the
    # non-preferred completion) in the same micro-batch, so twice the activations of SFT's rows. The
    # reference pass runs without autograd (its transients are one forward's, below the saved
    # activations) and the stored reference log-probabilities are 4 bytes per row.
    dpo: bool = False

    @property
    def rows(self) -> int:
        """Rows in one micro-batch."""
        return self.batch_size * (2 if self.dpo else 1)


Workload = ServeWorkload | FinetuneWorkload


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's memory for a workload; every rank of a TP group holds the same amounts."""

    model: ModelConfig
    layout: TPLayout
    dp: int
    device: Device
    workload: Workload
    per_rank_bytes: dict[str, int]  # kind (KINDS) -> bytes at the peak
    params_per_rank: int  # elements of the base model on one rank
    trainable_params_per_rank: int  # 0 when serving
    dtype: str  # compute dtype
    kv_dtype: str | None  # serving only
    max_seq_len: int | None  # serving only
    kv_bytes_per_token_per_rank: int  # one token of one sequence, every layer, this rank's kv heads
    vocab_align: int  # the vocabulary is padded to a multiple of vocab_align * tp
    extra: dict[str, Any] = field(default_factory=dict)  # workload-specific figures for the report
    pp: int = 1  # pipeline stages: the figures are the fullest stage's (extra["stages"]: each one's)

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def peak_bytes_per_rank(self) -> int:
        return sum(self.per_rank_bytes.values())

    @property
    def weights_bytes_per_rank(self) -> int:
        return self.per_rank_bytes["weights"]

    @property
    def device_bytes(self) -> int:
        return self.device.memory_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes_per_rank <= self.device_bytes

    @property
    def non_kv_bytes(self) -> int:
        """Everything but the KV cache: what the cache has to fit beside."""
        return self.peak_bytes_per_rank - self.per_rank_bytes["kv_cache"]

    @property
    def max_kv_tokens(self) -> int | None:
        """Serving: tokens of KV (summed over sequences) that fit in what the rest leaves free."""
        if not isinstance(self.workload, ServeWorkload):
            return None
        return max(0, self.device_bytes - self.non_kv_bytes) // self.kv_bytes_per_token_per_rank


def plan_memory(cfg: ModelConfig, tp: int, workload: Workload, device: Device, dp: int = 1,
                vocab_align: int = 64, pp: int = 1) -> MemoryPlan:
    """The per-rank memory of `workload` with `cfg` split over `tp` ranks on `device` (dp
    replicas change nothing per rank). With `pp` pipeline stages, the plan of the stage that
    needs the most (every stage's peak in extra["stages"]). Bad TP degrees or workload values
    are ConfigErrors."""
    if dp < 1:
        raise ConfigError(f"--dp must be at least 1, got {dp}")
    layout = layout_for(cfg, tp, vocab_align)
    if pp == 1:
        return _plan_stage(cfg, layout, workload, device, dp, vocab_align, None)
    plans = [_plan_stage(cfg, layout, workload, device, dp, vocab_align, st) for st in stages(cfg.num_hidden_layers, pp)]
    fullest = max(plans, key=lambda p: p.peak_bytes_per_rank)
    fullest.extra["stages"] = [{"stage": i, "layers": [st.layers.start, st.layers.stop],
                                "peak_bytes_per_rank": p.peak_bytes_per_rank}
                               for i, (st, p) in enumerate(zip(stages(cfg.num_hidden_layers, pp), plans))]
    return replace(fullest, pp=pp)


def _plan_stage(cfg: ModelConfig, layout: TPLayout, workload: Workload, device: Device, dp: int, vocab_align: int,
                stage: Stage | None) -> MemoryPlan:
    if isinstance(workload, ServeWorkload):
        return _plan_serve(cfg, layout, workload, device, dp, vocab_align, stage)
    return _plan_finetune(cfg, layout, workload, device, dp, vocab_align, stage)


def _reserve(device: Device, packed: bool, trains: bool = False) -> int:
    if device.kind != "cpu":
        return GPU_RESERVE
    triton = trains and importlib.util.find_spec("triton") is not None
    return CPU_RESERVE + (CPU_ONEDNN_RESERVE if packed else 0) + (CPU_TRITON_RESERVE if triton else 0)


def _packed_bytes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], elem: int, timing: bool) -> int:
    """CPU prepack: a reordered copy of every linear weight; when the one-row kernels are timed
    (serving), a transposed copy too (the worst case) and, while a group of same-shape weights
    is timed, one more copy of it (the largest group)."""
    groups: dict[tuple[int, ...], int] = {}
    for name in linear_weight_names(cfg, shapes):
        groups[shapes[name]] = groups.get(shapes[name], 0) + math.prod(shapes[name])
    copies = sum(groups.values())
    return elem * (2 * copies + max(groups.values()) if timing else copies)


def kv_bytes_per_token(cfg: ModelConfig, layout: TPLayout, kv_dtype: str, stage: Stage | None = None) -> int:
    """One token's keys and values on one rank, over every layer (of `stage`)."""
    per_head = cfg.head_dim * KV_DTYPE_BYTES[kv_dtype] + KV_SCALE_BYTES.get(kv_dtype, 0)
    layers = cfg.num_hidden_layers if stage is None else len(stage.layers)
    return layers * 2 * layout.local_kv_heads * per_head


def _check_positive(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def _plan_serve(cfg: ModelConfig, layout: TPLayout, w: ServeWorkload, device: Device, dp: int,
                vocab_align: int, stage: Stage | None = None) -> MemoryPlan:
    _check_positive(max_batch_size=w.max_batch_size, max_seq_len=w.max_seq_len, token_budget=w.token_budget,
                    kv_cache_tokens=w.kv_cache_tokens, kv_block_size=w.kv_block_size)
    dtype = dtype_name(w.dtype or cfg.torch_dtype)
    cpu = device.kind == "cpu"
    kv_dtype = kv_dtype_name(w.kv_dtype) if w.kv_dtype else ("fp32" if cpu else dtype)
    max_seq_len = w.max_seq_len or min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
    if max_seq_len > cfg.max_position_embeddings:
        raise ConfigError(f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings="
                          f"{cfg.max_position_embeddings}")
    # cb: attention's dtype (a quantized cache reads back as the engine's default cache dtype)
    b = DTYPE_BYTES[dtype]
    cb = DTYPE_BYTES[kv_dtype] if kv_dtype in DTYPE_BYTES else DTYPE_BYTES["fp32" if cpu else dtype]
    if stage is not None and (w.weight_dtype is not None or w.num_speculative_tokens or w.cpu_prepack and cpu):
        raise ConfigError("--pp plans dense weights on GPUs, without speculation, for now")
    shapes = rank_parameters(cfg, layout, stage)
    params = numel(shapes)
    per_token = kv_bytes_per_token(cfg, layout, kv_dtype, stage)
    tokens = min(w.token_budget, w.max_batch_size * max_seq_len)  # the widest step
    h, inter = cfg.hidden_size, cfg.intermediate_size // layout.tp
    q, kv = layout.local_heads * cfg.head_dim, layout.local_kv_heads * cfg.head_dim
    # In inference each op's inputs die with it: the widest moment of a layer is the residual,
    # its norm, and either the MLP (gate_up, silu(gate), the product) or attention (qkv, q/k/v
    # in the cache dtype, the output, the additive mask over the keys), plus each row's keys and
    # values gathered from its KV blocks.
    mlp = tokens * b * (2 * h + 4 * inter)
    gathered = min(w.max_batch_size, tokens) * max_seq_len * 2 * kv * cb
    attention = tokens * (b * (2 * h + q + 2 * kv + q) + cb * (2 * q + 2 * kv + max_seq_len)) + gathered
    # float32, gathered to sample: a decode row returns logits for its token and each drafted one
    logits = w.max_batch_size * (1 + w.num_speculative_tokens) * (layout.local_vocab + cfg.vocab_size) * 4
    if stage is not None and not stage.last:
        logits = 0  # a stage before the last passes hidden states on
    dense_packed = _packed_bytes(cfg, shapes, b, timing=True) if cpu and w.cpu_prepack else 0
    weights, packed = params * b, dense_packed
    if w.weight_dtype is not None:
        weights, packed = _quantized_weights(cfg, shapes, b, w, cpu)
    pool = w.kv_cache_tokens or w.max_batch_size * max_seq_len
    kv_cache = per_token * (-(-pool // w.kv_block_size) + 1) * w.kv_block_size  # and the scratch block
    parts = dict.fromkeys(KINDS, 0)
    extra: dict[str, Any] = {"tokens_per_step": tokens, "max_batch_size": w.max_batch_size}
    parts.update(weights=weights, packed_weights=packed, kv_cache=kv_cache,
                 activations=max(mlp, attention) + logits, framework_reserve=_reserve(device, packed > 0),
                 draft_model=_draft_bytes(w, device, max_seq_len, vocab_align),
                 cuda_graphs=0 if cpu else _graph_bytes(cfg, layout, w, b, cb, max_seq_len, extra))
    if w.weight_dtype is not None:
        saved = params * b + dense_packed - weights - packed  # (the reserve counts oneDNN's either way)
        extra.update(weight_dtype=w.weight_dtype, weight_group_size=w.weight_group_size,
                     dense_weights_bytes_per_rank=params * b, weights_saved_bytes_per_rank=saved,
                     kv_tokens_gained=saved // per_token)
    if w.num_speculative_tokens:
        # Drafted positions are written ahead of what a row keeps, within its max_seq_len, so they
        # come out of the pool: at most this many at once, given back when rejected.
        extra["speculative_kv_positions"] = w.max_batch_size * w.num_speculative_tokens
        # --speculative suffix: rank 0's cache of recent outputs, bounded over all adapters (host memory)
        from tprt.engine.speculative import DEFAULT_SUFFIX_CACHE_TOKENS, SUFFIX_BYTES_PER_TOKEN

        extra["suffix_cache_host_bytes"] = DEFAULT_SUFFIX_CACHE_TOKENS * SUFFIX_BYTES_PER_TOKEN
    if kv_dtype != "bf16":  # what this KV dtype gains (or loses) against a bf16 cache in the same memory
        bf16 = _plan_serve(cfg, layout, replace(w, kv_dtype="bf16"), device, dp, vocab_align, stage)
        extra["kv_bytes_per_token_per_rank_bf16"] = bf16.kv_bytes_per_token_per_rank
        extra["max_kv_tokens_bf16"] = bf16.max_kv_tokens
    return MemoryPlan(cfg, layout, dp, device, w, parts, params, 0, dtype, kv_dtype, max_seq_len, per_token, vocab_align,
                      extra=extra)


def _graph_bytes(cfg: ModelConfig, layout: TPLayout, w: ServeWorkload, b: int, cb: int, max_seq_len: int,
                 extra: dict[str, Any]) -> int:
    """The CUDA graphs' memory (module docstring); their buckets go to `extra`."""
    from tprt.engine.graph_buckets import (GRAPH_MODES, MAX_GRAPH_ADAPTERS, adapter_buckets, graph_max_tokens,
                                           graph_widths, token_buckets)

    if w.cuda_graphs not in GRAPH_MODES:
        raise ConfigError(f"--cuda-graphs must be one of {', '.join(GRAPH_MODES)}, got {w.cuda_graphs!r}")
    mode = "all" if w.cuda_graphs == "auto" else w.cuda_graphs
    if mode == "off":
        return 0
    width = graph_widths(mode, w.num_speculative_tokens)
    top = graph_max_tokens(w.max_batch_size, width)
    buckets, adapters = token_buckets(top), adapter_buckets(MAX_GRAPH_ADAPTERS)
    h, inter = cfg.hidden_size, cfg.intermediate_size // layout.tp
    q, kv = layout.local_heads * cfg.head_dim, layout.local_kv_heads * cfg.head_dim
    # The widest capture's transient: as a step's (activations), but the kernel reads the cache in place.
    transient = top * max(b * (2 * h + 4 * inter), b * (2 * h + 2 * q + 2 * kv) + cb * (2 * q + 2 * kv))
    outputs = sum(buckets) * len(adapters) * h * b
    inputs = (7 * top + 1 + top * -(-max_seq_len // w.kv_block_size)) * 8 + top * MAX_GRAPH_ADAPTERS * b
    extra.update(cuda_graphs=mode, cuda_graph_token_buckets=buckets, cuda_graph_adapter_buckets=adapters,
                 cuda_graph_row_width=width)
    return transient + outputs + inputs


def _quantized_weights(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], b: int, w: ServeWorkload,
                       cpu: bool) -> tuple[int, int]:
    """(weights, packed copies) on one rank with the decoder's linear weights at one byte each plus
    their float32 scales (per row, or per row and group); everything else stays in the compute
    dtype. On CPU only the LM head is packed (int8 layers use the compiled kernels in place)."""
    if w.weight_dtype not in ("int8", "fp8"):
        raise ConfigError(f"--quantize {w.weight_dtype!r} is not supported; expected int8 or fp8")
    g = w.weight_group_size
    if g is not None and (w.weight_dtype != "int8" or g < 1):
        raise ConfigError(f"--weight-group-size {g}: expected a positive group size, with --quantize int8")
    total = 0
    for name, shape in shapes.items():
        if name.endswith("_proj.weight"):
            out, cols = shape
            total += out * cols + 4 * out * (1 if g is None else -(-cols // g))
        else:
            total += math.prod(shape) * b
    head = shapes["embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    packed = (2 * math.prod(head) * b) if cpu and w.cpu_prepack else 0  # packed + transposed, as timed
    return total, packed


def _draft_bytes(w: ServeWorkload, device: Device, max_seq_len: int, vocab_align: int) -> int:
    """Rank 0's draft model (tprt.engine.speculative.DraftModel): its weights at TP 1 (and the CPU
    packed copies), a KV cache of one slot of max_seq_len + 1 positions per running sequence
    (blocks of 16, and the scratch block), and one row of full-vocabulary logits per sequence."""
    d = w.draft
    if d is None:
        return 0
    layout = layout_for(d, 1, vocab_align)
    dtype = dtype_name(d.torch_dtype)
    b = DTYPE_BYTES[dtype]
    shapes = rank_parameters(d, layout)
    cpu = device.kind == "cpu"
    packed = _packed_bytes(d, shapes, b, timing=True) if cpu and w.cpu_prepack else 0
    kv_dtype = "fp32" if cpu else dtype
    slot = -(-(max_seq_len + 1) // 16) * 16
    kv = kv_bytes_per_token(d, layout, kv_dtype) * (w.max_batch_size * slot + 16)
    return numel(shapes) * b + packed + kv + w.max_batch_size * layout.padded_vocab_size * 4


def _trainable_targets(w: FinetuneWorkload) -> set[str]:
    return set(TARGETS) if w.full else set(normalize_targets(w.lora_targets))


def _saved_per_token_per_layer(cfg: ModelConfig, layout: TPLayout, w: FinetuneWorkload, device: Device) -> int:
    """Bytes autograd keeps per token for one decoder layer's backward, as our modules save them."""
    b = DTYPE_BYTES[dtype_name(w.dtype)]
    h, inter = cfg.hidden_size, cfg.intermediate_size // layout.tp
    q, kv = layout.local_heads * cfg.head_dim, layout.local_kv_heads * cfg.head_dim
    t = _trainable_targets(w)
    # RMSNorm: fp32 saves its input (rms_norm), bf16 the float32 copy of it; the normed output is
    # kept when the norm weight or the next linear needs it for a weight gradient. Under sequence
    # parallelism the norms see seq / TP positions, and the next linear keeps the gathered input.
    sp = layout.tp if w.sequence_parallel else 1
    norm_in = 4 * h // sp
    attn_in_needed = w.full or bool(t & {"q", "k", "v"})
    mlp_in_needed = w.full or bool(t & {"gate", "up"})
    # A trained dense weight's overlapped product (on GPUs: --tp-comm-overlap auto) keeps only this
    # rank's chunk and gathers it again in the backward (tprt.parallel.overlap); LoRA's A, and the
    # plain product, keep the gathered input.
    linear_in = b * h // (sp if w.full and device.kind != "cpu" else 1)
    norms = 2 * norm_in + linear_in * (attn_in_needed + mlp_in_needed)
    # qkv output (v is a view of it), rotated q and k, SDPA's output (and its logsumexp), and the
    # o_proj input (a reshaped copy) when o gets a gradient.
    attention = b * ((q + 2 * kv) + q + kv + q + (q if "o" in t else 0)) + 4 * layout.local_heads
    # gate_up output (gate and up are views of it), silu(gate), and the product when down trains.
    mlp = b * (2 * inter + inter + (inter if "down" in t else 0))
    lora = 0 if w.full else b * w.lora_rank * len(t)  # each adapted target keeps its [rank] z
    return norms + attention + mlp + lora


def _plan_finetune(cfg: ModelConfig, layout: TPLayout, w: FinetuneWorkload, device: Device, dp: int,
                   vocab_align: int, stage: Stage | None = None) -> MemoryPlan:
    _check_positive(batch_size=w.batch_size, seq_len=w.seq_len, grad_accum=w.grad_accum)
    dtype = dtype_name(w.dtype)
    b = DTYPE_BYTES[dtype]
    shapes = rank_parameters(cfg, layout, stage)
    params = numel(shapes)
    trained = shapes if w.full else lora_parameters(cfg, layout, w.lora_targets, w.lora_rank, stage)
    trainable = numel(trained)
    tokens = w.rows * w.seq_len  # one micro-batch; accumulation adds no activations
    per_layer = _saved_per_token_per_layer(cfg, layout, w, device)
    h = cfg.hidden_size
    n_layers = cfg.num_hidden_layers if stage is None else len(stage.layers)
    # 1F1B: stage i holds the activations of up to (stages - i) micro-batches at once
    in_flight = 1 if stage is None else stage.count - stage.index
    # The loss: final norm, the local logits in the dtype and the vocab-parallel cross-entropy's
    # float32 softmax (the logits' gradient reuses its size), over the target tokens (at most
    # every token but the last of each row).
    targets = w.rows * (w.seq_len - 1)
    loss = targets * (4 * h + b * h + layout.local_vocab * (b + 4)) if stage is None or stage.last else 0
    if w.activation_checkpointing:
        # Each block keeps its input; one block's activations are recomputed at a time, in the
        # backward after the loss's are freed: the peak is the larger of the two (measured:
        # bench/sp_bench.py), on top of the kept inputs.
        block_input = b * h // (layout.tp if w.sequence_parallel else 1)  # seq / TP positions of it under SP
        blocks = tokens * in_flight * n_layers * block_input + max(0, tokens * per_layer - loss)
    else:
        blocks = tokens * in_flight * n_layers * per_layer
    cpu = device.kind == "cpu"
    packed = _packed_bytes(cfg, shapes, b, timing=False) if cpu and not w.full else 0
    extra: dict[str, Any] = {"tokens_per_micro_batch": tokens, "global_batch_rows": w.rows * w.grad_accum * dp}
    if w.full and w.sharded:
        parts = _sharded_state(cfg, shapes, b, dp, w.offload_optimizer, extra)
        parts.update(activations=blocks + loss, framework_reserve=_reserve(device, False, trains=True))
        return MemoryPlan(cfg, layout, dp, device, w, parts, params, params, dtype, None, None,
                          kv_bytes_per_token(cfg, layout, dtype, stage), vocab_align, extra=extra)
    if w.offload_optimizer:
        raise ConfigError("--offload-optimizer needs --full (a sharded full fine-tune)")
    low = dtype != "fp32"  # float32 masters, and float32 copies of the gradients in the update
    largest = max(math.prod(shape) for shape in trained.values())
    fp32_grads = min(4 * trainable, max(GRAD_CHUNK_BYTES, 4 * largest)) if low else 0  # the largest chunk
    parts = dict.fromkeys(KINDS, 0)
    parts.update(weights=params * b + (0 if w.full else trainable * b), packed_weights=packed,
                 activations=blocks + loss, gradients=trainable * b + fp32_grads, optimizer_states=trainable * 8,
                 master_weights=trainable * 4 * low, framework_reserve=_reserve(device, packed > 0, trains=True))
    return MemoryPlan(cfg, layout, dp, device, w, parts, params, trainable, dtype, None, None,
                      kv_bytes_per_token(cfg, layout, dtype, stage), vocab_align, extra=extra)


def shard_numel(shape: tuple[int, ...], dp: int) -> int:
    """Elements of one DP rank's FSDP shard of a parameter: ceil(rows / dp) rows (the largest shard)."""
    return -(-shape[0] // dp) * math.prod(shape[1:])


def _sharded_state(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], b: int, dp: int, offload: bool,
                   extra: dict[str, Any]) -> dict[str, int]:
    """The parameter, gradient and optimizer parts of a sharded full fine-tune (module docstring)."""
    sharded = sum(shard_numel(s, dp) for s in shapes.values())
    root = sum(math.prod(s) for n, s in shapes.items() if not n.startswith("layers."))
    block = sum(math.prod(s) for n, s in shapes.items() if n.startswith("layers.0."))
    two_blocks = block * min(2, cfg.num_hidden_layers)
    host = {"master_weights": 4 * sharded, "gradients": 4 * sharded, "optimizer_states": 8 * sharded}
    extra["sharded_params_per_rank"] = sharded
    extra["host_bytes_per_rank"] = sum(host.values()) if offload else 0
    parts = dict.fromkeys(KINDS, 0)
    parts.update(weights=b * (root + two_blocks), gradients=(b + 4) * block)
    if not offload:
        for kind, n in host.items():
            parts[kind] += n
    return parts
