"""The real Llama shapes (3.1-8B at TP 1 to 16, 70B at TP 8, 405B at TP 8 and 16; 3.2-1B's tied
embeddings) through the real code paths, every TP rank simulated in one process on meta
tensors and torch's fake process group (tests/fake_world.py): what each rank holds, the
engine's chunked prefill and decode steps, a LoRA training step, and the collectives each
issues, held against the Megatron design. Clipping (`clip_grad_norm`) is left out of the LoRA
step: it returns the norm as a Python float, which a meta tensor does not have.

The expected bytes per rank are the memory planner's (`tprt.plan`, what `tprt plan` prints:
`weight_bytes_per_rank`, `kv_bytes_per_token_per_rank`, `lora_bytes_per_rank`), held against the
model the real code builds and the rank files the converter writes; the planner is also held
against a count written here from the configs' shapes alone (`test_planner_matches_the_shapes`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
import torch
from torch.fx.experimental import _config as fx_config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bench.gpu_bench import random_model
from convert.plan import plan_tp
from fake_world import META, CONFIGS, Collective, CollectiveLog, build_rank, fake_world, rank_context, real_config
from tprt.distributed.context import TPContext
from tprt.engine.core import Engine, EngineConfig, kv_pool_blocks, run_to_completion
from tprt.engine.runner import ModelRunner, RunnerConfig, StepResult
from tprt.engine.sampling import SamplingParams
from tprt.engine.graph_buckets import kv_buckets, token_buckets
from tprt.engine.step_graphs import GraphKey, StepGraphs
from tprt.lora.attach import apply_lora
from tprt.lora.config import TARGETS
from tprt.model.batch import BatchRow, TokenBatch
from tprt.model.config import ModelConfig, TPLayout
from tprt.model.kv_cache import MASK_ELEMENTS, CacheStep
from tprt.model.llama import TPLlamaForCausalLM
from tprt.parallel.sharding import LAYER_RULES, hf_sources
from tprt.parallel.spec import get_spec
from tprt.plan import MemoryPlan, ServeWorkload, device, layout_for, lora_parameters, plan_memory
from tprt.train.grads import sync_gradients
from tprt.train.optim import AdamW
from tprt.train.step import compute_loss, dp_loss

BF16 = torch.bfloat16


# ---------------------------------------------------------------- per-rank bytes: the planner's

DTYPES = {2: "bf16", 4: "fp32"}  # itemsize -> the planner's dtype name


def _plan(cfg: ModelConfig, tp: int, itemsize: int) -> MemoryPlan:
    dtype = DTYPES[itemsize]
    return plan_memory(cfg, tp, ServeWorkload(dtype=dtype, kv_dtype=dtype), device("h100-80gb"))


def weight_bytes_per_rank(cfg: ModelConfig, tp: int, itemsize: int) -> int:
    return _plan(cfg, tp, itemsize).weights_bytes_per_rank


def kv_bytes_per_token_per_rank(cfg: ModelConfig, tp: int, itemsize: int) -> int:
    return _plan(cfg, tp, itemsize).kv_bytes_per_token_per_rank


def lora_bytes_per_rank(cfg: ModelConfig, tp: int, rank: int, itemsize: int) -> int:
    shapes = lora_parameters(cfg, layout_for(cfg, tp), TARGETS, rank)
    return sum(math.prod(shape) for shape in shapes.values()) * itemsize


# ---------------------------------------------------------------- per-rank bytes from the shapes alone

def shape_weight_bytes_per_rank(cfg: ModelConfig, tp: int, itemsize: int) -> int:
    """Every rank's weight bytes: the padded vocabulary split, kv heads split or replicated."""
    layout = TPLayout.for_model(cfg, tp)
    h, d = cfg.hidden_size, cfg.head_dim
    q_rows = cfg.num_attention_heads // tp * d
    kv_rows = max(1, cfg.num_key_value_heads // tp) * d  # a replicated kv head is held whole
    layer = (q_rows + 2 * kv_rows) * h + h * q_rows + 3 * (cfg.intermediate_size // tp) * h + 2 * h
    vocab = layout.local_vocab * h * (1 if cfg.tie_word_embeddings else 2)
    return (cfg.num_hidden_layers * layer + vocab + h) * itemsize


def shape_kv_bytes_per_token_per_rank(cfg: ModelConfig, tp: int, itemsize: int) -> int:
    """Keys and values of one token in every layer, this rank's kv heads."""
    return cfg.num_hidden_layers * 2 * max(1, cfg.num_key_value_heads // tp) * cfg.head_dim * itemsize


def shape_lora_bytes_per_rank(cfg: ModelConfig, tp: int, rank: int, itemsize: int) -> int:
    """A LoRA adapter of rank `rank` on all seven projections: column targets keep A [r, hidden]
    whole and split B by output rows; row targets split A by input columns and keep B whole."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size // tp
    q_rows = cfg.num_attention_heads // tp * d
    kv_rows = max(1, cfg.num_key_value_heads // tp) * d
    column = sum(rank * h + rows * rank for rows in (q_rows, kv_rows, kv_rows, i, i))
    row = (rank * q_rows + h * rank) + (rank * i + h * rank)
    return cfg.num_hidden_layers * (column + row) * itemsize


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors of the Hugging Face checkpoint of `cfg`, as transformers names and shapes them."""
    h, d = cfg.hidden_size, cfg.head_dim
    per_layer = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (cfg.num_attention_heads * d, h),
        "self_attn.k_proj.weight": (cfg.num_key_value_heads * d, h),
        "self_attn.v_proj.weight": (cfg.num_key_value_heads * d, h),
        "self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
        "mlp.gate_proj.weight": (cfg.intermediate_size, h), "mlp.up_proj.weight": (cfg.intermediate_size, h),
        "mlp.down_proj.weight": (h, cfg.intermediate_size),
    }
    # every rule of a Llama layer (Qwen's biases and q/k norms, Gemma's extra norms: tests/test_convert.py)
    others = ("self_attn.q_norm.", "self_attn.k_norm.", "pre_feedforward_layernorm.", "post_feedforward_layernorm.")
    assert set(per_layer) == {k for k in LAYER_RULES if not k.endswith(".bias") and not k.startswith(others)}
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_hidden_layers):
        shapes.update({f"model.layers.{n}.{k}": v for k, v in per_layer.items()})
    return shapes


# ---------------------------------------------------------------- what each rank holds

# 3.2-1B: tied embeddings; 405B at TP 16 (two nodes): each kv head held by two ranks.
SLICES = [("llama-3.1-8b", 1), ("llama-3.1-8b", 2), ("llama-3.1-8b", 4), ("llama-3.1-8b", 8),
          ("llama-3.1-70b", 8), ("llama-3.1-405b", 8), ("llama-3.1-405b", 16), ("llama-3.2-1b", 4)]


@pytest.mark.parametrize("name,tp", SLICES)
def test_planner_matches_the_shapes(name: str, tp: int) -> None:
    """The planner's weight, KV and LoRA bytes per rank equal a count from the config's shapes alone."""
    cfg = real_config(name)
    for itemsize in DTYPES:
        assert weight_bytes_per_rank(cfg, tp, itemsize) == shape_weight_bytes_per_rank(cfg, tp, itemsize)
        assert kv_bytes_per_token_per_rank(cfg, tp, itemsize) == shape_kv_bytes_per_token_per_rank(cfg, tp, itemsize)
        assert lora_bytes_per_rank(cfg, tp, 16, itemsize) == shape_lora_bytes_per_rank(cfg, tp, 16, itemsize)


@pytest.mark.parametrize("name,tp", SLICES)
def test_each_rank_holds_exactly_its_slice(name: str, tp: int) -> None:
    """Every parameter of every rank has the shape of the slices the converter writes for that
    rank (fused q/k/v and gate/up included), and the rank's bytes are the shapes' bytes."""
    cfg = real_config(name)
    layout = TPLayout.for_model(cfg, tp)
    shapes = hf_shapes(cfg)
    plan, manifest = plan_tp(list(shapes), shapes, dict.fromkeys(shapes, "BF16"), cfg, layout, "BF16")
    expected_bytes = weight_bytes_per_rank(cfg, tp, 2)
    with fake_world(tp):
        for rank in range(tp):
            model = build_rank(cfg, tp, rank)
            covered = set()
            for pname, p in model.named_parameters():
                parts = [manifest.local_shape(s) for s in hf_sources(pname)]
                covered.update(hf_sources(pname))
                assert tuple(p.shape) == (sum(s[0] for s in parts), *parts[0][1:]), pname
                assert p.dtype == BF16
            assert covered == set(shapes)  # nothing held that the checkpoint lacks, nothing missing
            held = sum(p.numel() * p.element_size() for p in model.parameters())
            assert held == expected_bytes == sum(f.data_bytes for f in plan.files if f.rank == rank)
            head = model.lm_head
            assert head.vocab_start == rank * layout.local_vocab
            assert head.local_valid == max(0, min(layout.local_vocab, cfg.vocab_size - head.vocab_start))


def test_published_per_rank_sizes() -> None:
    """The shapes give the sizes everyone quotes: 70B is 70.6e9 parameters, 17.6 GB per rank at
    TP=8 in bf16 (the padded vocabulary adds 0.02%); 405B does not fit 80 GB at TP=8."""
    cfg70, cfg405 = real_config("llama-3.1-70b"), real_config("llama-3.1-405b")
    assert weight_bytes_per_rank(cfg70, 1, 2) == 2 * 70_553_706_496  # HF's parameter count
    assert 17.6e9 < weight_bytes_per_rank(cfg70, 8, 2) < 17.7e9
    assert weight_bytes_per_rank(cfg405, 8, 2) > 80e9
    assert kv_bytes_per_token_per_rank(cfg70, 8, 2) == 80 * 2 * 1 * 128 * 2  # 40 KiB per token per rank


# ---------------------------------------------------------------- the engine at 70B, TP=8

def inference_collectives(cfg: ModelConfig, layout: TPLayout, rows: int, width: int, full_logits: bool,
                          gathered_rows: int | None = None) -> list[Collective]:
    """Megatron's inference forward: the embedding's all-reduce, two per layer (after attention
    and after the MLP), each [rows, width, hidden] in the model dtype; then the LM head's: the
    local logits [rows, local_vocab] gathered to rank 0 alone for sampling (no other rank holds
    the vocabulary), or one (value, id) pair per row all-gathered for greedy; none when no row
    returns logits (`gathered_rows` 0)."""
    h = cfg.hidden_size
    out = [Collective("all_reduce", (rows, width, h), BF16, "SUM")] * (1 + 2 * cfg.num_hidden_layers)
    n = rows if gathered_rows is None else gathered_rows
    if n == 0:
        return out
    gather = Collective("gather", (n, layout.local_vocab), BF16) if full_logits \
        else Collective("all_gather", (n, 2), torch.float64)
    return out + [gather]


def step_collectives(cfg: ModelConfig, layout: TPLayout, batch: TokenBatch, max_batch: int) -> list[Collective]:
    """What one `ModelRunner.execute(batch)` must issue on every rank: one forward call over the
    batch's tokens ([tokens, 1, hidden]), with static decode over `max_batch` slots (a batch of
    one-token rows padded to a token bucket)."""
    if batch.max_query_len == 1:
        rows = next(b for b in token_buckets(max_batch) if b >= batch.num_rows)  # a static step: padded to a bucket
        return inference_collectives(cfg, layout, rows, 1, batch.full_logits, gathered_rows=batch.num_logits)
    return inference_collectives(cfg, layout, batch.num_tokens, 1, batch.full_logits, gathered_rows=batch.num_logits)


def record_steps(runner: ModelRunner) -> list[CacheStep]:
    """What every attention group of `runner`'s forward calls attends with (keys, mask), in order
    (from now on)."""
    seen: list[CacheStep] = []
    prepare = runner.cache.prepare

    def recording(positions: torch.Tensor, tables: torch.Tensor, kv_len: int | None = None,
                  starts: tuple[int, ...] | None = None) -> CacheStep:
        step = prepare(positions, tables, kv_len, starts)
        seen.append(step)
        return step

    runner.cache.prepare = recording  # type: ignore[method-assign]
    return seen


def step_kv_lens(batch: TokenBatch, max_seq_len: int) -> list[int]:
    """The keys each attention group of the batch must read (tprt.model.attention): a static
    decode step's the smallest key bucket holding its rows, not max_seq_len; otherwise the
    one-token rows' up to their last position, then each run of prompt chunks' up to its end."""
    if batch.max_query_len == 1:
        return [next(k for k in kv_buckets(max_seq_len) if k >= batch.kv_len)]
    singles = [s + 1 for s, n in zip(batch.starts, batch.lens) if n == 1]
    runs, r = [], 0
    while r < batch.num_rows:
        end = r
        while end < batch.num_rows and (batch.starts[end], batch.lens[end]) == (batch.starts[r], batch.lens[r]):
            end += 1
        if batch.lens[r] > 1:
            runs.append(batch.starts[r] + batch.lens[r])
        r = end
    return ([max(singles)] if singles else []) + runs


class RecordingRunner:
    """Wraps rank 0's runner: records each batch, runs it on meta, checks the result's shapes and
    hands the engine values it can sample from (a meta tensor has none): zeros of those shapes."""

    def __init__(self, runner: ModelRunner, vocab: int) -> None:
        self.runner, self.vocab = runner, vocab
        self.plans: list[TokenBatch] = []

    def threads_for(self, batch: TokenBatch) -> Any:
        return self.runner.threads_for(batch)

    def execute(self, batch: TokenBatch) -> StepResult:
        self.plans.append(batch)
        result = self.runner.execute(batch)
        n = batch.num_logits
        if n == 0:
            assert result.ids is None and result.logits is None
            return result
        if batch.full_logits:
            assert result.ids is None and result.logits is not None
            assert result.logits.shape == (n, self.vocab) and result.logits.dtype == torch.float32
            return StepResult(None, torch.zeros(n, self.vocab))
        assert result.logits is None and result.ids is not None and result.ids.shape == (n,)
        return StepResult(torch.zeros(n, dtype=torch.long), None)


def test_engine_chunked_prefill_and_decode_70b_tp8() -> None:
    """Rank 0's real Engine schedules three requests (one prefilled in chunks across steps,
    one asking for logprobs, so full-vocabulary logits); every rank executes the same plans with
    its own shard and KV cache and issues exactly the collectives of the Megatron design."""
    cfg = real_config("llama-3.1-70b")
    tp, slots, max_seq = 8, 4, 4096
    layout = TPLayout.for_model(cfg, tp)
    config = EngineConfig(max_batch=slots, max_seq_len=max_seq, token_budget=512, cuda_graphs="decode")
    log = CollectiveLog()
    with fake_world(tp), log.recording():
        engine = Engine(build_rank(cfg, tp, 0), None, config, eos_token_ids=())
        steps = record_steps(engine.runner)
        recorder = RecordingRunner(engine.runner, cfg.vocab_size)
        engine.runner = recorder  # type: ignore[assignment]
        prompts = {"short": 40, "long": 600, "logprobs": 100}
        new_tokens = {"short": 4, "long": 3, "logprobs": 3}  # the short one still decodes when the others join
        for rid, n in prompts.items():
            params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens[rid], ignore_eos=True,
                                    logprobs=rid == "logprobs")
            engine.add([(7 * k) % cfg.vocab_size for k in range(n)], params, rid)
        done = run_to_completion(engine)
        assert {r: len(c.token_ids) for r, c in done.items()} == new_tokens
        rank0 = log.take()
        plans = recorder.plans
        chunks = [(p.starts[r], p.lens[r]) for p in plans for r in range(p.num_rows) if p.logits[r] < p.lens[r]]
        assert any(n < prompts["long"] and start > 0 for start, n in chunks), "no chunked prefill"
        assert any(p.max_query_len > 1 and 1 in p.lens for p in plans), "no mixed step"
        assert max(p.num_rows for p in plans if p.max_query_len == 1) == 3
        expected = [c for p in plans for c in step_collectives(cfg, layout, p, slots)]
        assert [c for c in rank0 if c.op != "broadcast"] == expected
        kv_lens = [step.kv_len for step in steps]
        assert kv_lens == [k for p in plans for k in step_kv_lens(p, max_seq)]
        assert max(kv_lens) <= 1024 < max_seq
        # Each plan reaches the other ranks as one STEP message: a header, then the plan's ints.
        assert sum(c.op == "broadcast" for c in rank0) == 2 * len(plans)

        for rank in range(1, tp):
            model = build_rank(cfg, tp, rank)
            runner = ModelRunner(model, kv_pool_blocks(config, max_seq), config.kv_block_size, slots, max_seq,
                                 RunnerConfig(cuda_graphs="decode"))
            steps = record_steps(runner)
            n_blocks = slots * max_seq // config.kv_block_size + 1  # the same pool as rank 0's, and scratch
            assert runner.cache.kv.shape == (cfg.num_hidden_layers, n_blocks, 2, 1, config.kv_block_size,
                                             cfg.head_dim)
            assert runner.cache.nbytes() == kv_bytes_per_token_per_rank(cfg, tp, 2) * n_blocks * config.kv_block_size
            for plan in plans:
                out = runner.execute(plan)
                if plan.full_logits:
                    assert out.logits is None and out.ids is None, "a follower holds the vocabulary's logits"
            assert log.take() == expected, f"rank {rank}"
            assert [step.kv_len for step in steps] == [k for p in plans for k in step_kv_lens(p, max_seq)]


