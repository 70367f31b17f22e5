"""Soak: one live `tprt serve` (TP 2, the tests' tiny model) under cycles of careless and hostile
traffic for a bounded time, with every rank's memory sampled.

    python bench/serve_soak.py                  # 5 minutes
    python bench/serve_soak.py --minutes 2 --sample-s 2

Each cycle: streams started and cancelled after their first token, greedy completions, a
fine-tuning job created and cancelled (queued or running), invalid calls (junk bytes, bad paths,
text too long to fit, unknown adapters), and health watches opened without a token and
dropped; then the same over the OpenAI HTTP API: chat streams dropped after their first event,
greedy completions, a file uploaded, a job created on it, listed and cancelled, the file deleted,
an upload in UTF-16, a body without a token, an unknown model. Every `--sample-s` seconds the resident memory (RSS) of the server's processes is
summed. Reported: cycles run, calls by status code, RSS at the start and the end, and the slope
of RSS over time (least squares over the samples after the first quarter, the warm-up), in MiB
per minute. Also checked: no call ended INTERNAL, health stayed SERVING. Bounded: every call has
a deadline and the server is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def rss_mib(pids: list[int]) -> float:
    import psutil

    return sum(psutil.Process(p).memory_info().rss for p in pids) / 2**20


def slope_per_minute(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB), in MiB per minute."""
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mm = sum(m for _, m in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 60 * sum((t - mt) * (m - mm) for t, m in samples) / var if var else 0.0


def http_cycle(http: object, count: Callable[[Any], Any], chats: str) -> None:
    """One round of careless HTTP traffic (see the module docstring)."""
    chat = {"model": "tp2", "messages": [{"role": "user", "content": "soak"}], "max_tokens": 200}
    for _ in range(2):
        with http.stream("POST", "/chat/completions", json={**chat, "stream": True}) as r:  # type: ignore[attr-defined]
            count(r)
            next(r.iter_lines(), None)  # the first event, then hang up
    for _ in range(2):
        count(http.post("/completions", json={"model": "tp2", "prompt": "steady", "max_tokens": 16,  # type: ignore[attr-defined]
                                               "temperature": 0}))
    up = count(http.post("/files", files={"file": ("t.jsonl", chats.encode())}, data={"purpose": "fine-tune"}))  # type: ignore[attr-defined]
    if up.status_code == 200:
        file_id = up.json()["id"]
        job = count(http.post("/fine_tuning/jobs", json={"model": "tp2", "training_file": file_id}))  # type: ignore[attr-defined]
        count(http.get("/fine_tuning/jobs", params={"limit": 5}))  # type: ignore[attr-defined]
        if job.status_code == 200:
            count(http.post(f"/fine_tuning/jobs/{job.json()['id']}/cancel"))  # type: ignore[attr-defined]
        count(http.delete(f"/files/{file_id}"))  # type: ignore[attr-defined]
    count(http.post("/files", files={"file": ("u.jsonl", chats.encode("utf-16"))}, data={"purpose": "fine-tune"}))  # type: ignore[attr-defined]
    count(http.post("/completions", json={"model": "tp2", "prompt": "x"}, headers={"Authorization": ""}))  # type: ignore[attr-defined]
    count(http.post("/completions", json={"model": "no-such-adapter", "prompt": "x", "max_tokens": 1}))  # type: ignore[attr-defined]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--sample-s", type=float, default=5.0)
    a = ap.parse_args()

    import grpc
    import httpx
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from serve.client import Client
    from servers import TOKEN, ServerProcess, prepare_root, server_args

    root = prepare_root(Path(tempfile.mkdtemp(prefix="tprt-soak-")), context=256)
    srv = ServerProcess(server_args(root) + ["--max-seq-len", "256", "--http-port", "0"], root / "server.log")
    m = re.search(r"OpenAI API (https?://[\d.]+:\d+/v1)", srv.line)
    assert m, srv.line
    base_url = m.group(1)
    pids = [srv.proc.pid, *srv.pids]
    codes: dict[str, int] = {}
    samples: list[tuple[float, float]] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.monotonic() - t0, rss_mib(pids)))
            stop.wait(a.sample_s)

    def count(fn: object) -> None:
        try:
            result = fn()  # type: ignore[operator]
            if hasattr(result, "__next__"):
                list(result)
            codes["OK"] = codes.get("OK", 0) + 1
        except grpc.RpcError as e:
            codes[e.code().name] = codes.get(e.code().name, 0) + 1

    def count_http(r: httpx.Response) -> httpx.Response:
        key = f"HTTP {r.status_code}"
        codes[key] = codes.get(key, 0) + 1
        return r

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cycles = 0
    healthy = True
    end = t0 + a.minutes * 60
    job = {"inline_jsonl": '{"text": "hello hello hello"}\n', "steps": 100_000, "batch_size": 1,
           "max_seq_len": 16, "lora_rank": 2}
    try:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        chats = "".join(json.dumps({"messages": [{"role": "user", "content": f"Q{i}"},
                                                 {"role": "assistant", "content": "hi"}]}) + "\n" for i in range(4))
        with Client(srv.target, token=TOKEN, timeout=30) as c, grpc.insecure_channel(srv.target) as bare, \
                httpx.Client(base_url=base_url, headers=auth, timeout=30) as http:
            watch = health_pb2_grpc.HealthStub(bare).Watch
            while time.monotonic() < end:
                streams = [c.generate("soak", max_new_tokens=200, ignore_eos=True) for _ in range(4)]
                for s in streams:
                    next(s)
                    s.cancel()  # type: ignore[attr-defined]
                for _ in range(4):
                    count(lambda: c.complete("steady", max_new_tokens=16, temperature=0))
                created: list[str] = []
                count(lambda: created.append(c.create_job(**job).id))
                for job_id in created:
                    count(lambda: c.cancel_job(job_id))
                junk = bare.unary_unary("/tprt.v1.Generation/Complete")
                count(lambda: junk(b"\x0a\x03\xff\xfe\xfd", metadata=(("authorization", f"Bearer {TOKEN}"),),
                                   timeout=30))
                count(lambda: c.create_job(dataset_path="x\x00" * 3000, steps=1))
                count(lambda: c.tokenize("y" * 5000))
                count(lambda: c.complete("hi", adapter_id="nope" * 100, max_new_tokens=1))
                watches = [watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(4)]
                for w in watches:
                    w.cancel()
                try:
                    http_cycle(http, count_http, chats)
                except httpx.TransportError as e:  # counted, not fatal: the next cycle opens a new connection
                    codes[f"HTTP {type(e).__name__}"] = codes.get(f"HTTP {type(e).__name__}", 0) + 1
                healthy = healthy and c.health_check() == "SERVING"
                cycles += 1
    finally:
        stop.set()
        sampler.join()
        srv.stop()
    steady = samples[len(samples) // 4:]
    print(f"{cycles} cycles in {a.minutes:g} min; calls: " + ", ".join(f"{k} {v}" for k, v in sorted(codes.items())))
    print(f"RSS (all ranks): {samples[0][1]:.0f} MiB at start, {samples[-1][1]:.0f} MiB at the end; "
          f"slope after warm-up {slope_per_minute(steady):+.2f} MiB/min over {len(steady)} samples")
    ok = healthy and "INTERNAL" not in codes and not any(k.startswith("HTTP 5") for k in codes)
    print("health stayed SERVING, no INTERNAL" if ok else "FAILED: health or INTERNAL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
