"""log_metrics: exact count-weighted interval means, one host sync per publish, sinks."""

from __future__ import annotations

import io
import json
import math
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from counting import CountSyncs, count_tolists, read_as_on_an_accelerator
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from toolkit import (
    Event,
    LoopInfo,
    LossSum,
    StepOutput,
    TrainState,
    accumulate,
    clip,
    compose,
    guard_nonfinite,
    make_step,
    run,
)
from toolkit.plugins import _metrics, progress
from toolkit.plugins._metrics import log_metrics
from toolkit.plugins._sinks import Sink, jsonl

LOOP = LoopInfo(None, None, None, 1, 0, None)  # for the events test_metrics_ranks sends


def recorder() -> tuple[list[tuple[int, dict[str, float]]], list[int], Sink]:
    rows: list[tuple[int, dict[str, float]]] = []
    closes: list[int] = []
    sink = Sink(lambda step, m: rows.append((step, dict(m))), lambda: closes.append(1))
    return rows, closes, sink


def frozen_state(**kw: Any) -> TrainState:
    """A model whose loss is chosen by the batch; lr=0 so nothing depends on updates."""
    model = torch.nn.Linear(1, 1, bias=False)
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), **kw)


def zero(model: torch.nn.Module) -> torch.Tensor:
    return model.weight.sum() * 0  # makes a constant loss require grad


def out(
    loss: float,
    *,
    count: Any = None,
    samples: int | None = None,
    records: dict | None = None,
    updated: bool = True,
    closed: bool | None = None,
    nonfinite: bool = False,
    overflow: bool = False,
    grad_norm: float | None = None,
    lr: Any = None,
) -> StepOutput:
    return StepOutput(
        torch.tensor(loss),
        records or {},
        count,
        samples,
        updated,
        updated if closed is None else closed,
        nonfinite=nonfinite,
        overflow=overflow,
        grad_norm=None if grad_norm is None else torch.tensor(grad_norm),
        lr=lr,
    )


def drive(
    plugin: Callable[[Event], Any],
    outs: Iterable[StepOutput],
    state: TrainState | None = None,
    tick: Callable[[], None] = lambda: None,
) -> TrainState:
    """run() the plugin over a step that replays ``outs``, one per micro-batch (``tick`` is
    called in each step call: it moves a fake clock)."""

    def replay(state: TrainState, o: StepOutput) -> tuple[TrainState, StepOutput]:
        tick()
        return state.replace(step=state.step + o.updated), o

    return run(replay, state or frozen_state(), iter(outs), max_steps=10**9, plugins=[plugin])


# ---------------------------------------------------------------- weighting, with run()


@pytest.mark.parametrize("tensor_counts", [False, True])
def test_loss_is_weighted_by_counts_exactly(tensor_counts: bool) -> None:
    # Per-token losses in micro-batches of 1, 3, 2 and 6 tokens, two per update.
    data = [torch.tensor(v) for v in ([4.0], [1.0, 2.0, 3.0], [5.0, 7.0], [0.5] * 6)]
    data += [torch.tensor([9.0]), torch.tensor([1.0, 1.0, 4.0])]

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> LossSum:
        n = batch.numel()
        return LossSum(zero(model) + batch.sum(), torch.tensor(n) if tensor_counts else n)

    rows, closes, sink = recorder()
    step = accumulate(make_step(loss_fn), micro_batches=2)
    run(step, frozen_state(), data, epochs=1, plugins=[log_metrics(every=2, sinks=[sink])])
    first = torch.cat(data[:4])
    last = torch.cat(data[4:])
    assert [s for s, _ in rows] == [2, 3]  # one full interval, then the partial one at end
    assert rows[0][1]["train/loss"] == pytest.approx(first.double().mean().item(), rel=1e-12)
    assert rows[1][1]["train/loss"] == pytest.approx(last.double().mean().item(), rel=1e-12)
    # A plain mean of the micro-batch means would differ: the weighting matters here.
    assert rows[0][1]["train/loss"] != pytest.approx(sum(d.mean().item() for d in data[:4]) / 4)
    assert closes == [1]


