"""Fine-tuning data: JSONL records -> token ids with a loss mask -> packed rows -> batches.

Three record formats, one JSON object per line:

- {"text": ...}                      loss on every token (after the first) and the closing EOS;
- {"prompt": ..., "completion": ...}  loss on the completion's tokens and the closing EOS only;
- {"messages": [{"role", "content"}, ...]}  rendered with the model's chat template; loss on the
  assistant turns only. A turn's span is found by rendering prefixes of the conversation: the
  text of `messages[:i]` with the generation prompt ends where assistant turn i starts, and the
  text of `messages[:i+1]` ends where it ends (trailing whitespace is left out). Where a
  template does not render prefixes as prefixes, the turn's content is searched for instead.
  Character spans become token spans by tokenizing the text up to each boundary (the longest
  common prefix with the whole text's ids), so the mask is exact whenever the tokenizer does not
  merge across a boundary and otherwise includes the one straddling token at a turn's start.

Documents are packed into rows of exactly `seq_len` tokens, whole documents only (first fit in
shuffled order), each document followed by EOS; the rest of a row is padding with no loss.
With `per_example=True` (the server's jobs, where `batch_size` counts examples as OpenAI's API
means it) each document is a row of its own, padded to the longest document.

Attention inside a packed row: the model's training forward is plain causal attention with no
document mask, so a document can attend to the ones before it in its row. Positions therefore
run on through the row (resetting them without a mask would show a query keys at "future"
relative positions); EOS separates the documents. `PackedRows.doc_positions` holds the
per-document positions for a forward that learns to keep attention within a document.

Bad input raises ValidationError (the field is the flag) naming the file and line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from tprt.errors import ConfigError, ValidationError
from tprt.text.chat import CHAT_ROLES
from tprt.text.tokenizer import Tokenizer

log = logging.getLogger("tprt")

IGNORE_INDEX = -100
T = TypeVar("T")


@dataclass
class Document:
    """One tokenised example: ids and, per token, whether it is a loss target."""

    ids: list[int]
    mask: list[bool]  # mask[i]: token i is predicted (from tokens < i) and counts in the loss
    where: str = ""  # "file:line", for messages

    @property
    def n_targets(self) -> int:
        return sum(self.mask)


def eos_id(tok: Tokenizer) -> int:
    """The id that ends a document: the tokenizer's first EOS."""
    if not tok.eos_token_ids:
        raise ConfigError(f"{tok.source}: the tokenizer has no eos_token; packing needs one to separate documents")
    return tok.eos_token_ids[0]


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; a bad line names file and line."""
    try:
        f = path.open("rb")  # decoded line by line: a bad byte is named by its line, not raised by the reader
    except OSError as e:
        raise ValidationError("--data", f"{path}: cannot read ({e.strerror or e})") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValidationError("--data", f"{path}:{lineno}: not UTF-8 text (byte {e.start + 1} of the line; "
                                      "UTF-16 and binary files are not JSONL)") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValidationError("--data", f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:
                raise ValidationError("--data", f"{path}:{lineno}: JSON nested too deeply") from None
            if not isinstance(rec, dict):
                raise ValidationError("--data", f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            try:  # a \ud800 escape decodes to a lone surrogate, which no tokenizer can take
                json.dumps(rec, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise ValidationError("--data", f"{path}:{lineno}: a string holds a lone surrogate (not Unicode text)") from None
            yield lineno, rec


def _string_field(rec: Mapping[str, Any], key: str, where: str) -> str:
    value = rec[key]
    if not isinstance(value, str):
        raise ValidationError("--data", f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def tokenize_record(rec: Mapping[str, Any], tok: Tokenizer, where: str) -> Document:
    """One JSONL record -> a Document ending in EOS (see the module docstring for the masks)."""
    eos = eos_id(tok)
    if "messages" in rec:
        return chat_document(rec["messages"], tok, where)
    if "prompt" in rec and "completion" in rec:
        prompt = tok.encode(_string_field(rec, "prompt", where), add_special_tokens=True)
        completion = tok.encode(_string_field(rec, "completion", where), add_special_tokens=False) + [eos]
        return Document(prompt + completion, [False] * len(prompt) + [True] * len(completion), where)
    if "text" in rec:
        ids = tok.encode(_string_field(rec, "text", where), add_special_tokens=True)
        if not ids or ids[-1] != eos:
            ids.append(eos)
        return Document(ids, [False] + [True] * (len(ids) - 1), where)
    keys = ", ".join(repr(k) for k in list(rec)[:5]) or "none"
    raise ValidationError(
        "--data", f"{where}: expected a 'text', 'prompt' and 'completion', or 'messages' field; found keys {keys}"
    )


def check_role(role: str, where: str) -> None:
    """A training message's role is one generation takes (a role the template does not know would
    otherwise be trained on in whatever shape the template gives it)."""
    if role not in CHAT_ROLES:
        raise ValidationError("--data", f"{where} has role {role[:20]!r}; expected one of {', '.join(CHAT_ROLES)}")


def _check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ValidationError("--data", f"{where}: field 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValidationError(
                "--data", f"{where}: messages[{i}] must be an object with string 'role' and 'content'"
            )
        check_role(m["role"], f"{where}: messages[{i}]")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValidationError("--data", f"{where}: 'messages' has no assistant turn to train on")
    return [dict(m) for m in messages]


def assistant_spans(messages: Sequence[Mapping[str, Any]], tok: Tokenizer, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span [start, end) of each assistant turn."""
    full = tok.apply_chat_template(messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], add_generation_prompt=True) if i else ""
        upto = tok.apply_chat_template(messages[: i + 1], add_generation_prompt=False)
        if full.startswith(before) and full.startswith(upto) and cursor <= len(before) < len(upto):
            start, end = len(before), len(upto)
        else:  # the template renders a prefix differently from the whole: look for the content
            start = full.find(m["content"], cursor)
            if start < 0 or not m["content"]:
                raise ValidationError(
                    "--data", f"{where}: cannot locate assistant messages[{i}] in the rendered chat template"
                )
            end = start + len(m["content"])
        end = start + len(full[start:end].rstrip())
        if end > start:
            spans.append((start, end))
        cursor = max(cursor, end)
    return full, spans


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def chat_document(messages: Any, tok: Tokenizer, where: str) -> Document:
    """A conversation rendered with the chat template; loss on the assistant spans (and EOS)."""
    msgs = _check_messages(messages, where)
    full, spans = assistant_spans(msgs, tok, where)
    ids = tok.encode(full, add_special_tokens=False)
    mask = [False] * len(ids)
    for start, end in spans:
        a = _common_prefix(tok.encode(full[:start], add_special_tokens=False), ids)
        b = _common_prefix(tok.encode(full[:end], add_special_tokens=False), ids)
        for k in range(max(a, 1), b):
            mask[k] = True
    eos = eos_id(tok)
    if not ids or ids[-1] != eos:
        ids.append(eos)  # a separator only: the template decides what the model learns to emit
        mask.append(False)
    return Document(ids, mask, where)


