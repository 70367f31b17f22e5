"""`tprt generate` and `tprt score` end to end: subprocesses on a tiny TP=2 checkpoint started by the
local launcher, compared with transformers; bad input gives one line on stderr and a non-zero exit,
and a rank failing after the start takes the others down (no hang).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tiny_chat import make_tiny_chat_model
from tprt.cli.main import main
from tprt.text.tokenizer import Tokenizer

PROMPTS = ("Hello there", "The quick brown fox", "Hi")
SYSTEM = "Be brief."
N_NEW = 6
TIMEOUT = 120  # a hang fails the test instead of blocking the suite


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("cli"), (1, 2))


@pytest.fixture(scope="module")
def hf(root: Path) -> Any:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    model.generation_config.pad_token_id = 0
    return model


def _hf_greedy(hf: Any, ids: list[int]) -> list[int]:
    """transformers' greedy continuation, stopping at EOS (id 2) like tprt."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N_NEW, do_sample=False, eos_token_id=2)
    return out[0, len(ids):].tolist()  # type: ignore[no-any-return]


def _hf_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from transformers' logits."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def _tprt(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tprt.cli", *args]
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    full_env.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=full_env)


def _one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tprt"), proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_generate_json_tp2(root: Path, hf: Any, tmp_path: Path) -> None:
    """Three uneven prompts (flags and a file) in one TP=2 batch: ids, text and logprobs as transformers'."""
    (tmp_path / "prompts.txt").write_text(f"{PROMPTS[1]}\n\n{PROMPTS[2]}\n")
    proc = _tprt("generate", "--model", str(root / "tp2"), "--prompt", PROMPTS[0], "--prompts-file",
                 str(tmp_path / "prompts.txt"), "--max-new-tokens", str(N_NEW), "--logprobs", "--json")
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    tok = Tokenizer.from_dir(root / "tp2")
    assert [r["index"] for r in results] == [0, 1, 2]
    for r, text in zip(results, PROMPTS):
        ids = tok.encode(text)
        want = _hf_greedy(hf, ids)
        assert r["token_ids"] == want, (text, r["token_ids"], want)
        assert r["finish_reason"] == ("stop" if 2 in want else "length")
        assert r["text"] == tok.decode(want, skip_special_tokens=True)
        assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(want)}
        torch.testing.assert_close(torch.tensor(r["logprobs"]), _hf_logprobs(hf, ids + want)[len(ids) - 1:],
                                   atol=1e-4, rtol=0)
    assert "TP=2" in proc.stderr


@pytest.mark.parametrize(("flags", "layout"), [(["--pp", "2"], "TP=2 x PP=2"),
                                              (["--sequence-parallel", "4"], "TP=2, sequence-parallel")])
def test_generate_over_stages_or_sequence_parallel(root: Path, hf: Any, flags: list[str], layout: str) -> None:
    """--pp 2 on the TP=2 checkpoint (4 local ranks, two stages of two), and prefill steps of 4
    tokens or more split over the TP ranks (--sequence-parallel 4): the same ids and logprobs as
    transformers, and the stderr line says the layout."""
    proc = _tprt("generate", "--model", str(root / "tp2"), *flags, "--prompt", *PROMPTS, "--max-new-tokens",
                 str(N_NEW), "--logprobs", "--json", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    tok = Tokenizer.from_dir(root / "tp2")
    for r, text in zip([json.loads(line) for line in proc.stdout.splitlines()], PROMPTS, strict=True):
        ids = tok.encode(text)
        want = _hf_greedy(hf, ids)
        assert r["token_ids"] == want, (text, r["token_ids"], want)
        torch.testing.assert_close(torch.tensor(r["logprobs"]), _hf_logprobs(hf, ids + want)[len(ids) - 1:],
                                   atol=1e-4, rtol=0)
    assert layout in proc.stderr, proc.stderr


def test_generate_speculative_tp2(root: Path, hf: Any) -> None:
    """--speculative ngram: the same greedy ids as transformers, and a line on what was drafted."""
    prompts = ("ab ab ab ab ab", PROMPTS[1])
    proc = _tprt("generate", "--model", str(root / "tp2"), "--prompt", *prompts, "--max-new-tokens", "12", "--json",
                 "--speculative", "ngram", "--spec-min-n", "1", "--num-speculative-tokens", "3")
    assert proc.returncode == 0, proc.stderr
    tok = Tokenizer.from_dir(root / "tp2")
    for r, text in zip([json.loads(line) for line in proc.stdout.splitlines()], prompts):
        ids = tok.encode(text)
        x = torch.tensor([ids])
        with torch.no_grad():
            want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                               eos_token_id=2)[0, len(ids):].tolist()
        assert r["token_ids"] == want, (text, r["token_ids"], want)
    assert "speculative:" in proc.stderr and "tokens drafted" in proc.stderr, proc.stderr


