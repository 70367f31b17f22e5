"""tprt plan: the planner's per-rank shapes are the runtime's, its numbers follow from them, and
the command reads every kind of source. (Its peaks against measured ones: tests/plan_checks.py,
run in test_smollm2's worlds.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers import TINY_CONFIGS, make_hf_llama
from tprt.cli.main import main
from tprt.distributed.context import TPContext
from tprt.errors import ConfigError
from tprt.lora.attach import apply_lora
from tprt.model.config import ModelConfig
from tprt.model.llama import TPLlamaForCausalLM
from tprt.plan.devices import device
from tprt.plan.memory import FinetuneWorkload, ServeWorkload, plan_memory
from tprt.plan.shapes import layout_for, lora_parameters, numel, rank_parameters

CONFIGS = Path(__file__).resolve().parent.parent / "bench" / "configs"
GIB = 1 << 30


def _config(name: str, **overrides: object) -> ModelConfig:
    d = dict(max_position_embeddings=256, **TINY_CONFIGS[name])
    d.update(overrides)
    return ModelConfig.from_dict(d)


def _meta_model(cfg: ModelConfig, tp: int, rank: int) -> TPLlamaForCausalLM:
    ctx = TPContext(group=None, rank=rank, world_size=tp, device=torch.device("meta"), backend=None)
    with torch.device("meta"):
        return TPLlamaForCausalLM(cfg, layout_for(cfg, tp), ctx, dtype=torch.float32)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("tp", (1, 2, 4, 8))
def test_shapes_are_the_runtimes(name: str, tp: int) -> None:
    """Every rank's parameters and LoRA factors, as the model and apply_lora build them."""
    cfg = _config(name)
    layout = layout_for(cfg, tp)
    targets = ["q", "k", "v", "o", "gate", "up", "down"]
    for rank in (0, tp - 1):
        model = _meta_model(cfg, tp, rank)
        assert {n: tuple(p.shape) for n, p in model.named_parameters()} == rank_parameters(cfg, layout)
        apply_lora(model, targets, 4, 8.0)
        lora = {n: tuple(p.shape) for n, p in model.named_parameters() if "lora_" in n}
        assert lora == lora_parameters(cfg, layout, targets, 4)


