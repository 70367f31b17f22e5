"""The TP model against transformers at TP 1, 2, 4 and 8: LlamaForCausalLM, and Qwen2 (q/k/v
biases), Qwen3 (q/k norms, explicit head_dim, attention_bias) and Mistral (a sliding window
shorter than the prompts) for the families beyond it.

One module-scoped setup writes six tiny HF checkpoints (gqa, rope_pad, tied, qwen2, qwen3, mistral), converts each to
TP 1/2/4/8 with `convert.api.hf_to_tp`, and records transformers' logits (per prompt, fp32) and
greedy generations. Each TP world (tests/mp.py: one gloo world per size) then runs every check:
uneven batched prompts, cached prefill/decode with continuous batching over a paged KV cache
(blocks of 5), recomputation without the cache, bf16 loading and a TP mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from helpers import FAMILY_CONFIGS, force_native_decode, forward_rows, make_hf_llama, make_hf_model
from mp import Checks, WorldResults, names, run_single, run_world
from tprt.checkpoint.format import TPCheckpoint
from tprt.model.config import ModelConfig
from tprt.distributed.context import TPContext
from tprt.errors import CheckpointError, ConfigError
from tprt.model.attention import TorchAttention
from tprt.model.batch import BatchRow, TokenBatch
from tprt.model.kv_cache import KVCache, kv_cache_dtype, quantize
from tprt.model.kv_scales import calibrate, scales_from_amax
from tprt.checkpoint.loading import load_model
from tprt.cpu import native
from tprt.cpu.fast_linear import prepack
from tprt.cpu.quant_linear import Int8Head
from tprt.parallel.sharding import hf_sources
from tprt.model.llama import LayerStack, TPLlamaForCausalLM

CONFIGS = ("gqa", "rope_pad", "tied", *FAMILY_CONFIGS)
TPS = (1, 2, 4, 8)
PROMPT_LENS = (7, 12, 4)  # uneven on purpose
N_NEW = 32
TOL = 1e-4  # max |ours - transformers| relative to max |transformers logit|
QUANT_GROUP = 16  # the int8 checkpoints' group size (per channel at TP 8: 8 columns per rank)
QUANT_TOL = 2e-2  # int8 weights: max logit error relative to the max logit (measured ~7e-3)
QUANT_AGREE = 0.9  # int8 weights: share of positions whose top-1 token is transformers'


# ----------------------------------------------------------------------------- setup (parent only)


def _reference(hf_dir: Path, vocab: int) -> dict[str, Any]:
    """transformers' fp32 logits of each prompt and its greedy continuation of N_NEW tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # always N_NEW tokens
    model.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    logits, generated = [], []
    model.zero_grad()
    _lm_loss(model(_pad(prompts)[0]).logits, prompts).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            logits.append(model(ids).logits[0])  # [len, vocab]
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False)
            generated.append(out[0, len(p) :].tolist())
    # The largest |key| (after RoPE) and |value| each layer's kv heads hold over every prompt and
    # its continuation, from transformers' own cache: tprt.model.kv_scales.calibrate's reference.
    amax = torch.zeros(model.config.num_hidden_layers, 2, model.config.num_key_value_heads)
    with torch.no_grad():
        for p, g in zip(prompts, generated):
            out = model(torch.tensor([p + g]), use_cache=True)
            cache = out["cache"] if "cache" in out else out["past_key_values"]  # renamed in transformers 5.2x
            for i, layer in enumerate(cache.layers):  # keys / values [1, kv_heads, seq, head_dim]
                for j, x in enumerate((layer.keys, layer.values)):
                    amax[i, j] = torch.maximum(amax[i, j], x.abs().amax(dim=(0, 2, 3)))
    return {"prompts": prompts, "logits": logits, "generated": generated, "grads": grads, "kv_amax": amax}


