"""Two replicas behind SGLang's model gateway against one replica, on the real SmolLM2-135M-Instruct
(issue 43).

    python bench/fleet_router.py                     # 32 streams, 4 shared system prompts, 128 tokens each
    python bench/fleet_router.py --streams 16 --tokens 32

The machine's cores are split: one replica is pinned to the first half of them (taskset) behind
sglang-router, the router and this client confined to that half too, and measured; then two
replicas, each pinned to its own half, sit behind the router (cache-aware) with the router and
the client free to run anywhere, and the same load goes through it: the whole machine against
half of it, every part of the serving path included. The load:
`--streams` concurrent streaming chats (EOS ignored, greedy), each with one of `--prefixes` long
system prompts and a question of its own, so requests share prefixes as a support bot's do.
Reported: output tokens per second of each setup and their ratio (goal: at least 1.8x), the
share of prompt tokens served from the prefix cache in each (goal: as often with two replicas as
with one), and the ceiling batching sets: one replica serving half the streams (what each of two
replicas gets) against all of them. Every server is stopped at the end. The machine may be shared: compare the ratios.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from serve_bench import prepare  # noqa: E402

SYSTEM = ("You are the support assistant of {shop}. Answer briefly and politely. Our opening hours are nine "
          "to five on weekdays. Returns are accepted within thirty days with a receipt. Shipping is free above "
          "fifty euros. We do not sell gift cards. ")
SHOPS = ["a tea shop", "a bicycle shop", "a bookshop", "a hardware store", "a bakery", "a florist"]


def chat(client: Any, i: int, prefixes: int, tokens: int) -> int:
    """One streaming chat; the output tokens it got (its usage)."""
    stream = client.chat.completions.create(
        model=client.model_name, stream=True, max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
        messages=[{"role": "system", "content": SYSTEM.format(shop=SHOPS[i % prefixes])},
                  {"role": "user", "content": f"Question {i}: can I return an item I bought {i % 7 + 2} days ago?"}])
    usage = [c.usage for c in stream if c.usage is not None]
    return int(usage[-1].completion_tokens) if usage else 0


def chats_served(servers: list[Any]) -> list[int]:
    from servers import metric

    return [int(metric(s.metrics(), "tprt_requests_total", method="/v1/chat/completions", outcome="ok"))
            for s in servers]


def load(base_url: str, model: str, streams: int, prefixes: int, tokens: int) -> tuple[float, int]:
    """`streams` concurrent chats through `base_url`: (seconds, output tokens)."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)
    client.model_name = model  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        got = list(pool.map(lambda i: chat(client, i, prefixes, tokens), range(streams)))
    return time.perf_counter() - t0, sum(got)


def cached_share(servers: list[Any]) -> float:
    from servers import metric

    cached = sum(metric(s.metrics(), "tprt_prompt_cached_tokens_total") for s in servers)
    prompt = sum(metric(s.metrics(), "tprt_prompt_tokens_total") for s in servers)
    return cached / max(prompt, 1.0)


def start_replica(model_dir: Path, data: Path, cores: str, threads: int, log: Path, max_batch: int) -> Any:
    from servers import ServerProcess

    data.mkdir(parents=True, exist_ok=True)
    launcher = ("taskset", "-c", cores, sys.executable, "-m", "tprt.cli")
    return ServerProcess(["--model", str(model_dir), "--port", "0", "--http-port", "0", "--metrics-port", "0",
                          "--data-dir", str(data), "--threads", str(threads), "--max-batch-size", str(max_batch),
                          "--max-queue", "256"], log, launcher=launcher)


def http_base(srv: Any) -> str:
    m = re.search(r"OpenAI API (https?://[\d.]+:\d+)/v1", srv.line)
    assert m, srv.line
    return m.group(1)


