"""Model configuration read from a Hugging Face `config.json` (Llama, Mistral, Qwen2, Qwen3), and the TP
divisibility rules."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tprt.errors import CheckpointError, ConfigError

# Architecture -> its config.json model_type. Qwen2 and Qwen3 are the Llama block with q/k/v
# biases (Qwen2), or a per-head RMSNorm on q and k before RoPE (Qwen3).
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


MAX_JSON_FILE_BYTES = 16 << 20  # a config file is kilobytes; more is not one
MAX_JSON_DEPTH = 64  # a config nests a few levels; deeper is refused before the parser recurses


def read_json_object(path: Path, shown: str, expected: str,
                     error: type[ConfigError] | type[CheckpointError]) -> dict[str, Any]:
    """The JSON object in the file `path`; `error` naming it as `shown` (a path, or a shorter
    name) when it is missing (saying `expected` is what should be there), not a regular file,
    too large, not UTF-8, nested too deeply, not JSON or not an object."""
    try:
        if not path.is_file():
            if path.exists():
                raise error(f"{shown}: not a regular file; expected {expected}")
            raise FileNotFoundError(path)
        if path.stat().st_size > MAX_JSON_FILE_BYTES:
            raise error(f"{shown}: larger than {MAX_JSON_FILE_BYTES >> 20} MiB; not a config file")
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise error(f"{shown}: not found; expected {expected}") from None
    except UnicodeDecodeError as e:
        raise error(f"{shown}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise error(f"{shown}: cannot be read ({e.strerror or type(e).__name__})") from None
    if _nesting(text) > MAX_JSON_DEPTH:
        raise error(f"{shown}: JSON nested more than {MAX_JSON_DEPTH} levels deep")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{shown}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(d, dict):
        raise error(f"{shown}: expected a JSON object")
    return d


def _nesting(text: str) -> int:
    """The deepest bracket nesting of JSON text, strings skipped (an upper bound for invalid JSON)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


