"""What progress and log_metrics read of their windows: weighted losses, counts, norms, LR."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any
from unittest import mock

import pytest
import torch
from counting import count_tolists, read_as_on_an_accelerator
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit import Event, LoopInfo, StepOutput, TrainState, _host
from toolkit.plugins._interval import Interval, read
from toolkit.plugins._shared import due

_SKIPPED = StepOutput(None, {}, None, None, updated=False, closed=False, skipped=True)


def micro(loss: float, count: Any = None, samples: int | None = None) -> StepOutput:
    return StepOutput(torch.tensor(loss, dtype=torch.float64), {}, count, samples, False, False)


_COUNTS = st.one_of(
    st.none(),
    st.integers(0, 50),
    st.integers(0, 50).map(torch.tensor),  # int64 beside float64 losses
    st.integers(0, 50).map(lambda c: torch.tensor([c])),  # one element, not 0-d
)
_MICRO = st.one_of(
    st.just(_SKIPPED),
    st.builds(
        micro, st.floats(-100, 100, allow_nan=False), _COUNTS, st.none() | st.integers(1, 64)
    ),
)
# A window: its micro-batches, then how it closed (applied, rejected, overflowed) with its
# grad norm and LR.
_WINDOWS = st.lists(
    st.tuples(
        st.lists(_MICRO, min_size=1, max_size=4),
        st.sampled_from(["applied", "rejected", "overflow"]),
        st.none() | st.floats(0, 10),
        st.sampled_from([None, 0.5, torch.tensor(0.25)]),
    ),
    max_size=6,
)


def _close(outs: list[StepOutput], how: str, norm: float | None, lr: Any) -> tuple:
    last = outs[-1]._replace(
        updated=how == "applied",
        closed=True,
        nonfinite=how == "rejected",
        overflow=how == "overflow",
        grad_norm=None if norm is None else torch.tensor(norm),
        lr=lr,
    )
    return (*outs[:-1], last)


@pytest.mark.slow  # 400 examples against the reference: about 8 s
@pytest.mark.parametrize("accelerator", [False, True])
@settings(max_examples=200, deadline=None)
@given(data=_WINDOWS, open_window=st.lists(_MICRO, max_size=3))
def test_reads_what_a_per_output_reference_gives(
    accelerator: bool, data: list, open_window: list[StepOutput]
) -> None:
    windows = [_close(*window) for window in data]
    interval = Interval()
    # On an accelerator the tensors are stacked: a count of shape (1,) must be made 0-d.
    with (
        mock.patch.object(_host, "_all_on_cpu", lambda tensors: False)
        if accelerator
        else nullcontext()
    ):
        read(interval, windows, open_window)

    # The reference: loss weighted by count, else samples, else 1; rejected windows and
    # micro-batches without a loss left out.
    kept = [o for w in windows if not w[-1].nonfinite for o in w] + open_window
    kept = [o for o in kept if o.loss is not None]

    def weight(o: StepOutput) -> float:
        if o.count is not None:
            return float(o.count)
        return 1.0 if o.samples is None else o.samples

    weights = [weight(o) for o in kept]
    nonzero = [(o.loss.item(), w) for o, w in zip(kept, weights) if w != 0]
    assert interval.sums["loss"] == pytest.approx(
        (sum(v * w for v, w in nonzero), sum(w for _, w in nonzero)), rel=1e-12, abs=1e-9
    )
    counts = [float(o.count) for o in kept if o.count is not None]
    assert interval.targets == (sum(counts) if counts else None)
    sizes = [o.samples for o in kept if o.samples is not None]
    assert interval.samples == (sum(sizes) if sizes else None)

    applied = [w[-1] for w in windows if w[-1].updated]
    norms = [o.grad_norm.item() for o in applied if o.grad_norm is not None]
    assert (interval.norms, interval.norm_total) == (len(norms), pytest.approx(sum(norms)))
    last_lr = applied[-1].lr if applied else None
    assert interval.lr == (last_lr.item() if isinstance(last_lr, torch.Tensor) else last_lr)
    assert interval.updates == len(applied)
    assert interval.nonfinite == sum(w[-1].nonfinite for w in windows)
    assert interval.overflow == sum(w[-1].overflow for w in windows)


def test_reads_add_up_and_each_is_one_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    read_as_on_an_accelerator(monkeypatch)
    tolists = count_tolists(monkeypatch)
    window = (
        micro(1.0, count=torch.tensor(2)),
        _close([micro(3.0, count=2)], "applied", 1.0, 0.5)[0],
    )
    interval = Interval()
    read(interval, [window])
    read(interval, [window, window])
    # Per read: the losses, the one tensor count and the grad norm of each window.
    assert tolists == [1 + 1 + 1 + 1, 2 * 4]
    assert interval.sums["loss"] == (3 * (1.0 * 2 + 3.0 * 2), 3 * 4)
    assert (interval.targets, interval.norms, interval.updates) == (12.0, 3, 3)


def test_nothing_to_read() -> None:
    interval = Interval()
    read(interval, [])
    assert interval.sums["loss"] == (0.0, 0) and interval.samples is None and interval.lr is None


# ---------------------------------------------------------------- due


def _step_event(step: int, updated: bool) -> Event:
    out = StepOutput(torch.tensor(1.0), {}, None, None, updated=updated, closed=True)
    state = TrainState(model=torch.nn.Linear(1, 1), step=step)
    return Event("step", state, LoopInfo(None, None, None, 1, 0, None), out)


def test_due_is_an_applied_update_at_a_multiple_of_every() -> None:
    assert due(_step_event(20, True), 10) and due(_step_event(20, True), 1)
    assert not due(_step_event(25, True), 10)
    assert not due(_step_event(20, False), 10)  # rejected, skipped: the step did not move
    start = _step_event(0, True)._replace(kind="start", out=None)
    assert not due(start, 10)  # step 0 is a multiple, but no update happened
