"""Speculative decoding on the real SmolLM2-135M-Instruct: batch-1 tokens/s with and without it,
on input-grounded prompts (bench/spec_prompts.json: edit this code, rewrite this JSON, quote this
text, extract these fields) and on free chat (batch 1 and 16 concurrent streams), fp32 and bf16,
against peers on the same weights, prompts and threads:

- transformers' prompt lookup (`generate(prompt_lookup_num_tokens=K)`) against its own plain
  greedy `generate`: their speed-up ratio;
- llama.cpp (llama-cpp-python, when `import llama_cpp` works) with `LlamaPromptLookupDecoding`
  against its plain decoding, on F32 / BF16 GGUF copies of the same weights (bench/generate_bench.py).

    python bench/spec_bench.py                     # everything (tens of minutes on 2 busy cores)
    python bench/spec_bench.py --quick             # 8 grounded prompts, 48 tokens, fp32 only

Ours: one engine per dtype with `--speculative` on; the plain runs turn it off per request
(SamplingParams.speculate=False), so both use the same weights and kernels. Every greedy output
with speculation is checked to be plain decoding's, token for token. Rates are generated tokens
over wall time from the request's first token to its last (decode only: prefill is the same work
either way), summed over prompts; the 16-stream figure is all streams' tokens over the batch's
decode time. The machine may be shared: compare ratios measured in the same run.

Each set also reports a ceiling computed from plain decoding's outputs (`ceiling`): the speed-up
prompt lookup would give if k were known in advance (no drafted position wasted), priced by the
step times the engine measured, and the steps ratio of copying the best stretch from anywhere in
the context. A target above the first is out of reach for prompt lookup on this model and CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import tprt  # noqa: E402, F401 - before torch: its allocator setting applies to every peer alike
import torch  # noqa: E402

from generate_bench import prepare, smollm2_gguf_copy  # noqa: E402
from tprt.checkpoint.loading import load_model  # noqa: E402
from tprt.engine.spec_defaults import DEFAULT_MAX_N, DEFAULT_MIN_N  # noqa: E402
from tprt.distributed.context import TPContext  # noqa: E402
from tprt.engine.core import Engine, EngineConfig  # noqa: E402
from tprt.engine.sampling import SamplingParams  # noqa: E402
from tprt.engine.speculative import SpeculativeConfig  # noqa: E402
from tprt.text.tokenizer import Tokenizer  # noqa: E402

PROMPTS = ROOT / "bench" / "spec_prompts.json"


def run_batch(engine: Engine, prompts: list[list[int]], n: int,
              speculate: bool) -> tuple[int, float, list[list[int]], int]:
    """Runs the prompts together (greedy, n tokens at most); (decode tokens, their seconds, outputs,
    steps)."""
    for i, p in enumerate(prompts):
        engine.add(p, SamplingParams(temperature=0.0, max_new_tokens=n, speculate=speculate), str(i))
    first: float | None = None
    outs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    counted = steps = 0
    while engine.has_work:
        events = engine.step()
        steps += 1
        now = time.perf_counter()
        for ev in events:
            if ev.token_id is None:
                continue
            if first is None:  # the batch's prefill step ends here: decode time starts
                first = now
            else:
                counted += 1
            outs[ev.request_id].append(ev.token_id)
    assert first is not None
    return counted, time.perf_counter() - first, [outs[str(i)] for i in range(len(prompts))], steps


def ours(engine: Engine, prompts: list[list[int]], n: int, batch: int, rounds: int = 1) -> dict[str, Any]:
    """Tokens/s without and with speculation over the prompts, `batch` at a time (alternating
    per group so other load falls on both alike; with `rounds` > 1 each group runs that many
    times, which side goes first alternating); outputs must match. Also machine-independent
    figures: engine steps without / with (the most a step's cost allows the speed-up to be), and
    the share of drafted tokens kept."""
    tokens: dict[bool, list[int]] = {False: [], True: []}
    seconds: dict[bool, list[float]] = {False: [], True: []}
    steps = {False: 0, True: 0}
    mismatches = 0
    plain_outputs: list[list[int]] = []
    before = engine.spec_stats
    for start in range(0, len(prompts), batch):
        group = prompts[start : start + batch]
        for r in range(rounds):
            got = {}
            for speculate in ((False, True) if r % 2 == 0 else (True, False)):
                got[speculate] = run_batch(engine, group, n, speculate=speculate)
                tokens[speculate].append(got[speculate][0])
                seconds[speculate].append(got[speculate][1])
                steps[speculate] += got[speculate][3]
            mismatches += sum(a != b for a, b in zip(got[False][2], got[True][2]))
            if r == 0:
                plain_outputs += got[False][2]
    after = engine.spec_stats
    assert before is not None and after is not None
    drafted, kept = after.drafted - before.drafted, after.accepted - before.accepted
    # all tokens over all decode time (a mean of per-prompt rates would let a short answer that
    # was drafted whole count as much as a long one)
    plain_tps = sum(tokens[False]) / sum(seconds[False])
    spec_tps = sum(tokens[True]) / sum(seconds[True])
    return {"plain_tps": plain_tps, "spec_tps": spec_tps, "speedup": spec_tps / plain_tps,
            "steps_ratio": steps[False] / max(steps[True], 1), "drafted": drafted,
            "acceptance": kept / max(drafted, 1), "outputs_differ": mismatches,
            "ceiling": ceiling(engine, prompts, plain_outputs) if batch == 1 else {}}


def ceiling(engine: Engine, prompts: list[list[int]], outputs: list[list[int]]) -> dict[str, float]:
    """What drafting could give on these outputs at most, from plain decoding's tokens (so no
    machine noise): `lookup_oracle_k` drafts with the engine's prompt lookup but drafts exactly
    the tokens that will be kept (no position wasted, so no k policy can do better), each step
    priced by the step times this engine measured (StepCosts; batch 1); `copy_oracle_steps`
    takes, each step, the longest stretch of the coming output found anywhere in prompt + output
    so far (at most k), the most any copying proposer could keep (a steps ratio, unpriced)."""
    from tprt.engine.speculative import Context

    spec = engine._speculator
    if spec is None:
        return {}
    c = spec.config
    tokens = sum(len(o) for o in outputs)
    cost = steps = 0.0
    for prompt, out in zip(prompts, outputs):
        ctx, pos = Context(c.min_n, c.max_n), 0
        ctx.extend(prompt)
        while pos < len(out):
            draft, kept = ctx.lookup(c.num_tokens), 0
            while kept < len(draft) and pos + kept < len(out) and draft[kept] == out[pos + kept]:
                kept += 1
            take = min(kept + 1, len(out) - pos)
            cost += spec.costs.relative(1, take - 1)
            ctx.extend(out[pos : pos + take])
            pos += take
        pos, seen = 0, list(prompt)
        while pos < len(out):
            best = 0
            for length in range(1, min(c.num_tokens, len(out) - pos) + 1):
                want = out[pos : pos + length]
                if not any(seen[j : j + length] == want for j in range(len(seen) - length + 1)):
                    break
                best = length
            take = min(best + 1, len(out) - pos)
            seen += out[pos : pos + take]
            pos += take
            steps += 1
    return {"lookup_oracle_k": tokens / max(cost, 1e-9), "copy_oracle_steps": tokens / max(steps, 1)}


def hf_prompt_lookup(workdir: Path, dtype: torch.dtype, prompts: list[list[int]], n: int, k: int) -> dict[str, Any]:
    """transformers' plain greedy generate and its prompt lookup, decode tokens/s (all prompts'
    tokens over their time)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(workdir / "hf", dtype=dtype).eval()

    def rate(p: list[int], **kw: Any) -> tuple[int, float]:
        x = torch.tensor([p])
        with torch.no_grad():
            t0 = time.perf_counter()
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=1, do_sample=False, pad_token_id=2)
            t1 = time.perf_counter()
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                 pad_token_id=2, **kw)
            t2 = time.perf_counter()
        made = out.shape[1] - len(p)
        return made - 1, max((t2 - t1) - (t1 - t0), 1e-9)  # the prefill call's time taken off

    plain, spec = [], []
    for p in prompts:
        plain.append(rate(p))
        spec.append(rate(p, prompt_lookup_num_tokens=k))
    a = sum(t for t, _ in plain) / sum(s for _, s in plain)
    b = sum(t for t, _ in spec) / sum(s for _, s in spec)
    return {"plain_tps": a, "spec_tps": b, "speedup": b / a}