def start_router(workers: list[str], log: Path, cores: str) -> tuple[subprocess.Popen[bytes], str]:
    import httpx

    from pg import free_port

    port = free_port()
    proc = subprocess.Popen(["taskset", "-c", cores, sys.executable, "-m", "sglang_router.launch_router",
                             "--host", "127.0.0.1", "--port",
                             str(port), "--worker-urls", *workers, "--policy", "cache_aware", "--log-level", "warn"],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"the router did not start: {log.read_text()[-2000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prefixes", type=int, default=4, help="distinct system prompts the streams share (4)")
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per stream (128)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tprt-fleet-bench"))
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs at least 2 cores to split between two replicas")
    half = len(cores) // 2
    first, second = ",".join(map(str, cores[:half])), ",".join(map(str, cores[half:2 * half]))
    model_dir = prepare(args.workdir, 1)
    logs = args.workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    max_batch = args.streams  # every stream in one replica's batch: the router's spread is what differs
    print(f"SmolLM2-135M TP 1; {args.streams} streams x {args.tokens} tokens, {args.prefixes} shared system "
          f"prompts; cores {first} | {second}", flush=True)

    # One replica on half the cores, with everything that serves it (the router, this client) on
    # that half too: the system that two replicas double on the whole machine.
    all_cores = os.sched_getaffinity(0)
    one = start_replica(model_dir, args.workdir / "data-one", first, half, logs / "one.log", max_batch)
    router = None
    try:
        router, url = start_router([http_base(one)], logs / "router-one.log", first)
        os.sched_setaffinity(0, set(cores[:half]))
        load(url, "tp1", 2, args.prefixes, 4)  # warm-up
        secs1, toks1 = load(url, "tp1", args.streams, args.prefixes, args.tokens)
        share1 = cached_share([one])
        # Half the streams, what each of two replicas will get: their time is the fleet's best.
        secs_half, _ = load(url, "tp1", args.streams // 2, args.prefixes, args.tokens)
    finally:
        os.sched_setaffinity(0, all_cores)
        if router is not None:
            router.terminate()
        one.stop()
    print(f"one replica behind sglang-router, all on cores {first}: {toks1} tokens in {secs1:.1f} s = "
          f"{toks1 / secs1:.1f} tok/s; prompt tokens from the prefix cache {share1:.0%}", flush=True)

    replicas = [start_replica(model_dir, args.workdir / f"data-{k}", c, half, logs / f"replica-{k}.log", max_batch)
                for k, c in enumerate((first, second))]
    router = None
    try:
        router, url = start_router([http_base(s) for s in replicas], logs / "router.log",
                                   ",".join(map(str, cores)))
        load(url, "tp1", 2, args.prefixes, 4)
        before2 = chats_served(replicas)
        secs2, toks2 = load(url, "tp1", args.streams, args.prefixes, args.tokens)
        share2 = cached_share(replicas)
        split = [after - b for after, b in zip(chats_served(replicas), before2)]
    finally:
        if router is not None:
            router.terminate()
        for s in replicas:
            s.stop()
    ratio = (toks2 / secs2) / (toks1 / secs1)
    best = secs1 / secs_half  # two replicas each serving half the streams in the time one serves half
    print(f"one replica with {args.streams // 2} streams: {secs_half:.1f} s, so two replicas can reach at most "
          f"{best:.2f}x (a batch of {args.streams} costs {best:.2f}x one of {args.streams // 2}, not 2x)", flush=True)
    print(f"two replicas behind sglang-router (cache-aware): {toks2} tokens in {secs2:.1f} s = "
          f"{toks2 / secs2:.1f} tok/s; prompt tokens from the prefix cache {share2:.0%}; streams per replica "
          f"{split}", flush=True)
    print(f"throughput ratio {ratio:.2f}x (goal >= 1.8x; {ratio / best:.0%} of the {best:.2f}x that batching "
          f"leaves); prefix-cache share {share2:.0%} vs {share1:.0%} (goal: as often)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
