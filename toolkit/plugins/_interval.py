"""What progress and log_metrics read of the updates since their last refresh or publish.

Each micro-batch's loss is weighted by its target count when the loss function reports one
(:class:`toolkit.LossSum`), else by its number of samples, else by 1, so that the mean over
micro-batches of different sizes is the exact mean over targets (or samples). Skipped
micro-batches (no loss) and the windows :func:`toolkit.guard_nonfinite` rejected are left
out. The plugins keep each window's outputs as they come and read them here, once per
refresh or publish: per update they only append and compare.

Records are flattened with "/" by :func:`flat_scalars`; a record can be reduced over the
interval by another kind than the weighted mean (``kinds``): its plain ``"sum"``, its
``"max"`` or its ``"min"`` over the micro-batches.
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain, compress
from typing import Any

import torch

from toolkit._checks import check
from toolkit._weighted import Column, _fsum, columns, weighted_sums
from toolkit.step._step import StepOutput

# How a record may be reduced over an interval (and over ranks) besides the weighted mean.
KINDS = ("mean", "sum", "max", "min")


@dataclasses.dataclass(slots=True)
class Interval:
    """Sums over the windows read so far.

    ``sums`` maps ``"loss"`` (and each flattened record averaged by weight) to ``(weighted
    sum, weight)``; ``reduced`` maps each record of another kind to its sum, maximum or
    minimum; ``targets`` is None while no loss reported counts, ``samples`` while no
    micro-batch had a sample count; ``lr`` is the last applied update's learning rate, None
    before one.
    """

    sums: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    reduced: dict[str, Any] = dataclasses.field(default_factory=dict)
    targets: float | None = None
    samples: int | None = None
    norm_total: float = 0.0
    norms: int = 0
    lr: Any = None
    updates: int = 0
    nonfinite: int = 0
    overflow: int = 0


def read(
    interval: Interval, windows: Sequence[tuple[StepOutput, ...]],
    open_window: Sequence[StepOutput] = (),
    flatten: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
    kinds: Mapping[str, str] = {}, also: Sequence[torch.Tensor] = (),
) -> list[Any]:  # fmt: skip
    """Add ``windows`` (each ending with its closing output) to ``interval``: one host read.

    ``flatten`` turns a micro-batch's records into flat ones (log_metrics); without it
    records are not read (progress). ``kinds`` maps a record (or ``"grad_norm"``) to
    ``"sum"``, ``"max"`` or ``"min"``: it goes to ``interval.reduced`` instead of the
    weighted means. The 0-d tensors ``also`` are read in the same host read; their values
    are returned.
    """
    # Each field is taken out of all outputs at once (zip), not by a python loop per field.
    closing = _fields(w[-1] for w in windows)
    kept = chain(*(w for w in windows if not w[-1].nonfinite), open_window)
    fields = _fields(out for out in kept if not out.skipped)  # outputs without a loss are out
    counts = fields.count
    counted = any(c is not None for c in counts)  # `is`: `None in counts` compares tensors
    known = [s for s in fields.samples if s is not None]  # some micro-batches may have none
    samples = tuple(1 if s is None else s for s in fields.samples)
    weights: Sequence[Any] | Column = Column(samples, None, tensors=False)
    if counted:
        weights = [_scalar(c) if isinstance(c, torch.Tensor) else s if c is None else c
                   for c, s in zip(counts, samples)]  # fmt: skip
    cols = columns([flatten(r) for r in fields.records]) if flatten and any(fields.records) else {}
    cols["loss"] = Column(fields.loss, None, tensors=True)  # skipped ones are out
    other = {key: cols.pop(key).values for key in kinds if key in cols}
    applied = list(compress(closing.lr, closing.updated))
    norms = [n for n in compress(closing.grad_norm, closing.updated) if n is not None]
    # Every tensor rides in the one host read: the norms, the last LR, ``also`` and the
    # other kinds' values.
    parts = [norms, applied[-1:], also, *other.values()]
    tensors = [_scalar(t) for p in parts for t in p if isinstance(t, torch.Tensor)]
    host = iter((got := weighted_sums(cols, weights, tensors)).also)
    norms, lr, returned, *others = (
        [next(host) if isinstance(v, torch.Tensor) else v for v in part] for part in parts
    )
    for key, (total, weight) in got.sums.items():
        before = interval.sums.get(key, (0.0, 0.0))
        interval.sums[key] = (before[0] + total, before[1] + weight)
    if counted:
        targets = sum([w for w, c in zip(got.weights, counts) if c is not None])
        interval.targets = targets + (interval.targets or 0.0)
    if known:
        interval.samples = sum(known) + (interval.samples or 0)
    interval.norm_total += sum(norms)
    interval.norms += len(norms)
    interval.lr = lr[0] if lr else interval.lr
    interval.updates += len(applied)
    interval.nonfinite += sum(closing.nonfinite)
    interval.overflow += sum(closing.overflow)
    for (key, _), values in zip(other.items(), others):
        _reduce_into(interval.reduced, key, kinds[key], values)
    if norms and "grad_norm" in kinds:  # from the norms read above, not read a second time
        _reduce_into(interval.reduced, "grad_norm", kinds["grad_norm"], norms)
    return returned


def combine(kind: str, a: Any, b: Any) -> Any:
    """Two partial reductions of ``kind`` combined; a NaN wins a max or min (as in torch)."""
    if kind == "sum":
        return a + b
    if a != a or b != b:
        return math.nan
    return max(a, b) if kind == "max" else min(a, b)


def _reduce_into(into: dict[str, Any], key: str, kind: str, values: Sequence[Any]) -> None:
    values = [into[key], *values] if key in into else list(values)
    if kind == "sum" and any(isinstance(v, float) for v in values):
        values = [_fsum(values)]  # exact, as the weighted sums are
    into[key] = functools.reduce(functools.partial(combine, kind), values)


def flat_scalars(
    records: Mapping[str, Any], chosen: frozenset[str] | None = None, who: str = "log_metrics",
    left_out: set[str] | None = None, prefix: str = "",
) -> dict[str, Any]:  # fmt: skip
    """A micro-batch's records flattened with "/": the numbers and one-element tensors.

    Other values (a tensor of logits kept for a plugin, a string) are left out (their names
    added to ``left_out`` when given), unless their name is ``chosen``: then they raise. With
    ``chosen``, only those names are kept.
    """
    flat: dict[str, Any] = {}
    for key, value in records.items():
        name, tensor = f"{prefix}{key}", isinstance(value, torch.Tensor)
        if isinstance(value, Mapping):
            flat.update(flat_scalars(value, chosen, who, left_out, f"{name}/"))
        elif isinstance(value, (int, float)) or (tensor and value.numel() == 1):
            flat[name] = _scalar(value) if tensor else value
        elif chosen is not None and name in chosen:  # a chosen record that is no scalar
            got, error = (tuple(value.shape), ValueError) if tensor else (type(value), TypeError)
            fix = "Reduce it first (.mean(), .sum()) or leave it out of records=."
            what = "a number or a one-element tensor"
            check(False, who, f"record {name!r}", what, got, fix, error)
        elif left_out is not None:
            left_out.add(name)
    return flat if chosen is None else {k: v for k, v in flat.items() if k in chosen}


def _scalar(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached and 0-d: most are already, and checking costs ~1% of reshaping."""
    return tensor.detach().reshape(()) if tensor.ndim or tensor.requires_grad else tensor


def _fields(outs: Iterable[Sequence[Any]]) -> Any:
    """The outputs as one StepOutput whose fields are tuples: a column per field."""
    return StepOutput._make(list(zip(*outs)) or [()] * len(StepOutput._fields))