def test_whole_model_over_ranks() -> None:
    """Summed over TP ranks: transformers' parameter count of Llama-3.1-8B plus the padding rows
    and the norms every rank holds (kv heads split, no replication up to TP 8)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    raw = json.loads((CONFIGS / "llama-3.1-8b" / "config.json").read_text())
    with torch.device("meta"):
        hf = LlamaForCausalLM(LlamaConfig(**raw))
    total = sum(p.numel() for p in hf.parameters())
    cfg = ModelConfig.from_dict(raw)
    for tp in (1, 2, 4, 8):
        layout = layout_for(cfg, tp)
        padding = 2 * (layout.padded_vocab_size - cfg.vocab_size) * cfg.hidden_size
        norms = (2 * cfg.num_hidden_layers + 1) * cfg.hidden_size
        assert tp * numel(rank_parameters(cfg, layout)) == total + padding + (tp - 1) * norms


def test_kv_replication_and_tied_embeddings() -> None:
    """A replicated kv head is held (and cached) by every rank that uses it; a tied LM head is not a second copy."""
    cfg = _config("rope_pad")  # 2 kv heads
    kv = [plan_memory(cfg, tp, ServeWorkload(max_seq_len=64, max_batch_size=2), device("h100-80gb"))
          .kv_bytes_per_token_per_rank for tp in (1, 2, 4, 8)]
    per_head = cfg.num_hidden_layers * 2 * cfg.head_dim * 4
    assert kv == [2 * per_head, per_head, per_head, per_head]
    tied, untied = _config("tied"), _config("tied", tie_word_embeddings=False)
    layout = layout_for(tied, 2)
    assert numel(rank_parameters(untied, layout)) - numel(rank_parameters(tied, layout)) == layout.local_vocab * 64


def test_serving_numbers() -> None:
    """Weights, the cache the engine allocates and the tokens that fit, from the shapes."""
    cfg = ModelConfig.from_file(CONFIGS / "llama-3.1-70b" / "config.json")
    plan = plan_memory(cfg, 8, ServeWorkload(max_seq_len=8192, max_batch_size=16), device("h100-80gb"))
    assert plan.dtype == plan.kv_dtype == "bf16" and plan.fits
    assert plan.weights_bytes_per_rank == 2 * numel(rank_parameters(cfg, plan.layout))
    assert plan.kv_bytes_per_token_per_rank == 80 * 2 * 1 * 128 * 2  # one kv head per rank
    # The paged pool: max_batch_size x max_seq_len positions in blocks of 16, and the scratch block.
    assert plan.per_rank_bytes["kv_cache"] == (16 * 8192 + 16) * plan.kv_bytes_per_token_per_rank
    paged = plan_memory(cfg, 8, ServeWorkload(max_seq_len=8192, max_batch_size=64, kv_cache_tokens=100_000,
                                              kv_block_size=32), device("h100-80gb"))
    assert paged.per_rank_bytes["kv_cache"] == (3125 + 1) * 32 * plan.kv_bytes_per_token_per_rank
    free = plan.device_bytes - plan.non_kv_bytes
    assert plan.max_kv_tokens == free // plan.kv_bytes_per_token_per_rank
    cpu = plan_memory(cfg, 8, ServeWorkload(dtype="bf16", max_seq_len=8192), device("cpu", 4096))
    assert cpu.kv_dtype == "fp32" and cpu.per_rank_bytes["packed_weights"] > 2 * cpu.weights_bytes_per_rank * 0.9


def test_finetune_numbers() -> None:
    """Full bf16 AdamW: 2 (weights) + 2 (gradients) + 8 (moments) + 4 (masters) bytes per
    parameter, and the update's largest float32 chunk of gradients (one parameter: the 70B's
    vocabulary block); LoRA keeps the frozen base and trains only its factors."""
    cfg = ModelConfig.from_file(CONFIGS / "llama-3.1-70b" / "config.json")
    full = plan_memory(cfg, 8, FinetuneWorkload(full=True, dtype="bf16", batch_size=1, seq_len=4096), device("h100-80gb"))
    n = full.params_per_rank
    parts = full.per_rank_bytes
    assert (parts["weights"], parts["gradients"], parts["optimizer_states"], parts["master_weights"]) == \
        (2 * n, 2 * n + 4 * full.layout.local_vocab * cfg.hidden_size, 8 * n, 4 * n)
    assert not full.fits
    lora = plan_memory(cfg, 8, FinetuneWorkload(lora_rank=16, dtype="bf16", batch_size=1, seq_len=4096),
                       device("h100-80gb"))
    assert lora.fits and lora.trainable_params_per_rank == numel(lora_parameters(cfg, lora.layout, ("q", "k", "v", "o"), 16))
    ac = plan_memory(cfg, 8, FinetuneWorkload(lora_rank=16, dtype="bf16", batch_size=1, seq_len=4096,
                                              activation_checkpointing=True), device("h100-80gb"))
    assert ac.per_rank_bytes["activations"] < lora.per_rank_bytes["activations"] / 4


def test_dpo_counts_two_completions_per_pair(capsys: pytest.CaptureFixture[str]) -> None:
    """A DPO micro-batch of B pairs holds 2B rows: the activations of an SFT batch of 2B rows,
    the same state; the CLI's --method dpo says so."""
    cfg = ModelConfig.from_file(CONFIGS / "llama-3.1-70b" / "config.json")
    dpo, sft2, sft1 = (plan_memory(cfg, 8, FinetuneWorkload(lora_rank=16, dtype="bf16", batch_size=b, seq_len=2048,
                                                            dpo=d), device("h100-80gb"))
                       for b, d in ((2, True), (4, False), (2, False)))
    assert dpo.per_rank_bytes == sft2.per_rank_bytes
    assert dpo.per_rank_bytes["activations"] > 1.9 * sft1.per_rank_bytes["activations"]
    assert dpo.extra["global_batch_rows"] == 4
    assert main(["plan", "--model", str(CONFIGS / "llama-3.1-70b"), "--tp", "8", "--device", "h100-80gb", "--json",
                 "finetune", "--method", "dpo", "--lora-rank", "16", "--seq-len", "2048", "--batch-size", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["per_rank_bytes"] == dpo.per_rank_bytes
    assert main(["plan", "--model", str(CONFIGS / "llama-3.1-70b"), "--tp", "8", "--device", "h100-80gb",
                 "finetune", "--method", "dpo", "--batch-size", "2"]) == 0
    assert "batch_size 2 pairs (DPO: 4 rows)" in capsys.readouterr().out


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", str(CONFIGS / "llama-3.1-70b"), "--tp", "8", "--device", "h100-80gb", "--json",
                 "finetune", "--full", "--seq-len", "4096", "--batch-size", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("fits", "per_rank_bytes", "peak_bytes_per_rank", "device_bytes", "weights_bytes_per_rank",
                "kv_bytes_per_token_per_rank", "max_kv_tokens", "suggestions"):
        assert key in out
    assert out["fits"] is False and out["peak_bytes_per_rank"] == sum(out["per_rank_bytes"].values())
    assert any(s.startswith("LoRA instead of full") for s in out["suggestions"])
    # 405B in bf16 does not fit 8 x 80 GB even to serve; flags may also follow the workload
    assert main(["plan", "serve", "--model", str(CONFIGS / "llama-3.1-405b" / "config.json"), "--tp", "8",
                 "--device", "h100-80gb", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["max_kv_tokens"] == 0 and out["weights_bytes_per_rank"] > 80 * GIB
    assert any("--tp 16" in s for s in out["suggestions"])


def test_cli_sources(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An HF directory and a TP checkpoint (its vocab_align) give the same plan as its config.json."""
    from convert.api import hf_to_tp

    hf = make_hf_llama(tmp_path / "hf", "rope_pad")
    hf_to_tp(hf, tmp_path / "tp2", tp=2)
    outs = []
    for src in (hf, hf / "config.json", tmp_path / "tp2"):
        assert main(["plan", "--model", str(src), "--tp", "2", "--device", "cpu", "--json", "serve"]) == 0
        out = json.loads(capsys.readouterr().out)
        del out["workload"]  # the flags as given (the checkpoint's dtype fills in --dtype)
        outs.append(out)
    assert outs[0] == outs[1] == outs[2]
    assert outs[0]["padded_vocab_size"] == 256  # 250 padded to a multiple of 64 x 2
    assert main(["plan", "--model", str(hf), "--tp", "3", "--device", "cpu", "serve"]) == 2
    assert "--tp 3 does not divide num_attention_heads=8" in capsys.readouterr().err
    assert main(["plan", "--model", str(tmp_path / "nope"), "--tp", "1", "--device", "cpu", "serve"]) == 2
    assert main(["plan", "--model", str(hf), "--tp", "1", "--device", "tpu", "serve"]) == 2
    assert "--device 'tpu' is not known" in capsys.readouterr().err


def test_bad_workload() -> None:
    cfg = _config("gqa")
    with pytest.raises(ConfigError, match="max-seq-len 1000 exceeds"):
        plan_memory(cfg, 1, ServeWorkload(max_seq_len=1000), device("cpu"))
    with pytest.raises(ConfigError, match="--batch-size must be at least 1"):
        plan_memory(cfg, 1, FinetuneWorkload(batch_size=0), device("cpu"))
    with pytest.raises(Exception, match="unknown LoRA target"):
        plan_memory(cfg, 1, FinetuneWorkload(lora_targets=("qq",)), device("cpu"))
    assert math.isclose(device("cpu", 2.5).memory_bytes, 2.5 * GIB)


@pytest.mark.parametrize("fmt, group", [("int8", None), ("int8", 16), ("fp8", None)])
def test_quantized_weights_are_what_the_loader_allocates(tmp_path: Path, fmt: str, group: int | None) -> None:
    """`--quantize` (once `--weight-dtype`): the planned weight bytes equal a loaded quantized checkpoint's parameter
    bytes (one byte per linear weight, float32 scales, the rest in the compute dtype)."""
    from convert.api import hf_to_tp
    from tprt.checkpoint.loading import load_model

    hf = make_hf_llama(tmp_path / "hf", "gqa")
    hf_to_tp(hf, tmp_path / "q", 1, quantize=fmt, group_size=group)
    model = load_model(tmp_path / "q", TPContext.single(), dtype="bf16")
    loaded = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = ModelConfig.from_file(hf / "config.json")
    plan = plan_memory(cfg, 1, ServeWorkload(dtype="bf16", weight_dtype=fmt, weight_group_size=group),
                       device("h100-80gb"))
    assert plan.weights_bytes_per_rank == loaded
    dense = plan_memory(cfg, 1, ServeWorkload(dtype="bf16"), device("h100-80gb"))
    assert plan.extra["weights_saved_bytes_per_rank"] == dense.weights_bytes_per_rank - loaded
    assert plan.max_kv_tokens == (dense.max_kv_tokens or 0) + plan.extra["kv_tokens_gained"]


def test_llama70b_tp8_quantized_weights_and_tokens_gained(capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's figure: Llama-3.1-70B at TP 8 on H100 in int8/FP8 holds about 8.8 GB of weights
    per rank (17.6 in bf16: linear weights halve, embeddings and LM head stay bf16)."""
    argv = ["plan", "--model", str(CONFIGS / "llama-3.1-70b"), "--tp", "8", "--device", "h100-80gb", "--json",
            "serve", "--quantize", "fp8"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert 8.5e9 < out["weights_bytes_per_rank"] < 9.2e9
    assert 17.5e9 < out["dense_weights_bytes_per_rank"] < 17.8e9
    assert out["kv_tokens_gained"] == out["weights_saved_bytes_per_rank"] // out["kv_bytes_per_token_per_rank"]
    assert main(argv[:-3] + ["serve", "--weight-dtype", "int8"]) == 0
    assert main([a for a in argv if a != "--json"]) == 0
    assert "fp8 weights: 9.09 GB per rank instead of 17.64 GB" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--weight-group-size 32: expected a positive group size, with --quantize int8"):
        plan_memory(_config("gqa"), 1, ServeWorkload(weight_dtype="fp8", weight_group_size=32), device("cpu"))


def test_serve_plan_counts_speculation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Speculative decoding: rank 0's draft model (its TP-1 weights at least), logits for every
    drafted position, and the KV positions written ahead; a draft of another vocabulary is refused."""
    big = ModelConfig.from_file(CONFIGS / "llama-3.1-70b" / "config.json")
    small = ModelConfig.from_file(CONFIGS / "llama-3.2-1b" / "config.json")
    dev = device("h100-80gb")
    plain = plan_memory(big, 8, ServeWorkload(dtype="bf16"), dev)
    spec = plan_memory(big, 8, ServeWorkload(dtype="bf16", num_speculative_tokens=4, draft=small), dev)
    draft_weights = numel(rank_parameters(small, layout_for(small, 1))) * 2
    assert draft_weights < spec.per_rank_bytes["draft_model"] < draft_weights * 1.5
    layout = layout_for(big, 8)
    assert spec.per_rank_bytes["activations"] - plain.per_rank_bytes["activations"] == \
        16 * 4 * (layout.local_vocab + big.vocab_size) * 4
    assert spec.extra["speculative_kv_positions"] == 16 * 4 and "speculative_kv_positions" not in plain.extra
    assert main(["plan", "--model", str(CONFIGS / "llama-3.1-70b"), "--tp", "8", "--device", "h100-80gb", "--json",
                 "serve", "--draft-model", str(CONFIGS / "llama-3.2-1b")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["per_rank_bytes"]["draft_model"] == spec.per_rank_bytes["draft_model"]
    other = tmp_path / "config.json"
    other.write_text(json.dumps({**json.loads((CONFIGS / "llama-3.2-1b" / "config.json").read_text()),
                                 "vocab_size": 32000}))
    assert main(["plan", "--model", str(CONFIGS / "llama-3.1-70b"), "--tp", "8", "--device", "h100-80gb",
                 "serve", "--draft-model", str(other)]) == 2
    assert "--draft-model" in capsys.readouterr().err


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantized_kv_cache(kv: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--kv-cache-dtype int8/fp8: one byte per value and a bfloat16 scale per head vector, as the runtime's
    cache holds them, and the KV tokens gained against bf16 in the same memory (x1.97 at head_dim 128)."""
    from tprt.model.kv_cache import KVCache, kv_cache_dtype

    cfg = ModelConfig.from_file(CONFIGS / "llama-3.1-70b" / "config.json")
    plan = plan_memory(cfg, 8, ServeWorkload(kv_dtype=kv, max_seq_len=8192), device("h100-80gb"))
    bf16 = plan_memory(cfg, 8, ServeWorkload(kv_dtype="bf16", max_seq_len=8192), device("h100-80gb"))
    assert plan.kv_bytes_per_token_per_rank == 80 * 2 * 1 * (128 + 2)
    assert plan.extra["max_kv_tokens_bf16"] == bf16.max_kv_tokens and plan.max_kv_tokens is not None
    assert bf16.max_kv_tokens is not None and 1.9 < plan.max_kv_tokens / bf16.max_kv_tokens < 2
    small = _config("gqa")  # the runtime's cache for this rank's kv heads, per position
    runtime = KVCache(small.num_hidden_layers, 5, small.num_key_value_heads, 16, small.head_dim, kv_cache_dtype(kv))
    planned = plan_memory(small, 1, ServeWorkload(kv_dtype=kv), device("cpu"))
    assert runtime.nbytes() == 5 * 16 * planned.kv_bytes_per_token_per_rank
    assert main(["plan", "--model", str(CONFIGS / "llama-3.1-70b"), "--tp", "8", "--device", "h100-80gb", "serve",
                 "--kv-cache-dtype", kv, "--max-seq-len", "8192"]) == 0
    out = capsys.readouterr().out
    assert f"KV cache: 20.3 KiB per token per rank ({kv})" in out
    assert f"vs a bf16 KV cache (40.0 KiB per token per rank): +{plan.max_kv_tokens - bf16.max_kv_tokens} KV tokens (x1.97)" in out
    assert main(["plan", "--model", str(CONFIGS / "llama-3.1-70b"), "--tp", "8", "--device", "h100-80gb", "serve",
                 "--kv-dtype", "int4"]) == 2  # the old spelling still works, and says so
    err = capsys.readouterr().err
    assert "--kv-dtype is the old spelling of --kv-cache-dtype; it still works" in err
    assert "--kv-cache-dtype 'int4' is not supported; expected fp32, bf16, fp16, int8, fp8 or int8-static" in err


def test_static_scale_kv_cache_doubles_bf16s_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    """--kv-dtype int8-static (serve's --kv-scales): one byte per value and nothing per token, as
    the runtime's cache with static scales holds them: exactly 2x bf16's KV tokens."""
    from tprt.model.kv_cache import KVCache

    cfg = ModelConfig.from_file(CONFIGS / "llama-3.1-70b" / "config.json")
    plan = plan_memory(cfg, 8, ServeWorkload(kv_dtype="int8-static", max_seq_len=8192), device("h100-80gb"))
    bf16 = plan_memory(cfg, 8, ServeWorkload(kv_dtype="bf16", max_seq_len=8192), device("h100-80gb"))
    assert plan.kv_bytes_per_token_per_rank * 2 == bf16.kv_bytes_per_token_per_rank == 80 * 2 * 1 * 256
    assert plan.max_kv_tokens is not None and bf16.max_kv_tokens is not None
    assert abs(plan.max_kv_tokens - 2 * bf16.max_kv_tokens) <= 2  # whole tokens of the same bytes
    small = _config("gqa")
    fixed = torch.ones(small.num_hidden_layers, 2, small.num_key_value_heads)
    runtime = KVCache(small.num_hidden_layers, 5, small.num_key_value_heads, 16, small.head_dim, torch.int8,
                      fixed_scales=fixed)
    planned = plan_memory(small, 1, ServeWorkload(kv_dtype="int8-static"), device("cpu"))
    assert runtime.kv.nbytes == 5 * 16 * planned.kv_bytes_per_token_per_rank
    assert main(["plan", "--model", str(CONFIGS / "llama-3.1-70b"), "--tp", "8", "--device", "h100-80gb", "serve",
                 "--kv-dtype", "int8-static", "--max-seq-len", "8192"]) == 0
    out = capsys.readouterr().out
    assert "KV cache: 20.0 KiB per token per rank (int8-static)" in out and "(x2.00)" in out, out


def test_serve_plan_counts_the_cuda_graphs(capsys: pytest.CaptureFixture[str]) -> None:
    """On CUDA the plan counts the graphs the runner captures (tprt.engine.graph_buckets): their
    token buckets (wider with speculation: verifying rows), each graph's output and the widest
    capture; none off CUDA or with --cuda-graphs off."""
    from tprt.engine.graph_buckets import token_buckets

    cfg = ModelConfig.from_file(CONFIGS / "llama-3.1-70b" / "config.json")
    dev = device("h100-80gb")
    plans = {mode: plan_memory(cfg, 8, ServeWorkload(dtype="bf16", max_batch_size=64, cuda_graphs=mode), dev)
             for mode in ("auto", "decode", "off")}
    spec = plan_memory(cfg, 8, ServeWorkload(dtype="bf16", max_batch_size=64, num_speculative_tokens=4), dev)
    assert plans["auto"].extra["cuda_graph_token_buckets"] == token_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert spec.extra["cuda_graph_token_buckets"] == token_buckets(320) and spec.extra["cuda_graph_row_width"] == 5
    assert plans["auto"].per_rank_bytes["cuda_graphs"] == plans["decode"].per_rank_bytes["cuda_graphs"] > 0
    outputs = sum(token_buckets(64)) * 4 * cfg.hidden_size * 2  # every bucket's hidden states, 4 adapter counts
    assert outputs < plans["auto"].per_rank_bytes["cuda_graphs"] < spec.per_rank_bytes["cuda_graphs"] < 2**30
    assert plans["off"].per_rank_bytes["cuda_graphs"] == 0 and "cuda_graph_token_buckets" not in plans["off"].extra
    assert plan_memory(cfg, 8, ServeWorkload(dtype="bf16"), device("cpu")).per_rank_bytes["cuda_graphs"] == 0
    assert main(["plan", "--model", str(CONFIGS / "llama-3.1-70b"), "--tp", "8", "--device", "h100-80gb",
                 "serve", "--max-batch-size", "64"]) == 0
    assert "CUDA graphs (--cuda-graphs all): steps of 1 to 64 tokens in 8 buckets" in capsys.readouterr().out


def test_pipeline_stages_split_the_layers_and_405b_fits_two_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    """--pp (issue 44): each stage holds its layers (the first the embedding, the last the final
    norm and LM head), its layers' KV cache, and under 1F1B stage i the activations of
    pp - i micro-batches; 405B in bf16 does not fit one 8 x H100 node but fits two at PP 2."""
    from tprt.parallel.stages import stages

    cfg = ModelConfig.from_file(CONFIGS / "llama-3.1-405b" / "config.json")
    layout = layout_for(cfg, 8)
    parts = [rank_parameters(cfg, layout, st) for st in stages(cfg.num_hidden_layers, 2)]
    assert numel(parts[0]) + numel(parts[1]) == numel(rank_parameters(cfg, layout))
    assert "embed_tokens.weight" in parts[0] and "lm_head.weight" in parts[1] and "norm.weight" not in parts[0]
    assert [len(st.layers) for st in stages(10, 4)] == [3, 3, 2, 2]
    serve = ServeWorkload(dtype="bf16", max_seq_len=8192)
    h100 = device("h100-80gb")
    one, two = plan_memory(cfg, 8, serve, h100), plan_memory(cfg, 8, serve, h100, pp=2)
    assert not one.fits and two.fits and two.pp == 2
    assert two.kv_bytes_per_token_per_rank * 2 == one.kv_bytes_per_token_per_rank  # 63 of 126 layers each
    tuned = FinetuneWorkload(lora_rank=16, dtype="bf16", batch_size=1, seq_len=4096)
    per_stage = plan_memory(cfg, 8, tuned, h100, pp=4).extra["stages"]
    assert [s["layers"] for s in per_stage] == [[0, 32], [32, 64], [64, 95], [95, 126]]
    assert per_stage[0]["peak_bytes_per_rank"] > per_stage[2]["peak_bytes_per_rank"]  # 4 micro-batches in flight vs 2
    assert main(["plan", "--model", str(CONFIGS / "llama-3.1-405b"), "--tp", "8", "--pp", "2", "--device", "h100-80gb",
                 "serve", "--max-seq-len", "8192"]) == 0
    out = capsys.readouterr().out
    assert "TP=8 x PP=2 x DP=1 (16 devices)" in out and "stage 1 (layers 63-125)" in out and "FITS" in out
    with pytest.raises(ConfigError, match="--pp must be between 1 and the model's 126 layers"):
        plan_memory(cfg, 8, serve, h100, pp=200)