def _lm_loss(logits: torch.Tensor, prompts: list[list[int]]) -> torch.Tensor:
    """Summed next-token cross-entropy over each prompt's real tokens; logits [batch, seq, vocab]."""
    losses = [
        F.cross_entropy(logits[b, : len(p) - 1], torch.tensor(p[1:], device=logits.device), reduction="sum")
        for b, p in enumerate(prompts)
    ]
    return torch.stack(losses).sum()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from convert.api import hf_to_tp

    root = tmp_path_factory.mktemp("model_tp")
    for i, name in enumerate(CONFIGS):
        hf_dir = (make_hf_model if name in FAMILY_CONFIGS else make_hf_llama)(root / f"{name}-hf", name, seed=i)
        for tp in TPS:
            hf_to_tp(hf_dir, root / f"{name}-tp{tp}", tp)
            if name == "gqa":  # int8 groups of 16 where each rank's o/down columns hold them, else per channel
                hf_to_tp(hf_dir, root / f"{name}-int8-tp{tp}", tp, quantize="int8",
                         group_size=QUANT_GROUP if 64 // tp >= QUANT_GROUP else None)
        vocab = ModelConfig.from_file(hf_dir / "config.json").vocab_size
        torch.save(_reference(hf_dir, vocab), root / f"{name}-ref.pt")
    return root


# ----------------------------------------------------------------------------- helpers (every rank)

_MODELS: dict[tuple[str, str, int, str], TPLlamaForCausalLM] = {}


def _model(ctx: TPContext, workdir: Path, name: str, dtype: str = "fp32") -> TPLlamaForCausalLM:
    """This rank's model for `name` at this TP size, loaded once per process."""
    key = (str(workdir), name, ctx.world_size, dtype)
    if key not in _MODELS:
        _MODELS[key] = load_model(workdir / f"{name}-tp{ctx.world_size}", ctx, dtype=dtype)
    return _MODELS[key]


def _ref(workdir: Path, name: str) -> dict[str, Any]:
    ref: dict[str, Any] = torch.load(workdir / f"{name}-ref.pt")
    return ref


def _pad(rows: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """Right-padded ids [batch, max_len] (pad id 0) and each row's length."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows]), [len(r) for r in rows]


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str, tol: float = TOL) -> None:
    scale = ref.float().abs().max().item() or 1.0  # an all-zero reference (a padding-only shard) must be met exactly
    err = (ours.detach().float().cpu() - ref.float().cpu()).abs().max().item() / scale  # references live on the CPU
    assert err <= tol, f"{what}: max error {err:.2e} of the logit scale > {tol:.0e}"


@dataclass
class _Seq:
    """A sequence being generated: its prompt, KV block table, greedy tokens and their full logits."""

    prompt: list[int]
    table: list[int]
    out: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


def _step(model: TPLlamaForCausalLM, cache: KVCache, seqs: list[_Seq]) -> None:
    """One engine-like step: new sequences feed their prompt (prefill), running ones their last
    token (decode), all in one batch of tokens; each gets one greedy token."""
    chunks = [[s.out[-1]] if s.out else s.prompt for s in seqs]
    starts = [len(s.prompt) + len(s.out) - 1 if s.out else 0 for s in seqs]
    batch = TokenBatch.of([BatchRow(tuple(s.table), a, tuple(c), 1) for s, a, c in zip(seqs, starts, chunks)])
    with torch.inference_mode():
        local = model(torch.tensor(batch.tokens), attention=TorchAttention().prepare(batch, cache))  # [batch, local_vocab]
        full = model.gather_logits(local)  # [batch, vocab]
    for s, t, row in zip(seqs, full.argmax(-1).tolist(), full):
        s.out.append(t)
        s.logits.append(row)


BLOCK = 5  # positions per KV block: an odd size, so sequences cross block edges at odd places
TABLE = 13  # blocks per sequence: 65 positions


def _garbage_cache(model: TPLlamaForCausalLM, n_seqs: int) -> tuple[KVCache, list[int]]:
    """A paged cache for n_seqs sequences whose every entry holds (finite) junk, as blocks left by
    earlier sequences do, and its free blocks in a scattered order."""
    cache = model.new_cache(n_seqs * TABLE + 1, BLOCK)
    cache.kv.normal_()
    free = (torch.randperm(n_seqs * TABLE, generator=torch.Generator().manual_seed(n_seqs)) + 1).tolist()
    return cache, free


def _take(free: list[int]) -> list[int]:
    """A sequence's block table, from the free blocks."""
    table, free[:] = free[:TABLE], free[TABLE:]
    return table


# ----------------------------------------------------------------------------- checks (every rank)


def check_logits(ctx: TPContext, workdir: Path, name: str) -> None:
    """Uneven right-padded prompts in one batch, no cache: every real position's logits match."""
    ref, model = _ref(workdir, name), _model(ctx, workdir, name)
    ids, lens = _pad(ref["prompts"])
    with torch.inference_mode():
        full = model.gather_logits(model(ids))  # [batch, seq, vocab]
    assert full.shape[-1] == model.config.vocab_size, "padding leaked into gathered logits"
    for b, n in enumerate(lens):
        _assert_close(full[b, :n], ref["logits"][b], f"prompt {b}")


def check_int8_logits(ctx: TPContext, workdir: Path, name: str) -> None:
    """The int8 checkpoint (each rank its own scales, groups whole) is close to transformers'
    float logits and agrees on nearly every top-1 token; prepacked, 12 decode rows in the
    compiled stack give the layer path's logits."""
    ref, model = _ref(workdir, name), _model(ctx, workdir, f"{name}-int8")
    ids, lens = _pad(ref["prompts"])
    with torch.inference_mode():
        full = model.gather_logits(model(ids))  # [batch, seq, vocab]
    agree = total = 0
    for b, n in enumerate(lens):
        _assert_close(full[b, :n], ref["logits"][b], f"prompt {b} (int8)", QUANT_TOL)
        agree += int((full[b, :n].argmax(-1).cpu() == ref["logits"][b].argmax(-1)).sum())
        total += n
    assert agree >= QUANT_AGREE * total, f"int8 top-1 agreement {agree}/{total}"
    if ctx.device.type != "cpu":  # the int8 LM head and the compiled stack below are CPU kernels
        return
    packed = load_model(workdir / f"{name}-int8-tp{ctx.world_size}", ctx)
    prepack(packed)  # the LM head in int8 too (tprt.cpu.quant_linear.Int8Head), each rank its vocabulary rows
    assert isinstance(packed.lm_head.method.base, Int8Head)
    for b, n in enumerate(lens):
        assert n <= native.MAX_Q8_ROWS  # one prompt's rows take the compiled int8 head
        with torch.inference_mode():
            one = packed.gather_logits(packed(ids[b : b + 1, :n]))[0]  # [n, vocab]
        _assert_close(one, ref["logits"][b], f"prompt {b} (int8, int8 LM head)", QUANT_TOL)
    # 12 rows (each prompt 4 times) decoding in one call of the compiled stack (an int8 model's
    # 9-32 rows; the all-reduces in C where TP > 1) against the layers one by one.
    from tprt.cpu.native_layers import NativeDecodeStack, install_native_layers

    install_native_layers(packed)
    stack = packed.stack
    assert isinstance(stack, NativeDecodeStack) == (native.available() and ctx.device.type == "cpu")
    if not isinstance(stack, NativeDecodeStack):
        return
    assert stack.max_rows == native.STACK_MAX_Q8_ROWS
    cache, free = _garbage_cache(packed, 12)
    seqs = [_Seq(p, _take(free)) for p in ref["prompts"] * 4]
    _step(packed, cache, seqs)  # one prefill of every prompt
    for _ in range(4):
        packed.stack = LayerStack()
        modules = [_Seq(s.prompt, s.table, list(s.out)) for s in seqs]
        _step(packed, cache, modules)
        packed.stack = stack
        _step(packed, cache, seqs)
        for s, m in zip(seqs, modules):  # float32: the norms' and attention's sums in another order
            _assert_close(s.logits[-1], m.logits[-1], "12 int8 rows: stack vs layers")


def check_cached_prefill(ctx: TPContext, workdir: Path, name: str) -> None:
    """Prefill into a paged cache (rows in scattered blocks) with last-position logits only; the
    vocab-parallel greedy pick equals the argmax of the gathered logits."""
    ref, model = _ref(workdir, name), _model(ctx, workdir, name)
    lens = [len(p) for p in ref["prompts"]]
    cache, free = _garbage_cache(model, len(lens))
    batch = TokenBatch.of([BatchRow(tuple(_take(free)), 0, tuple(p), 1) for p in ref["prompts"]])
    with torch.inference_mode():
        local = model(torch.tensor(batch.tokens), attention=TorchAttention().prepare(batch, cache))  # [batch, local_vocab]
        full = model.gather_logits(local)
    assert full.shape == (len(lens), model.config.vocab_size)
    with torch.inference_mode():
        greedy = model.greedy(local)
    assert torch.equal(greedy, full.argmax(-1)), "vocab-parallel greedy differs from argmax of gathered logits"
    for b, n in enumerate(lens):
        _assert_close(full[b], ref["logits"][b][n - 1], f"prompt {b} last position")


def check_greedy(ctx: TPContext, workdir: Path, name: str) -> None:
    """32 greedy tokens for the whole batch (in scattered KV blocks of 5) equal transformers'
    generate(); every cached decode step's logits equal a recomputation without the cache."""
    ref, model = _ref(workdir, name), _model(ctx, workdir, name)
    cache, free = _garbage_cache(model, 4)
    seqs = [_Seq(p, _take(free)) for p in ref["prompts"]]
    for _ in range(N_NEW):
        _step(model, cache, seqs)
    for b, s in enumerate(seqs):
        assert s.out == ref["generated"][b], f"prompt {b}: greedy tokens differ from transformers' generate"
    ids, _ = _pad([s.prompt + s.out[:-1] for s in seqs])
    with torch.inference_mode():
        full = model.gather_logits(model(ids))  # [batch, seq, vocab]
    for b, s in enumerate(seqs):
        n = len(s.prompt)
        _assert_close(torch.stack(s.logits), full[b, n - 1 : n - 1 + N_NEW], f"prompt {b} cached vs recomputed", 1e-5)


def check_native_stack(ctx: TPContext, workdir: Path, name: str, dtype: str = "fp32") -> None:
    """CPU decode with every layer in one compiled call (tprt.cpu.native_layers' stack; the
    all-reduces in C through shared memory where TP > 1). Each prompt alone: every decode step's
    logits bit-equal to the same layers run half by half. All prompts in one batch (3 rows per
    step): logits close to the layers run one by one. In fp32, transformers' greedy tokens."""
    from tprt.cpu import native

    ref = _ref(workdir, name)
    model = load_model(workdir / f"{name}-tp{ctx.world_size}", ctx, dtype=dtype)  # its own: kernels are set on it
    calls = force_native_decode(model)
    from tprt.cpu.native_layers import NativeDecodeStack

    stack = model.stack
    assert isinstance(stack, NativeDecodeStack) == (native.available() and ctx.device.type == "cpu")
    cache, free = _garbage_cache(model, 6)
    prefill_calls = 0  # the stack takes prompts of a few tokens too; counted apart
    for b, prompt in enumerate(ref["prompts"]):
        seq = _Seq(prompt, _take(free))
        before = calls[1]
        _step(model, cache, [seq])  # prefill
        prefill_calls += calls[1] - before
        for _ in range(N_NEW - 1):
            model.stack = LayerStack()  # the halves first: the stack then rewrites the same k/v
            halves = _Seq(prompt, seq.table, list(seq.out))
            _step(model, cache, [halves])
            model.stack = stack
            _step(model, cache, [seq])
            assert torch.equal(seq.logits[-1], halves.logits[-1]), f"prompt {b}: stack and halves differ"
        if dtype == "fp32":
            assert seq.out == ref["generated"][b], f"prompt {b}: greedy tokens differ from transformers' generate"
    decode_calls = calls[1] - prefill_calls
    assert (decode_calls == len(ref["prompts"]) * (N_NEW - 1)) == (native.available() and ctx.device.type == "cpu"), calls
    # Every prompt in one batch: decode steps of 3 rows in one call each, against the layers one by one.
    seqs = [_Seq(p, _take(free)) for p in ref["prompts"]]
    before = calls[1]
    _step(model, cache, seqs)  # one prefill of every prompt
    prefill_calls += calls[1] - before
    for _ in range(N_NEW - 1):
        model.stack = LayerStack()
        modules = [_Seq(s.prompt, s.table, list(s.out)) for s in seqs]
        _step(model, cache, modules)
        model.stack = stack
        _step(model, cache, seqs)
        # bf16: Gemma 2's logits are capped at 2 here, so the same rounding is a larger share of their scale
        bf16_tol = 3e-2 if model.config.final_logit_softcapping else 2e-2
        for s, m in zip(seqs, modules):  # the few-row products and SwiGLU round their own way
            _assert_close(s.logits[-1], m.logits[-1], "3 rows: stack vs layers", TOL if dtype == "fp32" else bf16_tol)
    if dtype == "fp32":
        assert [s.out for s in seqs] == ref["generated"], "3 rows: greedy tokens differ from transformers' generate"
    decode_calls = calls[1] - prefill_calls
    assert (decode_calls == (len(ref["prompts"]) + 1) * (N_NEW - 1)) == (native.available() and ctx.device.type == "cpu"), calls


# Quantized KV caches (tprt.model.kv_cache): max |logit error| over the logit scale against the
# uncached recomputation, and the share of greedy picks that must agree with transformers' (a
# pick that differs must be a near-tie: its lead over transformers' pick within KV_TOL too).
# int8-static: an int8 cache with static scales calibrated on the prompts and their continuations.
KV_TOL = {"int8": 1e-2, "fp8": 4e-2, "int8-static": 2e-2}  # measured at TP 1: 3.5e-3, 1.5e-2, 7.5e-3
KV_AGREE = {"int8": 0.95, "fp8": 0.95, "int8-static": 0.95}  # measured: 94 of 96 (the others near-ties), 95, 95


def _quantized_garbage(model: TPLlamaForCausalLM, n_seqs: int, kv: str,
                       kv_scales: torch.Tensor | None = None) -> tuple[KVCache, list[int]]:
    """`_garbage_cache` in a quantized dtype: junk values and scales (finite), as left by earlier
    sequences; with `kv_scales` (model-wide), an int8 cache of those static scales."""
    cache = model.new_cache(n_seqs * TABLE + 1, BLOCK, kv_cache_dtype(kv.removesuffix("-static")), kv_scales)
    assert cache.quantized
    values, scales = quantize(torch.randn(cache.kv.shape), cache.storage_dtype)
    cache.kv.copy_(values)
    if cache.scales is not None:
        cache.scales.copy_(scales * torch.rand(scales.shape) * 4)
    free = (torch.randperm(n_seqs * TABLE, generator=torch.Generator().manual_seed(n_seqs)) + 1).tolist()
    return cache, free


def check_quantized_cache(ctx: TPContext, workdir: Path, name: str, kv: str) -> None:
    """Prefill and decode of the whole batch over an int8 / FP8 / static-scale int8 cache (scattered blocks of 5 full
    of junk), fed transformers' greedy tokens: every step's logits within KV_TOL of the uncached
    recomputation and the greedy picks agreeing with transformers' (KV_AGREE; the others ties). The same steps on
    CPU decode's compiled path (every layer in one call, int8 read in the kernel; FP8 falls back
    to the torch path) give logits close to the torch path's."""
    from tprt.cpu import native

    ref, model = _ref(workdir, name), _model(ctx, workdir, name)
    fused = load_model(workdir / f"{name}-tp{ctx.world_size}", ctx)  # its own: kernels are set on it
    calls = force_native_decode(fused)
    kv_scales = None
    if kv == "int8-static":  # calibrated at this TP size on what the steps below write
        kv_scales = scales_from_amax(calibrate(model, [p + g for p, g in zip(ref["prompts"], ref["generated"])]))
    runs = []
    for m in (model, fused):
        cache, free = _quantized_garbage(m, 4, kv, kv_scales)
        seqs = [_Seq(p, _take(free)) for p in ref["prompts"]]
        agree = 0
        for i in range(N_NEW):
            _step(m, cache, seqs)
            for b, s in enumerate(seqs):
                want = ref["generated"][b][i]
                agree += s.out[-1] == want
                logits = s.logits[-1].float()
                margin = float(logits[s.out[-1]] - logits[want]) / float(logits.abs().max())
                assert margin <= KV_TOL[kv], f"{kv}: prompt {b} step {i} picked {s.out[-1]} over {want} by {margin:.1e}"
                s.out[-1] = ref["generated"][b][i]  # teacher-forced: every step sees the reference's tokens
        runs.append(seqs)
        assert agree >= KV_AGREE[kv] * N_NEW * len(seqs), f"{kv}: {agree} of {N_NEW * len(seqs)} greedy picks agree"
    ids, _ = _pad([p + g[:-1] for p, g in zip(ref["prompts"], ref["generated"])])
    with torch.inference_mode():
        full = model.gather_logits(model(ids))  # [batch, seq, vocab]
    for b, (s, f) in enumerate(zip(*runs)):
        n = len(s.prompt)
        _assert_close(torch.stack(s.logits), full[b, n - 1 : n - 1 + N_NEW], f"{kv} cache, prompt {b}", KV_TOL[kv])
        _assert_close(torch.stack(f.logits), torch.stack(s.logits), f"{kv} cache, prompt {b}: fused vs torch", 1e-4)
    assert (calls[1] == N_NEW - 1) == (native.available() and kv != "fp8" and ctx.device.type == "cpu"), calls


def check_kv_calibration(ctx: TPContext, workdir: Path, name: str) -> None:
    """tprt.model.kv_scales.calibrate at this TP size (each rank its kv heads, split or replicated,
    gathered) finds the largest |key| and |value| per layer and kv head that transformers' own
    cache holds for the same text; and each rank's cache takes its heads' scales."""
    ref, model = _ref(workdir, name), _model(ctx, workdir, name)
    texts = [p + g for p, g in zip(ref["prompts"], ref["generated"])]
    amax = calibrate(model, texts, chunk=5)  # chunks of 5: later chunks attend to the cached ones
    want = ref["kv_amax"]
    assert amax.shape == want.shape, (amax.shape, want.shape)
    assert ((amax - want).abs() <= 1e-4 * want).all(), f"max relative error {((amax - want).abs() / want).max():.1e}"
    scales = scales_from_amax(amax)
    cache = model.new_cache(3, BLOCK, torch.int8, scales)
    assert cache.fixed_scales is not None and cache.scales is None
    heads = cache.fixed_scales.shape[-1]
    first = ctx.rank // max(1, ctx.world_size // want.shape[-1]) * heads  # ARCHITECTURE.md's kv head rule
    assert torch.equal(cache.fixed_scales.cpu(), scales[:, :, first : first + heads].cpu())


def check_continuous(ctx: TPContext, workdir: Path, name: str) -> None:
    """Sequences join and leave: A leaves, C takes A's blocks (stale keys beyond C's length) and
    prefills alone while B decodes, D joins in a step that mixes its prefill with decodes."""
    ref, model = _ref(workdir, name), _model(ctx, workdir, name)
    prompts, want = ref["prompts"], ref["generated"]
    cache, free = _garbage_cache(model, 3)
    a, b = _Seq(prompts[0], _take(free)), _Seq(prompts[1], _take(free))
    for _ in range(7):
        _step(model, cache, [a, b])
    c = _Seq(prompts[2], a.table)
    _step(model, cache, [c])
    for _ in range(5):
        _step(model, cache, [c, b])
    d = _Seq(prompts[0], _take(free))
    for _ in range(6):
        _step(model, cache, [b, d, c])
    for label, s, w in (("A", a, want[0]), ("B", b, want[1]), ("C", c, want[2]), ("D", d, want[0])):
        assert s.out == w[: len(s.out)], f"sequence {label}: tokens differ from transformers' generate"


def check_bf16(ctx: TPContext, workdir: Path, name: str) -> None:
    """Cast to bf16 on load: every parameter bf16, logits near the fp32 reference."""
    ref, model = _ref(workdir, name), _model(ctx, workdir, name, dtype="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids, lens = _pad(ref["prompts"])
    with torch.inference_mode():
        full = model.gather_logits(model(ids))  # [batch, seq, vocab]
    for b, n in enumerate(lens):
        _assert_close(full[b, :n], ref["logits"][b], f"bf16 prompt {b}", 5e-2)
    # Cached decode: on CPU the cache (and so attention) is float32 under bf16 weights.
    cache = model.new_cache(TABLE + 1, BLOCK)
    assert cache.dtype == (torch.float32 if ctx.device.type == "cpu" else torch.bfloat16)
    prompt, table = ref["prompts"][0], [tuple(range(1, TABLE + 1))]
    n = len(prompt)
    with torch.inference_mode():
        forward_rows(model, cache, [prompt[:-1]], [0], table)
        last = forward_rows(model, cache, [prompt[-1:]], [n - 1], table)[0][0]
    _assert_close(last[None], ref["logits"][0][n - 1 : n], "bf16 cached decode", 5e-2)


def check_backward(ctx: TPContext, workdir: Path, name: str) -> None:
    """Loss on the gathered logits of uneven prompts: once the trainer has synchronised them over
    the TP group (tprt.train.grads: replicated k/v rows and the per-head q/k norms' shares
    summed), every parameter's gradient on this rank equals the matching slice of transformers'."""
    from tprt.train.grads import sync_gradients

    ref = _ref(workdir, name)
    path = workdir / f"{name}-tp{ctx.world_size}"
    model = load_model(path, ctx, requires_grad=True)
    _lm_loss(model.gather_logits(model(_pad(ref["prompts"])[0])), ref["prompts"]).backward()
    sync_gradients(model, ctx)
    manifest = TPCheckpoint(path).manifest
    compared = 0
    for pname, param in model.named_parameters():
        assert param.grad is not None, f"{pname}: no gradient"
        row = 0
        for src in hf_sources(pname):
            entry, want = manifest.tensors[src], ref["grads"][src]
            if entry.shape[0] > want.shape[0]:  # vocabulary padding: no gradient
                want = torch.cat((want, want.new_zeros(entry.shape[0] - want.shape[0], *want.shape[1:])))
            span = manifest.local_range(src, ctx.rank)
            if span is not None and entry.split_dim is not None:
                want = want.narrow(entry.split_dim, span[0], span[1] - span[0])
            got = param.grad[row : row + want.shape[0]]
            row += want.shape[0]
            _assert_close(got, want, f"grad of {src} (in {pname})", 1e-4)
            compared += 1
    assert compared >= 4 * model.config.num_hidden_layers, f"only {compared} gradients compared"


def check_engine(ctx: TPContext, workdir: Path, name: str) -> None:
    """The engine over the whole batch (CPU-packed linears with the layer's biases added after
    them; the static steps CUDA graphs replay, eager here) gives transformers' greedy tokens; a
    windowed model's sequences give back the blocks behind their windows."""
    from tprt.engine.core import Completion, Engine, EngineConfig
    from tprt.engine.sampling import SamplingParams

    ref = _ref(workdir, name)
    # With a window on every layer (Mistral), blocks of 4 positions: the blocks behind each
    # sequence's window go back to the pool as it decodes, and the tokens do not change.
    windows = set(load_model(workdir / f"{name}-tp{ctx.world_size}", ctx).config.windows)
    windowed = len(windows) == 1 and None not in windows
    for graphs, block in (("off", 16), ("all", 16), *((("off", 4),) if windowed else ())):
        model = load_model(workdir / f"{name}-tp{ctx.world_size}", ctx)  # its own: prepack changes it
        engine = Engine(model, None, EngineConfig(max_batch=4, max_seq_len=64, cuda_graphs=graphs, kv_block_size=block),
                        eos_token_ids=())
        if not engine.is_driver:
            engine.follow()
            continue
        with engine:
            for i, prompt in enumerate(ref["prompts"]):
                engine.add(prompt, SamplingParams(temperature=0.0, max_new_tokens=N_NEW, ignore_eos=True), str(i))
            done, most = {}, 0
            while engine.has_work:
                for event in engine.step():
                    done.setdefault(event.request_id, Completion(event.request_id)).add(event)
                most = max(most, engine.scheduler.pool.used)
        for i, want in enumerate(ref["generated"]):
            assert done[str(i)].token_ids == want, f"prompt {i}, graphs {graphs}, blocks of {block}: greedy tokens differ"
        longest = max(len(p) for p in ref["prompts"]) + N_NEW
        if block == 4:  # each sequence holds about window / 4 + 2 blocks, not length / 4
            window = model.config.sliding_window
            assert window is not None and most <= len(ref["prompts"]) * (window // 4 + 3) < longest // 4 * 3, most


def check_wrong_tp(ctx: TPContext, workdir: Path) -> None:
    """A checkpoint sharded for another TP size is refused with a one-line message."""
    other = 2 if ctx.world_size != 2 else 4
    with pytest.raises(CheckpointError) as info:
        load_model(workdir / f"gqa-tp{other}", ctx)
    msg = str(info.value)
    assert "\n" not in msg and f"tp_size={other}" in msg and f"has {ctx.world_size} TP rank" in msg, msg


def check_shm_allreduce_matches_gloo(ctx: TPContext, workdir: Path) -> None:
    """The TP group's shared-memory all-reduce (local CPU ranks: tprt.distributed.shm_allreduce)
    against gloo's, fp32 and bf16, odd sizes, a non-contiguous tensor and one larger than a slot
    (chunked): bit-equal at 2 ranks; beyond, within one rounding per addition (the order of the
    sums differs); every rank gets the same bits."""
    import torch.distributed as dist

    from tprt.distributed.shm_allreduce import SLOT_BYTES

    if ctx.world_size == 1 or ctx.device.type != "cpu":  # shared memory carries CPU tensors only
        assert ctx.shm is None
        return
    assert ctx.shm is not None  # local ranks on CPU
    assert ctx.shm.c_function() == ctx.shm.c_function()  # one C context however many callers (models) ask
    g = torch.Generator().manual_seed(ctx.rank)
    for dtype in (torch.float32, torch.bfloat16):
        eps = torch.finfo(dtype).eps
        for n in (1, 576, 1001, SLOT_BYTES // dtype.itemsize + 3):
            for x in ((torch.randn(n, generator=g) * 4).to(dtype), (torch.randn(5, 2 * n, generator=g)).to(dtype)[:, ::2]):
                ours, theirs, bound = x.clone(), x.clone(), x.abs().float()
                assert ctx.shm.all_reduce(ours) is ours
                dist.all_reduce(theirs, group=ctx.group)
                dist.all_reduce(bound, group=ctx.group)
                if ctx.world_size == 2:
                    assert torch.equal(ours, theirs), (dtype, n)
                else:
                    assert ((ours.float() - theirs.float()).abs() <= ctx.world_size * eps * bound).all(), (dtype, n)
                everyone = [torch.empty_like(ours) for _ in range(ctx.world_size)]
                dist.all_gather(everyone, ours.contiguous(), group=ctx.group)
                assert all(torch.equal(e, everyone[0]) for e in everyone), (dtype, n)


CHECKS: Checks = [
    ("shm_allreduce", check_shm_allreduce_matches_gloo),
    *((f"{n}-logits", partial(check_logits, name=n)) for n in CONFIGS),
    *((f"{n}-cached_prefill", partial(check_cached_prefill, name=n)) for n in CONFIGS),
    *((f"{n}-greedy", partial(check_greedy, name=n)) for n in CONFIGS),
    ("gqa-continuous", partial(check_continuous, name="gqa")),
    ("gqa-int8_logits", partial(check_int8_logits, name="gqa")),
    *((f"{n}-native_stack", partial(check_native_stack, name=n))
      for n in ("gqa", "tied", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")),
    *((f"{n}-native_stack_bf16", partial(check_native_stack, name=n, dtype="bf16"))
      for n in ("tied", "qwen3", "mistral", "gemma2", "gemma3")),
    *((f"{n}-backward", partial(check_backward, name=n)) for n in CONFIGS),
    *((f"{n}-engine", partial(check_engine, name=n)) for n in FAMILY_CONFIGS),
    ("tied-bf16", partial(check_bf16, name="tied")),
    *((f"gqa-kv_{kv}", partial(check_quantized_cache, name="gqa", kv=kv)) for kv in KV_TOL),
    ("gqa-kv_calibration", partial(check_kv_calibration, name="gqa")),
    ("wrong_tp", check_wrong_tp),
]


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def worlds(workdir: Path) -> dict[int, WorldResults]:
    """Every check at every TP size: TP 1 in this process, the others in one gloo world each."""
    out = {1: run_single(CHECKS, workdir)}
    for tp in TPS[1:]:
        out[tp] = run_world(tp, CHECKS, workdir)
    return out


@pytest.mark.parametrize("check", names(CHECKS))
@pytest.mark.parametrize("tp", TPS)
def test_model(worlds: dict[int, WorldResults], tp: int, check: str) -> None:
    worlds[tp].assert_ok(check)


def test_load_refuses_config_that_disagrees_with_tensors(workdir: Path, tmp_path: Path) -> None:
    """config.json edited after conversion: the tensor that does not fit is named in one line."""
    import json
    import shutil

    ckpt = tmp_path / "edited"
    shutil.copytree(workdir / "gqa-tp1", ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["intermediate_size"] = 96  # the files hold 128 rows each of gate and up
    (ckpt / "config.json").write_text(json.dumps(cfg))
    want = r"'model.layers.0.mlp.up_proj.weight' has rank-0 shape \[128, 64\].*\[192, 64\]"
    with pytest.raises(CheckpointError, match=want) as info:
        load_model(ckpt, TPContext.single())
    assert "\n" not in str(info.value)


def test_load_refuses_unknown_dtype(workdir: Path) -> None:
    with pytest.raises(ConfigError, match=r"--dtype 'int8' is not supported; expected fp32, bf16 or fp16"):
        load_model(workdir / "gqa-tp1", TPContext.single(), dtype="int8")
