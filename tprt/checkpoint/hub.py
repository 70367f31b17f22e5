"""A Hugging Face Hub model repository as a checkpoint source, through huggingface_hub.

Everything goes through huggingface_hub and its conventions: the token comes from the caller,
HF_TOKEN or the stored login; HF_ENDPOINT, HF_HUB_CACHE/HF_HOME and HF_HUB_OFFLINE are honoured;
files land in the standard cache (blobs + snapshots/<commit>/ links), so downloads are shared
with transformers and vLLM. Only the files a conversion reads are ever fetched: config,
tokenizer files, generation config, chat template, and the safetensors weights with their index.
Every failure is a one-line ConfigError; those about the repository itself (gated, missing, wrong
revision, no safetensors, not Llama) come before any output is written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tprt.errors import ConfigError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def is_hub_id(src: str | Path) -> bool:
    """`org/name` that is not an existing local path: a Hub repository id."""
    text = str(src)
    return bool(_REPO_ID.match(text)) and not Path(text).exists() and ".." not in text


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


@dataclass
class HubRepo:
    """One revision of a model repository, pinned to its commit once resolved."""

    repo_id: str
    revision: str | None = None
    token: str | None = None
    commit: str = ""  # set by resolve()
    files: dict[str, int | None] | None = None  # repo file -> size (None: unknown, offline)
    sha256: dict[str, str] | None = None  # LFS file -> the Hub's sha256 of its content (online only)

    @property
    def label(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")

    def resolve(self) -> HubRepo:
        """Pins the commit and lists the repository's files (offline: the cached snapshot's)."""
        if offline():
            snapshot = self.cached_snapshot()
            self.commit = snapshot.name
            self.files = {str(p.relative_to(snapshot)): None for p in snapshot.rglob("*") if p.is_file()}
            return self
        from huggingface_hub import HfApi, hf_hub_download

        info = hub_call(self, lambda: HfApi().model_info(
            self.repo_id, revision=self.revision, token=self.token, files_metadata=True))
        if not info.sha:
            raise ConfigError(f"{self.label}: the Hub did not report the revision's commit")
        self.commit = info.sha
        self.files = {s.rfilename: s.size for s in info.siblings or []}
        self.sha256 = {s.rfilename: s.lfs.sha256 for s in info.siblings or [] if s.lfs is not None}
        if self.has("config.json"):  # fetched by the revision's name so the cache records it (refs/)
            rev = self.revision
            quiet = quiet_tqdm(None)
            config = hub_call(self, lambda: hf_hub_download(self.repo_id, "config.json", revision=rev,
                                                            token=self.token, tqdm_class=quiet), "config.json")
            if Path(config).parent.name != self.commit:
                raise ConfigError(f"{self.label}: the revision moved while it was being read; try again")
        return self

    def cached_snapshot(self) -> Path:
        """The cache's snapshot folder for this revision (offline mode needs it present)."""
        try:
            return Path(self.download("config.json")).parent
        except ConfigError:
            raise ConfigError(
                f"{self.label}: not in the Hugging Face cache and HF_HUB_OFFLINE is set; "
                "run once online, or unset HF_HUB_OFFLINE"
            ) from None

    def download(self, filename: str, on_bytes: Callable[[int], None] | None = None) -> Path:
        """The cached path of `filename` at the pinned commit (downloaded if not cached, without
        huggingface_hub's own progress bar; `on_bytes` is told of each chunk received)."""
        from huggingface_hub import hf_hub_download

        rev, tqdm_class = self.commit or self.revision, quiet_tqdm(on_bytes)
        return Path(hub_call(self, lambda: hf_hub_download(
            self.repo_id, filename, revision=rev, token=self.token, tqdm_class=tqdm_class), filename))

    def cached(self, filename: str) -> Path | None:
        """`filename`'s path if this commit's copy is already in the cache (nothing is fetched)."""
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(self.repo_id, filename, revision=self.commit or self.revision)
        return Path(hit) if isinstance(hit, str) else None

    def has(self, filename: str) -> bool:
        assert self.files is not None, "resolve() first"
        return filename in self.files

    def config_json(self) -> dict[str, Any]:
        """config.json, parsed; fails on a non-Llama architecture."""
        from tprt.model.config import ModelConfig

        if not self.has("config.json"):
            raise ConfigError(f"{self.label}: no config.json in the repository; not a transformers model")
        path = self.download("config.json")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConfigError(f"{self.label}: config.json is not valid JSON") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{self.label}: config.json is not a JSON object")
        ModelConfig.from_dict(data, self.label)
        return data

    def weight_files(self) -> tuple[list[str], dict[str, str] | None]:
        """The safetensors files to fetch and the index's tensor -> file map (None: one file).
        Never .bin, .pth or original/: only safetensors are read."""
        if self.has(INDEX_NAME):
            index = self.download(INDEX_NAME)
            try:
                wm = json.loads(index.read_text())["weight_map"]
                weight_map = {str(k): str(v) for k, v in wm.items()}
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise ConfigError(f"{self.label}: {INDEX_NAME} has no 'weight_map' object") from None
            shards = sorted(set(weight_map.values()))
            for s in shards:
                if "/" in s or not self.has(s):
                    raise ConfigError(f"{self.label}: {INDEX_NAME} lists {s}, which the repository does not have")
            return shards, weight_map
        if self.has(SINGLE_NAME):
            return [SINGLE_NAME], None
        other = sorted(f for f in self.files or {} if f.endswith((".bin", ".pth", ".gguf")))
        found = f" (it has {', '.join(other[:3])}{', ...' if len(other) > 3 else ''})" if other else ""
        raise ConfigError(
            f"{self.label}: no safetensors weights ({SINGLE_NAME} or {INDEX_NAME}){found}; "
            "only safetensors are converted from the Hub"
        )

    def aux_files(self) -> list[str]:
        """Tokenizer files, generation config and chat template the repository has."""
        from tprt.checkpoint.format import TOKENIZER_FILES  # here: it imports torch, `tprt plan` does not

        return [n for n in TOKENIZER_FILES if self.has(n)]

    def delete_cached(self, filename: str) -> None:
        """Removes `filename` at the pinned commit from the cache: its snapshot link and its blob."""
        link = self.cached(filename)
        if link is None:
            return
        blob = link.resolve()
        link.unlink(missing_ok=True)
        if blob != link:
            blob.unlink(missing_ok=True)


