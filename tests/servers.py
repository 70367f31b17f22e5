"""The running `tprt serve` the server tests share: a server subprocess, its arguments and
--data-dir, and what tests read of it (metrics, waits, gRPC errors). A helper module, as mp.py
is: test modules import it rather than each other.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from serve.client import Client
from tiny_chat import make_tiny_chat_model
from train_fixtures import write_random_adapter

TOKEN = "s3cret-token"
MAX_BATCH = 16
MAX_QUEUE = 2
MAX_MESSAGE = 1 << 20
CONTEXT = 4096
START_TIMEOUT_S = 120.0


class ServerProcess:
    """`tprt serve` in a subprocess: waits for its "listening on" line, stops it, keeps its log."""

    def __init__(self, args: list[str], log: Path, tls_ca: Path | None = None,
                 launcher: tuple[str, ...] = (sys.executable, "-m", "tprt.cli")) -> None:
        self.log = log
        self.tls_ca = tls_ca
        self.proc = subprocess.Popen(
            [*launcher, "serve", *args], stdout=subprocess.PIPE,
            stderr=log.open("w"), text=True, env={**_env(), "PYTHONUNBUFFERED": "1"})
        self.ready = threading.Event()
        self.line = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(START_TIMEOUT_S) or not self.line:
            self.kill()
            raise AssertionError(f"server did not start: {self.tail()}")
        m = re.search(r"listening on ([\d.]+:\d+) .*metrics http://([\d.]+:\d+)/metrics; rank pids \[([\d, ]+)\]",
                      self.line)
        assert m, self.line
        self.target, self.metrics_addr = m.group(1), m.group(2)
        self.pids = [int(p) for p in m.group(3).split(",")]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "listening on" in line:
                self.line = line
                self.ready.set()
        self.ready.set()  # exited before becoming ready

    def tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else ""

    def client(self, token: str | None = TOKEN, timeout: float | None = 60.0) -> Client:
        return Client(self.target, token=token, timeout=timeout, tls_ca=self.tls_ca)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://{self.metrics_addr}/metrics", timeout=10) as r:
            return str(r.read().decode())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"server did not exit within {timeout}s: {self.tail()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _env() -> dict[str, str]:
    return dict(os.environ)


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` that have `labels` (and any others), in Prometheus text
    format (0 when absent)."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        sample, _, lab = key.partition("{")
        got = set(lab.rstrip("}").split(",")) if lab else set()
        if sample == name and want <= got:
            total += float(value)
    return total


def wait_for(pred: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def prepare_root(root: Path, context: int = CONTEXT) -> Path:
    """`root` with the tiny chat model at TP 2 (model/tp2), a token file and a data dir: what
    `server_args(root)` names. Also used by bench/serve_soak.py and bench/serve_fuzz.py."""
    make_tiny_chat_model(root / "model", (2,), max_positions=context)
    (root / "token").write_text(TOKEN + "\n")
    data_dir(root, "data")
    return root


def data_dir(root: Path, name: str) -> Path:
    """A --data-dir holding train.jsonl (each server needs its own: a server locks its --data-dir)."""
    d = root / name
    d.mkdir(exist_ok=True)
    (d / "train.jsonl").write_text("".join(
        json.dumps({"prompt": f"Q{i}: say hi", "completion": " hi there"}) + "\n" for i in range(8)))
    return d


def server_args(root: Path, data: Path | None = None) -> list[str]:
    return ["--model", str(root / "model" / "tp2"), "--port", "0", "--metrics-port", "0",
            "--data-dir", str(data or root / "data"), "--auth-token-file", str(root / "token"),
            "--max-batch-size", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE), "--max-seq-len", str(CONTEXT),
            "--drain-timeout", "20", "--threads", "1", "--collective-timeout", "30",
            "--max-message-bytes", str(MAX_MESSAGE), "--max-loras", "2", "--max-cpu-loras", "1",
            "--max-lora-rank", "16"]


def rpc_error(fn: Callable[[], Any]) -> Any:
    with pytest.raises(grpc.RpcError) as info:
        result = fn()
        if hasattr(result, "__next__"):
            list(result)
    return info.value


def wait_idle(server: ServerProcess) -> None:
    """Until no request runs or waits and every KV slot is free."""
    def idle() -> bool:
        m = server.metrics()
        return all(metric(m, name) == 0 for name in
                   ("tprt_running_requests", "tprt_waiting_requests", "tprt_kv_cache_usage_ratio"))

    wait_for(idle, 20, "the server to be idle")


def self_signed_cert(workdir: Path) -> tuple[Path, Path] | None:
    """A certificate and key for 127.0.0.1 in `workdir` (None without openssl): TLS servers."""
    if shutil.which("openssl") is None:
        return None
    cert, key = workdir / "cert.pem", workdir / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def write_model_adapter(workdir: Path, path: Path, targets: tuple[str, ...], rank: int, seed: int,
                          hidden: int | None = None) -> None:
    """A PEFT adapter directory for the test model (random A and B: it changes the outputs);
    `hidden` other than the model's: an adapter built for another base model."""
    from tprt.model.config import ModelConfig

    c = ModelConfig.from_dict(json.loads((workdir / "model" / "hf" / "config.json").read_text()))
    write_random_adapter(path, c if hidden is None else replace(c, hidden_size=hidden), targets, rank, seed, 0.5)
