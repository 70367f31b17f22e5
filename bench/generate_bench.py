"""Generation benchmark on the real SmolLM2-135M-Instruct, against peers measured in the same run.

    python bench/generate_bench.py                      # everything, about 5-10 minutes on 2 cores
    python bench/generate_bench.py --quick              # fewer repeats and tokens

    python bench/generate_bench.py --only-tp 2 --tiny   # TP=2 on a tiny random model: the all-reduce share

Peers: transformers' `generate` on the same weights (same dtype, same threads), llama.cpp
(`llama-cpp-python`, when installed: on F32 and F16 GGUF copies of the same weights, same
threads; skipped with a message otherwise), and the memory bandwidth floor: read bandwidth is
measured in this process by summing a large tensor on the threads used (and on one thread), with
torch's sum and with tprt's own prefetching read (the floor takes the faster), and
floor tokens/s = bandwidth / bytes of weights read per decoded token. Reported:

- batch-1 decode tokens/s in fp32 and bf16 (ours, transformers, floor; ratios)
- aggregate decode tokens/s with 2 and 4 sequences (ours) and 16 (ratio to batch 1)
- prefill tokens/s for a 512-token prompt (ours, transformers)
- TP=3 (3 local ranks) against TP=1 for batch-1 decode, with the all-reduces through shared
  memory (tprt.distributed.shm_allreduce) and through gloo (TPRT_SHM_ALLREDUCE=0), and the share
  of a token's time spent in all-reduces (the same collectives timed alone in the same world)

Decode rates are differences: (n2 - n1) tokens / (time of n2 - time of n1), best of --repeats, so
prefill and start-up cancel out. The machine may be shared: compare ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tprt  # noqa: E402, F401 - before torch: its allocator setting applies to every peer alike
import torch  # noqa: E402

from tprt.distributed.context import TPContext, init_distributed  # noqa: E402
from tprt.engine.core import Engine, EngineConfig, run_to_completion  # noqa: E402
from tprt.checkpoint.loading import load_model  # noqa: E402
from tprt.model.llama import TPLlamaForCausalLM  # noqa: E402
from tprt.cpu.hugepages import huge_empty  # noqa: E402
from tprt.engine.sampling import SamplingParams  # noqa: E402
from tprt.text.tokenizer import Tokenizer  # noqa: E402

QUESTION = "Write a long story about a cat who learns to play the piano."


def prepare(workdir: Path, tps: tuple[int, ...]) -> Path:
    """workdir/hf and a TP checkpoint per size in `tps` from the bundled GGUF (kept between runs)."""
    from convert.api import gguf_to_hf, hf_to_tp
    from tprt.cli.demo import smollm2_gguf

    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "hf").exists():
        gguf_to_hf(smollm2_gguf(), workdir / "hf")
    for tp in tps:
        if not (workdir / f"tp{tp}").exists():
            hf_to_tp(workdir / "hf", workdir / f"tp{tp}", tp=tp)
    return workdir


def prepare_tiny(workdir: Path, tps: tuple[int, ...]) -> Path:
    """workdir/tiny: a tiny random Llama (SmolLM2's tokenizer, 4 layers of 128) and its TP
    checkpoints, where the all-reduces are a large share of a token."""
    from transformers import LlamaConfig, LlamaForCausalLM as HFLlama

    from convert.api import hf_to_tp

    tiny = workdir / "tiny"
    if not (tiny / "hf").exists():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                             max_position_embeddings=2048)
        HFLlama(config).save_pretrained(tiny / "hf")
        for f in (workdir / "hf").glob("*token*"):
            (tiny / "hf" / f.name).write_bytes(f.read_bytes())
    for tp in tps:
        if not (tiny / f"tp{tp}").exists():
            hf_to_tp(tiny / "hf", tiny / f"tp{tp}", tp=tp)
    return tiny


CLOCK: Callable[[], float] = time.perf_counter  # --clock cpu: time.process_time


def best(fn: Callable[[], Any], repeats: int) -> float:
    """The shortest of `repeats` timed calls, in seconds of CLOCK."""
    times = []
    for _ in range(repeats):
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return min(times)


def read_bandwidth(repeats: int, threads: int) -> dict[str, float]:
    """Bytes/s of reading a 512 MiB float32 tensor on `threads` threads (the read side of a
    memory-bound matvec), on huge pages like our weights (tprt.cpu.hugepages): a floor measured
    on small pages would be lower. Two readers: torch's sum ("torch_sum") and tprt's own read
    (`tprt.cpu.native.stream_sum`: software prefetching, about a fifth faster here); "best" is the
    faster, the floor, so that no kernel beats it by reading better than the measurement did.
    Always wall time (a CPU clock would count every thread)."""
    from tprt.cpu import native

    x = huge_empty(512 * 1024 * 1024).view(torch.float32).fill_(1.0)
    before, pool = torch.get_num_threads(), native.threads()
    torch.set_num_threads(threads)
    native.set_threads(threads)
    try:
        readers: dict[str, Callable[[], Any]] = {"torch_sum": x.sum}
        if native.available():
            readers["prefetching_read"] = lambda: native.stream_sum(x)
        rates = {}
        for name, read in readers.items():
            read()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                read()
                times.append(time.perf_counter() - t0)
            rates[name] = x.nbytes / min(times)
        return {**rates, "best": max(rates.values())}
    finally:
        torch.set_num_threads(before)
        native.set_threads(pool)


def weight_bytes(model: TPLlamaForCausalLM) -> int:
    """Bytes of weights read per decoded token: every parameter once (a tied embedding is read once,
    by the LM head); an untied input embedding reads only one row and is left out."""
    total = sum(p.nbytes for p in model.parameters())
    if not model.config.tie_word_embeddings:
        total -= model.embed_tokens.weight.nbytes
    return total


def ours_decode(engine: Engine, prompt: list[int], batch: int, n1: int, n2: int, repeats: int) -> float:
    """Aggregate decode tokens/s of `batch` sequences on this engine (TP rank 0)."""

    def run(n: int) -> None:
        for i in range(batch):
            engine.add(prompt, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True), str(i))
        run_to_completion(engine)

    run(2)
    t1, t2 = best(lambda: run(n1), repeats), best(lambda: run(n2), repeats)
    return batch * (n2 - n1) / (t2 - t1)


def alternate_threads(engine: Engine, prompt: list[int], n1: int, n2: int, repeats: int,
                      threads: int) -> tuple[float, float]:
    """Batch-1 decode tokens/s with the kernels on `threads` threads and on one, measured in
    alternation (`repeats` rounds of each, best kept), so that other jobs' load falls on both alike."""
    from tprt.cpu import native

    rates: dict[int, float] = {threads: 0.0, 1: 0.0}
    try:
        for _ in range(repeats):
            for t in rates:
                native.set_threads(t)
                rates[t] = max(rates[t], ours_decode(engine, prompt, 1, n1, n2, 1))
    finally:
        native.set_threads(threads)
    return rates[threads], rates[1]


def hf_decode(model: Any, prompt: list[int], batch: int, n1: int, n2: int, repeats: int) -> float:
    x = torch.tensor([prompt] * batch)

    def run(n: int) -> None:
        with torch.no_grad():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=2)

    run(2)
    t1, t2 = best(lambda: run(n1), repeats), best(lambda: run(n2), repeats)
    return batch * (n2 - n1) / (t2 - t1)