@dataclass
class LoadReport:
    """What loading a file did, for the log."""

    n_documents: int = 0
    n_truncated: int = 0
    first_truncated: str = ""
    n_tokens: int = 0


def load_documents(path: Path, tok: Tokenizer, seq_len: int, truncate: bool = True) -> tuple[list[Document], LoadReport]:
    """Every record of `path`, tokenised; longer than `seq_len` -> truncated or refused."""
    docs: list[Document] = []
    report = LoadReport()
    for lineno, rec in read_jsonl(path):
        where = f"{path}:{lineno}"
        doc = tokenize_record(rec, tok, where)
        if len(doc.ids) > seq_len:
            if not truncate:
                raise ValidationError(
                    "--no-truncate", f"{where}: example has {len(doc.ids)} tokens, more than --seq-len {seq_len} "
                    "(refused because of --no-truncate; drop it to truncate such examples)"
                )
            report.n_truncated += 1
            report.first_truncated = report.first_truncated or f"{where} ({len(doc.ids)} tokens)"
            doc = Document(doc.ids[:seq_len], doc.mask[:seq_len], where)
        docs.append(doc)
        report.n_tokens += len(doc.ids)
    report.n_documents = len(docs)
    if not docs:
        raise ValidationError("--data", f"{path}: no examples (the file is empty or has only blank lines)")
    if report.n_truncated:
        log.warning(
            "%s: %d example(s) longer than --seq-len %d were truncated (first: %s); pass --no-truncate to refuse them",
            path, report.n_truncated, seq_len, report.first_truncated,
        )
    return docs, report


