"""Quantized weights (tprt.quant) on SmolLM2-135M: quality against bf16, decode speed against our
bf16 and llama.cpp's Q8_0 on the same weights, all measured in the same run.

    python bench/quant_bench.py                         # everything (about 10-20 minutes on 2 cores)
    python bench/quant_bench.py --quick                 # fewer tokens and repeats
    python bench/quant_bench.py --hf /tmp/smol/hf       # quality on these HF weights (default: this, if present)

Quality (on --hf: the original SmolLM2 weights when given, else the bundled GGUF's):
- perplexity of bench/quant_text.txt, bf16 vs int8 per channel vs int8 groups of 32: the prefill
  path (torch: weight-only, activations unrounded) in windows of --window tokens, and the decode
  path (prepack + the native kernels, one token at a time with the KV cache: the int8 products'
  activation rounding on VNNI CPUs included) over the first --decode-tokens tokens;
- greedy agreement with bf16 over --new tokens on 10 prompts: the share of positions equal to
  bf16's, and the mean length of the common prefix.

Speed (the bundled GGUF's weights, so that llama.cpp runs the very same ones): our bf16; our int8
imported from a Q8_0 copy of the GGUF as stored (`hf-to-tp --quantize int8 --group-size 32`: the
same int8 values and scales llama.cpp reads); llama.cpp (llama-cpp-python) on that Q8_0 file.
Batch-1 decode tokens/s at 1 and 2 threads (torch's and the native pool's), and 16 sequences'
aggregate decode tokens/s, ours only. Rates are differences of two run lengths, best of
--repeats (bench/generate_bench.py's method). The machine may be shared: compare ratios.
Our int8 model reads its LM head in int8 too (tprt.cpu.quant_linear.Int8Head, as llama.cpp's
Q8_0 file stores it); --compare-head adds the int8 model with a bf16 head to the same alternation.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tprt  # noqa: E402, F401 - before torch
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.generate_bench import best, ours_decode  # noqa: E402
from tprt.checkpoint.loading import load_model  # noqa: E402
from tprt.cpu import native  # noqa: E402
from tprt.distributed.context import TPContext  # noqa: E402
from tprt.engine.core import Engine, EngineConfig, run_to_completion  # noqa: E402
from tprt.engine.sampling import SamplingParams  # noqa: E402
from tprt.model.attention import backend as attention_backend  # noqa: E402
from tprt.model.batch import BatchRow, TokenBatch  # noqa: E402
from tprt.model.llama import TPLlamaForCausalLM  # noqa: E402
from tprt.text.tokenizer import Tokenizer  # noqa: E402

TEXT = ROOT / "bench" / "quant_text.txt"
PROMPTS = [
    "The history of the printing press begins", "Write a short poem about the sea.",
    "Explain how a refrigerator works.", "What are the three states of matter?",
    "Once upon a time, in a small village,", "List five uses of a paperclip.",
    "The best way to learn a new language is", "Describe the water cycle in simple terms.",
    "A recipe for pancakes:", "Why is the sky blue?",
]
FORMATS = {"bf16": {}, "int8": {"quantize": "int8"}, "int8-g32": {"quantize": "int8", "group_size": 32}}


def convert_all(hf: Path, workdir: Path) -> dict[str, Path]:
    """TP 1 checkpoints of `hf` in every format of FORMATS (kept between runs)."""
    from convert.api import hf_to_tp

    out = {}
    for name, opts in FORMATS.items():
        out[name] = workdir / f"quality-{name}"
        if not out[name].exists():
            hf_to_tp(hf, out[name], 1, dtype="bf16", **opts)  # type: ignore[arg-type]
    return out


def prefill_perplexity(model: TPLlamaForCausalLM, ids: list[int], window: int) -> float:
    """exp(mean next-token NLL) over `ids` in non-overlapping windows of `window` tokens."""
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start : start + window + 1]])  # [1, <= window + 1]
            logits = model.gather_logits(model(chunk[:, :-1]))[0].float()  # [seq, vocab]
            nll += float(F.cross_entropy(logits, chunk[0, 1:], reduction="sum"))
            count += chunk.shape[1] - 1
    return math.exp(nll / count)


def decode_perplexity(model: TPLlamaForCausalLM, ids: list[int]) -> float:
    """The same, one token per step through the KV cache on the CPU decode path (prepack and the
    native layers, as the engine runs them)."""
    from tprt.cpu.fast_linear import prepack
    from tprt.cpu.native_layers import install_native_layers

    prepack(model)
    install_native_layers(model)
    block = 16
    cache = model.new_cache(len(ids) // block + 2, block)
    table = tuple(range(1, len(ids) // block + 2))  # block 0 is scratch
    backend = attention_backend("auto", model.tp.device, cache)
    nll = 0.0
    with torch.inference_mode():
        for t in range(len(ids) - 1):
            step = backend.prepare(TokenBatch.of([BatchRow(table, t, (ids[t],), 1)]), cache)
            local = model(torch.tensor([ids[t]]), attention=step)  # [1, local_vocab]
            logits = model.gather_logits(local)[0].float()  # [vocab]
            nll -= float(torch.log_softmax(logits, -1)[ids[t + 1]])
    return math.exp(nll / (len(ids) - 1))


def greedy(path: Path, prompts: list[list[int]], new: int) -> list[list[int]]:
    model = load_model(path, TPContext.single())
    engine = Engine(model, None, EngineConfig(max_batch=len(prompts), max_seq_len=512))
    for i, p in enumerate(prompts):
        engine.add(p, SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True), str(i))
    done = run_to_completion(engine)
    engine.close()
    return [done[str(i)].token_ids for i in range(len(prompts))]


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict[str, float]:
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    total = sum(len(r) for r in ref)
    prefix = []
    for r, g in zip(ref, got):
        n = next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
        prefix.append(n)
    return {"positions_equal": round(same / total, 4), "mean_common_prefix": sum(prefix) / len(prefix)}


def quality(hf: Path, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    paths = convert_all(hf, workdir)
    tok = Tokenizer.from_dir(paths["bf16"])
    ids = tok.encode(TEXT.read_text())
    out: dict[str, Any] = {"text_tokens": len(ids)}
    for name, path in paths.items():
        model = load_model(path, TPContext.single())
        out[f"ppl_prefill_{name}"] = round(prefill_perplexity(model, ids, args.window), 4)
        out[f"ppl_decode_{name}"] = round(decode_perplexity(load_model(path, TPContext.single()),
                                                             ids[: args.decode_tokens]), 4)
        print(name, out[f"ppl_prefill_{name}"], out[f"ppl_decode_{name}"], flush=True)
    for name in FORMATS:
        for kind in ("prefill", "decode"):
            out[f"ppl_{kind}_{name}_over_bf16"] = round(out[f"ppl_{kind}_{name}"] / out[f"ppl_{kind}_bf16"], 4)
    prompts = [tok.encode(p) for p in PROMPTS]
    ref = greedy(paths["bf16"], prompts, args.new)
    for name in ("int8", "int8-g32"):
        out[f"greedy_{name}_vs_bf16"] = agreement(ref, greedy(paths[name], prompts, args.new))
        print(name, out[f"greedy_{name}_vs_bf16"], flush=True)
    return out


def q8_0_copy(src: Path, dst: Path) -> Path:
    """src (a llama.cpp GGUF) with every matrix requantized to Q8_0 (vectors F32), metadata as is."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        writer.add_key_value(name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if values.ndim == 1:
            writer.add_tensor(t.name, values)
        else:
            q = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def llama_cpp_rate(path: Path, prompt: list[int], n1: int, n2: int, repeats: int, threads: int) -> float | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama.cpp peer skipped: llama-cpp-python is not installed", file=sys.stderr)
        return None
    llm = Llama(model_path=str(path), n_ctx=len(prompt) + n2 + 8, n_threads=threads, n_threads_batch=threads,
                use_mmap=False, verbose=False)

    def run(n: int) -> None:
        for _, _token in zip(range(n), llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
            pass

    run(2)
    t1, t2 = best(lambda: run(n1), repeats), best(lambda: run(n2), repeats)
    return (n2 - n1) / (t2 - t1)


def speed(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from convert.api import gguf_to_hf, hf_to_tp
    from tprt.cli.demo import smollm2_gguf

    q8 = workdir / "smollm2-Q8_0.gguf"
    if not q8.exists():
        q8_0_copy(smollm2_gguf(), q8)
    if not (workdir / "speed-hf").exists():
        gguf_to_hf(smollm2_gguf(), workdir / "speed-hf")
    if not (workdir / "speed-bf16").exists():
        hf_to_tp(workdir / "speed-hf", workdir / "speed-bf16", 1, dtype="bf16")
    if not (workdir / "speed-int8").exists():
        t0 = time.perf_counter()
        hf_to_tp(q8, workdir / "speed-int8", 1, dtype="bf16", quantize="int8", group_size=32)  # Q8_0 as stored
        print(f"Q8_0 GGUF -> int8 TP checkpoint in {time.perf_counter() - t0:.1f}s", flush=True)
    prompt = Tokenizer.from_dir(workdir / "speed-bf16").encode("The history of the printing press begins")
    n1, n2 = args.n1, args.n2
    engines = {name: Engine(load_model(workdir / f"speed-{name}", TPContext.single()), None,
                            EngineConfig(max_batch=16, max_seq_len=512)) for name in ("bf16", "int8")}
    if args.compare_head:  # the int8 model with its LM head left in bf16, as before Int8Head
        from tprt.cpu import fast_linear

        int8_head, fast_linear.int8_head = fast_linear.int8_head, lambda model: None
        try:
            engines["int8_bf16_head"] = Engine(load_model(workdir / "speed-int8", TPContext.single()), None,
                                               EngineConfig(max_batch=16, max_seq_len=512))
        finally:
            fast_linear.int8_head = int8_head
    out: dict[str, Any] = {"q8_path": native.q8_path()}
    before = torch.get_num_threads()
    try:
        for threads in args.threads:
            rates = {name: 0.0 for name in engines}
            for _ in range(args.repeats):  # alternated, so other jobs' load falls on both alike
                for name, engine in engines.items():
                    torch.set_num_threads(threads)
                    native.set_threads(threads)
                    rates[name] = max(rates[name], ours_decode(engine, prompt, 1, n1, n2, 1))
            peer = llama_cpp_rate(q8, prompt, n1, n2, args.repeats, threads)
            out[f"b1_t{threads}"] = {name: round(rate, 1) for name, rate in rates.items()} | {
                                     "llama_cpp_q8_0": None if peer is None else round(peer, 1),
                                     "int8_over_llama_cpp": None if peer is None else round(rates["int8"] / peer, 2)} | {
                                     f"{name}_over_bf16": round(rate / rates["bf16"], 2)
                                     for name, rate in rates.items() if name != "bf16"}
            print(f"batch 1, {threads} thread(s):", json.dumps(out[f"b1_t{threads}"]), flush=True)
        torch.set_num_threads(max(args.threads))
        native.set_threads(max(args.threads))
        b16 = {name: ours_decode(engine, prompt, 16, n1, n2, args.repeats) for name, engine in engines.items()}
        out["b16"] = {k: round(v, 1) for k, v in b16.items()} | {f"{k}_over_bf16": round(v / b16["bf16"], 2)
                                                                for k, v in b16.items() if k != "bf16"}
        print("16 sequences:", json.dumps(out["b16"]), flush=True)
    finally:
        torch.set_num_threads(before)
        for engine in engines.values():
            engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", type=Path, default=Path("/tmp/smol/hf"), help="HF SmolLM2 for the quality part "
                    "(default /tmp/smol/hf; if absent, the bundled GGUF's weights)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tprt-quant-bench"))
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    ap.add_argument("--skip", choices=("quality", "speed"), help="leave one part out")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--compare-head", action="store_true", help="speed: also the int8 model with its LM "
                    "head in bf16 (before tprt.cpu.quant_linear.Int8Head), in the same alternation")
    args = ap.parse_args()
    args.window, args.decode_tokens = 512, 128 if args.quick else 512
    args.new = 32 if args.quick else 256
    args.n1, args.n2, args.repeats = (16, 48, 2) if args.quick else (32, 160, 3)
    args.workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    if args.skip != "quality":
        hf = args.hf
        if not (hf / "config.json").exists():
            from convert.api import gguf_to_hf
            from tprt.cli.demo import smollm2_gguf

            hf = args.workdir / "speed-hf"
            if not hf.exists():
                gguf_to_hf(smollm2_gguf(), hf)
        results["quality"] = quality(hf, args.workdir, args)
    if args.skip != "speed":
        results["speed"] = speed(args.workdir, args)
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
