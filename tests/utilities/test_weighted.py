"""weighted_sums: per key (sum of w * v, sum of w) of flat records, one host read."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from counting import count_tolists, read_as_on_an_accelerator
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit._weighted import Column, columns, weighted_sums
from toolkit.distributed._collectives import sum_over_ranks

_VALUES = st.one_of(st.floats(-1e6, 1e6, allow_nan=False), st.just(math.nan))
# (value, as a tensor?) so that one column can mix numbers and 0-d tensors.
_LEAVES = st.tuples(_VALUES, st.booleans())
_RECORDS = st.lists(
    st.tuples(
        st.dictionaries(st.sampled_from(["a", "b", "c"]), _LEAVES, max_size=3),
        st.integers(0, 50),  # the weight; 0 contributes nothing
        st.booleans(),  # the weight as a tensor?
    ),
    max_size=10,
)


def _leaf(value: float, tensor: bool) -> Any:
    return torch.tensor(value, dtype=torch.float64) if tensor else value


def _reference(
    records: list[dict[str, float]], weights: list[int], exclude_nan: bool
) -> dict[str, tuple[float, float]]:
    """One record at a time: the sums the reduction must give."""
    keys = list(dict.fromkeys(key for record in records for key in record))
    out = {}
    for key in keys:
        pairs = [(r[key], w) for r, w in zip(records, weights) if key in r and w != 0]
        pairs = [(v, w) for v, w in pairs if not (exclude_nan and math.isnan(v))]
        out[key] = (math.fsum(v * w for v, w in pairs), math.fsum(w for _, w in pairs))
    return out


@settings(max_examples=300, deadline=None)
@given(data=_RECORDS, exclude_nan=st.booleans(), flags=st.booleans())
def test_sums_match_a_per_record_reference(
    data: list[tuple[dict[str, tuple[float, bool]], int, bool]], exclude_nan: bool, flags: bool
) -> None:
    records = [{k: _leaf(*leaf) for k, leaf in record.items()} for record, _, _ in data]
    weights = [torch.tensor(w) if as_tensor else w for _, w, as_tensor in data]
    cols = columns(records)
    if flags:  # a caller that knows which columns hold only tensors (or none) says so
        cols = {
            key: col._replace(tensors=kinds.pop() if len(kinds) == 1 else None)
            for key, col in cols.items()
            for kinds in [{isinstance(v, torch.Tensor) for v in col.values}]
        }
    also = [torch.tensor(7.5), torch.tensor(3)]  # the caller's own tensors, same read
    got = weighted_sums(cols, weights, also, exclude_nan=exclude_nan)

    plain = [{k: value for k, (value, _) in record.items()} for record, _, _ in data]
    expected = _reference(plain, [w for _, w, _ in data], exclude_nan)
    assert list(got.sums) == list(expected)  # keys in order of first appearance
    for key, (total, weight) in expected.items():
        got_total, got_weight = got.sums[key]
        assert got_weight == weight
        assert got_total == total or (math.isnan(got_total) and math.isnan(total))
    assert list(got.weights) == [w for _, w, _ in data]
    assert got.also == [7.5, 3]


def test_a_column_of_some_records_uses_their_weights() -> None:
    records = [{"a": 1.0}, {"b": torch.tensor(2.0)}, {"a": 3.0, "b": 4.0}]
    got = weighted_sums(columns(records), [1, torch.tensor(10), 100])
    assert got.sums == {"a": (301.0, 101), "b": (420.0, 110)}


def test_one_host_read_for_values_weights_and_the_callers_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    read_as_on_an_accelerator(monkeypatch)
    tolists = count_tolists(monkeypatch)
    records = [{"a": torch.tensor(float(i)), "b": float(i)} for i in range(20)]
    weights = [torch.tensor(2.0)] * 20
    got = weighted_sums(columns(records), weights, [torch.tensor(0.5)])
    assert tolists == [20 + 20 + 1]  # one transfer, whatever the number of records
    assert got.sums["a"] == (2.0 * sum(range(20)), 40.0) and got.also == [0.5]


def test_weight_sums_stay_exact_integers_and_float_weights_are_summed_exactly() -> None:
    ints = weighted_sums({"x": Column([1.0, 2.0], None)}, [2**53, 1])
    assert ints.sums["x"][1] == 2**53 + 1  # a float sum would round this
    floats = weighted_sums({"x": Column([1.0] * 3, None)}, [0.1, 0.2, 0.3])
    assert floats.sums["x"][1] == math.fsum([0.1, 0.2, 0.3])  # not 0.6000000000000001


def test_inf_minus_inf_is_nan_and_overflow_is_inf() -> None:
    got = weighted_sums({"x": Column([math.inf, -math.inf], None)}, [1, 1])
    assert math.isnan(got.sums["x"][0])
    got = weighted_sums({"x": Column([1e308, 1e308], None)}, [1, 1])
    assert got.sums["x"][0] == math.inf


def test_in_one_process_sum_over_ranks_changes_nothing() -> None:
    sums = {"loss": (3.0, 2.0)}
    assert sum_over_ranks("who", sums, [1.0, 2.0]) == (sums, [1.0, 2.0])
