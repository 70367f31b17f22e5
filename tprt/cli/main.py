"""The `tprt` command: argument parsing into one dataclass per subcommand, and error reporting."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

from tprt.engine.settings import add_attention_flag, add_graphs_flag, add_kv_cache_flags, add_sequence_parallel_flag
from tprt.errors import TprtError

DEMO_QUESTION = "What is the capital of France? Answer in one sentence."

EPILOG = """examples:
  tprt demo                              convert the bundled SmolLM2 model, chat, fine-tune and serve it at TP=3
  tprt generate --model ./smollm2-tp3 --chat --prompt "What is the capital of France?"
  tprt score --model ./smollm2-tp3 --file essay.txt
  tprt calibrate-kv --model ./smollm2-tp3 --file chats.jsonl --out kv_scales.safetensors
  tprt finetune --model ./smollm2-tp3 --data chats.jsonl --out ./run --lora-rank 8 --steps 100
  tprt serve --model ./smollm2-tp3 --port 50051 --metrics-port 9400
  tprt plan --model bench/configs/llama-3.1-70b --tp 8 --device h100-80gb serve --max-seq-len 8192

exit status: 0 success, 1 failure while running, 2 bad usage or input.
"""

GENERATE_EPILOG = """examples:
  tprt generate --model ./smollm2-tp3 --chat --prompt "What is the capital of France?"
  tprt generate --model ./smollm2-tp3 --prompt "Once upon a time" "The sky is" --max-new-tokens 32
  tprt generate --model ./smollm2-tp3 --prompts-file prompts.txt --temperature 0.8 --top-p 0.95 --seed 1
  tprt generate --model ./smollm2-tp3 --prompt "2 + 2 =" --logprobs --top-logprobs 5 --json
  tprt generate --model ./smollm2-tp3 --chat --prompt "Invent a person" --json-schema person.schema.json
  tprt generate --model ./smollm2-tp3 --chat --prompt "Is the sky green?" --choice yes no
  torchrun --nproc-per-node 3 -m tprt.cli generate --model ./smollm2-tp3 --prompt "Hello"
  tprt generate --model ./smollm2-tp3 --pp 2 --prompt "Hello"   # 6 ranks: 2 stages of 15 layers

Without torchrun, the checkpoint's TP number of local ranks (times --pp) is started
automatically; under torchrun (one or more nodes) the world size must equal that. Several prompts
run as one batch; text is streamed in prompt order. --temperature 0 (the default) is greedy.
With --seed S, prompt i (counting from 0) is sampled with seed S + i, whatever else is in the
batch. --json prints one JSON object per prompt (text, token_ids, finish_reason, stop_reason,
usage, and logprobs/top_logprobs when asked for) instead of streaming. With an output constraint
(--json-schema, --regex, --choice, --grammar) every token is chosen among those the constraint
allows, after temperature and the other filters; the output ends (finish_reason "stop") when the
constraint is complete, or says "length" if --max-new-tokens runs out first.
"""

SCORE_EPILOG = """examples:
  tprt score --model ./smollm2-tp3 --file essay.txt
  tprt score --model ./smollm2-tp3 --file docs.jsonl --json

