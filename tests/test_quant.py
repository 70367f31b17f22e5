"""Quantized weights (tprt.quant): the int8/FP8 math, the linear method's lifecycle, conversion in
the stream (hf-to-tp --quantize, reshard, verify, GGUF Q8_0 as stored), the refusals, and the
"garbage" test: a quantized model must agree with the float one on its greedy tokens, and a
broken scale or a transposed weight must fail that same check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from convert.api import hf_to_tp, reshard, tp_to_hf, verify
from convert.cli import main as convert_main
from tests.helpers import make_hf_llama
from tprt.checkpoint.format import TPCheckpoint
from tprt.checkpoint.loading import load_model
from tprt.distributed.context import TPContext
from tprt.errors import CheckpointError, ConfigError
from tprt.model.llama import TPLlamaForCausalLM
from tprt.parallel.layers import ColumnParallelLinear, ParallelLinear, RowParallelLinear
from tprt.quant.formats import QuantSpec, dequantize, parse_spec, quantize
from tprt.quant.methods import QuantLinear

# Top-1 agreement of a quantized tiny model's logits with the float model's, over every position
# of a batch of prompts. The tiny random model's logits are close together (a few hundredths
# apart), so FP8's 3-bit mantissa flips more of its near-ties than int8 does; a broken model
# agrees on about 1 in the vocabulary size (256).
AGREE = {"int8": 0.9, "fp8": 0.6}
LOGIT_TOL = {"int8": 0.02, "fp8": 0.1}  # max |quantized - float| logit over the max |float logit|


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("quant")
    hf = make_hf_llama(root / "hf", "gqa", seed=3)
    hf_to_tp(hf, root / "float", 1)
    hf_to_tp(hf, root / "int8", 1, quantize="int8")
    hf_to_tp(hf, root / "int8-g32", 1, quantize="int8", group_size=32)
    hf_to_tp(hf, root / "fp8", 1, quantize="fp8")
    return root


def _prompts(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (4, 16), generator=torch.Generator().manual_seed(0))  # [batch, seq]


def _logits(model: TPLlamaForCausalLM) -> torch.Tensor:
    with torch.inference_mode():
        return model.gather_logits(model(_prompts(model.config.vocab_size))).float()  # [batch, seq, vocab]


def agreement(model: TPLlamaForCausalLM, ref: torch.Tensor) -> float:
    """The share of positions where `model`'s top-1 token is the float model's."""
    return (_logits(model).argmax(-1) == ref.argmax(-1)).float().mean().item()


# ----------------------------------------------------------------------------- the math


@pytest.mark.parametrize("group", [None, 16, 64])
def test_int8_quantize_round_trip_is_within_half_a_step(group: int | None) -> None:
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(1))
    w[3] = 0.0  # an all-zero row stays exactly zero
    q, s = quantize(w, QuantSpec("int8", group))
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert s.shape == (24, 1 if group is None else 128 // group)
    assert int(q.abs().max()) == 127  # every group's largest value uses the full range
    err = (dequantize(q, s) - w).abs().reshape(24, s.shape[1], -1)  # [rows, groups, group]
    assert (err <= s.unsqueeze(-1) / 2 + 1e-7).all()
    assert torch.equal(dequantize(q, s)[3], torch.zeros(128))


def test_fp8_quantize_keeps_e4m3_precision_per_channel() -> None:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    q, s = quantize(w, QuantSpec("fp8"))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (16, 1)
    assert torch.allclose(q.float().abs().amax(-1), torch.full((16,), 448.0))
    rel = ((dequantize(q, s) - w).abs() / w.abs().clamp(min=s * 2**-6)).max().item()
    assert rel <= 2**-4  # 3 mantissa bits: half a unit in the last place is 1/16 relative


# ----------------------------------------------------------------------------- the method


@pytest.mark.parametrize("spec", [QuantSpec("int8"), QuantSpec("int8", 16), QuantSpec("fp8")])
def test_method_lifecycle_on_column_and_row_layers(spec: QuantSpec) -> None:
    """Rank 1 of 2: create (int8/fp8 weight + float32 scales of this rank's shape), load the
    rank's pieces without casting, apply == F.linear on the dequantized slice, in float32 sums."""
    ctx = TPContext(group=None, rank=1, world_size=2, device=torch.device("cpu"), backend=None)
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(64, 64, generator=gen)
    method = QuantLinear(spec)
    for kind in ("column", "row"):
        part = w[32:] if kind == "column" else w[:, 32:]  # this rank's rows or columns
        q, s = quantize(part, spec)
        with torch.device("meta"):
            layer: ParallelLinear = (ColumnParallelLinear(64, 32, ctx, torch.bfloat16, method) if kind == "column"
                                     else RowParallelLinear(32, 64, ctx, torch.bfloat16, method))
        shapes = {n: (tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters()}
        assert shapes == {"weight": (tuple(q.shape), spec.storage, False),
                          "weight_scale": (tuple(s.shape), torch.float32, False)}
        state = {}
        for name, src in (("weight", q), ("weight_scale", s)):
            dest = torch.empty_like(src)
            method.load_weight(layer, name, dest, [src[:5], src[5:]])  # two pieces, in row order
            state[name] = dest
        layer.load_state_dict(state, assign=True)
        method.process_after_loading(layer)
        x = torch.randn(3, 2, part.shape[1], generator=gen).to(torch.bfloat16)
        got = method.apply(layer, x)
        assert got.dtype == torch.bfloat16
        want = F.linear(x.float(), dequantize(q, s)).to(torch.bfloat16)
        assert torch.equal(got, want), kind


def test_fp8_scaled_mm_path_matches_its_emulation() -> None:
    """The GPU path (torch._scaled_mm, which also runs on CPU here): activations quantized to
    e4m3 per row, float32 scales on both sides; equals the dequantized product of the rounded
    activations to bf16 output rounding, and the plain product to the activations' rounding."""
    from tprt.quant.methods import quantize_rows_fp8, scaled_mm_fp8

    gen = torch.Generator().manual_seed(6)
    q, s = quantize(torch.randn(48, 128, generator=gen), QuantSpec("fp8"))
    x = torch.randn(2, 5, 128, generator=gen).to(torch.bfloat16)
    y = scaled_mm_fp8(x, q, s)
    assert y.shape == (2, 5, 48) and y.dtype == torch.bfloat16
    xq, xs = quantize_rows_fp8(x.reshape(-1, 128))
    emulated = F.linear(xq.float() * xs, dequantize(q, s)).view(2, 5, 48)
    plain = F.linear(x.float(), dequantize(q, s))
    scale = plain.abs().max()
    assert (y.float() - emulated).abs().max() <= 8e-3 * scale
    assert (y.float() - plain).abs().max() <= 6e-2 * scale


def test_quantize_linears_in_memory_matches_the_converter(root: Path) -> None:
    """bench/GPU helper: quantizing a loaded float model gives the converter's tensors (TP 1)."""
    from tprt.quant.methods import quantize_linears

    model = load_model(root / "float", TPContext.single())
    quantize_linears(model, QuantSpec("int8", 32))
    want = load_model(root / "int8-g32", TPContext.single())
    for a, b in zip(model.linears(), want.linears()):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.weight_scale, b.weight_scale)
    ids = _prompts(256)
    with torch.inference_mode():
        assert torch.equal(model(ids), want(ids))


def test_method_refuses_a_shard_that_splits_a_group() -> None:
    with torch.device("meta"), pytest.raises(ConfigError, match="48 input columns.*group_size 32"):
        ColumnParallelLinear(48, 8, TPContext.single(), torch.float32, QuantLinear(QuantSpec("int8", 32)))


# ----------------------------------------------------------------------------- models and the garbage test


@pytest.mark.parametrize("fmt", ["int8", "int8-g32", "fp8"])
def test_quantized_model_logits_close_and_greedy_agrees(root: Path, fmt: str) -> None:
    ref = _logits(load_model(root / "float", TPContext.single()))
    model = load_model(root / fmt, TPContext.single(), dtype="bf16")
    kind = fmt.split("-")[0]
    err = (_logits(model) - ref).abs().max().item() / ref.abs().max().item()
    assert err <= LOGIT_TOL[kind] + (0.02 if kind == "int8" else 0.0), fmt  # bf16 activations add their rounding
    assert agreement(model, ref) >= AGREE[kind], fmt


@pytest.mark.parametrize("breakage", ["scale rows shifted", "scale of another layer", "weight transposed"])
def test_garbage_check_fails_a_broken_model(root: Path, breakage: str) -> None:
    """The agreement check above must catch the bugs quantized paths have shipped with."""
    ref = _logits(load_model(root / "float", TPContext.single()))
    model = load_model(root / "int8", TPContext.single())
    with torch.no_grad():
        for layer in model.linears():
            if breakage == "scale rows shifted":
                layer.weight_scale.copy_(layer.weight_scale.roll(1, dims=0))
            elif breakage == "scale of another layer":
                layer.weight_scale.fill_(layer.weight_scale.mean().item() * 7)
            elif layer.weight.shape[0] == layer.weight.shape[1]:  # square: a transposed layout loads silently
                layer.weight.copy_(layer.weight.t().contiguous())
    assert agreement(model, ref) < AGREE["int8"], breakage


def test_int8_model_reads_its_lm_head_in_int8_at_inference(root: Path) -> None:
    """prepack gives an int8 model's LM head an int8 copy in the decoder's format (groups of 32
    here): products without autograd, of any row count, take it (the compiled kernel rounds x per
    block of 32 on VNNI CPUs); a product autograd records takes the dense weight; the prepacked
    model still passes the garbage check; a float model's head stays dense."""
    from tprt.cpu import native
    from tprt.cpu.fast_linear import FastLinear, prepack
    from tprt.cpu.quant_linear import Int8Head

    assert native.available(), "the compiled kernels must build here (a C compiler)"
    ref = _logits(load_model(root / "float", TPContext.single()))
    model = load_model(root / "int8-g32", TPContext.single())
    dense = model.lm_head.weight_matrix().detach().clone()  # [vocab, hidden]
    prepack(model)
    method = model.lm_head.method.base
    assert isinstance(method, Int8Head) and method.q8 is not None
    want_q, want_s = quantize(dense, QuantSpec("int8", 32))
    assert torch.equal(method.q8[0], want_q) and torch.equal(method.q8[1], want_s)
    x = torch.randn(40, dense.shape[1], generator=torch.Generator().manual_seed(5))
    exact = F.linear(x, dequantize(want_q, want_s))  # [40, vocab]
    with torch.inference_mode():
        for rows in (1, 5, 16, 40):  # one-row, few-row, tiled and dequantized paths
            got = model.lm_head(x[:rows])
            assert (got - exact[:rows]).abs().max() <= 0.02 * exact.abs().max(), rows
            assert (got - F.linear(x[:rows], dense)).abs().max() > 0, rows  # not the dense weight
    xg = x[:3].clone().requires_grad_()
    model.lm_head(xg).sum().backward()
    assert torch.allclose(xg.grad, dense.sum(0).expand(3, -1), atol=1e-5)  # dense weight's gradient
    assert agreement(model, ref) >= AGREE["int8"]
    floats = load_model(root / "float", TPContext.single())
    prepack(floats)
    assert isinstance(floats.lm_head.method.base, FastLinear)


def test_lora_base_takes_no_gradient_and_full_finetune_is_refused(root: Path) -> None:
    with pytest.raises(ConfigError, match=r"weights are int8 \(frozen\).*LoRA"):
        load_model(root / "int8", TPContext.single(), requires_grad=True)
    model = load_model(root / "int8", TPContext.single())
    assert all(not p.requires_grad for p in model.parameters())


# ----------------------------------------------------------------------------- the converter


def test_manifest_records_the_format_and_verify_passes(root: Path) -> None:
    m = TPCheckpoint(root / "int8-g32").manifest
    assert m.extra["weight_format"] == "int8" and m.extra["group_size"] == 32
    assert m.tensors["model.layers.0.self_attn.q_proj.weight"].dtype == "I8"
    scale = m.tensors["model.layers.0.mlp.down_proj.weight_scale"]
    assert (scale.dtype, scale.shape, scale.split_dim) == ("F32", (64, 4), 1)
    assert m.tensors["model.embed_tokens.weight"].dtype == "F32"  # embeddings and LM head stay float
    assert verify(root / "int8-g32") == [] and verify(root / "fp8") == []


def test_tp2_and_reshard_round_trip_bit_exact(root: Path, tmp_path: Path) -> None:
    """Quantizing is per row and group, so TP 2 then reshard to 1 gives TP 1's tensors exactly;
    per channel, a row-parallel weight's scales are replicated (every rank: the whole row's)."""
    hf_to_tp(root / "hf", tmp_path / "tp2", 2, quantize="int8", group_size=32)
    hf_to_tp(root / "hf", tmp_path / "pc2", 2, quantize="int8")
    m = TPCheckpoint(tmp_path / "pc2").manifest
    assert m.tensors["model.layers.0.self_attn.o_proj.weight_scale"].split_dim is None
    assert m.local_shape("model.layers.0.self_attn.o_proj.weight") == (64, 32)
    reshard(tmp_path / "tp2", tmp_path / "back1", 1, dtype="bf16")  # --dtype casts floats, never the scales
    assert verify(tmp_path / "tp2") == [] and verify(tmp_path / "back1") == []
    back = TPCheckpoint(tmp_path / "back1").open_rank(0)
    direct = TPCheckpoint(root / "int8-g32").open_rank(0)
    for name in direct.manifest.tensors:
        if name.endswith(("_proj.weight", "_scale")):
            assert torch.equal(back.tensor(name), direct.tensor(name)), name
    assert back.tensor("model.layers.1.mlp.up_proj.weight_scale").dtype == torch.float32
    back.close(), direct.close()


def test_refusals_are_one_line_and_name_the_layer(root: Path, tmp_path: Path) -> None:
    cases = [
        (lambda: hf_to_tp(root / "hf", tmp_path / "a", 4, quantize="int8", group_size=64),
         r"model\.layers\.0\.\w+\.\w+_proj\.weight: TP=4 gives each rank 32 input columns, which splits a group"),
        (lambda: hf_to_tp(root / "hf", tmp_path / "b", 1, quantize="fp8", group_size=32),
         "--group-size: fp8 weights have one scale per output channel"),
        (lambda: hf_to_tp(root / "hf", tmp_path / "c", 1, quantize="int4"), "--quantize 'int4' is not supported"),
        (lambda: hf_to_tp(root / "hf", tmp_path / "d", 1, quantize="int8", group_size=24), "multiple of 16"),
        (lambda: reshard(root / "int8", tmp_path / "e", 1, quantize="fp8"), "already int8.*quantize them twice"),
        (lambda: reshard(root / "int8-g32", tmp_path / "f", 4), r"TP=4 .* splits a group of --group-size 32"),
        (lambda: tp_to_hf(root / "int8", tmp_path / "g"), "holds int8 weights.*does not dequantize"),
    ]
    for run, want in cases:
        with pytest.raises((ConfigError, CheckpointError), match=want) as info:
            run()
        assert "\n" not in str(info.value)
    assert not any(p.name in "abcdefg" for p in tmp_path.iterdir())


def test_cli_quantize_flags(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert convert_main(["hf-to-tp", str(root / "hf"), str(tmp_path / "q"), "--tp", "2", "--quantize", "int8",
                         "--group-size", "32"]) == 0
    assert "int8 weights" in capsys.readouterr().out
    assert convert_main(["verify", str(tmp_path / "q")]) == 0
    assert convert_main(["hf-to-tp", str(root / "hf"), str(tmp_path / "r"), "--tp", "1", "--group-size", "32"]) == 2
    assert "--group-size applies with --quantize int8 only" in capsys.readouterr().err


def test_compressed_tensors_checkpoint_is_refused_by_name(root: Path, tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "fp8-hf"
    shutil.copytree(root / "hf", src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                  "config_groups": {"group_0": {"weights": {"type": "float", "num_bits": 8}}}}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"pre-quantized \(compressed-tensors \(float8\)\).*--quantize"):
        hf_to_tp(src, tmp_path / "out", 1)


def test_bad_manifest_format_is_refused(root: Path, tmp_path: Path) -> None:
    import shutil

    ckpt = tmp_path / "bad"
    shutil.copytree(root / "int8", ckpt)
    manifest = json.loads((ckpt / "tprt_manifest.json").read_text())
    manifest["extra"]["group_size"] = -4
    (ckpt / "tprt_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="weight_format 'int8' with group_size -4 is not supported"):
        load_model(ckpt, TPContext.single())


def test_gguf_q8_0_imports_as_stored(tmp_path: Path) -> None:
    """Q8_0 blocks (32 int8 + an fp16 scale) become int8 with group size 32 bit for bit, q/k rows
    un-permuted to HF order like every other import; the model computes what the dequantized
    import computes."""
    from gguf import GGMLQuantizationType as Q

    from convert.gguf import GGUFSource
    from tests.gguf_helpers import tiny_shapes, write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, {n: Q.Q8_0 for n, s in tiny_shapes(64, False).items() if len(s) == 2})
    hf_to_tp(path, tmp_path / "q", 2, quantize="int8", group_size=32)
    hf_to_tp(path, tmp_path / "f", 1)
    assert verify(tmp_path / "q") == []
    with GGUFSource(path) as src:
        name = "model.layers.1.self_attn.q_proj.weight"
        got = src.q8_0_rows(name, 0, src.shapes()[name][0])
        assert got is not None
        assert torch.equal(dequantize(*got), src.read_rows(name, 0, src.shapes()[name][0]))  # the same values
        ckpt = TPCheckpoint(tmp_path / "q")
        rank = ckpt.open_rank(1)
        rows = got[0].shape[0] // 2
        assert torch.equal(rank.tensor(name), got[0][rows:]) and torch.equal(rank.tensor(name + "_scale"), got[1][rows:])
        rank.close()
    reshard(tmp_path / "q", tmp_path / "q1", 1)
    ref = _logits(load_model(tmp_path / "f", TPContext.single()))
    err = (_logits(load_model(tmp_path / "q1", TPContext.single())) - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item()  # the same weights: float32 rounding only


# ----------------------------------------------------------------------------- LoRA on a quantized base


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_lora_trains_on_a_quantized_base_and_serves(tmp_path: Path, fmt: str) -> None:
    """QLoRA-style: the int8/FP8 base stays frozen and unchanged (products on the dequantized
    weight), fp32 adapters learn (the loss falls); the saved adapter then serves on the same base
    with the CPU decode kernels (prepack) and changes its outputs as it did in training; merging
    into the quantized base is refused."""
    from tests.train_fixtures import make_tiny_model
    from tprt.cpu.fast_linear import prepack
    from tprt.lora.attach import attach
    from tprt.lora.merge import merge_lora
    from tprt.lora.peft_io import read_adapter
    from tprt.text.tokenizer import Tokenizer
    from tprt.train.data import prepare_data
    from tprt.lora.config import LoRASettings
    from tprt.train.trainer import FinetuneConfig, OptimSettings, Trainer

    hf, _ = make_tiny_model(tmp_path, tp=1)
    base = tmp_path / fmt
    hf_to_tp(hf, base, 1, quantize=fmt)
    data_path = tmp_path / "data.jsonl"
    answer = "The capital of France is Paris."
    recs = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]}
            for q in ("What is the capital of France?", "France's capital?", "Name the capital of France.")]
    data_path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    ctx = TPContext.single()
    data = prepare_data(data_path, Tokenizer.from_dir(base), 64, 0)
    cfg = FinetuneConfig(model=base, data=data_path, out=tmp_path / "run",
                         lora=LoRASettings(4, targets=("q", "k", "v", "o", "gate", "up", "down")),
                         optim=OptimSettings(lr=3e-2), steps=10, batch_size=2, seq_len=64, dtype="fp32", progress=False)
    trainer = Trainer(cfg, ctx, data)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    assert any(p.dtype == QuantSpec(fmt).storage for p in frozen.values())
    losses = [trainer.train_step()[0] for _ in range(10)]
    assert sum(losses[-3:]) / 3 < 0.7 * losses[0], losses
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if "lora_" not in n)
    from tprt.train.export import write_adapter

    write_adapter(trainer.model, ctx, tmp_path / "adapter", trainer.adapter_config())
    prompt = torch.tensor([Tokenizer.from_dir(base).encode("What is the capital of France?")])
    with torch.inference_mode():
        trained = trainer.model.gather_logits(trainer.model(prompt))[0, -1].float()

    served = load_model(base, ctx, dtype="fp32")
    prepack(served)  # int8: the compiled products under the adapter
    with torch.inference_mode():
        plain = served.gather_logits(served(prompt))[0, -1].float()
    attach(served, read_adapter(served, tmp_path / "adapter", ctx))
    with torch.inference_mode():
        adapted = served.gather_logits(served(prompt))[0, -1].float()
    assert (adapted - plain).abs().max() > 10 * (adapted - trained).abs().max()  # the adapter acts, as trained
    assert int(adapted.argmax()) == int(trained.argmax())
    with pytest.raises(ConfigError, match=f"weights are {fmt}; merging an adapter"):
        merge_lora(served)
