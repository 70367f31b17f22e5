"""Model configuration read from a Hugging Face `config.json` (Llama, Mistral, Qwen2, Qwen3, Gemma 2,
Gemma 3 text), and the TP divisibility rules."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tprt.errors import CheckpointError, ConfigError

# Architecture -> its config.json model_type. Qwen2 and Qwen3 are the Llama block with q/k/v
# biases (Qwen2), or a per-head RMSNorm on q and k before RoPE (Qwen3). Gemma 2 and 3 change more:
# `GEMMA_ARCHITECTURES` below.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
# Gemma's block: embeddings scaled by sqrt(hidden), RMSNorms scaling by (1 + weight) in float32,
# GeGLU, a norm on each half's output as well as its input, queries scaled by
# query_pre_attn_scalar, and sliding-window layers interleaved with global ones. Gemma 2 adds
# tanh soft-capping of attention scores and final logits; Gemma 3 q/k norms and a rope base of
# its own for the sliding layers.
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# hidden_act -> what the MLP's gate goes through: SwiGLU, or GeGLU with the tanh approximation.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


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
    # Each position of a windowed layer attends to the last `sliding_window` positions only, itself
    # included (Mistral v0.1's 4096); None: every layer to every earlier position.
    sliding_window: int | None = None
    # Which layers are windowed (Gemma's interleaving); empty: every layer, when there is a window.
    sliding_layers: tuple[bool, ...] = ()
    hidden_act: str = "silu"  # one of ACTIVATIONS
    gemma_block: bool = False  # Gemma's norms, embedding scale and extra per-half norms (GEMMA_ARCHITECTURES)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power; None: head_dim's
    attn_logit_softcapping: float | None = None  # attention scores -> cap * tanh(score / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # the same of the LM head's logits (Gemma 2)
    local_rope_theta: float | None = None  # the windowed layers' plain rope base (Gemma 3); None: rope_theta's
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # config.json as read

    @property
    def llama_block(self) -> bool:
        """Whether the decoder block is Llama's exactly (no biases, no q/k norms, no window, no Gemma)."""
        return not (self.qkv_bias or self.o_bias or self.qk_norm or self.sliding_window or self.gemma_block)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer`; None: it attends to every earlier position."""
        if self.sliding_window is None or (self.sliding_layers and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Every layer's `window_of`."""
        return tuple(self.window_of(i) for i in range(self.num_hidden_layers))

    @property
    def query_scale(self) -> float:
        """What the model multiplies queries by so that attention's 1/sqrt(head_dim) makes
        query_pre_attn_scalar's scaling (1 where there is none)."""
        if self.query_pre_attn_scalar is None:
            return 1.0
        return (self.head_dim / self.query_pre_attn_scalar) ** 0.5

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
        gemma, gemma2 = arch in GEMMA_ARCHITECTURES, arch == "Gemma2ForCausalLM"
        act_field = "hidden_activation" if gemma and d.get("hidden_activation") else "hidden_act"
        act = d.get(act_field) or ("gelu_pytorch_tanh" if gemma else "silu")
        if act != ("gelu_pytorch_tanh" if gemma else "silu"):
            raise ConfigError(f"{source}: field {act_field!r} must be "
                              f"{'gelu_pytorch_tanh' if gemma else 'silu'!r} for {arch}, got {act!r}")
        if d.get("mlp_bias"):
            raise ConfigError(f"{source}: field 'mlp_bias'=true is not supported (expected false: no MLP biases)")
        attention_bias = bool(d.get("attention_bias", False))
        if attention_bias and arch == "MistralForCausalLM":
            raise ConfigError(f"{source}: field 'attention_bias'=true is not supported for {arch} (expected false)")
        window, sliding_layers = _refuse_unimplemented(d, source, arch)
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ConfigError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older ones `rope_scaling`.
        # Gemma 3's hold one per layer kind; older Gemma 3 configs name the local base rope_local_base_freq.
        rope = d.get("rope_parameters") or d.get("rope_scaling")
        local_rope = None
        if isinstance(rope, dict) and ("full_attention" in rope or "sliding_attention" in rope):
            per_kind: dict[str, Any] = rope
            rope, local_rope = per_kind.get("full_attention"), per_kind.get("sliding_attention") or {}
        default_theta = 1e6 if arch == "Gemma3ForCausalLM" else 10000.0
        rope_theta = d.get("rope_theta") or (rope if isinstance(rope, dict) else {}).get("rope_theta") or default_theta
        local_theta = None
        if arch == "Gemma3ForCausalLM":
            _parse_rope_scaling(local_rope, source, plain_only=True)
            local_theta = float((local_rope if isinstance(local_rope, dict) else {}).get("rope_theta")
                                or d.get("rope_local_base_freq") or 10000.0)
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
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            sliding_window=window,
            sliding_layers=sliding_layers,
            hidden_act=act,
            gemma_block=gemma,
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or 256) if gemma else None,
            attn_logit_softcapping=_positive_or_none(d, "attn_logit_softcapping", source, gemma2 and 50.0),
            final_logit_softcapping=_positive_or_none(d, "final_logit_softcapping", source, gemma2 and 30.0),
            local_rope_theta=local_theta,
            raw=dict(d),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        return cls.from_dict(read_json_object(path, str(path), "a Hugging Face config.json", ConfigError),
                             source=str(path))


def _refuse_unimplemented(d: dict[str, Any], source: str, arch: str) -> tuple[int | None, tuple[bool, ...]]:
    """Fields that change the model's math and that tprt does not implement are refused by name
    (ignored, they would give wrong logits without a word). Returns the sliding window in effect
    (None when there is none) and which layers it applies to (empty: all)."""
    interleaved = arch in GEMMA_ARCHITECTURES
    window = d.get("sliding_window", 4096 if interleaved else None)  # transformers' Gemma default
    in_effect = d.get("use_sliding_window", True) is not False
    longest = d.get("max_position_embeddings", 2048)
    if window is None or not in_effect or (isinstance(window, int) and window >= longest):
        window = None
    elif not (arch == "MistralForCausalLM" or interleaved) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"{source}: field 'sliding_window'={window!r} is not supported for {arch} (attention "
                          f"over only the last {window} positions of some layers); expected null, at least "
                          f"max_position_embeddings={longest}, or a Mistral or Gemma model")
    if not interleaved:
        for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            if d.get(key) is not None:
                raise ConfigError(f"{source}: field {key!r}={d[key]!r} is not supported for {arch} (expected null)")
    if d.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: field 'use_bidirectional_attention'=true is not supported (expected false: "
                          f"a causal language model)")
    layer_types = list(d.get("layer_types") or [])
    n_layers = int(d["num_hidden_layers"])  # checked a positive integer already
    if interleaved:
        if not layer_types:  # transformers' defaults: every 2nd (Gemma 2) or 6th (Gemma 3) layer global
            every = 2 if arch == "Gemma2ForCausalLM" else int(d.get("sliding_window_pattern") or 6)
            layer_types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
        if len(layer_types) != n_layers or any(t not in ("sliding_attention", "full_attention") for t in layer_types):
            raise ConfigError(f"{source}: field 'layer_types' must list 'sliding_attention' or 'full_attention' "
                              f"for each of the {n_layers} layers")
        sliding = tuple(t == "sliding_attention" for t in layer_types)
        return window, (sliding if window is not None else ())
    kinds = {"full_attention"} if window is None else {"sliding_attention"}  # every layer alike
    if in_effect and any(t not in kinds for t in layer_types):
        raise ConfigError(f"{source}: field 'layer_types' lists {sorted(set(layer_types) - kinds)} "
                          f"layers; expected {sorted(kinds)[0]} only")
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{source}: field 'partial_rotary_factor'={d['partial_rotary_factor']!r} is not "
                          f"supported (expected 1.0: RoPE over the whole head)")
    return window, ()


def _positive_or_none(d: dict[str, Any], key: str, source: str, default: float | bool = False) -> float | None:
    """d[key] as a positive float, None for null; `default` (False: None) where the key is absent."""
    value = d.get(key, default or None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{source}: field {key!r} must be a positive number or null, got {value!r}")
    return float(value)


def _parse_rope_scaling(rs: Any, source: str, plain_only: bool = False) -> RopeScaling | None:
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise ConfigError(f"{source}: field 'rope_scaling' must be an object, got {rs!r}")
    rope_type = rs.get("rope_type") or rs.get("type") or "default"
    if plain_only and rope_type != "default":
        raise ConfigError(f"{source}: field 'rope_parameters.sliding_attention': rope type {rope_type!r} is not "
                          f"supported there (expected 'default')")
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
