"""The long run of the serving fuzz test: many random requests (tests/fuzz_requests.py) against one
live `tprt serve` (TP 2, the tests' tiny model), with shrinking on.

    python bench/serve_fuzz.py                       # 2000 examples, at most 10 minutes
    python bench/serve_fuzz.py --examples 200 --minutes 2

Passes when no call ends INTERNAL or UNKNOWN, health stays SERVING and a greedy control request
keeps its exact output; prints how many calls ended with each status code. Bounded: every call
has a deadline, the run stops at --minutes, jobs it created are cancelled, and the server is
stopped at the end.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--minutes", type=float, default=10.0)
    a = ap.parse_args()

    import grpc
    from hypothesis import HealthCheck, given, settings

    from fuzz_requests import Call, calls, send
    from test_server import TOKEN, ServerProcess, prepare_root, server_args

    root = prepare_root(Path(tempfile.mkdtemp(prefix="tprt-fuzz-")), context=256)
    srv = ServerProcess(server_args(root) + ["--max-seq-len", "256"], root / "server.log")
    codes: dict[str, int] = {}
    made: list[str] = []
    end = time.monotonic() + a.minutes * 60
    try:
        client = srv.client()
        control = {"prompt": "The control request", "max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
        expected = list(client.complete(**control).tokens)
        with grpc.insecure_channel(srv.target) as channel:
            @settings(max_examples=a.examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(call=calls())
            def one(call: Call) -> None:
                if time.monotonic() > end:  # past the time cap: the remaining examples make no calls
                    return
                code, jobs = send(channel, TOKEN, call)
                made.extend(jobs)
                codes[code.name] = codes.get(code.name, 0) + 1
                assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), call

            one()
        for job_id in made:
            client.cancel_job(job_id)
        ok = client.health_check() == "SERVING" and list(client.complete(**control).tokens) == expected
        print(f"{sum(codes.values())} calls: " + ", ".join(f"{k} {v}" for k, v in sorted(codes.items())))
        print("health SERVING and the control output unchanged" if ok else "FAILED: health or control output")
        return 0 if ok else 1
    finally:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