def test_without_counts_losses_are_weighted_by_samples() -> None:
    data = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0, 6.0, 7.0, 8.0])]
    rows, _, sink = recorder()
    run(
        make_step(lambda m, b: zero(m) + b.mean()),
        frozen_state(),
        data,
        max_steps=2,
        plugins=[log_metrics(every=2, sinks=[sink])],
    )
    assert rows[0][1]["train/loss"] == pytest.approx(torch.cat(data).mean().item())  # 4.5
    assert "train/tokens_per_s" not in rows[0][1]


def test_without_samples_each_micro_batch_weighs_one() -> None:
    data = [1.0, 2.0, 6.0]  # python floats: no leading dimension, so no sample count
    rows, _, sink = recorder()
    run(
        make_step(lambda m, b: zero(m) + b),
        frozen_state(),
        data,
        max_steps=3,
        plugins=[log_metrics(every=3, sinks=[sink])],
    )
    (step, metrics), *_ = rows
    assert step == 3 and metrics["train/loss"] == pytest.approx(3.0)
    assert "train/samples_per_s" not in metrics


def test_records_are_weighted_flattened_and_averaged_over_the_batches_having_them() -> None:
    batches = [
        (torch.tensor([1.0]), {"acc": torch.tensor(1.0), "sub": {"x": 2.0}}),
        (torch.tensor([1.0, 1.0, 1.0]), {"acc": torch.tensor(0.0), "sub": {"x": 4.0, "y": 8}}),
    ]

    def loss_fn(model: torch.nn.Module, batch: tuple) -> LossSum:
        values, records = batch
        return LossSum(zero(model) + values.sum(), values.numel(), records)

    rows, _, sink = recorder()
    run(
        make_step(loss_fn),
        frozen_state(),
        batches,
        max_steps=2,
        plugins=[log_metrics(every=2, sinks=[sink])],
    )
    metrics = rows[0][1]
    assert metrics["train/acc"] == pytest.approx(0.25)  # (1*1 + 0*3) / 4
    assert metrics["train/sub/x"] == pytest.approx(3.5)  # (2*1 + 4*3) / 4
    assert metrics["train/sub/y"] == pytest.approx(8.0)  # only the second batch has it


@settings(max_examples=40, deadline=None)
@given(
    batches=st.lists(
        st.tuples(
            st.floats(-100, 100, allow_nan=False),
            st.integers(1, 50),
            st.booleans(),  # whether this micro-batch closes a window
        ),
        min_size=1,
        max_size=30,
    ),
    every=st.integers(1, 4),
    fold=st.sampled_from([1, 2, 3, 4096]),
)
def test_property_each_interval_publishes_the_exact_weighted_mean(
    batches: list[tuple[float, int, bool]], every: int, fold: int
) -> None:
    batches = [(torch.tensor(loss).item(), c, closes) for loss, c, closes in batches]  # float32
    rows, _, sink = recorder()
    outs = [out(loss, count=count, updated=closes) for loss, count, closes in batches]
    with mock.patch.object(_metrics, "_FOLD", fold):  # folding must not change any result
        drive(log_metrics(every, sinks=[sink]), outs)
    expected: list[tuple[int, float]] = []
    step, total, weight = 0, 0.0, 0
    for loss, count, closes in batches:
        total, weight = total + loss * count, weight + count
        step += closes
        if closes and step % every == 0:
            expected.append((step, total / weight))
            total, weight = 0.0, 0
    if weight:
        expected.append((step, total / weight))
    assert [s for s, _ in rows] == [s for s, _ in expected]
    for (_, metrics), (_, mean) in zip(rows, expected):
        assert metrics["train/loss"] == pytest.approx(mean, rel=1e-9, abs=1e-9)


# ---------------------------------------------------------------- what each publish holds


def test_learning_rate_is_the_one_each_update_used() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = TrainState(model=model, optimizer=opt, scheduler=sched)
    rows, _, sink = recorder()
    data = [torch.randn(4, 2) for _ in range(3)]
    run(
        make_step(lambda m, b: m(b).square().mean()),
        state,
        data,
        max_steps=3,
        plugins=[log_metrics(every=1, sinks=[sink])],
    )
    assert [m["train/lr"] for _, m in rows] == pytest.approx([0.1, 0.05, 0.025])


def test_tensor_learning_rate_is_synced_with_the_rest() -> None:
    rows, _, sink = recorder()
    drive(log_metrics(1, sinks=[sink]), [out(1.0, lr=torch.tensor(0.125))])
    assert rows[0][1]["train/lr"] == 0.125