def hub_call(repo: HubRepo, fn: Any, filename: str | None = None) -> Any:
    """Runs a huggingface_hub call, turning its errors into one ConfigError line."""
    from huggingface_hub import errors

    what = f"{repo.label}: {filename}" if filename else repo.label
    try:
        return fn()
    except errors.GatedRepoError:
        raise ConfigError(f"{repo.label}: gated repository; accept its license on the Hub and pass --token "
                          "(or set HF_TOKEN, or `hf auth login`)") from None
    except errors.RevisionNotFoundError:
        raise ConfigError(f"{repo.label}: revision {repo.revision!r} not found on the Hub") from None
    except errors.RepositoryNotFoundError:
        raise ConfigError(f"{repo.label}: repository not found on the Hub (or private: pass --token)") from None
    except errors.EntryNotFoundError:
        raise ConfigError(f"{what}: file not found in the repository") from None
    except errors.LocalEntryNotFoundError:
        raise ConfigError(f"{what}: not in the Hugging Face cache, and the Hub cannot be reached"
                          + (" (HF_HUB_OFFLINE is set)" if offline() else "")) from None
    except errors.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        if status in (401, 403):
            raise ConfigError(f"{repo.label}: access denied (HTTP {status}); pass --token or set HF_TOKEN") from None
        raise ConfigError(f"{what}: Hub request failed (HTTP {status})") from None
    except (OSError, errors.HFValidationError) as e:
        raise ConfigError(f"{what}: Hub request failed: {e}") from None
    except Exception as e:  # noqa: BLE001 - the HTTP client's own errors (connection refused, ...)
        if type(e).__module__.split(".")[0] not in ("httpx", "httpx2", "httpcore"):
            raise
        raise ConfigError(f"{what}: cannot reach the Hub ({type(e).__name__}: {e})") from None


def quiet_tqdm(on_bytes: Callable[[int], None] | None) -> Any:
    """A tqdm class for hf_hub_download that draws nothing and hands each update to `on_bytes`
    (the converter's own bar counts downloads and conversion together)."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class Quiet(hf_tqdm):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if on_bytes is not None and n:
                on_bytes(int(n))
            return None

    return Quiet


def hub_config(repo_id: str, revision: str | None = None, token: str | None = None) -> Path:
    """config.json of a Hub model, fetched alone (into the cache, or found there offline); its
    local path. Nothing else is requested: no repo listing, no weights."""
    return HubRepo(repo_id, revision, token).download("config.json")