@dataclass(frozen=True)
class RopeScaling:
    """HF `rope_scaling`; only the fields the supported rope types use."""

    rope_type: str  # "default", "llama3" (Llama 3.1+) or "linear"
    factor: float = 1.0  # how much the context was stretched
    low_freq_factor: float = 1.0  # llama3: wavelengths above original/low_freq_factor are scaled
    high_freq_factor: float = 4.0  # llama3: wavelengths below original/high_freq_factor are kept
    original_max_position_embeddings: int = 8192  # llama3: context length before stretching


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family model, independent of how it is sharded."""

    vocab_size: int  # true vocabulary size, before any TP padding
    hidden_size: int  # model width
    intermediate_size: int  # SwiGLU inner width
    num_hidden_layers: int  # transformer blocks
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # kv heads (GQA when fewer than query heads)
    head_dim: int  # per-head width; HF defaults it to hidden_size // num_attention_heads
    rms_norm_eps: float  # epsilon inside every RMSNorm
    rope_theta: float  # RoPE base frequency
    max_position_embeddings: int  # context length
    tie_word_embeddings: bool  # lm_head shares embed_tokens' weight
    rope_scaling: RopeScaling | None = None  # None means plain RoPE
    bos_token_id: int | None = None  # beginning-of-sequence token
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation
    torch_dtype: str = "float32"  # dtype the checkpoint was saved in
    architecture: str = "LlamaForCausalLM"  # one of SUPPORTED_ARCHITECTURES
    qkv_bias: bool = False  # q/k/v projections have biases (Qwen2; attention_bias in Llama and Qwen3)
    o_bias: bool = False  # o_proj has a bias (attention_bias in Llama and Qwen3)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    # Each position attends to the last `sliding_window` positions only, itself included (Mistral
    # v0.1's 4096); None: to every earlier position.
    sliding_window: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # config.json as read

    @property
    def llama_block(self) -> bool:
        """Whether the decoder block is Llama's exactly (no biases, no q/k norms, no window)."""
        return not (self.qkv_bias or self.o_bias or self.qk_norm or self.sliding_window)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Validates an HF Llama config dict; errors name `source` and the offending field."""
        archs = d.get("architectures") or [next((a for a, t in ARCHITECTURES.items() if t == d.get("model_type")),
                                                 "LlamaForCausalLM")]
        arch = archs[0]
        if arch not in ARCHITECTURES or d.get("model_type", ARCHITECTURES[arch]) != ARCHITECTURES[arch]:
            raise ConfigError(
                f"{source}: unsupported architecture {arch!r} (model_type {d.get('model_type')!r}); "
                f"expected one of {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(d.get(key), int) or d[key] <= 0:
                raise ConfigError(f"{source}: field {key!r} must be a positive integer, got {d.get(key)!r}")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: field 'hidden_act' must be 'silu', got {d['hidden_act']!r}")
        if d.get("mlp_bias"):
            raise ConfigError(f"{source}: field 'mlp_bias'=true is not supported (expected false: no MLP biases)")
        attention_bias = bool(d.get("attention_bias", False))
        if attention_bias and arch == "MistralForCausalLM":
            raise ConfigError(f"{source}: field 'attention_bias'=true is not supported for {arch} (expected false)")
        window = _refuse_unimplemented(d, source, arch)
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ConfigError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older ones `rope_scaling`.
        rope = d.get("rope_parameters") or d.get("rope_scaling")
        rope_theta = d.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            rope_scaling=_parse_rope_scaling(rope, source),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            architecture=arch,
            qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",  # Qwen2's q/k/v always have biases
            o_bias=attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=window,
            raw=dict(d),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        return cls.from_dict(read_json_object(path, str(path), "a Hugging Face config.json", ConfigError),
                             source=str(path))


def _refuse_unimplemented(d: dict[str, Any], source: str, arch: str) -> int | None:
    """Fields that change the model's math and that tprt does not implement are refused by name
    (ignored, they would give wrong logits without a word). Returns the sliding window in effect
    (Mistral's, on every layer), None when there is none."""
    window = d.get("sliding_window")
    in_effect = d.get("use_sliding_window", True) is not False
    longest = d.get("max_position_embeddings", 2048)
    if window is None or not in_effect or (isinstance(window, int) and window >= longest):
        window = None
    elif arch != "MistralForCausalLM" or not isinstance(window, int) or window < 1:
        raise ConfigError(f"{source}: field 'sliding_window'={window!r} is not supported for {arch} (attention "
                          f"over only the last {window} positions of some layers); expected null, at least "
                          f"max_position_embeddings={longest}, or a Mistral model (every layer windowed)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) is not None:
            raise ConfigError(f"{source}: field {key!r}={d[key]!r} is not supported (expected null)")
    layer_types = d.get("layer_types") or []
    kinds = {"full_attention"} if window is None else {"sliding_attention"}  # every layer alike
    if in_effect and any(t not in kinds for t in layer_types):
        raise ConfigError(f"{source}: field 'layer_types' lists {sorted(set(layer_types) - kinds)} "
                          f"layers; expected {sorted(kinds)[0]} only")
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{source}: field 'partial_rotary_factor'={d['partial_rotary_factor']!r} is not "
                          f"supported (expected 1.0: RoPE over the whole head)")
    return window


def _parse_rope_scaling(rs: Any, source: str) -> RopeScaling | None:
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise ConfigError(f"{source}: field 'rope_scaling' must be an object, got {rs!r}")
    rope_type = rs.get("rope_type") or rs.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: rope_scaling type {rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return None
    return RopeScaling(
        rope_type=rope_type,
        factor=float(rs.get("factor", 1.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
    )


@dataclass(frozen=True)
class TPLayout:
    """How a model is split over `tp` ranks: the one place that checks divisibility."""

    tp: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    padded_vocab_size: int

    @classmethod
    def for_model(cls, cfg: ModelConfig, tp: int, vocab_align: int = 64) -> TPLayout:
        """Refuses a TP degree the heads do not allow; pads the vocabulary to `vocab_align * tp`."""
        if tp < 1:
            raise ConfigError(f"--tp must be at least 1, got {tp}")
        if vocab_align < 1:
            raise ConfigError(f"--vocab-align must be at least 1, got {vocab_align}")
        h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        if h % tp:
            allowed = [d for d in range(1, h + 1) if h % d == 0 and (kv % d == 0 or d % kv == 0)]
            raise ConfigError(
                f"--tp {tp} does not divide num_attention_heads={h}; allowed TP degrees: {allowed}"
            )
        if kv % tp and tp % kv:
            raise ConfigError(
                f"--tp {tp} neither divides num_key_value_heads={kv} nor is a multiple of it; "
                "kv heads can be split or replicated but not both"
            )
        multiple = vocab_align * tp
        padded = -(-cfg.vocab_size // multiple) * multiple
        return cls(tp=tp, num_heads=h, num_kv_heads=kv, vocab_size=cfg.vocab_size, padded_vocab_size=padded)

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tp

    @property
    def kv_replication(self) -> int:
        """How many ranks hold the same kv head (1 when kv heads are split)."""
        return max(1, self.tp // self.num_kv_heads)

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.tp)

    def kv_heads_of(self, rank: int) -> range:
        """The model-wide indices of TP rank `rank`'s kv heads: split, or replicated with rank r
        holding head r // (TP / n_kv)."""
        first = rank // self.kv_replication * self.local_kv_heads
        return range(first, first + self.local_kv_heads)

    @property
    def local_vocab(self) -> int:
        return self.padded_vocab_size // self.tp
