"""The rank protocol without a process group: headers and commands survive their wire encodings,
nothing is sent on one rank, and the serving executor dispatches each command to its handler
with a typed result. (Over a real TP group: tests/test_engine.py's `rank_protocol` check.)"""

from __future__ import annotations

import pickle
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from serve.ranks.executor import RankExecutor
from tprt.distributed.context import TPContext
from tprt.distributed.protocol import Command, Header, Tag, send_command, send_signal, send_step
from serve.ranks.commands import (AdapterLoaded, LoadAdapter, MoveAdapter, PromptLogprobs, RankCommand, TrainAbort,
                                  TrainFinish, TrainSave, TrainStart, TrainStarted, TrainStep, TrainStepResult)
from tprt.distributed.ranks import CommandFailed, RankGroup
from tprt.model.batch import BatchRow, TokenBatch
from tprt.train.data import Dataset, PackedRows
from tprt.train.trainer import FinetuneConfig


def _train_start() -> TrainStart:
    rows = torch.arange(12).reshape(3, 4)
    dataset = Dataset(PackedRows(rows, rows.clone(), rows % 4), None, "digest")
    return TrainStart(FinetuneConfig(model=Path("m"), data=Path("d.jsonl"), out=Path("o")), dataset, resume=True)


def _every_command() -> list[Command[Any]]:
    return [_train_start(), TrainStep(), TrainSave(), TrainFinish(1.25), TrainAbort(), LoadAdapter("tuned", "/a", 3),
            MoveAdapter(3, "host"), PromptLogprobs((1, 5, 9), 2)]


@pytest.mark.parametrize("tag", list(Tag))
def test_header_roundtrip(tag: Tag) -> None:
    header = Header(tag, 17 if tag is Tag.STEP else 0)
    assert Header.decode(header.encode()) == header


@pytest.mark.parametrize("data", [[], [0, 1, 0], [*Header(Tag.STEP).encode()[:1], 99, 0], Header(Tag.EXIT).encode()[:2]])
def test_header_malformed(data: list[int]) -> None:
    """A follower reading something that is not a header (ranks out of step) says so."""
    with pytest.raises(RuntimeError, match="malformed message header"):
        Header.decode(data)


def test_commands_roundtrip() -> None:
    """Every command of the union pickles (broadcast_object_list) back to an equal command."""
    commands = _every_command()
    assert {type(c) for c in commands} == set(typing.get_args(RankCommand))
    for cmd in commands:
        back = pickle.loads(pickle.dumps(cmd))
        assert isinstance(back, RankCommand) and type(back) is type(cmd)
        if isinstance(cmd, TrainStart):
            assert back.config == cmd.config and back.resume and back.dataset.digest == "digest"
            assert torch.equal(back.dataset.train.input_ids, cmd.dataset.train.input_ids)
        else:
            assert back == cmd


def test_one_rank_sends_nothing() -> None:
    """With one rank there is no process group: sending anything is a no-op."""
    ctx = TPContext.single()
    send_step(TokenBatch.of([BatchRow((1,), 0, (5,), 1)]), ctx)
    send_command(TrainStep(), ctx)
    send_signal(Tag.KEEPALIVE, ctx)
    send_signal(Tag.EXIT, ctx)
    with pytest.raises(ValueError):
        send_signal(Tag.STEP, ctx)  # a step carries a batch


class _Unknown(Command[None]):
    pass


def test_executor_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """RankExecutor runs each command's handler with the command's fields and returns its typed
    result; a failure (or an unknown command) is CommandFailed, after the executor abandoned it."""
    ctx = TPContext.single()
    executor = RankExecutor(SimpleNamespace(tp=ctx), None, Path("m"), Path("d"))  # type: ignore[arg-type]
    calls: list[tuple[str, tuple[Any, ...]]] = []

    def handler(name: str, result: Any) -> Any:
        def run(*args: Any) -> Any:
            calls.append((name, args))
            return result
        return run

    step = TrainStepResult(step=3, loss=1.5, grad_norm=0.25, seconds=0.1, tokens=64)
    monkeypatch.setattr(executor, "_cmd_train_start", handler("start", TrainStarted(2, 10)))
    monkeypatch.setattr(executor, "_cmd_train_step", handler("step", step))
    monkeypatch.setattr(executor, "_cmd_train_save", handler("save", "ckpt/step-3"))
    monkeypatch.setattr(executor, "_cmd_train_finish", handler("finish", "out/adapter"))
    monkeypatch.setattr(executor, "_cmd_load_adapter", handler("load", AdapterLoaded(8, 16.0, 1)))
    monkeypatch.setattr(executor, "_cmd_move_adapter", handler("move", None))
    ranks = RankGroup(ctx, executor)
    start = _train_start()
    assert ranks.run(start) == TrainStarted(2, 10)
    assert ranks.run(TrainStep()) == step
    assert ranks.run(TrainSave()) == "ckpt/step-3"
    assert ranks.run(TrainFinish(1.25)) == "out/adapter"
    assert ranks.run(LoadAdapter("tuned", "/a", 1)) == AdapterLoaded(rank=8, alpha=16.0, index=1)
    assert ranks.run(MoveAdapter(1, "host")) is None
    assert calls == [("start", (start.config, start.dataset, True)), ("step", ()), ("save", ()),
                     ("finish", (1.25,)), ("load", ("tuned", "/a", 1)), ("move", (1, "host"))]

    executor.trainer = object()
    assert ranks.run(TrainAbort()) is None and executor.trainer is None  # the real handler
    executor.trainer = object()
    with pytest.raises(CommandFailed, match="^unknown command _Unknown$"):
        ranks.run(_Unknown())
    assert executor.trainer is None  # abandoned


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 9])
def test_a_batch_splits_into_micro_batches_of_its_rows(parts: int) -> None:
    """Pipeline stages pass a step along in micro-batches (tprt.engine.stage_runner): consecutive
    rows, every row in exactly one, about as many tokens each, at most one per row, and their
    tokens, logits and adapters in the batch's order."""
    rows = [BatchRow((1, 2), 0, tuple(range(9)), 1, 1), BatchRow((3,), 5, (7,), 1),
            BatchRow((4,), 2, (8, 9), 2, 2), BatchRow((5, 6), 0, tuple(range(12)), 0)]
    batch = TokenBatch.of(rows, full_logits=True)
    split = batch.split(parts)
    assert len(split) == min(parts, batch.num_rows) and all(p.num_rows for p in split)
    assert sum((p.tokens for p in split), ()) == batch.tokens
    assert sum((p.starts for p in split), ()) == batch.starts and sum((p.tables for p in split), ()) == batch.tables
    assert sum((p.adapters or (0,) * p.num_rows for p in split), ()) == batch.adapters
    assert sum(p.num_logits for p in split) == batch.num_logits and all(p.full_logits for p in split)
    if parts == 2:  # 12 of 24 tokens before the cut: the first two rows and the third
        assert [p.lens for p in split] == [(9, 1, 2), (12,)]
