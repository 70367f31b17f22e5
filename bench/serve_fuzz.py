"""The long run of the serving fuzz tests: many random requests against one live `tprt serve`
(TP 2, the tests' tiny model, gRPC and the OpenAI HTTP API), with shrinking on.

    python bench/serve_fuzz.py                       # 2000 gRPC + 2000 HTTP examples, at most 10 minutes
    python bench/serve_fuzz.py --examples 200 --minutes 2
    python bench/serve_fuzz.py --only http           # or grpc

gRPC (tests/fuzz_requests.py): random Generate, Complete, Tokenize and CreateJob messages or
bytes. HTTP (tests/fuzz_http.py): completions and chats with random fields (some streamed and
dropped after the first event), uploads of random content, jobs with random hyperparameters and
metadata, listings and lookups of random ids, raw bytes to random routes, with the token
sometimes missing or wrong.

Passes when no gRPC call ends INTERNAL or UNKNOWN, no HTTP call gets a 5xx other than 503/507,
every HTTP body is well formed (OpenAI's error shape, no bare NaN, SSE events JSON to the end),
health stays SERVING and a greedy control request keeps its exact output; prints how many calls
ended with each status. Bounded: every call has a deadline, each half stops at half of
--minutes, jobs it created are cancelled, and the server is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def fuzz_grpc(srv: object, examples: int, end: float, codes: dict[str, int]) -> list[str]:
    import grpc
    from hypothesis import HealthCheck, given, settings

    from fuzz_requests import Call, calls, send
    from servers import TOKEN

    made: list[str] = []
    with grpc.insecure_channel(srv.target) as channel:  # type: ignore[attr-defined]
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(call=calls())
        def one(call: Call) -> None:
            if time.monotonic() > end:  # past the time cap: the remaining examples make no calls
                return
            code, jobs = send(channel, TOKEN, call)
            made.extend(jobs)
            codes[code.name] = codes.get(code.name, 0) + 1
            assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), call

        one()
    return made


def fuzz_http(base_url: str, examples: int, end: float, codes: dict[str, int]) -> None:
    import httpx
    from hypothesis import HealthCheck, given, settings

    from fuzz_http import HttpCall, assert_acceptable, cancel_jobs, http_calls, send_http
    from servers import TOKEN

    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=base_url) as http:
        chats = "".join(json.dumps({"messages": [{"role": "user", "content": f"Q{i}"},
                                                 {"role": "assistant", "content": "hi"}]}) + "\n" for i in range(4))
        up = http.post("/files", files={"file": ("t.jsonl", chats.encode())}, data={"purpose": "fine-tune"},
                       headers=auth, timeout=60)
        up.raise_for_status()
        made: list[str] = []

        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(call=http_calls(["tp2"], [up.json()["id"]]))
        def one(call: HttpCall) -> None:
            if time.monotonic() > end:
                return
            out = send_http(http, TOKEN, call)
            made.extend(out.job_ids)
            codes[str(out.status)] = codes.get(str(out.status), 0) + 1
            assert_acceptable(call, out)

        try:
            one()
        finally:
            cancel_jobs(http, TOKEN, made)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=2000, help="examples per protocol")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--only", choices=["grpc", "http"], help="fuzz one protocol only")
    a = ap.parse_args()

    from servers import ServerProcess, prepare_root, server_args

    root = prepare_root(Path(tempfile.mkdtemp(prefix="tprt-fuzz-")), context=256)
    srv = ServerProcess(server_args(root) + ["--max-seq-len", "256", "--http-port", "0",
                                             "--max-dataset-bytes", "4096", "--max-queued-jobs", "2"],
                        root / "server.log")
    halves = [p for p in ("grpc", "http") if a.only in (None, p)]
    t0 = time.monotonic()
    try:
        client = srv.client()
        control = {"prompt": "The control request", "max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
        expected = list(client.complete(**control).tokens)
        ok = True
        for i, half in enumerate(halves):
            codes: dict[str, int] = {}
            end = t0 + a.minutes * 60 * (i + 1) / len(halves)
            started = time.monotonic()
            try:
                if half == "grpc":
                    for job_id in fuzz_grpc(srv, a.examples, end, codes):
                        client.cancel_job(job_id)
                else:
                    m = re.search(r"OpenAI API (https?://[\d.]+:\d+/v1)", srv.line)
                    assert m, srv.line
                    fuzz_http(m.group(1), a.examples, end, codes)
            except AssertionError as e:
                ok = False
                print(f"{half}: FAILED: {e}")
            print(f"{half}: {sum(codes.values())} calls in {time.monotonic() - started:.0f} s: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(codes.items())))
        ok = ok and client.health_check() == "SERVING" and list(client.complete(**control).tokens) == expected
        print("health SERVING and the control output unchanged" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
