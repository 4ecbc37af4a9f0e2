"""What several plugins share: the typed entries they keep in ``state.extras``, extras key
claims, when an update is due, "better than best".

Each plugin's memory is one ``state.extras`` entry, a plain dict of numbers, strings and
tensors (checkpoints save ``state.extras`` as it is), typed below. A plugin that measures
(validate, peak_memory) writes a ``MetricsEntry``; readers (log_metrics, progress,
early_stop, checkpoints) find one with :func:`metric_entry`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypedDict

import torch

from toolkit.loop._run import Event


class MetricsEntry(TypedDict):  # a measuring plugin's latest metrics, and their state.step
    step: int
    metrics: dict[str, float]


class ValidationEntry(MetricsEntry):  # best: the best monitored value, None until a number
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


def claim(event: Event, key: str, owner: str) -> None:
    """Record at ``"start"`` that ``owner`` keeps ``state.extras[key]`` in this run.

    The run's ``loop.claimed`` (fresh per :func:`toolkit.run`) maps each claimed key to its
    owner; a second claim of one key in the same run raises before any training. A key
    already *in* ``state.extras`` (restored, or left by an earlier run) is no clash.

    Example:
        >>> import torch
        >>> from toolkit import TrainState
        >>> from toolkit.loop._run import Event, LoopInfo
        >>> loop = LoopInfo(None, None, None, 1, 0, None)
        >>> event = Event("start", TrainState(model=torch.nn.Linear(1, 1)), loop)
        >>> claim(event, "ema", "ema")
        >>> claim(event, "ema", "validate")
        Traceback (most recent call last):
        ...
        ValueError: validate: state.extras['ema'] is already kept by ema in this run; ...
    """
    holder = event.loop.claimed.get(key)
    if holder is not None:
        raise ValueError(
            f"{owner}: state.extras[{key!r}] is already kept by {holder} in this run; two "
            f"plugins writing one key would overwrite each other's memory. Give each its own "
            f"key, e.g. {owner}(..., key={key + '_2'!r}) (and the same key to whatever reads "
            "it, such as early_stop or ema_model)."
        )
    event.loop.claimed[key] = owner


def due(event: Event, every: int) -> bool:
    """True for a ``"step"`` event whose update was applied, at a multiple of ``every``."""
    # The step first: most events are not at a multiple of every.
    return event.state.step % every == 0 and event.out is not None and event.out.updated


def metric_entry(entry: Any) -> tuple[Any, Mapping[str, Any]] | None:
    """``(step, metrics)`` of a ``MetricsEntry`` (or one that extends it), else None.

    Example:
        >>> metric_entry({"step": 4, "metrics": {"loss": 0.5}, "best": 0.5})
        (4, {'loss': 0.5})
        >>> metric_entry({"step": 4, "weights": {}}) is None  # e.g. ema's entry
        True
    """
    if isinstance(entry, Mapping) and "step" in entry and isinstance(entry.get("metrics"), Mapping):
        return entry["step"], entry["metrics"]
    return None


def better(value: float, best: float | None, mode: str, margin: float = 0.0) -> bool:
    """Whether ``value`` beats ``best`` by more than ``margin``; a NaN never does."""
    if best is None or math.isnan(best):
        return not math.isnan(value)
    return value < best - margin if mode == "min" else value > best + margin