def llama_cpp_prompt_lookup(workdir: Path, dtype: str, prompts: list[list[int]], n: int, k: int,
                            threads: int) -> dict[str, Any] | None:
    """llama.cpp plain and with LlamaPromptLookupDecoding (num_pred_tokens=k), tokens/s from each
    prompt's first generated token to its last, all prompts' tokens over their time; None without
    llama-cpp-python."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        print("llama.cpp peer skipped: llama-cpp-python is not installed", file=sys.stderr)
        return None
    path, weights = smollm2_gguf_copy(workdir, dtype)
    ctx = max(len(p) for p in prompts) + n + 16
    out: dict[str, Any] = {"weights": weights}
    for name, draft in (("plain", None), ("spec", LlamaPromptLookupDecoding(num_pred_tokens=k))):
        llm = Llama(model_path=str(path), n_ctx=ctx, n_threads=threads, n_threads_batch=threads, use_mmap=False,
                    verbose=False, draft_model=draft)
        made_all, seconds_all = 0, 0.0
        for p in prompts:
            first, made = None, 0
            for token in llm.generate(p, top_k=1, temp=0.0, reset=True):
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    made += 1
                if made + 1 >= n or token in (2,):  # SmolLM2's <|im_end|> ends a chat answer
                    break
            made_all += made
            seconds_all += time.perf_counter() - (first or time.perf_counter())
        out[f"{name}_tps"] = made_all / max(seconds_all, 1e-9)
        del llm
    out["speedup"] = out["spec_tps"] / out["plain_tps"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tprt-bench"),
                    help="SmolLM2 converted by bench/generate_bench.py (made here when missing)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128, help="generated tokens per prompt at most")
    ap.add_argument("--method", choices=("ngram", "suffix"), default="ngram")
    ap.add_argument("--k", type=int, default=4, help="drafted tokens per step at most (ours and the peers)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--limit", type=int, help="only the first N grounded prompts")
    ap.add_argument("--quick", action="store_true", help="--limit 8 --tokens 48 --dtypes fp32")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--stream-rounds", type=int, default=4,
                    help="runs of the 16-stream batch each way, which side goes first alternating (one run of "
                         "a few seconds is within the machine's noise)")
    ap.add_argument("--draft-cost", type=float, help="SpeculativeConfig.draft_cost (the default's otherwise)")
    ap.add_argument("--min-n", type=int, default=DEFAULT_MIN_N, help=f"shortest n-gram matched ({DEFAULT_MIN_N})")
    ap.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, help=f"longest n-gram matched ({DEFAULT_MAX_N})")
    args = ap.parse_args()
    if args.quick:
        args.limit, args.tokens, args.dtypes = 8, 48, "fp32"
    torch.set_num_threads(args.threads)
    from tprt.cpu import native

    native.set_threads(args.threads)
    workdir = prepare(args.workdir, (1,))
    tok = Tokenizer.from_dir(workdir / "tp1")
    data = json.loads(PROMPTS.read_text())
    chat = [tok.encode_chat([{"role": "user", "content": q}]) for q in data["grounded"][: args.limit]]
    free = [tok.encode_chat([{"role": "user", "content": q}]) for q in data["free"]]
    streams = (free * 2)[:16]
    result: dict[str, Any] = {"threads": args.threads, "tokens": args.tokens, "method": args.method, "k": args.k, "min_n": args.min_n, "max_n": args.max_n,
                              "grounded_prompts": len(chat), "load_average_before": os.getloadavg()}
    spec = SpeculativeConfig(args.method, num_tokens=args.k, min_n=args.min_n, max_n=args.max_n)
    if args.draft_cost is not None:
        spec = SpeculativeConfig(args.method, num_tokens=args.k, min_n=args.min_n, max_n=args.max_n,
                                 draft_cost=args.draft_cost)
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if dtype not in args.dtypes.split(","):
            continue
        model = load_model(workdir / "tp1", TPContext.single(), dtype)
        longest = max(len(p) for p in chat + free) + args.tokens + 8
        # no prefix cache: the second run of a prompt would reuse the first one's keys and values,
        # computed in chunks of another size (other roundings in bf16), and differ for that reason
        engine = Engine(model, tok, EngineConfig(max_batch=16, max_seq_len=longest, speculative=spec,
                                                 prefix_cache=False))
        run_batch(engine, chat[:1], 8, speculate=True)  # warm-up
        kernels = type(engine.runner.model.stack).__name__  # NativeDecodeStack unless prepack timed another way
        r: dict[str, Any] = {"grounded_b1": ours(engine, chat, args.tokens, 1),
                             "free_b1": ours(engine, free, args.tokens, 1),
                             "free_16_streams": ours(engine, streams, args.tokens, 16, args.stream_rounds),
                             "stack": kernels}
        print(f"[{dtype}] ours {json.dumps(r)}", file=sys.stderr, flush=True)
        del engine, model
        if not args.no_peers:
            r["hf_grounded_b1"] = hf_prompt_lookup(workdir, torch_dtype, chat, args.tokens, args.k)
            print(f"[{dtype}] transformers {json.dumps(r['hf_grounded_b1'])}", file=sys.stderr, flush=True)
            peer = llama_cpp_prompt_lookup(workdir, dtype, chat, args.tokens, args.k, args.threads)
            if peer is not None:
                r["llama_cpp_grounded_b1"] = peer
                print(f"[{dtype}] llama.cpp {json.dumps(peer)}", file=sys.stderr, flush=True)
        result[dtype] = r
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result, indent=2))
    report(result)


def report(r: dict[str, Any]) -> None:
    print(f"\nspeculative decoding ({r['method']}, k <= {r['k']}, n-grams {r.get('min_n')}-{r.get('max_n')}), SmolLM2-135M, {r['threads']} threads, "
          f"{r['grounded_prompts']} grounded prompts, {r['tokens']} tokens at most")
    for dtype in ("fp32", "bf16"):
        x = r.get(dtype)
        if not x:
            continue
        for name in ("grounded_b1", "free_b1", "free_16_streams"):
            y = x[name]
            print(f"{dtype} {name:<16} plain {y['plain_tps']:7.1f} tok/s  spec {y['spec_tps']:7.1f} tok/s  "
                  f"{y['speedup']:.2f}x  steps {y['steps_ratio']:.2f}x fewer, {y['acceptance']:.0%} of "
                  f"{y['drafted']} drafted kept (outputs differing: {y['outputs_differ']})")
            if y.get("ceiling"):
                print(f"{'':<21}ceiling: {y['ceiling']['lookup_oracle_k']:.2f}x with prompt lookup and k known "
                      f"in advance; {y['ceiling']['copy_oracle_steps']:.2f}x fewer steps copying the best stretch")
        for peer in ("hf_grounded_b1", "llama_cpp_grounded_b1"):
            if peer in x:
                y = x[peer]
                print(f"{dtype} {peer:<22} plain {y['plain_tps']:7.1f} tok/s  spec {y['spec_tps']:7.1f} tok/s  "
                      f"{y['speedup']:.2f}x")


if __name__ == "__main__":
    main()
