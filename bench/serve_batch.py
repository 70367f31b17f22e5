"""Interactive latency while a batch runs, on the real SmolLM2-135M-Instruct (issue 42).

    python bench/serve_batch.py                      # 200 batch requests, 12 interactive probes
    python bench/serve_batch.py --batch 50 --probes 6 --tokens 32

`tprt serve` (TP 1, HTTP on loopback) is measured twice in one run with the same interactive
probes: greedy streaming chat requests, one at a time, each timed to its first token (TTFT) and
to its end. First with the server otherwise idle, then while a batch of `--batch` chat requests
(`--batch-tokens` tokens each, EOS ignored) runs through /v1/batches. Reported: the probes' p50
and p90 TTFT and p50 time per output token, idle and under the batch, their ratios (goal: p50
TTFT under the batch within 1.5x of idle), how far the batch got while the probes ran, and the
batch's own throughput (requests and tokens per second until it completes), against the same
requests sent as one wave of interactive requests (the batch's cost of yielding).

Bounded: every call has a deadline; the server is stopped with SIGTERM at the end. The machine
may be shared: compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from serve_bench import prepare  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Why is the sky blue?",
             "Write a haiku about the sea.", "What is 12 times 7?", "Describe a cat in one sentence."]


def probe(client: Any, model: str, i: int, tokens: int) -> tuple[float, float]:
    """One streaming interactive request: (TTFT, seconds per output token after the first)."""
    t0 = time.perf_counter()
    first, n = None, 0
    stream = client.chat.completions.create(model=model, stream=True, max_tokens=tokens, temperature=0,
                                            messages=[{"role": "user", "content": f"{QUESTIONS[i % 6]} ({i})"}],
                                            extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            n += 1
            if first is None:
                first = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    assert first is not None
    return first, (wall - first) / max(1, n - 1)


def probes(client: Any, model: str, count: int, tokens: int, offset: int) -> list[tuple[float, float]]:
    return [probe(client, model, offset + i, tokens) for i in range(count)]


def summary(results: list[tuple[float, float]]) -> dict[str, float]:
    ttft = sorted(r[0] for r in results)
    return {"ttft_p50_ms": 1000 * statistics.median(ttft), "ttft_p90_ms": 1000 * ttft[int(0.9 * (len(ttft) - 1))],
            "tpot_p50_ms": 1000 * statistics.median(r[1] for r in results)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=200, help="requests in the batch (200)")
    p.add_argument("--batch-tokens", type=int, default=48, help="tokens of each batch request (48)")
    p.add_argument("--probes", type=int, default=12, help="interactive requests timed, idle and under the batch (12)")
    p.add_argument("--tokens", type=int, default=16, help="tokens of each probe (16)")
    p.add_argument("--max-batch-size", type=int, default=8, help="the server's --max-batch-size (8)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/tprt-serve-batch"), help="SmolLM2 conversions (kept)")
    args = p.parse_args()

    import openai

    from servers import ServerProcess

    model_dir = prepare(args.workdir, 1)
    data = args.workdir / "data"
    if data.exists():
        import shutil

        shutil.rmtree(data)
    srv = ServerProcess(["--model", str(model_dir), "--port", "0", "--http-port", "0", "--metrics-port", "0",
                         "--data-dir", str(data), "--max-seq-len", "512", "--max-batch-size",
                         str(args.max_batch_size)], args.workdir / "server.log")
    try:
        m = re.search(r"OpenAI API (https?://[\d.]+:\d+/v1)", srv.line)
        assert m, srv.line
        client = openai.OpenAI(base_url=m.group(1), api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        probes(client, model, 2, args.tokens, 1000)  # warm-up
        idle = probes(client, model, args.probes, args.tokens, 0)

        lines = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": model, "max_tokens": args.batch_tokens, "temperature": 0, "ignore_eos": True,
                           "messages": [{"role": "user", "content": f"{QUESTIONS[i % 6]} [{i}]"}]}}
                 for i in range(args.batch)]
        file_id = client.files.create(file=("batch.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                      purpose="batch").id
        t0 = time.perf_counter()
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        while client.batches.retrieve(batch.id).request_counts.completed < 1:  # type: ignore[union-attr]
            time.sleep(0.05)
        busy = probes(client, model, args.probes, args.tokens, 100)
        during = client.batches.retrieve(batch.id).request_counts.completed  # type: ignore[union-attr]
        while (b := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            time.sleep(0.2)
        batch_s = time.perf_counter() - t0
        assert b.status == "completed" and b.request_counts.completed == args.batch, b  # type: ignore[union-attr]

        # The same requests as one wave of interactive ones, max_batch at a time: the peer.
        t1 = time.perf_counter()
        with ThreadPoolExecutor(args.max_batch_size) as pool:
            bodies = [{k: v for k, v in x["body"].items() if k != "ignore_eos"} for x in lines]
            list(pool.map(lambda b: client.chat.completions.create(**b, extra_body={"ignore_eos": True}), bodies))
        wave_s = time.perf_counter() - t1
    finally:
        srv.stop()
    a, u = summary(idle), summary(busy)
    print(f"probes idle:        TTFT p50 {a['ttft_p50_ms']:.0f} ms, p90 {a['ttft_p90_ms']:.0f} ms; "
          f"per token p50 {a['tpot_p50_ms']:.1f} ms")
    print(f"probes under batch: TTFT p50 {u['ttft_p50_ms']:.0f} ms, p90 {u['ttft_p90_ms']:.0f} ms; "
          f"per token p50 {u['tpot_p50_ms']:.1f} ms  ({during} of {args.batch} batch requests done by then)")
    print(f"ratio under batch / idle: TTFT p50 {u['ttft_p50_ms'] / a['ttft_p50_ms']:.2f}x (goal <= 1.5x), "
          f"p90 {u['ttft_p90_ms'] / a['ttft_p90_ms']:.2f}x, per token {u['tpot_p50_ms'] / a['tpot_p50_ms']:.2f}x")
    tokens = args.batch * args.batch_tokens
    print(f"batch: {args.batch} requests in {batch_s:.1f} s ({args.batch / batch_s:.2f} req/s, "
          f"{tokens / batch_s:.0f} tok/s); as one interactive wave: {wave_s:.1f} s ({tokens / wave_s:.0f} tok/s); "
          f"batch / wave throughput {wave_s / batch_s:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
