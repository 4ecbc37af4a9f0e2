"""What several plugins share: when an update is due, the metrics entry, "better than best".

The metrics convention between plugins is ``state.extras[NAME] = {"step", "metrics", ...}``:
a plugin that produces metrics (validate, peak_memory) stores python floats under
``"metrics"`` with the ``"step"`` they were made at; readers (log_metrics, progress,
early_stop) recognise such an entry with :func:`metric_entry`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from toolkit._loop import Event

__all__ = ["better", "check_mode", "due", "metric_entry"]


def due(event: Event, every: int) -> bool:
    """True for a ``"step"`` event whose update was applied, at a multiple of ``every``."""
    # The step first: most events are not at a multiple of every.
    return event.state.step % every == 0 and event.out is not None and event.out.updated


def metric_entry(entry: Any) -> tuple[Any, Mapping[str, Any]] | None:
    """``(step, metrics)`` of an extras entry of the metrics form, or None for any other.

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
