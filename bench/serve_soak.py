"""Soak: one live `tprt serve` (TP 2, the tests' tiny model) under cycles of careless and hostile
traffic for a bounded time, with every rank's memory sampled.

    python bench/serve_soak.py                  # 5 minutes
    python bench/serve_soak.py --minutes 2 --sample-s 2

Each cycle: streams started and cancelled after their first token, greedy completions, a
fine-tuning job created and cancelled (queued or running), invalid calls (junk bytes, bad paths,
text too long to fit, unknown adapters), and health watches opened without a token and
dropped. Every `--sample-s` seconds the resident memory (RSS) of the server's processes is
summed. Reported: cycles run, calls by status code, RSS at the start and the end, and the slope
of RSS over time (least squares over the samples after the first quarter, the warm-up), in MiB
per minute. Also checked: no call ended INTERNAL, health stayed SERVING. Bounded: every call has
a deadline and the server is stopped at the end.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--sample-s", type=float, default=5.0)
    a = ap.parse_args()

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from serve.client import Client
    from test_server import TOKEN, ServerProcess, prepare_root, server_args

    root = prepare_root(Path(tempfile.mkdtemp(prefix="tprt-soak-")), context=256)
    srv = ServerProcess(server_args(root) + ["--max-seq-len", "256"], root / "server.log")
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

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cycles = 0
    healthy = True
    end = t0 + a.minutes * 60
    job = {"inline_jsonl": '{"text": "hello hello hello"}\n', "steps": 100_000, "batch_size": 1,
           "max_seq_len": 16, "lora_rank": 2}
    try:
        with Client(srv.target, token=TOKEN, timeout=30) as c, grpc.insecure_channel(srv.target) as bare:
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
    ok = healthy and "INTERNAL" not in codes
    print("health stayed SERVING, no INTERNAL" if ok else "FAILED: health or INTERNAL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
