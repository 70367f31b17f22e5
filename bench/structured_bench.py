"""Structured outputs on the real SmolLM2-135M-Instruct (TP 1, CPU): validity, overhead, compile time.

    python bench/structured_bench.py                      # bf16, two threads
    python bench/structured_bench.py --dtype fp32 --threads 2 --repeats 3
    python bench/structured_bench.py --only validity

- validity: each of tests/json_schemas.py's schemas (at least 50) asked for in a chat, greedy and
  sampled (seeded): every output that ends must parse and validate (`jsonschema`); outputs that
  run out of --max-new-tokens are counted apart ("length"), as a client would see them.
- overhead: batch-1 decode tokens/s with a JSON-schema constraint (an object holding one long
  string, so both runs decode the same number of tokens) over the same request unconstrained,
  alternated --repeats times (difference of two lengths, so prefill cancels out); then 16
  streams, half of them constrained, over 16 unconstrained. Targets: >= 0.97 and >= 0.90.
- compile: every schema of the suite compiled once on a fresh compiler (no cache): p50, p95, max.
  Target p95 < 10 ms.
- hostile (issue 38): a plain 16-token request's latency alone, beside 16 unconstrained rows
  (what batching alone costs it), then beside 16 rows of each hostile constraint the hostile
  round found (R2: the 35-byte ambiguous grammar whose masks grow
  with the output; R3: the 23-byte regex whose lexer costs 0.8 s), started --hostile-head steps
  before it: the ratio to alone (goal <= 2x), how the hostile rows ended (the mask budget's
  constraint error), and the slowest step. Alternated --repeats times.
- peer: llama.cpp's own JSON-schema mode (llama-cpp-python's `response_format`) on the same
  weights and threads, its constrained/unconstrained ratio, when llama-cpp-python is installed
  (skipped with a message otherwise; never in CI).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

LONG = {"type": "object", "properties": {"story": {"type": "string", "minLength": 5000}}, "required": ["story"]}
ASK = "Write a long story about a lighthouse keeper, as JSON."


def validity(engine: Any, tok: Any, max_new: int) -> dict[str, Any]:
    import jsonschema

    from json_schemas import SCHEMAS
    from tprt.engine.constraints import ConstraintSpec
    from tprt.engine.core import run_to_completion
    from tprt.engine.sampling import SamplingParams

    out: dict[str, Any] = {"schemas": len(SCHEMAS)}
    for mode, params in (("greedy", {"temperature": 0.0}), ("sampled", {"temperature": 0.7, "top_p": 0.95})):
        valid = invalid = length = 0
        bad: list[str] = []
        for i, (name, schema) in enumerate(SCHEMAS.items()):
            prompt = tok.encode_chat([{"role": "user", "content": "Reply with JSON valid under this JSON Schema: "
                                       + json.dumps(schema)}])
            seed = {"seed": i} if mode == "sampled" else {}
            engine.add(prompt, SamplingParams(max_new_tokens=max_new, **params, **seed,  # type: ignore[arg-type]
                                              constraint=ConstraintSpec.json_schema(schema, "schema")), name)
        for name, done in run_to_completion(engine).items():
            if done.finish_reason == "length":
                length += 1
                continue
            try:
                jsonschema.validate(json.loads(done.text), SCHEMAS[name])
                valid += 1
            except (ValueError, jsonschema.ValidationError) as e:
                invalid += 1
                bad.append(f"{name}: {str(e)[:100]}: {done.text[:100]!r}")
        out[mode] = {"valid": valid, "invalid": invalid, "length": length, "bad": bad}
        print(f"validity {mode}: {valid} valid, {invalid} invalid, {length} ran out of {max_new} tokens",
              file=sys.stderr, flush=True)
    return out


def decode_rate(engine: Any, prompt: list[int], rows: list[Any], n1: int, n2: int) -> float:
    """Aggregate decode tokens/s of `rows` (constraint or None each), by the difference of two lengths."""
    from tprt.engine.core import run_to_completion
    from tprt.engine.sampling import SamplingParams

    def run(n: int) -> float:
        for i, c in enumerate(rows):
            engine.add(prompt, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=c is None, constraint=c),
                       str(i))
        start = time.perf_counter()
        done = run_to_completion(engine)
        assert all(d.finish_reason == "length" for d in done.values()), "a row ended early"
        return time.perf_counter() - start

    return len(rows) * (n2 - n1) / (run(n2) - run(n1))


def overhead(engine: Any, tok: Any, repeats: int, n1: int, n2: int) -> dict[str, Any]:
    from tprt.engine.constraints import ConstraintSpec

    prompt = tok.encode_chat([{"role": "user", "content": ASK}])
    spec = ConstraintSpec.json_schema(LONG, "schema")
    engine.structured_outputs.compile(spec)
    decode_rate(engine, prompt, [spec], 2, 8)  # warm up both paths
    decode_rate(engine, prompt, [None], 2, 8)
    b1: dict[str, list[float]] = {"free": [], "constrained": []}
    b16: dict[str, list[float]] = {"free": [], "half": []}
    for _ in range(repeats):  # alternated, so a noisy minute hits both
        b1["free"].append(decode_rate(engine, prompt, [None], n1, n2))
        b1["constrained"].append(decode_rate(engine, prompt, [spec], n1, n2))
        b16["free"].append(decode_rate(engine, prompt, [None] * 16, n1 // 2, n2 // 2))
        b16["half"].append(decode_rate(engine, prompt, [spec, None] * 8, n1 // 2, n2 // 2))
    r = {k: max(v) for k, v in {**{f"b1_{k}": v for k, v in b1.items()},
                                **{f"b16_{k}": v for k, v in b16.items()}}.items()}
    r["b1_ratio"] = r["b1_constrained"] / r["b1_free"]
    r["b16_ratio"] = r["b16_half"] / r["b16_free"]
    r["runs"] = {"b1": b1, "b16": b16}
    print(f"overhead: batch 1 {r['b1_constrained']:.1f} vs {r['b1_free']:.1f} tok/s ({r['b1_ratio']:.3f}); "
          f"16 streams half constrained {r['b16_half']:.1f} vs {r['b16_free']:.1f} ({r['b16_ratio']:.3f})",
          file=sys.stderr, flush=True)
    return r


def compile_times(tok: Any) -> dict[str, float]:
    from json_schemas import SCHEMAS
    from tprt.engine.constraints import ConstraintSpec, StructuredOutputs

    outputs = StructuredOutputs(tok)
    outputs.warm_up()  # the per-vocabulary tables (a server builds them at start)
    times = []
    for schema in SCHEMAS.values():
        start = time.perf_counter()
        outputs.compile(ConstraintSpec.json_schema(schema, "schema"))
        times.append(time.perf_counter() - start)
    times.sort()
    r = {"p50_ms": 1e3 * statistics.median(times), "p95_ms": 1e3 * times[int(0.95 * (len(times) - 1))],
         "max_ms": 1e3 * times[-1]}
    print(f"compile: p50 {r['p50_ms']:.2f} ms, p95 {r['p95_ms']:.2f} ms, max {r['max_ms']:.2f} ms", file=sys.stderr)
    return r


def llama_cpp_peer(workdir: Path, dtype: str, threads: int, n: int) -> dict[str, float] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama.cpp peer skipped: llama-cpp-python is not installed", file=sys.stderr)
        return None
    from generate_bench import smollm2_gguf_copy

    path, weights = smollm2_gguf_copy(workdir, dtype)
    llm = Llama(model_path=str(path), n_ctx=n + 256, n_threads=threads, n_threads_batch=threads, use_mmap=False,
                verbose=False)
    messages = [{"role": "user", "content": ASK}]

    def rate(**kw: Any) -> float:
        start = time.perf_counter()
        out = llm.create_chat_completion(messages, max_tokens=n, temperature=0.0, **kw)
        return int(out["usage"]["completion_tokens"]) / (time.perf_counter() - start)

    free = rate()
    constrained = rate(response_format={"type": "json_object", "schema": LONG})
    return {"free": free, "constrained": constrained, "ratio": constrained / free}


R2_GRAMMAR = 'start: s\ns: s s | s s s | "a" | "b"'
R3_REGEX = "((a{1000}){1000}){1000}"


def hostile(engine: Any, tok: Any, repeats: int, head: int) -> dict[str, Any]:
    """The plain request's latency alone and beside 16 hostile rows (see the module docstring)."""
    from tprt.engine.constraints import ConstraintSpec
    from tprt.engine.sampling import SamplingParams

    plain = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    ask = tok.encode_chat([{"role": "user", "content": "Write a very long string of the letters a and b."}])
    specs = {"R2": ConstraintSpec.grammar(R2_GRAMMAR, "grammar"), "R3": ConstraintSpec.regex(R3_REGEX, "regex"),
             "free": None}  # free: 16 unconstrained rows, what batching alone costs the plain request

    def latency(kind: str | None, r: int) -> dict[str, Any]:
        ended: dict[str, str] = {}

        def note(ev: Any) -> None:
            ended[ev.request_id] = ev.stop_reason if isinstance(ev.stop_reason, str) else ev.finish_reason

        if kind is not None:
            for i in range(16):
                engine.add(ask, SamplingParams(max_new_tokens=600, temperature=1.0, seed=1000 * r + i,
                                               constraint=specs[kind], ignore_eos=specs[kind] is None),
                           f"{kind}-{i}")
            for _ in range(head):
                for ev in engine.step():
                    if ev.finish_reason is not None:
                        note(ev)
        engine.add(plain, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True), "plain")
        start, slowest, done = time.perf_counter(), 0.0, False
        while not done:
            t = time.perf_counter()
            events = engine.step()
            slowest = max(slowest, time.perf_counter() - t)
            for ev in events:
                if ev.request_id == "plain" and ev.finish_reason is not None:
                    done = True
                elif ev.finish_reason is not None:
                    note(ev)
        seconds = time.perf_counter() - start
        for i in range(16):  # the hostile rows still running
            engine.cancel(f"{kind}-{i}")
        while engine.has_work:
            engine.step()
        reasons: dict[str, int] = {}
        for reason in ended.values():
            reasons[str(reason)] = reasons.get(str(reason), 0) + 1
        return {"seconds": seconds, "slowest_step": slowest, "hostile_ended": reasons}

    out: dict[str, Any] = {}
    for r in range(repeats):
        for kind in (None, "free", "R2", "R3"):
            out.setdefault(kind or "alone", []).append(latency(kind, r))
    alone = statistics.median(x["seconds"] for x in out["alone"])
    free = statistics.median(x["seconds"] for x in out["free"])
    for kind in ("free", "R2", "R3"):
        out[f"{kind}_over_alone"] = statistics.median(x["seconds"] for x in out[kind]) / alone
    for kind in ("R2", "R3"):
        out[f"{kind}_over_free"] = statistics.median(x["seconds"] for x in out[kind]) / free
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tprt-bench"), help="SmolLM2 conversions (kept)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128, help="decode tokens of the longer run (the shorter: a quarter)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="per validity request")
    ap.add_argument("--only", choices=["validity", "overhead", "compile", "hostile"])
    ap.add_argument("--hostile-head", type=int, default=40, help="steps the hostile rows run before the plain one")
    a = ap.parse_args()

    import torch

    from generate_bench import prepare
    from tprt.checkpoint.loading import load_model
    from tprt.distributed.context import TPContext
    from tprt.engine.core import Engine, EngineConfig
    from tprt.text.tokenizer import Tokenizer

    torch.set_num_threads(a.threads)
    workdir = prepare(a.workdir, (1,))
    tok = Tokenizer.from_dir(workdir / "tp1")
    model = load_model(workdir / "tp1", TPContext.single(), a.dtype)
    engine = Engine(model, tok, EngineConfig(max_batch=64, max_seq_len=2048))
    from tprt.cpu import native

    native.set_threads(a.threads)
    result: dict[str, Any] = {"dtype": a.dtype, "threads": a.threads}
    if a.only in (None, "compile"):
        result["compile"] = compile_times(tok)
    if a.only in (None, "overhead"):
        result["overhead"] = overhead(engine, tok, a.repeats, a.tokens // 4, a.tokens)
        peer = llama_cpp_peer(a.workdir, a.dtype, a.threads, a.tokens)
        if peer is not None:
            result["llama_cpp"] = peer
    if a.only in (None, "hostile"):
        result["hostile"] = hostile(engine, tok, a.repeats, a.hostile_head)
    if a.only in (None, "validity"):
        result["validity"] = validity(engine, tok, a.max_new_tokens)
    print(json.dumps(result))
    v = result.get("validity")
    return 1 if v is not None and (v["greedy"]["invalid"] or v["sampled"]["invalid"]) else 0


if __name__ == "__main__":
    sys.exit(main())