A .jsonl file holds one {"text": ...} object per line; any other file is one document. Each token
after the first gets log p(token | text before it); perplexity = exp(-mean logprob), per document
and over all tokens. The logits stay split over the TP ranks (vocab-parallel cross-entropy).
"""


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, like every other tprt error."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _generate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    g = sub.add_parser("generate", help="generate text from prompts", epilog=GENERATE_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Generate text with a TP checkpoint, streaming it to stdout.")
    g.add_argument("--model", type=Path, required=True, metavar="DIR", help="TP checkpoint directory")
    g.add_argument("--prompt", dest="prompts", action="extend", nargs="+", default=[], metavar="TEXT",
                   help="prompt text (several allowed)")
    g.add_argument("--prompts-file", type=Path, metavar="FILE", help="a file with one prompt per non-empty line")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    g.add_argument("--system", metavar="TEXT", help="system message (with --chat)")
    g.add_argument("--max-new-tokens", type=int, metavar="N",
                   help="tokens to generate at most (default 256, or what the context leaves)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability (0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="HF-style penalty (1 = off)")
    g.add_argument("--seed", type=int, help="sampling seed (prompt i uses seed + i)")
    g.add_argument("--stop", action="extend", nargs="+", default=[], metavar="STR", help="stop strings")
    g.add_argument("--stop-token-id", dest="stop_token_ids", action="extend", nargs="+", type=int, default=[],
                   metavar="ID", help="token ids that end generation (besides EOS)")
    g.add_argument("--logprobs", action="store_true", help="report each token's log-probability (with --json)")
    g.add_argument("--top-logprobs", type=int, default=0, metavar="N", help="also the N most likely tokens (0-20)")
    g.add_argument("--dtype", metavar="{fp32,bf16,fp16}", help="compute dtype (default: the checkpoint's)")
    add_kv_cache_flags(g)
    add_attention_flag(g)
    add_graphs_flag(g)
    add_sequence_parallel_flag(g)
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of streaming")
    g.add_argument("--threads", type=int, metavar="N",
                   help="torch threads per rank (default: cores / TP; 1 is faster on a busy machine)")
    g.add_argument("--adapter", type=Path, metavar="DIR", help="LoRA adapter directory, applied without merging")
    g.add_argument("--pp", type=int, default=1, metavar="N",
                   help="pipeline stages: the layers split over N stages of the checkpoint's TP ranks each "
                        "(TP x N ranks; default 1); the tokens are the same as without")
    c = g.add_argument_group("output constraints (at most one; the output always matches it)")
    c.add_argument("--json-schema", type=Path, metavar="FILE", help="JSON that validates against this JSON Schema")
    c.add_argument("--regex", metavar="RE", help="text that fully matches this regular expression")
    c.add_argument("--choice", action="extend", nargs="+", default=[], metavar="TEXT",
                   help="exactly one of these strings")
    c.add_argument("--grammar", type=Path, metavar="FILE", help="text in the language of this Lark grammar")
    from tprt.cli.speculative_flags import add_speculative_flags

    add_speculative_flags(g)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="tprt",
        description="Tensor-parallel runtime for Llama models. Checkpoints come from `tprt-convert`.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    demo = sub.add_parser("demo", help="run the pipeline on the real SmolLM2-135M-Instruct model")
    demo.add_argument("--out", type=Path, default=Path("demo-out"), help="output directory (default: demo-out)")
    demo.add_argument("--tp", type=int, default=3, help="TP degree of the demo checkpoint (default: 3)")
    demo.add_argument("--prompt", default=DEMO_QUESTION, help="the chat question to answer")
    demo.add_argument("--no-serve", action="store_true", help="skip the serving part (tprt serve, a job over its API)")
    _generate_parser(sub)
    s = sub.add_parser("score", help="per-token log-probabilities and perplexity of text", epilog=SCORE_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Score text with a TP checkpoint: per-token log-probabilities and perplexity.")
    s.add_argument("--model", type=Path, required=True, metavar="DIR", help="TP checkpoint directory")
    s.add_argument("--file", type=Path, required=True, metavar="TEXT_OR_JSONL", help=".txt (one document) or .jsonl")
    s.add_argument("--dtype", metavar="{fp32,bf16,fp16}", help="compute dtype (default: the checkpoint's)")
    s.add_argument("--json", action="store_true", help="print per-token results as JSON")
    add_kv_cache_flags(s, None, "score through a KV cache of this dtype, 512 tokens at a time, each part attending to "
                                "the earlier ones as stored (default: no cache, one pass in the compute dtype)")
    add_attention_flag(s)
    s.add_argument("--threads", type=int, metavar="N", help="torch threads per rank (default: cores / TP)")
    from tprt.cli.finetune import add_parsers as add_train_parsers  # finetune, merge-lora

    add_train_parsers(sub)
    from serve.cli import add_parsers as add_serve_parsers  # serve, client

    add_serve_parsers(sub)
    from tprt.cli.plan import add_parser as add_plan_parser

    add_plan_parser(sub)
    from tprt.cli.calibrate import add_parser as add_calibrate_parser

    add_calibrate_parser(sub)
    return ap


def _run(args: argparse.Namespace) -> int:
    if args.command in ("serve", "client"):
        from serve.cli import run as run_serve

        return run_serve(args)
    if args.command in ("finetune", "merge-lora"):
        from tprt.cli.finetune import run as run_train

        return run_train(args)
    if args.command == "calibrate-kv":
        from tprt.cli.calibrate import run as run_calibrate

        return run_calibrate(args)
    if args.command == "plan":
        from tprt.cli.plan import run as run_plan

        return run_plan(args)
    if args.command == "demo":
        from tprt.cli.demo import DemoArgs, run_demo

        return run_demo(DemoArgs(out=args.out, tp=args.tp, question=args.prompt, serve=not args.no_serve))
    if args.command == "generate":
        from tprt.cli.generate import GenerateArgs, run_generate

        fields = {k: v for k, v in vars(args).items() if k != "command"}
        for k in ("prompts", "stop", "stop_token_ids", "choice"):
            fields[k] = tuple(fields[k])
        return run_generate(GenerateArgs(**fields))
    if args.command == "score":
        from tprt.cli.generate import ScoreArgs, run_score

        return run_score(ScoreArgs(model=args.model, file=args.file, dtype=args.dtype, json=args.json,
                                   threads=args.threads, kv_cache_dtype=args.kv_cache_dtype,
                                   kv_scales=args.kv_scales, attention_backend=args.attention_backend))
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except TprtError as e:
        from tprt.distributed.launcher import LaunchError

        if os.environ.get("RANK", "0") == "0":  # under torchrun, one copy of the message
            print(f"tprt: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, LaunchError) else 2
    except KeyboardInterrupt:
        print("tprt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
