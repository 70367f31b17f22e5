"""The converter's Python API; `tprt-convert` is a thin layer over these functions.

Every function writes its output atomically (a temporary sibling directory renamed into place
at the end), refuses an existing `dst` unless `force`, and raises `tprt.errors.TprtError` with a
one-line message for anything wrong with the input or the output location.
"""

from __future__ import annotations

from pathlib import Path

from convert import engine
from convert.verify import verify as _verify
from convert.verify import verify_hub
from tprt.checkpoint.format import Manifest
from tprt.checkpoint.hub import HubRepo, is_hub_id
from tprt.errors import ConfigError
from tprt.quant.formats import parse_spec

__all__ = ["gguf_to_hf", "hf_to_tp", "hub_gguf", "reshard", "tp_to_hf", "verify"]


def hf_to_tp(
    src: Path | str, dst: Path, tp: int, dtype: str | None = None, vocab_align: int = 64,
    force: bool = False, progress: bool = False,
    revision: str | None = None, token: str | None = None, stream: bool = False,
    quantize: str | None = None, group_size: int | None = None,
) -> Manifest:
    """HF directory, .gguf file or Hub repo id (`org/name`) -> TP checkpoint with `tp` ranks.
    `dtype`: bf16, fp16 or fp32 (None keeps the source's); the vocabulary is zero-padded to a
    multiple of vocab_align * tp. For a Hub repo: `revision` (branch, tag or commit), `token`
    (default: HF_TOKEN or the stored login), and `stream` to delete each shard this run
    downloaded from the cache once it is converted. `quantize` ("int8" or "fp8") stores the
    decoder's linear weights quantized with float32 scales per output channel, or per
    `group_size` input columns (int8 only); the manifest records the format."""
    hub = engine.HubOptions(revision, token, stream) if revision or token or stream else None
    return engine.convert_to_tp(_src(src), Path(dst), tp, dtype, vocab_align, force, progress, hub,
                                parse_spec(quantize, group_size))


def _src(src: Path | str) -> Path | str:
    """A Hub repo id stays a string; anything else is a local path."""
    return str(src) if is_hub_id(src) else Path(src)


def reshard(
    src: Path, dst: Path, tp: int, dtype: str | None = None, vocab_align: int | None = None,
    force: bool = False, progress: bool = False, quantize: str | None = None, group_size: int | None = None,
) -> Manifest:
    """TP checkpoint -> TP checkpoint with `tp` ranks, straight from the rank files. vocab_align
    None keeps the source checkpoint's. A quantized source stays in its format (its groups must
    stay whole at the new TP size); `quantize` quantizes a float one as `hf_to_tp` does."""
    return engine.convert_to_tp(Path(src), Path(dst), tp, dtype, vocab_align, force, progress, None,
                                parse_spec(quantize, group_size))


def tp_to_hf(
    src: Path, dst: Path, dtype: str | None = None, force: bool = False, progress: bool = False,
    max_shard_size: int | str | None = None,
) -> list[str]:
    """TP checkpoint -> HF directory loadable by transformers. The source HF shard layout (kept in
    the manifest) is reproduced unless `max_shard_size` ("5GB", "500MB" or bytes) is given; without
    either, shards of at most 5GB. Returns the safetensors file names written."""
    return engine.convert_to_hf(Path(src), Path(dst), dtype, force, progress, max_shard_size)


def gguf_to_hf(
    src: Path | str, dst: Path, dtype: str | None = None, force: bool = False, progress: bool = False,
    max_shard_size: int | str | None = None, revision: str | None = None, token: str | None = None,
    gguf_file: str | None = None,
) -> list[str]:
    """.gguf file -> HF directory (dequantised; q/k rows back in HF's rotate-half order). `src`
    may be a Hub repo id: its .gguf file (`gguf_file`, needed when it has several) is fetched
    into the Hugging Face cache first."""
    if is_hub_id(src):
        src = hub_gguf(HubRepo(str(src), revision, token).resolve(), gguf_file)
    elif gguf_file or revision:
        raise ConfigError(f"{src}: --gguf-file and --revision apply to a Hub repo id (org/name)")
    if Path(src).suffix.lower() != ".gguf":
        raise ConfigError(f"{src}: SRC must be a .gguf file")
    return engine.convert_to_hf(Path(src), Path(dst), dtype, force, progress, max_shard_size)


def hub_gguf(repo: HubRepo, name: str | None) -> Path:
    """The cached path of the repository's .gguf file `name` (None: its only one), fetched alone."""
    ggufs = sorted(f for f in repo.files or {} if f.lower().endswith(".gguf"))
    if name is None:
        if len(ggufs) != 1:
            found = ", ".join(ggufs[:6]) + (", ..." if len(ggufs) > 6 else "") if ggufs else "none"
            raise ConfigError(f"{repo.label}: pick one .gguf file with --gguf-file (found: {found})")
        name = ggufs[0]
    elif name not in ggufs:
        raise ConfigError(f"{repo.label}: no file {name!r} in the repository (.gguf files: {', '.join(ggufs) or 'none'})")
    return repo.download(name)


def verify(path: Path | str, revision: str | None = None, token: str | None = None) -> list[str]:
    """Re-reads every file (sha256, size, header) and checks shapes against the manifest and
    config.json; returns the problems found, one line each (empty when sound). A Hub repo id
    verifies its download in the huggingface_hub cache (sha256 against the Hub's)."""
    if is_hub_id(path):
        return verify_hub(HubRepo(str(path), revision, token))
    return _verify(Path(path))