def test_static_steps_over_key_buckets_give_the_eager_tokens(tmp_path: Path) -> None:
    """The key buckets on real values: one sequence (batch 1 is a bucket: no padding row, so the
    CPU kernels may read it) crosses the 16-, 32- and 64-key buckets and generates the tokens
    of the eager path. (On CUDA the buckets are the default; on CPU this test sets them.)"""
    config = json.loads((CONFIGS / "llama-3.1-8b" / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = random_model(tmp_path / "config.json", TPContext.single("cpu"), torch.float32)

    def generate(static: bool) -> list[int]:
        config = EngineConfig(max_batch=2, max_seq_len=128, cuda_graphs="decode" if static else "off")
        engine = Engine(model, None, config, eos_token_ids=())
        if static:
            assert engine.runner.graphs is not None
            engine.runner.graphs.kv_buckets = kv_buckets(128, smallest=16)
        engine.add(list(range(3, 13)), SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True), "a")
        return run_to_completion(engine)["a"].token_ids

    kv_lens: list[int] = []
    forward = StepGraphs._forward

    def recording(self: StepGraphs, key: GraphKey) -> torch.Tensor:
        kv_lens.append(key.kv_len)
        return forward(self, key)

    with patch.object(StepGraphs, "_forward", recording):
        static = generate(True)
    assert sorted(set(kv_lens)) == [16, 32, 64, 128]
    assert static == generate(False)


def test_long_context_decode_70b_tp8() -> None:
    """Sixteen sequences of the full 128K context on the last rank: a paged cache of more than
    2**31 elements, rows at their very end, their block tables in pool order and not."""
    cfg = real_config("llama-3.1-70b")
    tp, slots, max_seq, size = 8, 16, cfg.max_position_embeddings, 16
    per_seq = max_seq // size
    layout = TPLayout.for_model(cfg, tp)
    log = CollectiveLog()
    with fake_world(tp), log.recording():
        runner = ModelRunner(build_rank(cfg, tp, tp - 1), slots * per_seq + 1, size, slots, max_seq,
                             RunnerConfig(cuda_graphs="decode"))
        assert runner.cache.kv.numel() > 2**31
        assert runner.cache.nbytes() == kv_bytes_per_token_per_rank(cfg, tp, 2) * (slots * per_seq + 1) * size
        starts = tuple(max_seq - 1 - s for s in range(slots))
        for order in (tuple(range(slots)), tuple(reversed(range(slots)))):
            tables = tuple(tuple(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in order)
            plan = TokenBatch.of([BatchRow(t, s, (1,), 1) for t, s in zip(tables, starts)])
            result = runner.execute(plan)
            assert result.ids is not None and result.ids.shape == (slots,)
            assert log.take() == step_collectives(cfg, layout, plan, slots)


def test_long_context_prefill_mask_70b_tp8() -> None:
    """A 2048-token chunk at the end of the 128K context, beside a second row at another start:
    each row's attention mask is a staircase of at most MASK_ELEMENTS (bf16: 32 MiB), not a mask
    of chunk x context per row (2 x 2048 x 128K x 2 bytes: 1 GiB), and the queries go in blocks."""
    cfg = real_config("llama-3.1-70b")
    tp, slots, max_seq, chunk = 8, 2, cfg.max_position_embeddings, 2048
    layout = TPLayout.for_model(cfg, tp)
    log = CollectiveLog()
    with fake_world(tp), log.recording():
        per_seq = max_seq // 16
        runner = ModelRunner(build_rank(cfg, tp, 0), slots * per_seq + 1, 16, slots, max_seq,
                             RunnerConfig(cuda_graphs="decode"))
        steps = record_steps(runner)
        starts = (max_seq - chunk, max_seq - 3 * chunk)
        tables = tuple(tuple(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(slots))
        plan = TokenBatch.of([BatchRow(t, s, (1,) * chunk, 1) for t, s in zip(tables, starts)], full_logits=True)
        result = runner.execute(plan)
        assert result.logits is not None and result.logits.shape == (2, cfg.vocab_size)
        assert log.take() == step_collectives(cfg, layout, plan, slots)
    # One attention group per row (their starts differ), each with its staircase in query blocks.
    assert [(step.kv_len, step.starts) for step in steps] == [(s + chunk, (s,)) for s in starts]
    for step in steps:
        assert step.masks[None].numel() <= MASK_ELEMENTS and step.masks[None].shape == (MASK_ELEMENTS // step.kv_len, step.kv_len)
    assert steps[0].masks[None].numel() * steps[0].masks[None].element_size() == 32 << 20


# ---------------------------------------------------------------- a LoRA step at scale

class LargestTensors(TorchDispatchMode):
    """Watches every op's outputs: the largest tensor made on the host, and the widest last
    dimension of a matrix on the device."""

    def __init__(self) -> None:
        super().__init__()
        self.widest = 0
        self.host_numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim():
                if t.device.type == "cpu":
                    self.host_numel = max(self.host_numel, t.numel())
                elif t.dim() > 1:  # [rows, features]; 1-D buffers (the gradient sync's) are flat
                    self.widest = max(self.widest, t.shape[-1])
        return out


@contextmanager
def all_tokens_are_targets() -> Iterator[None]:
    """Meta tensors have no values: boolean masks (the loss's target positions) select everything."""
    with fx_config.patch(meta_nonzero_assume_all_nonzero=True):  # type: ignore[attr-defined]
        yield


def lora_step(model: TPLlamaForCausalLM, batch: int, seq: int, log: CollectiveLog) -> dict[str, list[Collective]]:
    """One LoRA step as the trainer takes it (forward with the vocab-parallel loss, backward,
    gradient sync, AdamW); the collectives of each phase."""
    ctx = model.tp
    params = apply_lora(model, TARGETS, rank=16, alpha=32.0)
    ids = torch.zeros(batch, seq, dtype=torch.long, device=ctx.device)
    phases = {}
    with all_tokens_are_targets():
        loss_sum, n_tokens = compute_loss(model, ids, ids)
    phases["forward"] = log.take()
    loss, _ = dp_loss(loss_sum, n_tokens, ctx)
    loss.backward()
    phases["backward"] = log.take()
    sync_gradients(model, ctx)
    phases["sync"] = log.take()
    AdamW(params, lr=1e-4).step()
    phases["optimizer"] = log.take()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in params)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    return phases


# 70B on its last rank, which holds the vocabulary's padding; the collectives are every rank's.
# Its every op is watched (`LargestTensors`; slow, so there only).
LORA_CASES = [("llama-3.1-70b", 8, 7, True), ("llama-3.1-8b", 1, 0, False), ("llama-3.1-8b", 2, 1, False),
              ("llama-3.1-8b", 4, 3, False), ("llama-3.1-8b", 8, 5, False), ("llama-3.1-8b", 16, 9, False)]


@pytest.mark.parametrize("name,tp,rank,watched", LORA_CASES)
def test_lora_training_step(name: str, tp: int, rank: int, watched: bool) -> None:
    """Forward: the inference all-reduces plus the loss's two reductions of [tokens] (never the
    vocabulary). Backward: one all-reduce per column-parallel input that needs a gradient (two
    per layer less the first layer's attention input, whose embedding is frozen, plus the LM
    head's). Sync: the replicated LoRA factors' partial gradients, summed. No tensor on any
    rank spans the whole vocabulary, and nothing of a layer's size is made on the host."""
    cfg = real_config(name)
    layout = TPLayout.for_model(cfg, tp)
    batch, seq = 2, 512
    tokens = batch * (seq - 1)
    h, n_layers = cfg.hidden_size, cfg.num_hidden_layers
    log = CollectiveLog()
    watch = LargestTensors()
    with fake_world(tp), log.recording():
        model = build_rank(cfg, tp, rank)
        with watch if watched else nullcontext():
            phases = lora_step(model, batch, seq, log)
    lora = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() * p.element_size() for p in lora) == lora_bytes_per_rank(cfg, tp, 16, 2)
    if tp == 1:
        assert all(not calls for calls in phases.values())
        return
    hidden = Collective("all_reduce", (batch, seq, h), BF16, "SUM")
    assert phases["forward"] == [hidden] * (1 + 2 * n_layers) + [
        Collective("all_reduce", (tokens,), torch.float32, "MAX"),
        Collective("all_reduce", (2, tokens), torch.float32, "SUM"),
    ]
    assert phases["backward"] == [Collective("all_reduce", (tokens, h), BF16, "SUM")] + [hidden] * (2 * n_layers - 1)
    specs = [(p, get_spec(p)) for p in lora]
    partial = sum(p.numel() for p, spec in specs if spec is not None and spec.partial_grad)
    # With TP > kv heads (8B at TP 16) the k/v LoRA B rows are summed over the ranks sharing a head.
    shared_kv = sum(p.numel() for p, spec in specs if spec is not None and spec.kv_replication > 1)
    assert (shared_kv > 0) == (layout.kv_replication > 1)
    assert all(c.op == "all_reduce" and c.dtype == torch.float32 for c in phases["sync"])
    assert sum(c.shape[0] for c in phases["sync"]) == partial + shared_kv
    assert phases["optimizer"] == []
    if not watched:
        return
    assert watch.widest < cfg.vocab_size  # the widest is this rank's vocabulary block
    assert watch.widest == max(layout.local_vocab, cfg.intermediate_size // tp * 2, h)
    assert watch.host_numel < h * 64  # LoRA's seeded init, drawn on the host, is [rank, features]


def test_sequence_parallel_lora_training_step_70b_tp8() -> None:
    """Megatron's sequence parallelism (issue 44) on 70B at TP 8: the forward's all-reduces of
    [batch, seq, hidden] become a reduce-scatter after the embedding and each row-parallel layer
    and an all-gather of seq / 8 before each column-parallel layer and the LM head; the backward
    issues their conjugates, and the only all-reduce of a hidden-sized tensor left is the LM
    head's input gradient (its vocabulary-parallel product)."""
    from tprt.train.step import enable_sequence_parallel

    cfg = real_config("llama-3.1-70b")
    tp, batch, seq = 8, 1, 512
    h, n_layers = cfg.hidden_size, cfg.num_hidden_layers
    log = CollectiveLog()
    with fake_world(tp), log.recording():
        model = build_rank(cfg, tp, 7)
        enable_sequence_parallel(model)
        phases = lora_step(model, batch, seq, log)
    scatter = Collective("reduce_scatter_single", (seq, batch, h), BF16)  # seq first: the split dimension
    gather = Collective("all_gather_single", (seq // tp, batch, h), BF16)
    tokens = batch * (seq - 1)
    assert phases["forward"] == [scatter] + [gather, scatter] * (2 * n_layers) + [gather] + [
        Collective("all_reduce", (tokens,), torch.float32, "MAX"),
        Collective("all_reduce", (2, tokens), torch.float32, "SUM"),
    ]
    backward = phases["backward"]
    assert backward[0] == Collective("all_reduce", (tokens, h), BF16, "SUM")  # the LM head's input gradient
    assert all(c in (scatter, gather) for c in backward[1:]) and len(backward) - 1 >= 4 * n_layers - 1


def test_405b_pipeline_stages_at_tp8_pp2_hold_what_the_planner_says() -> None:
    """405B at TP 8 x PP 2 (issue 44), each stage built on meta as load_stage builds it: the
    first holds the embedding and layers 0-62, the second layers 63-125, the final norm and the
    LM head, each exactly the planner's bytes for its stage (and together the whole model's);
    a stage's forward runs its own layers over the previous stage's hidden states."""
    from tprt.model.stage import AbsentLayer, TPLlamaStage
    from tprt.parallel.stages import stages
    from tprt.plan.shapes import layout_for, numel, rank_parameters

    cfg = real_config("llama-3.1-405b")
    layout = layout_for(cfg, 8)
    parts = stages(cfg.num_hidden_layers, 2)
    with fake_world(8):
        built = []
        for st in parts:
            with META:
                built.append(TPLlamaStage(cfg, TPLayout.for_model(cfg, 8), rank_context(7, 8), st, torch.bfloat16))
        for st, model in zip(parts, built):
            held = {n: tuple(p.shape) for n, p in model.named_parameters()}
            assert held == rank_parameters(cfg, layout, st)
            assert sum(isinstance(layer, AbsentLayer) for layer in model.layers) == cfg.num_hidden_layers - 63
        assert sum(numel(rank_parameters(cfg, layout, st)) for st in parts) == numel(rank_parameters(cfg, layout))
        hidden = torch.empty(1, 16, cfg.hidden_size, dtype=torch.bfloat16, device=META)
        assert built[1](hidden).shape == (1, 16, cfg.hidden_size)
