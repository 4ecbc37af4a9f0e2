"""columns/weigh: the count-weighted sums that progress and log_metrics share."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from counting import CountOps
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit import StepOutput
from toolkit._host import to_host
from toolkit.plugins._weighting import columns, weigh


def out(loss: float | None, count: Any = None, samples: int | None = None) -> StepOutput:
    value = None if loss is None else torch.tensor(loss, dtype=torch.float64)
    return StepOutput(value, {}, count, samples, updated=True, closed=True)


_counts = st.one_of(
    st.none(),
    st.integers(1, 50),
    st.integers(1, 50).map(lambda c: torch.tensor(c)),  # int64 beside float64 losses
)
_outs = st.lists(
    st.builds(
        out,
        st.one_of(st.none(), st.floats(-100, 100, allow_nan=False)),
        _counts,
        st.one_of(st.none(), st.integers(1, 64)),
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(outs=_outs)
def test_sums_match_a_per_output_reference(outs: list[StepOutput]) -> None:
    kept = [o for o in outs if o.loss is not None]
    weights = [
        float(o.count) if o.count is not None else (1.0 if o.samples is None else o.samples)
        for o in kept
    ]
    counts = [float(o.count) for o in kept if o.count is not None]
    sizes = [o.samples for o in kept if o.samples is not None]

    cols = columns(outs)
    extra = torch.tensor(7.5)  # the caller's own tensors follow in the same read
    values = to_host([*cols.tensors, extra])
    sums = weigh(cols, values)

    assert list(cols.outs) == kept
    assert values[len(cols.tensors) :] == [7.5]
    assert sums.weights == weights
    assert sums.loss == sum([o.loss.item() * w for o, w in zip(kept, weights)])
    assert sums.weight == sum(weights)
    assert sums.targets == (sum(counts) if counts else None)
    assert sums.samples == (sum(sizes) if sizes else None)


def test_no_count_columns_are_read_when_no_loss_reports_counts() -> None:
    cols = columns([out(1.0, samples=2), out(None), out(3.0, samples=6)])
    assert len(cols.tensors) == 2 and not cols.counted
    sums = weigh(cols, to_host(cols.tensors))
    assert (sums.loss, sums.weight, sums.samples, sums.targets) == (20.0, 8, 8, None)


def test_count_tensors_cost_no_op_and_no_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    # Comparing a tensor with None (list.count(None), `in`) raises inside torch and costs
    # about 20 us per tensor; reshaping a 0-d tensor is a dispatched op. Neither is needed.
    def refuse(self: torch.Tensor, other: Any) -> Any:
        raise AssertionError("a count tensor was compared with ==")

    monkeypatch.setattr(torch.Tensor, "__eq__", refuse)
    outs = [out(1.0, count=torch.tensor(3), samples=2), out(2.0, count=None, samples=2)]
    outs.append(out(3.0, count=torch.tensor([5]), samples=2))  # 1-element, reshaped to 0-d
    with CountOps() as ops:
        cols = columns(outs)
    assert ops.calls["reshape.default"] + ops.calls["view.default"] == 1
    assert [t.shape for t in cols.tensors] == [torch.Size([])] * 5
    assert weigh(cols, to_host(cols.tensors)).targets == 8
