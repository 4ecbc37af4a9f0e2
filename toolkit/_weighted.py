"""Count-weighted sums of records: the one reduction behind key_average, log_metrics, validate.

A record is a flat mapping of numbers or 0-d tensors with one weight. :func:`columns` turns
records into one column per key; :func:`weighted_sums` gives, per key, the weighted sum and
the total weight over the records that have the key, reading every tensor (values, weights
and the caller's own) back in one :func:`toolkit._host.to_host` call. A record of weight 0
contributes nothing, not even a NaN; sums are exact (``math.fsum``).
"""

import itertools
import math
import operator
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from toolkit._host import to_host

K = TypeVar("K", bound=Hashable)


class Column(NamedTuple):
    """One key's values (numbers or 0-d tensors) and the record index of each.

    ``rows=None`` means value ``i`` belongs to record ``i`` (every record has the key).
    ``tensors`` says, when the caller knows, that every value is a tensor (True) or none is
    (False); None looks at each value's type.
    """

    values: Sequence[Any]
    rows: Sequence[int] | None
    tensors: bool | None = None


class Sums(NamedTuple):
    """Per key ``(weighted sum, weight)``; the weights and the ``also`` tensors as numbers."""

    sums: dict[Any, tuple[float, float]]  # by the keys of the columns
    weights: Sequence[Any]
    also: list[Any]


def columns(records: Sequence[Mapping[K, Any]]) -> dict[K, Column]:
    """The columns of flat records, keys in order of first appearance."""
    found: dict[K, tuple[list[Any], list[int]]] = {}
    for row, record in enumerate(records):
        for key, value in record.items():
            values, rows = found.setdefault(key, ([], []))
            values.append(value)
            rows.append(row)
    return {key: Column(values, rows) for key, (values, rows) in found.items()}


def weighted_sums(
    cols: Mapping[Any, Column],
    weights: Sequence[Any] | Column,
    also: Sequence[torch.Tensor] = (),
    *,
    exclude_nan: bool = False,
) -> Sums:
    """Per key, ``sum(w * v)`` and ``sum(w)`` over its values; one host read for all tensors.

    ``weights`` has one number or 0-d tensor per record (a :class:`Column` when the caller
    knows whether they are tensors). With ``exclude_nan`` a NaN value is left out with its
    weight.
    """
    # Whole columns at a time (no isinstance per value unless needed): a publish every few
    # updates reads a few dozen values, and each python step per value shows.
    every = [*cols.values(), weights if isinstance(weights, Column) else Column(weights, None)]
    found = [_tensors(column) for column in every]
    read = iter(to_host(list(itertools.chain(*found, also))))  # in that order
    *values, weight_numbers = [_substitute(c.values, t, read) for c, t in zip(every, found)]
    sums: dict[Any, tuple[float, float]] = {}
    for (key, column), column_values in zip(cols.items(), values):
        rows = column.rows
        picked = weight_numbers if rows is None else list(map(weight_numbers.__getitem__, rows))
        sums[key] = _sum(column_values, picked, exclude_nan)
    return Sums(sums, weight_numbers, list(read))


def _tensors(column: Column) -> Sequence[torch.Tensor]:
    """The tensors among a column's values: all of them, none, or a filtered list."""
    if column.tensors is not None:
        return column.values if column.tensors else ()
    tensors = [v for v in column.values if isinstance(v, torch.Tensor)]
    return column.values if len(tensors) == len(column.values) else tensors


def _substitute(values: Sequence[Any], tensors: Sequence[Any], read: Iterator) -> Sequence[Any]:
    """``values`` with each of its ``tensors`` replaced by its host value, taken from ``read``."""
    if not tensors:
        return values
    if len(tensors) == len(values):
        return list(itertools.islice(read, len(values)))
    return [next(read) if isinstance(v, torch.Tensor) else v for v in values]


def _sum(values: Sequence[Any], weights: Sequence[Any], exclude_nan: bool) -> tuple[float, float]:
    if exclude_nan:
        values, weights = _kept(values, weights, exclude_nan)
    total = _fsum(list(map(operator.mul, values, weights)))
    if not math.isfinite(total) and 0 in weights:
        # A NaN or inf of weight 0 made it so; left out, as it should be. (A finite value of
        # weight 0 adds exactly 0, so the usual case needs no filtering.)
        values, weights = _kept(values, weights, exclude_nan)
        total = _fsum(list(map(operator.mul, values, weights)))
    weight = sum(weights)  # exact for integer weights (counts), the usual case
    return total, weight if type(weight) is int else math.fsum(weights)


def _kept(values: Sequence[Any], weights: Sequence[Any], exclude_nan: bool) -> tuple[list, list]:
    """The (value, weight) pairs of positive weight and, with ``exclude_nan``, no NaN value."""
    kept = [(v, w) for v, w in zip(values, weights) if w != 0 and not (exclude_nan and v != v)]
    return [v for v, _ in kept], [w for _, w in kept]


def _fsum(products: list[Any]) -> float:
    try:
        return math.fsum(products)
    except (ValueError, OverflowError):
        # fsum refuses inf - inf (the answer is NaN) and overflowing partial sums (inf); plain
        # summation gives those IEEE results.
        return float(sum(products))