@dataclass
class PackedRows:
    """Rows of exactly seq_len tokens: input ids, labels (IGNORE_INDEX where no loss), positions."""

    input_ids: torch.Tensor  # [rows, seq_len] int64
    labels: torch.Tensor  # [rows, seq_len] int64; labels[r, t] == input_ids[r, t] where a target, else -100
    doc_positions: torch.Tensor  # [rows, seq_len] int64; 0.. within each document (padding continues)
    lengths: torch.Tensor | None = None  # [rows] int64: tokens before the padding (None: every row full)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def n_targets(self, rows: torch.Tensor | Sequence[int] | None = None) -> int:
        """Loss tokens in `rows` (all rows when None)."""
        labels = self.labels if rows is None else self.labels[torch.as_tensor(rows, dtype=torch.long)]
        return int((labels != IGNORE_INDEX).sum())

    def n_tokens(self, rows: Sequence[int]) -> int:
        """Tokens in `rows`, padding left out: what a step over them trains on."""
        if self.lengths is None:
            return len(rows) * self.seq_len
        return int(self.lengths[torch.as_tensor(list(rows), dtype=torch.long)].sum())


def pack(docs: Sequence[Document], seq_len: int, pad_id: int, per_example: bool = False) -> PackedRows:
    """Whole documents into rows of `seq_len`, in the given order: a row is closed when the next
    document does not fit. Padding has label IGNORE_INDEX. `per_example`: one document per row,
    the rows as long as the longest document (at most `seq_len`)."""
    rows: list[list[Document]] = []
    used = seq_len
    for doc in docs:
        if len(doc.ids) > seq_len:
            raise ValueError(f"{doc.where}: document of {len(doc.ids)} tokens does not fit --seq-len {seq_len}")
        if per_example or used + len(doc.ids) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(doc)
        used += len(doc.ids)
    if per_example and docs:
        seq_len = max(len(doc.ids) for doc in docs)
    ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((len(rows), seq_len), dtype=torch.long)
    lengths = torch.tensor([sum(len(doc.ids) for doc in row) for row in rows], dtype=torch.long)
    for r, row in enumerate(rows):
        t = 0
        for doc in row:
            n = len(doc.ids)
            ids[r, t : t + n] = torch.tensor(doc.ids)
            target = torch.tensor(doc.mask, dtype=torch.bool)
            labels[r, t : t + n] = torch.where(target, ids[r, t : t + n], IGNORE_INDEX)
            positions[r, t : t + n] = torch.arange(n)
            t += n
        positions[r, t:] = torch.arange(seq_len - t) + (positions[r, t - 1] + 1 if t else 0)
    return PackedRows(ids, labels, positions, lengths)


def shuffled(items: Sequence[Any], seed: int) -> list[Any]:
    """A copy of `items` in an order that depends only on `seed`."""
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [items[i] for i in order]