def smollm2_gguf_copy(workdir: Path, dtype: str) -> tuple[Path, str]:
    """The bundled SmolLM2 GGUF re-encoded in `dtype`'s float type (F32 or BF16) for llama.cpp
    peers, made once under `workdir`; (its path, the GGUF type name)."""
    from tprt.cli.demo import smollm2_gguf

    weights = "F32" if dtype == "fp32" else "BF16"
    path = workdir / f"smollm2-{weights}.gguf"
    if not path.exists():
        gguf_copy(smollm2_gguf(), path, weights)
    return path, weights


def gguf_copy(src: Path, dst: Path, float_type: str) -> Path:
    """src (a llama.cpp GGUF file) with every matrix dequantised to F32 or BF16 (vectors F32, as
    llama.cpp keeps norms) and its metadata as is: the weights tprt decodes, for llama.cpp."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue  # the writer's own
        vtype = field.types[0]
        writer.add_key_value(name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if float_type == "F32" else gguf.LlamaFileType.MOSTLY_BF16)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if float_type == "F32" or values.ndim == 1:
            writer.add_tensor(t.name, values)
        else:
            bits = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy()
            writer.add_tensor(t.name, bits, raw_shape=values.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def llama_cpp_decode(workdir: Path, dtype: str, prompt: list[int], n1: int, n2: int, repeats: int,
                     threads: int) -> tuple[str, float] | None:
    """(weights, batch-1 decode tokens/s) of llama.cpp on `threads` threads, on F32 (fp32) or BF16
    (bf16) copies of the bundled GGUF's weights; None, with a message, without llama-cpp-python."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama.cpp peer skipped: llama-cpp-python is not installed (`pip install llama-cpp-python` builds "
              "it from source, about 10 minutes on 2 cores)", file=sys.stderr)
        return None
    path, weights = smollm2_gguf_copy(workdir, dtype)
    # use_mmap=False: llama.cpp reads its weights into its own memory. Mapped from the page cache,
    # its decode here swung between 41 and 61 tokens/s (BF16) with the state of the cache.
    llm = Llama(model_path=str(path), n_ctx=len(prompt) + n2 + 8, n_threads=threads, n_threads_batch=threads,
                use_mmap=False, verbose=False)

    def run(n: int) -> None:
        for _, _token in zip(range(n), llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
            pass

    run(2)
    t1, t2 = best(lambda: run(n1), repeats), best(lambda: run(n2), repeats)
    return weights, (n2 - n1) / (t2 - t1)


def prefill_rates(engine: Engine, hf: Any, n: int, repeats: int) -> tuple[float, float]:
    """Tokens/s of prefilling one n-token prompt (and sampling one token): ours, transformers.
    Each of our calls gets a prompt of its own (another first token), or the prefix cache would
    serve all but its last block from the call before."""
    prompt = [(i * 7919) % 40000 + 100 for i in range(n)]
    calls = iter(range(1, 1 << 30))

    def ours() -> None:
        engine.add([next(calls)] + prompt[1:], SamplingParams(temperature=0.0, max_new_tokens=1), "p")
        run_to_completion(engine)

    def theirs() -> None:
        with torch.no_grad():
            hf(torch.tensor([prompt]), use_cache=True)

    ours()
    theirs()
    return n / best(ours, repeats), n / best(theirs, repeats)


def single_rank(workdir: Path, args: argparse.Namespace, bw: float, bw1: float, bw_torch: float) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    tok = Tokenizer.from_dir(workdir / "tp1")
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
    n1, n2 = args.tokens // 4, args.tokens
    out: dict[str, Any] = {"prompt_tokens": len(prompt)}
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = load_model(workdir / "tp1", TPContext.single(), dtype)
        engine = Engine(model, tok, EngineConfig(max_batch=16, max_seq_len=max(640, len(prompt) + n2 + 8)))
        r: dict[str, Any] = {"weight_bytes": weight_bytes(model)}
        r["floor"], r["floor_1thread"] = bw / r["weight_bytes"], bw1 / r["weight_bytes"]
        r["floor_torch_sum"] = bw_torch / r["weight_bytes"]  # torch's sum alone: what earlier runs called the floor
        if args.alternate:
            r["ours_b1"], r["ours_b1_1thread"] = alternate_threads(engine, prompt, n1, n2, args.repeats, args.threads)
        else:
            r["ours_b1"] = ours_decode(engine, prompt, 1, n1, n2, args.repeats)
        peer = llama_cpp_decode(workdir, dtype, prompt, n1, n2, args.repeats, args.threads)
        if peer is not None:
            r["llama_cpp_weights"], r["llama_cpp_b1"] = peer
        if args.b1_only:
            out[dtype] = r
            print(f"[{dtype}] {json.dumps(r)}", file=sys.stderr, flush=True)
            del engine, model
            continue
        hf = LlamaForCausalLM.from_pretrained(workdir / "hf", dtype=torch_dtype).eval()
        r["hf_b1"] = hf_decode(hf, prompt, 1, n1, n2, args.repeats)
        for batch in (2, 4):  # a few sequences: tprt's few-row kernels (tprt.cpu.native.gemv_rows_kernel)
            r[f"ours_b{batch}"] = ours_decode(engine, prompt, batch, n1 // 2, n2 // 2, args.repeats)
        r["ours_b16"] = ours_decode(engine, prompt, 16, n1 // 2, n2 // 2, args.repeats)
        r["hf_b16"] = hf_decode(hf, prompt, 16, n1 // 2, n2 // 2, args.repeats)
        r["ours_prefill512"], r["hf_prefill512"] = prefill_rates(engine, hf, 512, args.repeats)
        out[dtype] = r
        print(f"[{dtype}] {json.dumps(r)}", file=sys.stderr, flush=True)
        del engine, model, hf
    return out


def _tp_rank(workdir: str, tokens: int, repeats: int, shm: bool) -> dict[str, Any] | None:
    """Batch-1 fp32 decode on this TP world, then the same all-reduces timed alone (the
    hidden-state ones through the path the model uses: shared memory when the world has it,
    unless `shm` is false)."""
    import torch.distributed as dist

    from tprt.parallel.mappings import reduce_from_region

    os.environ["TPRT_SHM_ALLREDUCE"] = "1" if shm else "0"  # here: the launcher's ranks may not inherit ours
    ctx = init_distributed()
    model = load_model(Path(workdir) / f"tp{ctx.world_size}", ctx, "fp32")
    tok = Tokenizer.from_dir(Path(workdir) / f"tp{ctx.world_size}")
    prompt = tok.encode_chat([{"role": "user", "content": QUESTION}])
    engine = Engine(model, tok, EngineConfig(max_batch=1, max_seq_len=len(prompt) + tokens + 8))
    if not engine.is_driver:
        engine.follow()
    else:
        with engine:
            rate = ours_decode(engine, prompt, 1, tokens // 4, tokens, repeats)
    # Per decoded token: 1 embedding + 2 per layer all-reduces of [1, 1, hidden], and the greedy
    # all-gather of one (value, id) pair per rank; plus the plan broadcast (2 small broadcasts).
    h = torch.zeros(1, 1, model.config.hidden_size, dtype=torch.float32)
    pair = torch.zeros(1, 2, dtype=torch.float64)
    parts = [torch.empty_like(pair) for _ in range(ctx.world_size)]
    n_steps = 32

    def all_reduces() -> None:
        for _ in range(n_steps):
            for _ in range(1 + 2 * model.config.num_hidden_layers):
                reduce_from_region(h, ctx)

    def others() -> None:
        for _ in range(n_steps):
            dist.all_gather(parts, pair, group=ctx.group)
            dist.broadcast(torch.zeros(1, dtype=torch.int64), group=ctx.group, group_src=0)
            dist.broadcast(torch.zeros(16, dtype=torch.int64), group=ctx.group, group_src=0)

    dist.barrier(group=ctx.group)
    allreduce_s = best(all_reduces, repeats) / n_steps
    dist.barrier(group=ctx.group)
    other_s = best(others, repeats) / n_steps
    if not engine.is_driver:
        return None
    return {"tokens_per_s": rate, "allreduce_s_per_token": allreduce_s, "allreduce_share": allreduce_s * rate,
            "other_collectives_s_per_token": other_s, "other_collectives_share": other_s * rate,
            "allreduce": "shared memory" if ctx.shm is not None else "gloo"}


def tp_comparison(workdir: Path, tp: int, tokens: int, repeats: int) -> dict[str, Any]:
    """Batch-1 fp32 decode at TP=tp (one thread per rank) with the all-reduces through shared
    memory and through gloo, and at TP=1 on one thread."""
    from tprt.distributed.launcher import launch_local

    out: dict[str, Any] = {}
    for label, shm in (("shm", True), ("gloo", False)):
        out[label] = launch_local(tp, _tp_rank, (str(workdir), tokens, repeats, shm), threads_per_rank=1)[0]
    out["tp1_one_thread"] = launch_local(1, _tp_rank, (str(workdir), tokens, repeats, True), threads_per_rank=1)[0]
    out["ratio_shm"] = out["shm"]["tokens_per_s"] / out["tp1_one_thread"]["tokens_per_s"]
    out["ratio_gloo"] = out["gloo"]["tokens_per_s"] / out["tp1_one_thread"]["tokens_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tprt-generate-bench"))
    ap.add_argument("--tokens", type=int, default=96, help="decode tokens of the long run (the short one is 1/4)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads for TP=1, transformers and llama.cpp (default: every core this process may use)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: process CPU time, robust to other load (one thread only; the TP runs always use wall time)")
    ap.add_argument("--quick", action="store_true", help="--tokens 48 --repeats 2")
    ap.add_argument("--b1-only", action="store_true",
                    help="TP=1: only batch-1 decode (ours, llama.cpp, the floor): quick before/after comparisons")
    ap.add_argument("--alternate", action="store_true",
                    help="batch-1 decode also with the kernels on one thread, the two measured in alternation")
    ap.add_argument("--no-tp", "--no-tp3", action="store_true", help="skip the TP comparison")
    ap.add_argument("--only-tp", type=int, metavar="N", help="only the TP comparison, at TP=N (default 3)")
    ap.add_argument("--only-tp3", dest="only_tp", action="store_const", const=3, help="--only-tp 3")
    ap.add_argument("--tiny", action="store_true", help="the TP comparison on a tiny random model, not SmolLM2")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.repeats = 48, 2
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu needs --threads 1 (CPU time counts every thread's work)")
    global CLOCK
    torch.set_num_threads(args.threads)
    tp = args.only_tp or 3
    workdir = prepare(args.workdir, (1,) if args.no_tp or args.tiny else (1, tp))
    if args.clock == "cpu":
        CLOCK = time.process_time
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    reads, reads1 = read_bandwidth(10, args.threads), read_bandwidth(10, 1)
    bw, bw1 = reads["best"], reads1["best"]
    result: dict[str, Any] = {"threads": args.threads, "clock": args.clock, "read_bandwidth_GBps": bw / 1e9,
                              "read_bandwidth_1thread_GBps": bw1 / 1e9,
                              "read_bandwidths_GBps": {k: v / 1e9 for k, v in reads.items()},
                              "read_bandwidths_1thread_GBps": {k: v / 1e9 for k, v in reads1.items()}}
    if args.only_tp is None:
        result.update(single_rank(workdir, args, bw, bw1, reads["torch_sum"]))
    if not args.no_tp:
        CLOCK = time.perf_counter
        where = prepare_tiny(args.workdir, (1, tp)) if args.tiny else workdir
        result["tp"] = {"tp": tp, "model": "tiny" if args.tiny else "SmolLM2-135M",
                        **tp_comparison(where, tp, args.tokens // 2, args.repeats)}
    result["read_bandwidth_after_GBps"] = read_bandwidth(10, args.threads)["best"] / 1e9  # the floor uses the first
    result["load_average_after"] = os.getloadavg()
    report(result)


def report(r: dict[str, Any]) -> None:
    print(json.dumps(r, indent=1))
    reads = r["read_bandwidths_GBps"]
    print(f"\nread bandwidth {r['read_bandwidth_GBps']:.1f} GB/s on {r['threads']} thread(s) (torch's sum "
          f"{reads['torch_sum']:.1f}), {r['read_bandwidth_1thread_GBps']:.1f} on one; {r['clock']} clock, "
          f"prompt {r.get('prompt_tokens')} tokens")
    for dt in ("fp32", "bf16") if "fp32" in r else ():
        x = r[dt]
        print(f"{dt}: batch-1 decode {x['ours_b1']:.1f} tok/s | floor {x['floor']:.1f} "
              f"({x['ours_b1'] / x['floor']:.0%} of the {r['threads']}-thread floor, "
              f"{x['ours_b1'] / x['floor_1thread']:.0%} of the 1-thread floor; "
              f"{x['ours_b1'] / x['floor_torch_sum']:.0%} of the floor by torch's sum)")
        if "ours_b1_1thread" in x:
            print(f"{dt}: kernels on one thread, in alternation: {x['ours_b1_1thread']:.1f} tok/s "
                  f"({x['ours_b1'] / x['ours_b1_1thread']:.2f}x; {x['ours_b1_1thread'] / x['floor_1thread']:.0%} "
                  f"of the 1-thread floor)")
        if x.get("llama_cpp_b1"):
            print(f"{dt}: llama.cpp ({x['llama_cpp_weights']}) {x['llama_cpp_b1']:.1f} tok/s "
                  f"(ours {x['ours_b1'] / x['llama_cpp_b1']:.2f}x)")
        if "hf_b1" not in x:
            continue
        print(f"{dt}: transformers batch-1 {x['hf_b1']:.1f} tok/s (ours {x['ours_b1'] / x['hf_b1']:.2f}x)")
        print(f"{dt}: 2 / 4 sequences {x['ours_b2']:.1f} / {x['ours_b4']:.1f} tok/s "
              f"({x['ours_b2'] / x['ours_b1']:.1f}x / {x['ours_b4'] / x['ours_b1']:.1f}x batch 1)")
        print(f"{dt}: 16 sequences {x['ours_b16']:.1f} tok/s ({x['ours_b16'] / x['ours_b1']:.1f}x batch 1) | "
              f"transformers {x['hf_b16']:.1f} ({x['ours_b16'] / x['hf_b16']:.2f}x)")
        print(f"{dt}: prefill 512 tokens {x['ours_prefill512']:.0f} tok/s | transformers {x['hf_prefill512']:.0f} "
              f"({x['ours_prefill512'] / x['hf_prefill512']:.2f}x)")
    if "tp" in r:
        t = r["tp"]
        for label in ("shm", "gloo"):
            run = t[label]
            print(f"TP={t['tp']} ({t['model']}, all-reduce through {run['allreduce']}) batch-1 fp32 decode "
                  f"{run['tokens_per_s']:.1f} tok/s vs TP=1 (1 thread) {t['tp1_one_thread']['tokens_per_s']:.1f} "
                  f"({t['ratio_' + label]:.2f}x); all-reduces {run['allreduce_s_per_token'] * 1e3:.2f} ms "
                  f"({run['allreduce_share']:.0%} of a token), the greedy gather and plan broadcasts "
                  f"{run['other_collectives_s_per_token'] * 1e3:.2f} ms ({run['other_collectives_share']:.0%})")


if __name__ == "__main__":
    main()
