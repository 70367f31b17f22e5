"""A Hub model repository read as a TensorSource, shard after shard as the conversion reaches it.

The plan needs every tensor's shape, dtype and offset before any data: each shard's header comes
from the cache when the shard is there, else from two HTTP Range requests (its 8-byte length,
then the JSON), so nothing is downloaded up front. Shards are then fetched in storage order,
the next one downloading (huggingface_hub.hf_hub_download, into the standard cache) while the
current one is converted. With `stream`, a shard that was not in the cache before this run is
deleted from it once all its tensors are written: raw weights on disk stay at about two shards.
"""

from __future__ import annotations

import functools
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from convert.rules import is_ignored
from convert.sources import ByteRange, _PreadFile, as_torch
from tprt.checkpoint.hub import HubRepo, hub_call
from tprt.checkpoint.safetensors_io import MAX_HEADER_BYTES, TensorInfo, parse_header
from tprt.errors import CheckpointError, ConfigError
from tprt.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from convert.progress import Progress


class DownloadCancelled(Exception):
    """Raised inside huggingface_hub's download loop to stop it when the source closes early."""


class HubSource:
    """Safetensors shards of a resolved HubRepo, downloaded lazily in storage order."""

    def __init__(self, repo: HubRepo, stream: bool) -> None:
        self.repo = repo
        self.stream = stream
        self.path = Path(repo.label)  # names the source in messages
        self.config_json = repo.config_json()
        self.config = ModelConfig.from_dict(self.config_json, repo.label)
        self.shards, self.weight_map = repo.weight_files()
        self._aux = {n: repo.download(n).read_bytes() for n in repo.aux_files()}
        self._was_cached = {s: repo.cached(s) is not None for s in self.shards}
        self._headers = [self._header(s) for s in self.shards]
        self._where: dict[str, tuple[int, TensorInfo]] = {}
        for k, (tensors, shard) in enumerate(zip(self._headers, self.shards)):
            for name, info in tensors.items():
                if is_ignored(name):
                    continue
                if name in self._where:
                    raise CheckpointError(f"{repo.label}: tensor {name!r} stored in two shards")
                if self.weight_map is not None and self.weight_map.get(name) != shard:
                    raise CheckpointError(f"{repo.label}/{shard}: holds {name!r}, which the index places elsewhere")
                self._where[name] = (k, info)
        self._open: dict[int, _PreadFile] = {}
        self._pending: dict[int, Future[Path]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hub-download")
        self._progress: Progress | None = None
        self._closing = threading.Event()

    # --- headers and downloads ---------------------------------------------------------------

    def _header(self, shard: str) -> dict[str, TensorInfo]:
        local = self.repo.cached(shard)
        if local is not None:
            from tprt.checkpoint.safetensors_io import read_header

            return read_header(local)[0]
        size = (self.repo.files or {}).get(shard)
        if size is None:  # online, the listing has every size; offline, shards must be cached
            raise ConfigError(f"{self.repo.label}/{shard}: not in the Hugging Face cache and HF_HUB_OFFLINE is set")
        (n,) = struct.unpack("<Q", self._range(shard, 0, 8))
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"{self.repo.label}/{shard}: corrupt safetensors header (declares {n} bytes)")
        return parse_header(self._range(shard, 8, n), size, f"{self.repo.label}/{shard}")[0]

    def _range(self, shard: str, start: int, nbytes: int) -> bytes:
        """Bytes [start, start + nbytes) of `shard` at the pinned commit, by an HTTP Range request."""
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = hf_hub_url(self.repo.repo_id, shard, revision=self.repo.commit)
        headers = {**build_hf_headers(token=self.repo.token), "Range": f"bytes={start}-{start + nbytes - 1}"}

        def get() -> bytes:
            with get_session().stream("GET", url, headers=headers, follow_redirects=True) as r:
                hf_raise_for_status(r)
                if r.status_code != 206:
                    raise ConfigError(f"{self.repo.label}/{shard}: the Hub ignored a Range request "
                                      f"(HTTP {r.status_code}); cannot read the header alone")
                data = r.read()
            if len(data) != nbytes:
                raise CheckpointError(f"{self.repo.label}/{shard}: truncated header ({len(data)} of {nbytes} bytes)")
            return data

        data: bytes = hub_call(self.repo, get, shard)
        return data

    def attach(self, progress: Progress) -> None:
        """Counts downloaded bytes on `progress` too (one bar for download and conversion)."""
        self._progress = progress

    def _fetch(self, k: int) -> Future[Path]:
        if k not in self._pending:
            self._pending[k] = self._pool.submit(self.repo.download, self.shards[k], self._on_bytes)
        return self._pending[k]

    def _on_bytes(self, n: int) -> None:
        """Called by the download thread for each chunk received."""
        if self._closing.is_set():
            raise DownloadCancelled(f"{self.repo.label}: download cancelled")  # hf deletes its partial file
        if self._progress is not None:
            self._progress.update(n)

    def _file(self, k: int) -> _PreadFile:
        f = self._open.get(k)
        if f is None:
            path = self._fetch(k).result()
            if k + 1 < len(self.shards):
                self._fetch(k + 1)  # the next shard downloads while this one is converted
            f = self._open[k] = _PreadFile(path)
            if {n: (i.dtype, i.shape, i.begin) for n, i in f.tensors.items()} != {
                n: (i.dtype, i.shape, i.begin) for n, i in self._headers[k].items()
            }:
                raise CheckpointError(f"{self.repo.label}/{self.shards[k]}: downloaded header differs from the Hub's")
        return f

    # --- TensorSource ------------------------------------------------------------------------

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: info.shape for n, (_, info) in self._where.items()}

    def order(self) -> list[str]:
        return sorted(self._where, key=lambda n: (self._where[n][0], self._where[n][1].begin))

    def dtype(self, name: str) -> str:
        return self._where[name][1].dtype

    def raw_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return self._file(self._where[name][0]).rows(name, start, stop)

    def byte_ranges(self, name: str, start: int, stop: int) -> list[ByteRange] | None:
        return [self._file(self._where[name][0]).span(name, start, stop)]

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        info = self._where[name][1]
        return as_torch(self.raw_rows(name, start, stop), info.dtype, info.shape)

    def aux_files(self) -> dict[str, bytes]:
        return dict(self._aux)

    def release_after(self, names: list[str]) -> dict[str, Callable[[], None]]:
        """For the last tensor of each shard in `names` (plan order): closes the shard, and with
        `stream` deletes it from the cache unless it was there before this run. The caller runs
        the callback once that tensor's bytes are written and hashed."""
        last: dict[int, str] = {}
        for n in names:
            last[self._where[n][0]] = n
        if self._progress is not None:  # what is left to download joins the bar's total
            files = self.repo.files or {}
            self._progress.grow(sum(files.get(self.shards[k]) or 0 for k in last if not self._was_cached[self.shards[k]]))
        return {n: functools.partial(self._release, k) for k, n in last.items()}

    def _release(self, k: int) -> None:
        f = self._open.pop(k, None)
        if f is not None:
            f.close()
        if self.stream and not self._was_cached[self.shards[k]]:
            self.repo.delete_cached(self.shards[k])

    def close(self) -> None:
        """Stops a download still running (after a failure or Ctrl-C) at its next chunk."""
        self._closing.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for f in self._open.values():
            f.close()
        self._open.clear()

