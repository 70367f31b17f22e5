"""Preference data for DPO: JSONL pairs -> two rows per pair, checked line by line.

A line, in the format OpenAI, Together and Fireworks share:

    {"input": {"messages": [{"role": "user", "content": "..."}, ...]},
     "preferred_output": [{"role": "assistant", "content": "..."}],
     "non_preferred_output": [{"role": "assistant", "content": "..."}]}

Each output is rendered after the prompt with the model's chat template, as an SFT chat would
be (`tprt.train.data.chat_document`); only the output's assistant tokens are scored (the prompt's
own assistant turns, if any, are context). The two outputs share the prompt by construction, so a
pair whose prompt differs can be spelled only by an output that holds a non-assistant turn (a
user message of its own), or by a template that renders the shared prompt into different tokens
before the two outputs: both are refused.

Refused by file and line, before anything trains: a missing or malformed input.messages,
preferred_output or non_preferred_output; identical outputs (also once cut to the sequence
length); a prompt that leaves no room for a completion token within the sequence length. An
output running past the sequence length is cut there (with `truncate`), as SFT examples are.

Rows: pair i is rows 2i (preferred) and 2i + 1 (non-preferred) of one `PackedRows`, one
completion per row padded to the longest, so a micro-batch of pairs always holds both halves.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tprt.errors import ValidationError
from tprt.text.tokenizer import Tokenizer
from tprt.train.data import (Dataset, Document, _check_messages, _common_prefix, chat_document, check_role, eos_id,
                             file_digest, pack, read_jsonl, shuffled, split_eval)

log = logging.getLogger("tprt")

Pair = tuple[Document, Document]
OUTPUTS = ("preferred_output", "non_preferred_output")


def _prompt_messages(rec: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    inp = rec.get("input")
    if not isinstance(inp, dict) or "messages" not in inp:
        raise ValidationError("--data", f"{where}: expected 'input' with 'messages' (the prompt), found keys "
                                        f"{', '.join(repr(k) for k in list(rec)[:5]) or 'none'}")
    msgs = inp["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise ValidationError("--data", f"{where}: 'input.messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValidationError("--data", f"{where}: input.messages[{i}] must be an object with string 'role' "
                                            "and 'content'")
        check_role(m["role"], f"{where}: input.messages[{i}]")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def _output(rec: Mapping[str, Any], key: str, where: str) -> list[dict[str, Any]]:
    if key not in rec:
        raise ValidationError("--data", f"{where}: missing {key!r} (a list of assistant messages)")
    out = rec[key]
    if not isinstance(out, list) or not out:
        raise ValidationError("--data", f"{where}: {key!r} must be a non-empty list of assistant messages")
    for i, m in enumerate(out):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValidationError("--data", f"{where}: {key}[{i}] must be an object with a string 'content'")
        if m.get("role") != "assistant":
            raise ValidationError("--data", f"{where}: {key}[{i}] has role {str(m.get('role'))[:20]!r}; outputs hold "
                                            "assistant messages only (the prompt, input.messages, is shared by both)")
    return [{"role": "assistant", "content": m["content"]} for m in out]


def _completion(prompt: list[dict[str, Any]], output: list[dict[str, Any]], n_prompt_ids: list[int],
                tok: Tokenizer, where: str) -> tuple[Document, int]:
    """The prompt and one output as a Document scored on the output only; and the prompt's length
    in its tokens."""
    doc = chat_document(_check_messages(prompt + output, where), tok, where)
    n_prompt = _common_prefix(n_prompt_ids, doc.ids)
    mask = [m and k >= n_prompt for k, m in enumerate(doc.mask)]
    return Document(doc.ids, mask, where), n_prompt


def tokenize_pair(rec: Mapping[str, Any], tok: Tokenizer, seq_len: int, where: str, truncate: bool = True,
                  cut: list[str] | None = None) -> Pair:
    """One preference line -> (preferred, non-preferred) Documents of at most `seq_len` tokens
    (`where` appended to `cut` when an output was cut to fit)."""
    prompt = _prompt_messages(rec, where)
    chosen_msgs, rejected_msgs = (_output(rec, key, where) for key in OUTPUTS)
    if chosen_msgs == rejected_msgs:
        raise ValidationError("--data", f"{where}: preferred_output and non_preferred_output are identical; a pair "
                                        "needs two different answers")
    prompt_ids = tok.encode(tok.apply_chat_template(prompt, add_generation_prompt=True), add_special_tokens=False)
    chosen, n_c = _completion(prompt, chosen_msgs, prompt_ids, tok, where)
    rejected, n_r = _completion(prompt, rejected_msgs, prompt_ids, tok, where)
    if n_c != n_r or chosen.ids[:n_c] != rejected.ids[:n_r]:
        raise ValidationError("--data", f"{where}: the prompt tokenizes differently before the two outputs "
                                        f"({n_c} and {n_r} tokens); a pair must share its prompt")
    if n_c >= seq_len:
        raise ValidationError("--data", f"{where}: the prompt takes {n_c} tokens, leaving no room for the "
                                        f"completions within the sequence length of {seq_len}")
    pair = []
    for doc, key in ((chosen, OUTPUTS[0]), (rejected, OUTPUTS[1])):
        if len(doc.ids) > seq_len:
            if not truncate:
                raise ValidationError("--no-truncate", f"{where}: prompt and {key} take {len(doc.ids)} tokens, more "
                                                       f"than the sequence length of {seq_len}")
            doc = Document(doc.ids[:seq_len], doc.mask[:seq_len], where)
            if cut is not None and where not in cut:
                cut.append(where)
        if not doc.n_targets:
            raise ValidationError("--data", f"{where}: {key} has no token to score within the sequence length of "
                                            f"{seq_len}")
        pair.append(doc)
    if pair[0].ids == pair[1].ids:
        raise ValidationError("--data", f"{where}: preferred_output and non_preferred_output are identical within the "
                                        f"sequence length of {seq_len} tokens")
    return pair[0], pair[1]


def load_pairs(path: Path, tok: Tokenizer, seq_len: int, truncate: bool = True,
               cut: list[str] | None = None) -> list[Pair]:
    """Every line of `path` as a checked pair; the first bad line is refused by number."""
    eos_id(tok)
    pairs = [tokenize_pair(rec, tok, seq_len, f"{path}:{lineno}", truncate, cut) for lineno, rec in read_jsonl(path)]
    if not pairs:
        raise ValidationError("--data", f"{path}: no preference pairs (the file is empty or has only blank lines)")
    if cut:
        log.warning("%s: %d pair(s) cut to the sequence length of %d (first: %s); pass --no-truncate to refuse them",
                    path, len(cut), seq_len, cut[0])
    return pairs


def prepare_preferences(
    data: Path, tok: Tokenizer, seq_len: int, seed: int, eval_fraction: float = 0.0,
    eval_data: Path | None = None, truncate: bool = True,
) -> Dataset:
    """Reads, checks, splits and lays out preference pairs (two rows each, see the module
    docstring); deterministic for a given seed."""
    if seq_len < 2:
        raise ValidationError("--seq-len", f"--seq-len must be at least 2, got {seq_len}")
    cut: list[str] = []
    pairs = load_pairs(data, tok, seq_len, truncate, cut)
    digest = file_digest(data)
    if eval_data is not None:
        if eval_fraction:
            raise ValidationError("--eval-data", "give --eval-data or --eval-fraction, not both")
        held_out = load_pairs(eval_data, tok, seq_len, truncate)
        train = shuffled(pairs, seed)
        digest = hashlib.sha256((digest + file_digest(eval_data)).encode()).hexdigest()
    else:
        train, held_out = split_eval(pairs, eval_fraction, seed)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos_id(tok)
    rows = pack([d for pair in train for d in pair], seq_len, pad, per_example=True)
    eval_rows = pack([d for pair in held_out for d in pair], seq_len, pad, per_example=True) if held_out else None
    report = {"documents": len(pairs), "truncated": len(cut), "tokens": int(rows.n_tokens(range(len(rows)))),
              "pairs": len(train), "train_rows": len(rows), "eval_rows": len(eval_rows) if eval_rows else 0}
    return Dataset(rows, eval_rows, digest, report, pairs=True)


def is_preference_file(path: Path) -> bool:
    """Whether the first record of a JSONL file is a preference pair (has 'preferred_output',
    'non_preferred_output' or 'input'), as an upload is checked before a job names its method."""
    for _, rec in read_jsonl(path):
        return any(key in rec for key in (*OUTPUTS, "input"))
    return False
