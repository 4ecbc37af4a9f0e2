"""Count-weighted sums over an interval's micro-batch outputs, for progress and log_metrics.

Each micro-batch's loss is weighted by its target count when the loss function reports one
(:class:`toolkit.LossSum`), else by its number of samples, else by 1, so that the mean over
micro-batches of different sizes is the exact mean over targets (or samples). Skipped
micro-batches (no loss) are left out.

The work is split in two so that the caller reads these tensors and its own (grad norms, the
LR, records) back in a single host read: :func:`columns` lists the tensors to read, and
:func:`weigh` turns their values into sums. Both are written with comprehensions over whole
columns and build the count columns only when a loss reported counts: with a publish every
few updates, each pass over the outputs shows in the overhead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import torch

from toolkit._step import StepOutput

__all__ = ["Columns", "Sums", "columns", "weigh"]


class Columns(NamedTuple):
    """The outputs that have a loss, and the tensors to read for them.

    ``tensors`` holds the losses, then the count tensors; the caller passes them first to
    its host read and hands the values to :func:`weigh`.
    """

    outs: Sequence[StepOutput]
    tensors: list[torch.Tensor]
    counts: list[Any]
    samples: list[int | None]
    counted: bool


class Sums(NamedTuple):
    """Weighted sums of one interval.

    ``weights`` has one weight per output with a loss (for weighting records alike);
    ``targets`` is ``None`` when no loss reported counts, ``samples`` when no micro-batch
    had a sample count.
    """

    loss: float
    weight: float
    weights: list[float]
    targets: float | None
    samples: int | None


def columns(outs: Sequence[StepOutput]) -> Columns:
    """The tensors to read back for ``outs``: their losses, then their count tensors."""
    losses = [o.loss for o in outs if o.loss is not None]
    kept = outs if len(losses) == len(outs) else [o for o in outs if o.loss is not None]
    counts = [o.count for o in kept]
    # Not counts.count(None): comparing a tensor with None raises inside torch and costs
    # about 20 us per tensor; identity tests cost nanoseconds.
    counted = any(c is not None for c in counts)
    count_tensors = (
        # A reshape is a dispatched op (microseconds): only for counts that are not 0-d.
        [c if c.ndim == 0 else c.reshape(()) for c in counts if isinstance(c, torch.Tensor)]
        if counted
        else []
    )
    return Columns(kept, [*losses, *count_tensors], counts, [o.samples for o in kept], counted)


def weigh(cols: Columns, values: Sequence[float]) -> Sums:
    """The sums, from ``values``: the host values of ``cols.tensors`` (more may follow)."""
    n = len(cols.outs)
    samples = cols.samples
    unsized = None in samples
    whole = cast("list[float]", samples)  # used only when no sample count is None
    targets = None
    if cols.counted:
        read = iter(values[n : len(cols.tensors)])
        counts = [
            None if c is None else next(read) if isinstance(c, torch.Tensor) else float(c)
            for c in cols.counts
        ]
        weights = [
            c if c is not None else (1.0 if m is None else m) for c, m in zip(counts, samples)
        ]
        targets = sum([c for c in counts if c is not None])
    else:
        weights = [1.0 if m is None else m for m in samples] if unsized else whole
    sized = [m for m in samples if m is not None] if unsized else cast("list[int]", samples)
    loss = sum([v * w for v, w in zip(values[:n], weights)])
    return Sums(loss, sum(weights), weights, targets, sum(sized) if sized else None)
