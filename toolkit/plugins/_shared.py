"""What several plugins share: the typed entries they keep in ``state.extras``, when an
update is due, "better than best".

Each plugin's own memory is one ``state.extras`` entry, a plain dict of numbers, strings and
tensors (checkpoints save ``state.extras`` as it is), typed below. What a plugin publishes
for the others goes to ``state.metrics`` instead (a :class:`toolkit.Metrics` per name).
"""

import math
from typing import TypedDict

import torch

from toolkit.loop._run import Event


class ValidationEntry(TypedDict):  # best: the best monitored value, None until a number
    epoch: int
    best: float | None
    best_step: int | None


class EarlyStopEntry(TypedDict):  # seen_step: the last evaluation judged; bad: in a row
    metric: str
    seen_step: int | None
    best: float | None
    best_step: int | None
    bad: int


class EmaEntry(TypedDict):  # the averages by the unwrapped model's names
    step: int
    num_updates: int
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def due(event: Event, every: int) -> bool:
    """True for a ``"step"`` event whose update was applied, at a multiple of ``every``."""
    # The step first: most events are not at a multiple of every.
    return event.state.step % every == 0 and event.out is not None and event.out.updated


def better(value: float, best: float | None, mode: str, margin: float = 0.0) -> bool:
    """Whether ``value`` beats ``best`` by more than ``margin``; a NaN never does."""
    if best is None or math.isnan(best):
        return not math.isnan(value)
    return value < best - margin if mode == "min" else value > best + margin