def test_generate_chat_streams_text(root: Path, hf: Any) -> None:
    """--chat --system: the chat template's prompt, the text streamed to stdout."""
    proc = _tprt("generate", "--model", str(root / "tp2"), "--chat", "--system", SYSTEM, "--prompt", PROMPTS[0],
                 "--max-new-tokens", str(N_NEW))
    assert proc.returncode == 0, proc.stderr
    tok = Tokenizer.from_dir(root / "tp2")
    ids = tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPTS[0]}])
    assert proc.stdout == tok.decode(_hf_greedy(hf, ids), skip_special_tokens=True) + "\n"


def test_generate_with_output_constraints_tp2(root: Path, tmp_path: Path) -> None:
    """--json-schema, --regex, --choice and --grammar at TP=2: every output matches its constraint
    and ends with "stop"."""
    import re

    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "w": {"enum": ["ab", "cd"]}},
              "required": ["n", "w"], "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    (tmp_path / "g.lark").write_text('start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/\n')
    runs = {"schema": ["--json-schema", str(tmp_path / "s.json")], "regex": ["--regex", "[a-f]{3}[0-9]"],
            "choice": ["--choice", "red", "green blue"], "grammar": ["--grammar", str(tmp_path / "g.lark")]}
    for kind, flags in runs.items():
        proc = _tprt("generate", "--model", str(root / "tp2"), "--prompt", PROMPTS[0], PROMPTS[1], "--json",
                     "--max-new-tokens", "40", "--temperature", "0.8", "--seed", "3", *flags)
        assert proc.returncode == 0, proc.stderr
        for r in (json.loads(line) for line in proc.stdout.splitlines()):
            assert r["finish_reason"] == "stop", (kind, r)
            text = r["text"]
            if kind == "schema":
                jsonschema.validate(json.loads(text), schema)
            elif kind == "regex":
                assert re.fullmatch("[a-f]{3}[0-9]", text), text
            elif kind == "choice":
                assert text in ("red", "green blue"), text
            else:
                assert re.fullmatch("x=[0-9]{1,3};", text), text


