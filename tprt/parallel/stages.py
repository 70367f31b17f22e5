"""Pipeline stages: which of the decoder's layers each stage holds (torch-free: the planner's
arithmetic and the runtime's stage models share it). The first stage also holds the embedding,
the last the final norm and the LM head."""

from __future__ import annotations

from dataclasses import dataclass

from tprt.errors import ConfigError


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: `layers` of the decoder, the embedding on the first stage, the final
    norm and the LM head on the last (with tied embeddings the last stage holds the embedding
    matrix as its head)."""

    index: int
    count: int
    layers: range

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def stages(n_layers: int, pp: int) -> list[Stage]:
    """The decoder's layers split over `pp` stages as evenly as they go (the first stages take
    the remainder's extra layers)."""
    if pp < 1 or pp > n_layers:
        raise ConfigError(f"--pp must be between 1 and the model's {n_layers} layers, got {pp}")
    base, extra = divmod(n_layers, pp)
    out, start = [], 0
    for i in range(pp):
        n = base + (1 if i < extra else 0)
        out.append(Stage(i, pp, range(start, start + n)))
        start += n
    return out