def split_eval(docs: Sequence[T], fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """(train, eval): a seeded `fraction` of the documents (or pairs) held out (at least one when > 0)."""
    if not 0.0 <= fraction < 1.0:
        raise ValidationError("--eval-fraction", f"--eval-fraction must be in [0, 1), got {fraction}")
    order = shuffled(docs, seed)
    n_eval = 0 if fraction == 0 else max(1, round(fraction * len(docs)))
    if n_eval >= len(docs):
        raise ValidationError(
            "--eval-fraction", f"--eval-fraction {fraction} leaves no training example out of {len(docs)}"
        )
    return order[n_eval:], order[:n_eval]


def file_digest(path: Path) -> str:
    """sha256 of a data file (recorded in checkpoints: a resume must read the same data)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Dataset:
    """Packed training and evaluation rows. `pairs`: preference pairs, rows 2i and 2i + 1 the
    preferred and non-preferred completions of pair i (tprt.train.preference)."""

    train: PackedRows
    eval: PackedRows | None
    digest: str  # of the training file (and the eval file, when given)
    report: dict[str, Any] = field(default_factory=dict)
    pairs: bool = False
    # DPO's reference log-probabilities per row, by split ("train", "eval"), once computed
    # (tprt.train.dpo): kept with the rows, so no epoch scores them again
    reference: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def n_examples(self) -> int:
        """Training examples: rows, or pairs of rows."""
        return len(self.train) // 2 if self.pairs else len(self.train)


def prepare_data(
    data: Path, tok: Tokenizer, seq_len: int, seed: int, eval_fraction: float = 0.0,
    eval_data: Path | None = None, truncate: bool = True, per_example: bool = False,
) -> Dataset:
    """Reads, tokenises, splits and packs (`per_example`: one example per row, see `pack`);
    deterministic for a given seed."""
    if seq_len < 2:
        raise ValidationError("--seq-len", f"--seq-len must be at least 2, got {seq_len}")
    docs, rep = load_documents(data, tok, seq_len, truncate)
    digest = file_digest(data)
    if eval_data is not None:
        if eval_fraction:
            raise ValidationError("--eval-data", "give --eval-data or --eval-fraction, not both")
        eval_docs, _ = load_documents(eval_data, tok, seq_len, truncate)
        train_docs = shuffled(docs, seed)
        digest = hashlib.sha256((digest + file_digest(eval_data)).encode()).hexdigest()
    else:
        train_docs, eval_docs = split_eval(docs, eval_fraction, seed)
    if not any(d.n_targets for d in train_docs):
        raise ValidationError("--data", f"{data}: no example has a token to train on (all masked or truncated away)")
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos_id(tok)
    train = pack(train_docs, seq_len, pad, per_example)
    evalset = pack(eval_docs, seq_len, pad, per_example) if eval_docs else None
    report = {"documents": rep.n_documents, "truncated": rep.n_truncated, "tokens": rep.n_tokens,
              "train_documents": len(train_docs),
              "train_rows": len(train), "eval_rows": len(evalset) if evalset else 0}
    return Dataset(train, evalset, digest, report)


class BatchStream:
    """The global order of training rows: epoch e visits every row once in an order seeded by
    (seed, e); a step takes the next `rows_per_step` rows, running on into the next epoch. Its
    state (epoch, cursor) is the data position saved in checkpoints."""

    def __init__(self, n_rows: int, seed: int, rows_per_step: int) -> None:
        if n_rows < 1:
            raise ValidationError("--data", "no training rows")
        self.n_rows = n_rows
        self.seed = seed
        self.rows_per_step = rows_per_step
        self.epoch = 0
        self.cursor = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        return shuffled(range(self.n_rows), self.seed * 1_000_003 + epoch)

    def next_step(self) -> list[int]:
        """The global row indices of the next optimizer step."""
        out: list[int] = []
        while len(out) < self.rows_per_step:
            if self.cursor == self.n_rows:
                self.epoch += 1
                self.cursor = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.rows_per_step - len(out), self.n_rows - self.cursor)
            out.extend(self._order[self.cursor : self.cursor + take])
            self.cursor += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "n_rows": self.n_rows, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state["n_rows"] != self.n_rows or state["seed"] != self.seed:
            raise ConfigError(
                f"--resume: the checkpoint's data has {state['n_rows']} rows (seed {state['seed']}), "
                f"this run's {self.n_rows} (seed {self.seed})"
            )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._epoch_order(self.epoch)


def rank_share(rows: Sequence[int], dp_rank: int, dp_size: int, micro_batch: int) -> list[list[int]]:
    """This DP rank's micro-batches of one step's global rows: a contiguous 1/dp_size of them,
    cut into micro-batches of `micro_batch` rows."""
    per_rank = len(rows) // dp_size
    mine = list(rows[dp_rank * per_rank : (dp_rank + 1) * per_rank])
    return [mine[i : i + micro_batch] for i in range(0, len(mine), micro_batch)]
