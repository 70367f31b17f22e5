"""Rank 0's live requests: each request id's sequence, made from a checked request (seeded,
constrained, keyed for prefix sharing by its adapter's weights version), and the cancellations
the next step reports."""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq

import torch

from tprt.engine.request import check_request
from tprt.engine.sampling import SamplingParams
from tprt.engine.scheduler import Status
from tprt.engine.sequence import Sequence, TokenEvent
from tprt.engine.structured import StructuredOutputManager
from tprt.errors import ValidationError
from tprt.text.tokenizer import Tokenizer


class RequestRegistry:
    """Request ids to live sequences (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...], vocab_size: int,
                 max_seq_len: int, device: torch.device, seed: int | None, structured: StructuredOutputManager) -> None:
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.vocab_size, self.max_seq_len, self.device = vocab_size, max_seq_len, device
        self.structured = structured
        self._seeds = random.Random(seed)  # every sampled request without a seed draws one from here
        self._live: dict[str, Sequence] = {}
        self._versions: dict[int, int] = {}  # each adapter index's weights version
        self.pending: list[TokenEvent] = []  # cancellations, reported by the next step

    def __len__(self) -> int:
        return len(self._live)

    def count(self, priority: int) -> int:
        """Live requests of one priority."""
        return sum(1 for seq in self._live.values() if seq.priority == priority)

    def get(self, request_id: str) -> Sequence | None:
        return self._live.get(request_id)

    def new(self, prompt_ids: Seq[int], params: SamplingParams, request_id: str, adapter: int,
            priority: int = 0) -> Sequence:
        """A checked request's sequence, registered. Raises ValidationError naming the field, through
        the front ends' own checks (tprt.engine.request)."""
        if request_id in self._live:
            raise ValidationError("request_id", f"request_id {request_id!r} is already in use")
        prompt = [int(t) for t in prompt_ids]
        check_request(params, len(prompt), self.max_seq_len, self.vocab_size, what="max_seq_len",
                      has_tokenizer=self.tokenizer is not None)
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValidationError("prompt", f"prompt token ids must be in [0, {self.vocab_size - 1}]")
        seed = None if params.greedy else (params.seed if params.seed is not None else self._seeds.getrandbits(63))
        seq = Sequence(request_id, prompt, params, seed, self.tokenizer, self.eos_token_ids, self.device, adapter,
                       priority)
        seq.cache_key = (adapter, self._versions.get(adapter, 0))
        if params.constraint is not None:
            matcher = self.structured.matcher(params.constraint)
            if params.thinking is not None:  # the constraint is the answer's: parked while the model thinks
                seq.parked = matcher
            else:
                seq.matcher = matcher
        self._live[request_id] = seq
        return seq

    def propose(self, request_id: str, draft: Seq[int]) -> int:
        """A draft for a running request's next row (tprt.engine.core.Engine.propose): trimmed to
        what it may still generate and what its grammar accepts; dropped unless it is decoding
        (and not in a step in flight). Returns the tokens taken."""
        seq = self._live.get(request_id)
        if seq is None:
            raise ValidationError("request_id", f"request_id {request_id!r} is not a running request")
        ids = [int(t) for t in draft]
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValidationError("draft", f"draft token ids must be in [0, {self.vocab_size - 1}]")
        room = seq.params.max_new_tokens - len(seq.output) - 1
        running = seq.status is Status.RUNNING
        if seq.in_flight:  # its row in a step not yet collected verifies the draft it was launched with
            return 0
        seq.draft = self.structured.grammar_prefix(seq, ids[: max(0, room)]) if running else []
        return len(seq.draft)

    def remove(self, seq: Sequence) -> None:
        self._live.pop(seq.request_id, None)

    def new_version(self, adapter: int) -> None:
        """Adapter index `adapter` has new weights: its later requests share no prefix with earlier ones."""
        self._versions[adapter] = self._versions.get(adapter, 0) + 1
