"""What several plugins share: the typed entries they keep in ``state.extras``, extras key
claims, when an update is due, "better than best".

Each plugin's memory is one ``state.extras`` entry, a plain dict of numbers, strings and
tensors (checkpoints save ``state.extras`` as it is), typed below. A plugin that measures
(validate, peak_memory) writes a :class:`MetricsEntry`; readers (log_metrics, progress,
early_stop, checkpoints) find one with :func:`metric_entry`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypedDict

import torch

from toolkit.loop._run import Event

__all__ = [
    "EarlyStopEntry",
    "EmaEntry",
    "MetricsEntry",
    "ValidationEntry",
    "better",
    "check_mode",
    "claim",
    "due",
    "metric_entry",
]


class MetricsEntry(TypedDict):
    """What a measuring plugin keeps: its latest ``metrics`` and the ``step`` they are of."""

    step: int
    metrics: dict[str, float]


class ValidationEntry(TypedDict):
    """validate's entry: a :class:`MetricsEntry` with the best ``monitor`` value so far."""

    step: int
    metrics: dict[str, float]
    epoch: int
    best: float | None  # None until an evaluation gives a number
    best_step: int | None


class EarlyStopEntry(TypedDict):
    """early_stop's counters: the ``step`` of the last evaluation judged, the best so far,
    and the evaluations in a row without improvement."""

    metric: str
    seen_step: int | None
    best: float | None
    best_step: int | None
    bad: int


class EmaEntry(TypedDict):
    """ema's average: the tensors by the unwrapped model's names, and how often it moved."""

    step: int
    num_updates: int
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def claim(event: Event, key: str, owner: str) -> None:
    """Record at ``"start"`` that ``owner`` keeps ``state.extras[key]`` in this run.

    Every plugin that keeps memory in ``state.extras`` calls this on its ``"start"`` event,
    before it reads or writes its entry. The run's :attr:`LoopInfo.claimed` (fresh per
    :func:`toolkit.run`) maps each claimed key to its owner; a second claim of one key in
    the same run (two ``ema()``, ``validate(key="ema")`` next to ``ema()``, one plugin
    listed twice) raises before any training, naming both owners and the fix. A key that is
    already *in* ``state.extras`` at start (restored from a checkpoint, or left by an earlier
    ``run()`` on the same state) is not a clash: only two claims within one run are.

    Args:
        event: the ``"start"`` event (its ``loop.claimed`` is written).
        key: the ``state.extras`` key the plugin keeps.
        owner: how to name the plugin in the error, e.g. ``"ema"`` or ``"validate"``; the
            error suggests ``owner(..., key=...)`` as the fix.

    Raises:
        ValueError: ``key`` was already claimed in this run.

    Example:
        >>> import torch
        >>> from toolkit import TrainState
        >>> from toolkit.loop._run import Event, LoopInfo
        >>> loop = LoopInfo(None, None, None, 1, 0, None)
        >>> event = Event("start", TrainState(model=torch.nn.Linear(1, 1)), loop)
        >>> claim(event, "ema", "ema")
        >>> loop.claimed
        {'ema': 'ema'}
        >>> claim(event, "ema", "validate")
        Traceback (most recent call last):
        ...
        ValueError: validate: state.extras['ema'] is already kept by ema in this run; ...
    """
    claimed = event.loop.claimed
    holder = claimed.get(key)
    if holder is not None:
        raise ValueError(
            f"{owner}: state.extras[{key!r}] is already kept by {holder} in this run; two "
            f"plugins writing one key would overwrite each other's memory. Give each its own "
            f"key, e.g. {owner}(..., key={key + '_2'!r}) (and the same key to whatever reads "
            "it, such as early_stop or ema_model)."
        )
    claimed[key] = owner


def due(event: Event, every: int) -> bool:
    """True for a ``"step"`` event whose update was applied, at a multiple of ``every``."""
    # The step first: most events are not at a multiple of every.
    return event.state.step % every == 0 and event.out is not None and event.out.updated


def metric_entry(entry: Any) -> tuple[Any, Mapping[str, Any]] | None:
    """``(step, metrics)`` of a :class:`MetricsEntry` (or one that extends it), else None.

    Example:
        >>> metric_entry({"step": 4, "metrics": {"loss": 0.5}, "best": 0.5})
        (4, {'loss': 0.5})
        >>> metric_entry({"step": 4, "weights": {}}) is None  # e.g. ema's entry
        True
    """
    if isinstance(entry, Mapping) and "step" in entry:
        metrics = entry.get("metrics")
        if isinstance(metrics, Mapping):
            return entry["step"], metrics
    return None


def check_mode(who: str, mode: Any) -> None:
    """Raise ValueError unless ``mode`` is ``"min"`` or ``"max"``."""
    if mode not in ("min", "max"):
        raise ValueError(
            f"{who}: mode must be 'min' (lower is better) or 'max' (higher is better); "
            f"got {mode!r}."
        )


def better(value: float, best: float | None, mode: str, margin: float = 0.0) -> bool:
    """Whether ``value`` beats ``best`` by more than ``margin``; a NaN never does."""
    if best is None or math.isnan(best):
        return not math.isnan(value)
    return value < best - margin if mode == "min" else value > best + margin