def test_score_tp2_jsonl(root: Path, hf: Any, tmp_path: Path) -> None:
    """Per-token logprobs equal transformers' log-softmax of the targets; perplexities follow."""
    docs = ["The quick brown fox jumps over the lazy dog.", "Tensor parallel!"]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    proc = _tprt("score", "--model", str(root / "tp2"), "--file", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    tok = Tokenizer.from_dir(root / "tp2")
    total_lp, total_n = 0.0, 0
    for d, text in zip(out["documents"], docs):
        ids = tok.encode(text)
        want = _hf_logprobs(hf, ids)
        assert [t["id"] for t in d["tokens"]] == ids and d["tokens"][0]["logprob"] is None
        torch.testing.assert_close(torch.tensor([t["logprob"] for t in d["tokens"][1:]]), want, atol=1e-4, rtol=0)
        assert d["num_tokens"] == len(ids) - 1
        assert abs(d["perplexity"] - torch.exp(-want.mean()).item()) < 1e-3 * d["perplexity"]
        total_lp, total_n = total_lp + want.sum().item(), total_n + len(ids) - 1
    assert out["overall"]["num_tokens"] == total_n
    assert abs(out["overall"]["logprob"] - total_lp) < 1e-3


def test_generate_with_a_quantized_kv_cache_tp1(root: Path, hf: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """--kv-cache-dtype int8 and fp8: transformers' greedy tokens (the tiny model's margins are wide
    enough for both at this length)."""
    ids = Tokenizer.from_dir(root / "tp1").encode(PROMPTS[0])
    for kv in ("int8", "fp8"):
        assert main(["generate", "--model", str(root / "tp1"), "--prompt", PROMPTS[0], "--max-new-tokens", str(N_NEW),
                     "--kv-cache-dtype", kv, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == _hf_greedy(hf, ids), kv


def test_calibrate_kv_then_generate_and_score_with_static_scales(root: Path, hf: Any, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`tprt calibrate-kv` at TP=2 (two ranks, each its kv heads) writes the same scales as at TP=1
    in this process; `generate --kv-scales` then gives transformers' greedy tokens, and `score
    --kv-scales` logprobs near transformers' (a float cache's: equal to them)."""
    from safetensors.torch import load_file

    doc = tmp_path / "calib.txt"
    doc.write_text(" ".join(PROMPTS) + " The quick brown fox jumps over the lazy dog. " * 3)
    proc = _tprt("calibrate-kv", "--model", str(root / "tp2"), "--file", str(doc), "--out", str(tmp_path / "kv2.st"))
    assert proc.returncode == 0, proc.stderr
    assert "--kv-scales" in proc.stdout and "margin 1.25" in proc.stdout, proc.stdout
    assert main(["calibrate-kv", "--model", str(root / "tp1"), "--file", str(doc), "--out", str(tmp_path / "kv1.st"),
                 "--margin", "2"]) == 0
    tp2, tp1 = load_file(tmp_path / "kv2.st")["kv_scales"], load_file(tmp_path / "kv1.st")["kv_scales"]
    torch.testing.assert_close(tp1, tp2 * 2 / 1.25, rtol=1e-5, atol=0)
    cfg = json.loads((root / "tp2" / "config.json").read_text())
    assert list(tp2.shape) == [cfg["num_hidden_layers"], 2, cfg["num_key_value_heads"]] and bool((tp2 > 0).all())

    ids = Tokenizer.from_dir(root / "tp2").encode(PROMPTS[1])
    proc = _tprt("generate", "--model", str(root / "tp2"), "--prompt", PROMPTS[1], "--max-new-tokens", str(N_NEW),
                 "--kv-scales", str(tmp_path / "kv2.st"), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["token_ids"] == _hf_greedy(hf, ids)
    capsys.readouterr()
    text = "The quick brown fox jumps over the lazy dog. Hello there."
    (tmp_path / "doc.txt").write_text(text)
    want = _hf_logprobs(hf, Tokenizer.from_dir(root / "tp1").encode(text))
    for flags, tol in ((["--kv-cache-dtype", "fp32"], 1e-4), (["--kv-scales", str(tmp_path / "kv1.st")], 0.05)):
        assert main(["score", "--model", str(root / "tp1"), "--file", str(tmp_path / "doc.txt"), "--json", *flags]) == 0
        got = torch.tensor([t["logprob"] for t in json.loads(capsys.readouterr().out)["documents"][0]["tokens"][1:]])
        torch.testing.assert_close(got, want, atol=tol, rtol=0)


def test_score_txt_tp1(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A .txt file is one document; the text report has a line per document and an overall line."""
    (tmp_path / "doc.txt").write_text("Hello world, hello tensor parallel world.\n")
    assert main(["score", "--model", str(root / "tp1"), "--file", str(tmp_path / "doc.txt")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("document 1: ") and lines[1].startswith("overall: ") and len(lines) == 2


@pytest.mark.parametrize("argv, needles", [
    (["generate", "--model", "{root}/nope", "--prompt", "hi"], ["nope", "not a directory"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "x" * 200], ["prompt 1", "200 tokens", "96"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--max-new-tokens", "95"], ["--max-new-tokens 95"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--top-p", "2"], ["--top-p", "got 2.0"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--temperature", "hot"], ["--temperature", "hot"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--stop-token-id", "999"], ["--stop-token-id"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--dtype", "int8"], ["--dtype", "int8"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--kv-cache-dtype", "int4"], ["--kv-cache-dtype", "int4"]),
    (["generate", "--model", "{root}/tp2"], ["no prompt"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--kv-scales", "{root}/none.st"],
     ["--kv-scales", "none.st", "no such file", "tprt calibrate-kv"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--kv-scales", "{root}/kv_bad.st"],
     ["--kv-scales", "kv_bad.st", "[1, 2, 1]", "this model needs"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--kv-scales", "{root}/bad.jsonl"],
     ["--kv-scales", "bad.jsonl", "not a safetensors file"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--kv-scales", "{root}/kv_bad.st", "--kv-cache-dtype",
      "fp8"], ["--kv-scales", "--kv-cache-dtype int8", "not fp8"]),
    (["score", "--model", "{root}/tp2", "--file", "{root}/not.schema.json", "--kv-cache-dtype", "int3"],
     ["--kv-cache-dtype", "int3"]),
    (["calibrate-kv", "--model", "{root}/tp2", "--file", "{root}/bad.jsonl", "--out", "{root}/x.st"], ["bad.jsonl:2"]),
    (["calibrate-kv", "--model", "{root}/tp2", "--file", "{root}/not.schema.json", "--out", "{root}/x.st",
      "--margin", "0.5"], ["--margin", "at least 1", "0.5"]),
    (["calibrate-kv", "--model", "{root}/tp2", "--file", "{root}/not.schema.json", "--out", "{root}/no/x.st"],
     ["--out", "does not exist"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--threads", "0"], ["--threads"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--pp", "0"], ["--pp", "between 1 and", "got 0"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--sequence-parallel", "-1"], ["--sequence-parallel", "-1"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--pp", "99"], ["--pp", "layers", "got 99"]),
    (["score", "--model", "{root}/tp2", "--file", "{root}/bad.jsonl"], ["bad.jsonl:2", '"text"']),
    (["score", "--model", "{root}/tp2", "--file", "{root}/missing.txt"], ["missing.txt"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--regex", "(x"], ["--regex", "unclosed"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--regex", "a", "--choice", "b"],
     ["--regex and --choice", "at most one"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--json-schema", "{root}/bad.jsonl"],
     ["--json-schema", "bad.jsonl", "not JSON"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--json-schema", "{root}/not.schema.json"],
     ["--json-schema", "Unimplemented", "not"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--grammar", "{root}/missing.lark"],
     ["--grammar", "missing.lark"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--draft-model", "{root}/tp1"],
     ["--draft-model", "--speculative draft"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--speculative", "ngram", "--num-speculative-tokens",
      "0"], ["--num-speculative-tokens", "got 0"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--speculative", "draft", "--draft-model",
      "{root}/tp2"], ["--draft-model", "tp_size=2"]),
    (["generate", "--model", "{root}/tp2", "--prompt", "hi", "--speculative", "draft", "--draft-model",
      "{root}/othervocab"], ["--draft-model", "vocab_size 300", "tokenizer"]),
])
def test_bad_input(root: Path, argv: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before any rank starts: one line naming the flag, file or prompt; exit status 2."""
    (root / "bad.jsonl").write_text('{"text": "fine"}\n{"txt": "oops"}\n')
    (root / "not.schema.json").write_text('{"not": {"type": "string"}}')
    from safetensors.torch import save_file

    save_file({"kv_scales": torch.ones(1, 2, 1)}, root / "kv_bad.st")  # not this model's shape
    other = root / "othervocab"  # a TP-1 checkpoint whose vocabulary is not the model's
    if not other.exists():
        shutil.copytree(root / "tp1", other)
        for name in ("config.json", "tprt_manifest.json"):
            meta = json.loads((other / name).read_text())
            meta["vocab_size"] = 300
            (other / name).write_text(json.dumps(meta))
    try:
        rc = main([a.format(root=root) for a in argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code  # type: ignore[assignment]
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("tprt"), err
    for n in needles:
        assert n in err[0], err[0]


def test_subprocess_errors_exit_fast(root: Path, tmp_path: Path) -> None:
    """As a command: a wrong directory, a torchrun world of the wrong size, and a rank that fails
    after the launch (its file deleted) each give one line and a non-zero exit, without hanging."""
    _one_line_error(_tprt("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"), "nope")
    env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    _one_line_error(_tprt("generate", "--model", str(root / "tp2"), "--prompt", "hi", env=env),
                    "tp_size=2", "WORLD_SIZE=3")
    broken = tmp_path / "broken"
    shutil.copytree(root / "tp2", broken)
    (broken / "rank-00001-of-00002.safetensors").unlink()
    _one_line_error(_tprt("generate", "--model", str(broken), "--prompt", "hi"), "rank 1", "missing")


def test_help_has_examples() -> None:
    proc = _tprt("generate", "--help")
    assert proc.returncode == 0 and "examples:" in proc.stdout and "--top-logprobs" in proc.stdout


def test_generate_on_two_torchrun_nodes(root: Path, hf: Any) -> None:
    """Two torchrun agents on loopback as two nodes of one process each (RANK 0 and 1, both
    LOCAL_RANK 0): the TP=2 ranks join torchrun's world and node 0 prints transformers' tokens."""
    from tprt.distributed.launcher import free_port

    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
         str(node), "--master-addr", "127.0.0.1", "--master-port", port, "-m", "tprt.cli", "generate", "--model",
         str(root / "tp2"), "--prompt", PROMPTS[1], "--max-new-tokens", str(N_NEW), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for node in (0, 1)]
    try:
        outs = [p.communicate(timeout=TIMEOUT) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [0, 0], [err[-2000:] for _, err in outs]
    ids = Tokenizer.from_dir(root / "tp2").encode(PROMPTS[1])
    assert json.loads(outs[0][0])["token_ids"] == _hf_greedy(hf, ids)
    assert outs[1][0] == ""  # only rank 0 prints