def test_tensor_learning_rate_and_gradient_norms_are_each_read_as_their_own() -> None:
    # Bug caught: the one host read hands its values back in order; reading the LR before
    # the norms while taking the norms first gave the LR as a norm and a norm as the LR.
    rows, _, sink = recorder()
    outs = [out(1.0, grad_norm=g, lr=torch.tensor(0.125)) for g in (2.0, 4.0)]
    drive(log_metrics(2, sinks=[sink]), outs)
    assert (rows[0][1]["train/lr"], rows[0][1]["train/grad_norm"]) == (0.125, 3.0)


def test_grad_norm_is_the_mean_over_the_interval_updates() -> None:
    norms: list[float] = []

    def spy(event: Event) -> None:
        if event.kind == "step" and event.out.grad_norm is not None:
            norms.append(event.out.grad_norm.item())

    model = torch.nn.Linear(3, 1)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = clip(make_step(lambda m, b: m(b).square().mean()), max_norm=1e9)
    rows, _, sink = recorder()
    data = [torch.randn(4, 3) * (i + 1) for i in range(6)]
    run(step, state, data, max_steps=6, plugins=[spy, log_metrics(every=3, sinks=[sink])])
    assert len(norms) == 6
    got = [m["train/grad_norm"] for _, m in rows]
    assert got == pytest.approx([sum(norms[:3]) / 3, sum(norms[3:]) / 3])


def test_no_grad_norm_key_when_the_step_does_not_compute_it() -> None:
    rows, _, sink = recorder()
    run(
        make_step(lambda m, b: zero(m) + b.sum()),
        frozen_state(),
        [torch.ones(2)] * 2,
        max_steps=2,
        plugins=[log_metrics(every=2, sinks=[sink])],
    )
    assert "train/grad_norm" not in rows[0][1]


def test_times_throughput_and_counters_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])  # run()'s clock
    rows, _, sink = recorder()
    plugin = log_metrics(every=2, sinks=[sink], clock=lambda: now[0])

    def fetched(o: StepOutput) -> StepOutput:
        now[0] += 0.25  # waiting for the batch; the step call takes 0.75 (tick)
        return o

    # 2 updates of 2 micro-batches of 8 samples with 100 and 60 tokens; a rejected window
    # and an overflowed one in between (their time counts, a rejected loss does not).
    events = [
        out(1.0, count=100, samples=8, updated=False),
        out(3.0, count=60, samples=8, lr=0.5, grad_norm=2.0),
        out(float("nan"), count=10, samples=8, updated=False, closed=True, nonfinite=True),
        out(2.0, count=50, samples=8, updated=False, closed=True, overflow=True),
        out(2.0, count=100, samples=8, lr=0.25, grad_norm=4.0),
    ]

    def tick() -> None:
        now[0] += 0.75

    drive(plugin, map(fetched, events), tick=tick)  # lazily: the clock moves
    ((step, m),) = rows
    assert step == 2
    assert m["train/loss"] == pytest.approx((100 * 1 + 60 * 3 + 50 * 2 + 100 * 2) / 310)
    assert m["train/lr"] == 0.25  # the last applied update's
    assert m["train/grad_norm"] == pytest.approx(3.0)
    assert m["time/data"] == pytest.approx(5 * 0.25 / 2)  # seconds per update
    assert m["time/step"] == pytest.approx(5 * 0.75 / 2)
    assert m["train/samples_per_s"] == pytest.approx(4 * 8 / 5.0)  # kept micro-batches / wall
    assert m["train/tokens_per_s"] == pytest.approx(310 / 5.0)
    assert m["train/nonfinite"] == 1.0 and m["train/overflow"] == 1.0


def test_nonfinite_and_overflow_keys_absent_when_zero() -> None:
    rows, _, sink = recorder()
    drive(log_metrics(1, sinks=[sink]), [out(1.0)])
    assert not {"train/nonfinite", "train/overflow"} & rows[0][1].keys()


