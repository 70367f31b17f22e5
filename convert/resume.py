"""Where an interrupted conversion stopped: a journal kept in its (kept) temporary directory.

The copy writes tensors in plan order; at each checkpoint (the end of a source shard) every open
output file is fsynced, then the journal records how many tensors are done, how far each open
file got, and the size and sha256 of each finished one. A rerun with the same plan (`key`)
truncates the open files to those lengths, re-hashes what they hold, and carries on from the
next tensor, so the shards already converted are never read (or downloaded) again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tprt.checkpoint.fsutil import write_bytes_atomic

JOURNAL = ".tprt-resume.json"


@dataclass
class ResumeState:
    tensors_done: int = 0
    written: dict[str, int] = field(default_factory=dict)  # open output file -> bytes kept
    closed: dict[str, tuple[int, str]] = field(default_factory=dict)  # finished file -> (size, sha256)


class Journal:
    def __init__(self, directory: Path, key: str) -> None:
        self.path = directory / JOURNAL
        self.key = key

    def load(self) -> ResumeState:
        """The recorded state, or a fresh start when there is none, it is for another plan, or
        the files on disk are shorter than it says."""
        try:
            d = json.loads(self.path.read_text())
            if d.get("key") != self.key:
                return ResumeState()
            state = ResumeState(int(d["tensors_done"]), {str(k): int(v) for k, v in d["written"].items()},
                                {str(k): (int(v[0]), str(v[1])) for k, v in d["closed"].items()})
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return ResumeState()
        sizes = {**state.written, **{n: s for n, (s, _) in state.closed.items()}}
        for name, size in sizes.items():
            f = self.path.parent / name
            if not f.is_file() or f.stat().st_size < size:
                return ResumeState()
        return state

    def prepare(self) -> ResumeState:
        """load(); when there is nothing to resume, the directory is emptied of a previous
        attempt's files so none of them can end up in the output."""
        state = self.load()
        if state.tensors_done == 0:
            for child in self.path.parent.iterdir():
                if child.is_file():
                    child.unlink()
        return state

    def save(self, state: ResumeState) -> None:
        data = {"key": self.key, "tensors_done": state.tensors_done, "written": state.written,
                "closed": {n: list(v) for n, v in state.closed.items()}}
        write_bytes_atomic(self.path, json.dumps(data).encode())

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
