"""The metrics convention between plugins: ``state.extras[NAME] = {"step", "metrics", ...}``.

A plugin that produces metrics (validate, peak_memory) stores python floats under
``"metrics"`` with the ``"step"`` they were made at; readers (log_metrics, progress,
early_stop) recognise such an entry with :func:`metric_entry`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["metric_entry"]


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