def test_guard_rejected_windows_are_left_out_of_the_loss() -> None:
    data = [1.0, 2.0, float("nan"), 3.0, 4.0]
    rows, _, sink = recorder()
    step = guard_nonfinite(make_step(lambda m, b: zero(m) + b), max_retries=3)
    run(step, frozen_state(), data, max_steps=4, plugins=[log_metrics(every=4, sinks=[sink])])
    ((s, m),) = rows
    assert s == 4 and m["train/loss"] == pytest.approx(2.5) and m["train/nonfinite"] == 1.0


def test_a_micro_batch_without_targets_counts_for_nothing() -> None:
    # A LossSum count of 0 makes the micro-batch's mean loss 0/0: it must not poison the
    # interval's mean, which is over targets.
    rows, _, sink = recorder()
    drive(log_metrics(1, sinks=[sink]), [out(math.nan, count=0, updated=False), out(2.0, count=3)])
    assert rows[0][1]["train/loss"] == 2.0


def test_loss_stays_nan_without_a_guard_to_reject_it() -> None:
    rows, _, sink = recorder()
    with pytest.warns(RuntimeWarning, match="up to update 2 is nan; .* guard_nonfinite"):
        run(
            make_step(lambda m, b: zero(m) + b),
            frozen_state(),
            [1.0, float("nan")],
            max_steps=2,
            plugins=[log_metrics(every=2, sinks=[sink])],
        )
    assert math.isnan(rows[0][1]["train/loss"])


# ---------------------------------------------------------------- syncs


def test_one_host_sync_per_publish_and_none_per_micro_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    read_as_on_an_accelerator(monkeypatch)
    tolists = count_tolists(monkeypatch)

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> LossSum:
        total = torch.nn.functional.mse_loss(model(batch), batch, reduction="sum")
        records = {"mean": batch.mean(), "nested": {"max": batch.max()}, "const": 1.0}
        return LossSum(total, torch.tensor(batch.numel()), records)

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    state = TrainState(model=model, optimizer=opt, scheduler=sched)
    step = compose(accumulate(micro_batches=2), clip(max_norm=10.0))(make_step(loss_fn))
    rows, _, sink = recorder()
    data = [torch.randn(3, 2) for _ in range(12)]
    with CountSyncs() as syncs:
        run(step, state, data, max_steps=6, plugins=[log_metrics(every=3, sinks=[sink])])
    assert syncs.count == 0  # no .item()/float()/bool() anywhere: not per micro-batch either
    # Exactly one device-to-host copy per publish, holding every value of the interval:
    # 6 micro-batches x (loss, count, 2 tensor records) + 3 grad norms.
    assert tolists == [6 * 4 + 3, 6 * 4 + 3]
    assert [s for s, _ in rows] == [3, 6]
    assert rows[0][1]["train/const"] == 1.0


def test_a_long_interval_is_folded_every_fold_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    read_as_on_an_accelerator(monkeypatch)
    # Memory stays bounded: with _FOLD = 3, the losses and grad norms of 10 updates of 2
    # micro-batches are read back after updates 3, 6 and 9 (2 losses + 1 norm each), and the
    # end reads the last update's.
    tolists = count_tolists(monkeypatch)
    rows, _, sink = recorder()
    outs = [
        out(float(i), samples=1, updated=i % 2 == 1, grad_norm=1.0 if i % 2 else None)
        for i in range(20)
    ]
    with mock.patch.object(_metrics, "_FOLD", 3):
        drive(log_metrics(10**6, sinks=[sink]), outs)
    assert tolists == [9, 9, 9, 3]
    assert rows[0][1]["train/loss"] == sum(range(20)) / 20


# ---------------------------------------------------------------- memory


class _Blob:
    """Stands for a large object a plugin keeps in state.extras (weak-referenceable)."""


@pytest.mark.parametrize("plugin_name", ["log_metrics", "progress"])
def test_an_open_interval_keeps_outputs_not_old_states(plugin_name: str) -> None:
    # A plugin that puts a new object in extras every update: once replaced, it must be
    # freed, even while log_metrics or progress waits for the end of a long interval.
    refs: list[weakref.ref[_Blob]] = []
    alive_too_long: list[int] = []

    def churn(event: Event) -> TrainState | None:
        if event.kind != "step":
            return None
        alive_too_long.extend(i for i, ref in enumerate(refs[:-1]) if ref() is not None)
        blob = _Blob()
        refs.append(weakref.ref(blob))
        return event.state.replace(extras={**event.state.extras, "blob": blob})

    _, _, sink = recorder()
    waiting = (
        log_metrics(10**6, sinks=[sink])
        if plugin_name == "log_metrics"
        else progress(every=10**6, console=Console(file=io.StringIO()), min_interval=0)
    )
    step = make_step(lambda m, b: zero(m) + b.sum())
    run(step, frozen_state(), [torch.ones(2)] * 8, max_steps=8, plugins=[churn, waiting])
    assert len(refs) == 8 and alive_too_long == []


# ---------------------------------------------------------------- steps, resume, end


def test_logged_steps_keep_increasing_after_a_resume(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    step = make_step(lambda m, b: m(b).square().mean())
    model = torch.nn.Linear(2, 1)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    data = [torch.randn(4, 2) for _ in range(20)]
    state = run(step, state, data, max_steps=5, plugins=[log_metrics(2, sinks=[jsonl(path)])])
    # A new process would build new plugins; the state (checkpoint) carries the step.
    run(step, state, data, max_steps=9, plugins=[log_metrics(2, sinks=[jsonl(path)])])
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [2, 4, 5, 6, 8, 9]


def test_the_same_plugin_can_drive_two_runs() -> None:
    rows, closes, sink = recorder()
    plugin = log_metrics(2, sinks=[sink])
    step = make_step(lambda m, b: zero(m) + b)
    state = run(step, frozen_state(), [1.0, 3.0, 5.0], max_steps=3, plugins=[plugin])
    run(step, state, [7.0, 9.0], max_steps=5, plugins=[plugin])
    assert [(s, m["train/loss"]) for s, m in rows] == [(2, 2.0), (3, 5.0), (4, 7.0), (5, 9.0)]
    assert closes == [1, 1]


def test_partial_interval_is_flushed_and_sinks_closed_when_training_raises() -> None:
    def loss_fn(model: torch.nn.Module, batch: float) -> torch.Tensor:
        if batch < 0:
            raise RuntimeError("bad batch")
        return zero(model) + batch

    rows, closes, sink = recorder()
    with pytest.raises(RuntimeError, match="bad batch"):
        run(
            make_step(loss_fn),
            frozen_state(),
            [1.0, 2.0, 3.0, -1.0],
            max_steps=10,
            plugins=[log_metrics(every=2, sinks=[sink])],
        )
    assert [(s, m["train/loss"]) for s, m in rows] == [(2, 1.5), (3, 3.0)]
    assert closes == [1]


def test_nothing_to_flush_writes_nothing_more_at_end() -> None:
    rows, closes, sink = recorder()
    drive(log_metrics(2, sinks=[sink]), [out(1.0), out(2.0)])
    assert [s for s, _ in rows] == [2] and closes == [1]


def test_sinks_are_all_closed_even_if_one_fails_to() -> None:
    closed = []

    def broken() -> None:
        raise OSError("disk gone")

    sinks = [Sink(lambda s, m: None, broken), Sink(lambda s, m: None, lambda: closed.append(1))]
    plugin = log_metrics(1, sinks=sinks)
    with pytest.warns(RuntimeWarning, match="disk gone"):  # run() reports a failing "end"
        drive(plugin, [out(1.0)])
    assert closed == [1]


def test_a_single_sink_is_accepted() -> None:
    rows, _, sink = recorder()
    drive(log_metrics(1, sinks=sink), [out(1.0)])
    assert rows[0][0] == 1


# ---------------------------------------------------------------- other plugins' metrics


def test_plugin_metrics_are_published_once_per_new_step() -> None:
    def producer(event: Event) -> TrainState | None:
        state = event.state
        if event.kind == "step" and state.step in (2, 3):
            entry = {"step": state.step, "values": {"loss": state.step / 10}}
            memory = {**state.extras, "val": {"best": 0.1}}
            return state.replace(metrics={**state.metrics, "val": entry}, extras=memory)
        if event.kind == "step" and state.step == 4:  # new metrics, same val entry
            return state.replace(metrics=dict(state.metrics))
        return None

    rows, _, sink = recorder()
    run(
        make_step(lambda m, b: zero(m) + b),
        frozen_state(),
        [1.0] * 5,
        max_steps=5,
        plugins=[producer, log_metrics(every=2, sinks=[sink])],
    )
    assert [(s, m.get("val/loss")) for s, m in rows] == [(2, 0.2), (3, 0.3), (4, None), (5, None)]
    assert "train/loss" in rows[0][1]  # merged with the interval that closes at the same step
    assert "val/best" not in rows[0][1]  # a plugin's memory (extras) is not published
    assert set(rows[1][1]) == {"val/loss"}  # published at its step, not held for the interval


def test_plugin_metrics_nested_and_from_epoch_end() -> None:
    def producer(event: Event) -> TrainState | None:
        if event.kind == "epoch_end":
            entry = {"step": event.state.step, "values": {"acc": {"top1": 0.5, "top5": 0.75}}}
            return event.state.replace(metrics={**event.state.metrics, "val": entry})
        return None

    rows, _, sink = recorder()
    run(
        make_step(lambda m, b: zero(m) + b),
        frozen_state(),
        [1.0, 2.0, 3.0],
        epochs=1,
        plugins=[producer, log_metrics(every=2, sinks=[sink])],
    )
    assert rows[1] == (3, {"val/acc/top1": 0.5, "val/acc/top5": 0.75})
    assert rows[2][0] == 3 and rows[2][1]["train/loss"] == 3.0  # partial interval at end


def test_plugin_metrics_restored_with_the_state_are_not_republished() -> None:
    restored = frozen_state(step=10, metrics={"val": {"step": 10, "values": {"loss": 0.5}}})
    rows, _, sink = recorder()
    drive(log_metrics(1, sinks=[sink]), [out(1.0)], state=restored)
    assert [s for s, _ in rows] == [11] and "val/loss" not in rows[0][1]


def test_plugin_metric_tensor_is_refused() -> None:
    def producer(event: Event) -> TrainState | None:
        if event.kind == "step":
            entry = {"step": event.state.step, "values": {"loss": torch.tensor(0.5)}}
            return event.state.replace(metrics={"val": entry})
        return None

    with pytest.raises(TypeError, match=r"metric val/loss must be a float; got 'a tensor'"):
        run(
            make_step(lambda m, b: zero(m) + b),
            frozen_state(),
            [1.0],
            max_steps=1,
            plugins=[producer, log_metrics(every=1, sinks=[recorder()[2]])],
        )


# ---------------------------------------------------------------- ranks


def test_only_rank_zero_writes_but_every_rank_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    read_as_on_an_accelerator(monkeypatch)
    tolists = count_tolists(monkeypatch)
    monkeypatch.setattr(_metrics, "is_rank_zero", lambda: False)
    rows, closes, sink = recorder()
    drive(log_metrics(1, sinks=[sink]), [out(1.0), out(2.0)])
    assert rows == [] and tolists == [1, 1] and closes == [1]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("every", [0, -1, 1.5, True, "10"])
def test_every_must_be_a_positive_int(every: Any) -> None:
    with pytest.raises(ValueError, match=r"log_metrics: every must be an int >= 1"):
        log_metrics(every, sinks=[])


_NO_START = mock.Mock(spec=["write", "close"])


@pytest.mark.parametrize("sinks", ["metrics.jsonl", None, [print], [_NO_START]])
def test_sinks_must_be_sinks(sinks: Any) -> None:
    with pytest.raises(TypeError, match=r"log_metrics: sinks(\[0\])? must be a (list of )?sink"):
        log_metrics(1, sinks=sinks)


@pytest.mark.parametrize(
    ("records", "error", "match"),
    [
        (
            {"acc": torch.ones(3)},
            ValueError,
            r"record 'acc' must be a number or a one-element tensor; got \(3,\). Reduce it "
            r"first \(.mean\(\), .sum\(\)\) or leave it out of records=",
        ),
        (
            {"a": {"b": "x"}},
            TypeError,
            r"record 'a/b' must be a number or a one-element tensor; got <class 'str'>",
        ),
        ({"loss": 1.0}, ValueError, r"records must be named unlike published keys; got \['loss'\]"),
    ],
)
def test_bad_records_are_refused_with_the_key(records: dict, error: type, match: str) -> None:
    chosen = ["acc", "a/b", "loss"]
    with pytest.raises(error, match=match):
        drive(log_metrics(1, sinks=[recorder()[2]], records=chosen), [out(1.0, records=records)])
