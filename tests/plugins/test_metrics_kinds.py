"""log_metrics beyond the interval mean: sums, maxima, run totals, epochs, LR groups, MFU."""

from __future__ import annotations

import json
import math
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from test_metrics import drive, frozen_state, out, recorder, zero

from toolkit import Event, LossSum, StepOutput, TrainState, accumulate, make_step, run
from toolkit.plugins import Sink, checkpoints
from toolkit.plugins._metrics import log_metrics
from toolkit.plugins._sinks import jsonl

# ---------------------------------------------------------------- sums, maxima, minima


def test_sum_max_and_min_over_the_interval_leave_rejected_windows_out() -> None:
    rows, _, sink = recorder()
    plugin = log_metrics(2, sinks=[sink], reduce={"n": "sum", "peak": "max", "low": "min"})
    drive(
        plugin,
        [
            out(1.0, count=100, records={"n": torch.tensor(100), "peak": 5.0, "low": 2.0},
                updated=False),
            out(3.0, count=60, records={"n": 60, "peak": torch.tensor(7.0), "low": 1.0}),
            # Rejected by the guard: none of it counts.
            out(float("nan"), count=10, records={"n": 10, "peak": 99.0, "low": -9.0},
                updated=False, closed=True, nonfinite=True),
            out(2.0, count=40, records={"n": 40, "peak": 6.0, "low": torch.tensor(3.0)}),
            # The partial interval at the end: a NaN wins the max, wherever it comes.
            out(4.0, count=8, records={"n": 8, "peak": 1.0, "low": 0.5}, updated=False),
            out(4.0, count=8, records={"n": 8, "peak": float("nan"), "low": 0.5}),
        ],
    )  # fmt: skip
    (s1, m1), (s2, m2) = rows
    assert (s1, m1["train/n"], m1["train/peak"], m1["train/low"]) == (2, 200, 7.0, 1.0)
    assert m1["train/loss"] == pytest.approx((100 * 1 + 60 * 3 + 40 * 2) / 200)
    assert (s2, m2["train/n"], m2["train/low"]) == (3, 16, 0.5) and math.isnan(m2["train/peak"])


def test_a_summed_count_is_the_sum_not_the_mean() -> None:
    # fairseq2's num_target_elements: 1492 targets over ten batches, not their mean.
    sizes = [150] * 9 + [142]

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> LossSum:
        n = batch.numel()
        return LossSum(zero(model) + batch.sum(), n, {"num_target_elements": n})

    data = [torch.ones(n) for n in sizes]
    rows, _, sink = recorder()
    summed = log_metrics(10, sinks=[sink], reduce={"num_target_elements": "sum"})
    rows_mean, _, sink_mean = recorder()
    averaged = log_metrics(10, sinks=[sink_mean])
    run(make_step(loss_fn), frozen_state(), data, max_steps=10, plugins=[summed, averaged])
    assert rows[0][1]["train/num_target_elements"] == 1492
    # The default, a count-weighted mean, is another number.
    mean = sum(n * n for n in sizes) / sum(sizes)
    assert rows_mean[0][1]["train/num_target_elements"] == pytest.approx(mean)


@pytest.mark.parametrize(("kind", "expected"), [("max", 3.0), ("min", 1.0), ("mean", 2.0)])
def test_grad_norm_can_be_the_interval_maximum(kind: str, expected: float) -> None:
    rows, _, sink = recorder()
    drive(
        log_metrics(2, sinks=[sink], reduce={"grad_norm": kind}),
        [out(0.0, grad_norm=1.0), out(0.0, grad_norm=3.0)],
    )
    assert rows[0][1]["train/grad_norm"] == expected


# ---------------------------------------------------------------- run totals and resume


def _tokens_loss(model: torch.nn.Module, batch: torch.Tensor) -> LossSum:
    n = batch.numel()
    return LossSum(zero(model) + batch.sum(), n, {"ntokens": n})


_DATA = [torch.ones(n) for n in (3, 1, 4, 1, 5, 9, 2, 6)]


def _totals_plugin(sink: Any) -> Any:
    return log_metrics(2, sinks=[sink], reduce={"ntokens": "sum"}, totals=["ntokens"])


def test_run_totals_survive_a_checkpoint_resume(tmp_path: Path) -> None:
    step = make_step(_tokens_loss)
    whole, _, sink = recorder()
    final = run(step, frozen_state(), _DATA, max_steps=8, plugins=[_totals_plugin(sink)])
    assert [m["train/total/ntokens"] for _, m in whole] == [4, 9, 23, 31]
    assert final.extras["log_metrics"] == {"totals": {"ntokens": 31}, "through": 8}

    # log_metrics before checkpoints: the save at step 4 holds the totals through step 4.
    first, _, sink = recorder()
    save = checkpoints(tmp_path / "ckpt", every=4, at_end=False)
    run(step, frozen_state(), _DATA, max_steps=6, plugins=[_totals_plugin(sink), save])
    assert [s for s, _ in first] == [2, 4, 6]  # then the job dies; step 4 is on disk
    resumed, _, sink = recorder()
    load = checkpoints(tmp_path / "ckpt", every=4, at_end=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is missing: no warning
        again = run(step, frozen_state(), _DATA, max_steps=8, plugins=[_totals_plugin(sink), load])
    assert [(s, m["train/total/ntokens"]) for s, m in resumed] == [(6, 23), (8, 31)]
    assert again.extras["log_metrics"] == final.extras["log_metrics"]


def test_a_checkpoint_between_publishes_warns_of_the_updates_left_out(tmp_path: Path) -> None:
    step = make_step(_tokens_loss)
    _, _, sink = recorder()
    # A save at step 3 holds the totals published at step 2: update 3 is in none.
    save = checkpoints(tmp_path / "ckpt", every=3, at_end=False)
    run(step, frozen_state(), _DATA, max_steps=3, plugins=[save, _totals_plugin(sink)])
    load = checkpoints(tmp_path / "ckpt", every=3, at_end=False)
    with pytest.warns(RuntimeWarning, match=r"count the updates up to step 2, and the run "
                      r"resumes from step 3: no total counts the 1 update between"):  # fmt: skip
        state = run(step, frozen_state(), _DATA, max_steps=6, plugins=[load, _totals_plugin(sink)])
    assert state.extras["log_metrics"]["through"] == 6


def test_sinks_start_at_the_step_the_run_resumes_from(tmp_path: Path) -> None:
    started: list[int] = []
    rows: list[tuple[int, dict]] = []

    def sink() -> Any:
        return types.SimpleNamespace(
            write=lambda s, m: rows.append((s, m)), close=lambda: None, start=started.append
        )

    def val(event: Event) -> TrainState | None:  # a plugin publishing at step 1
        if event.kind == "step" and event.state.step == 1:
            entry = {"step": 1, "values": {"score": 0.5}}
            return event.state.replace(metrics={**event.state.metrics, "val": entry})
        return None

    def go(every: int, max_steps: int) -> None:
        save = checkpoints(tmp_path / "ckpt", every=4, at_end=False)
        plugins = [val, log_metrics(every, sinks=[sink()]), save]
        run(make_step(_tokens_loss), frozen_state(), _DATA, max_steps=max_steps, plugins=plugins)

    go(every=4, max_steps=4)
    # The entry made at the run's first update is published (it is not from an earlier run).
    assert started == [0] and [s for s, m in rows if "val/score" in m] == [1]
    rows.clear()
    # checkpoints restores at "restore", before every "start": log_metrics starts its sinks
    # at the resumed step, and the restored val entry of step 1 is not published again.
    go(every=1, max_steps=6)
    assert started == [0, 4]
    assert [s for s, _ in rows] == [5, 6] and not any("val/score" in m for _, m in rows)


# ---------------------------------------------------------------- per epoch


@pytest.mark.parametrize("every", [1, 100])
def test_epoch_loss_counts_a_straddling_window_where_it_closes(every: int) -> None:
    # Epochs of batches of 1, 2 and 3 tokens of loss 1, 2 and 3; windows of 2 micro-batches:
    # [1, 2] in epoch 0; [3 | 1] closes in epoch 1; [2, 3] in epoch 1.
    data = [torch.full((n,), float(n)) for n in (1, 2, 3)]

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> LossSum:
        return LossSum(zero(model) + batch.sum(), batch.numel())

    rows, _, sink = recorder()
    step = accumulate(make_step(loss_fn), micro_batches=2)
    run(
        step,
        frozen_state(),
        data,
        epochs=2,
        plugins=[log_metrics(every, sinks=[sink], per_epoch=True)],
    )
    epochs = [(s, m["train/epoch"], m["train/epoch_loss"]) for s, m in rows if "train/epoch" in m]
    assert epochs == [(1, 1.0, pytest.approx(5 / 3)), (3, 2.0, pytest.approx(23 / 9))]


def test_no_epoch_keys_unless_asked() -> None:
    rows, _, sink = recorder()
    run(make_step(lambda m, b: zero(m) + b), frozen_state(), [1.0, 2.0], epochs=2,
        plugins=[log_metrics(1, sinks=[sink])])  # fmt: skip
    assert not any("train/epoch_loss" in m for _, m in rows)


# ---------------------------------------------------------------- learning rate per group


def _two_groups(names: tuple[str, str] | None) -> TrainState:
    model = torch.nn.Linear(2, 1)
    groups: list[dict[str, Any]] = [
        {"params": [model.weight], "lr": 0.1},
        {"params": [model.bias], "lr": 0.01},
    ]
    if names:
        for group, name in zip(groups, names):
            group["name"] = name
    opt = torch.optim.SGD(groups)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))  # base / update
    return TrainState(model=model, optimizer=opt, scheduler=sched)


@pytest.mark.parametrize(
    ("names", "keys"), [(None, ("0", "1")), (("decay", "bias"), ("decay", "bias"))]
)
def test_each_parameter_group_logs_the_lr_its_update_used(names: Any, keys: tuple) -> None:
    rows, _, sink = recorder()
    data = [torch.randn(4, 2) for _ in range(4)]
    step = make_step(lambda m, b: m(b).square().mean())
    run(step, _two_groups(names), data, max_steps=4, plugins=[log_metrics(2, sinks=[sink])])
    got = [m[k] for _, m in rows for k in ("train/lr", *(f"train/lr/{key}" for key in keys))]
    # Update u uses base / u: updates 2 and 4 close the intervals.
    assert got == pytest.approx([0.05, 0.05, 0.005, 0.025, 0.025, 0.0025], rel=1e-12)


def test_one_group_logs_train_lr_only() -> None:
    rows, _, sink = recorder()
    run(make_step(lambda m, b: zero(m) + b), frozen_state(), [1.0], max_steps=1,
        plugins=[log_metrics(1, sinks=[sink])])  # fmt: skip
    assert [k for k in rows[0][1] if k.startswith("train/lr")] == ["train/lr"]


# ---------------------------------------------------------------- which records


def test_non_scalar_records_are_left_out_and_records_chooses() -> None:
    logits = torch.randn(4, 10)
    record = {"acc": torch.tensor(0.5), "n": 3, "logits": logits, "name": "x", "sub": {"v": logits}}
    rows: list[tuple[int, dict, int]] = []  # (step, metrics, warnings given by then)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sink = Sink(lambda step, m: rows.append((step, m, len(caught))), lambda: None)
        drive(log_metrics(1, sinks=[sink]), [out(1.0, records=record)] * 3)
    assert sorted(k for k in rows[0][1] if k.startswith("train/")) == [
        "train/acc", "train/loss", "train/n"
    ]  # fmt: skip
    # Said once, at the first publish (not first noticed missing from the logs at the end).
    assert [given for _, _, given in rows] == [1, 1, 1] and len(caught) == 1
    assert caught[0].category is RuntimeWarning
    assert str(caught[0].message).startswith("log_metrics: records ['logits', 'name', 'sub/v'] ")
    rows, _, sink = recorder()
    drive(log_metrics(1, sinks=[sink], records=["acc"]), [out(1.0, records=record)])
    assert sorted(k for k in rows[0][1] if k.startswith("train/")) == ["train/acc", "train/loss"]
    rows.clear()  # records=[]: no record logged, and no warning (an error in this suite)
    drive(log_metrics(1, sinks=[sink], records=[]), [out(1.0, records=record)])
    assert sorted(k for k in rows[0][1] if k.startswith("train/")) == ["train/loss"]


# ---------------------------------------------------------------- MFU


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"flops_per_sample": 3e9, "peak_flops": 1e10}, 3e9 * (4 * 8 / 8.0) / 1e10),
        ({"flops_per_token": 1e8, "peak_flops": 1e10}, 1e8 * (100 + 60 + 50 + 30) / 8.0 / 1e10),
    ],
)
def test_mfu_is_the_achieved_share_of_the_peak(options: dict, expected: float) -> None:
    now = [0.0]
    rows, _, sink = recorder()

    def timed(o: StepOutput) -> StepOutput:
        now[0] += 2.0
        return o

    outs = [
        out(1.0, count=c, samples=8, updated=u)
        for c, u in ((100, False), (60, True), (50, False), (30, True))
    ]
    drive(log_metrics(2, sinks=[sink], clock=lambda: now[0], **options), map(timed, outs))
    assert rows[0][1]["train/mfu"] == pytest.approx(expected, rel=1e-12)
    rows.clear()
    drive(log_metrics(2, sinks=[sink]), [out(1.0, samples=8)] * 2)
    assert "train/mfu" not in rows[0][1]


# ---------------------------------------------------------------- bad input


_BAD = [
    ({"reduce": ["n"]}, TypeError,
     r"reduce must be a mapping of record names to a kind, e\.g\. \{'ntokens': 'sum'\}; got \["),
    ({"reduce": {"n": "avg"}}, ValueError,
     r"reduce\['n'\] must be one of \['mean', 'sum', 'max', 'min'\]; got 'avg'"),
    ({"reduce": {"loss": "max"}}, ValueError,
     r"reduce\['loss'\] must be a record or 'grad_norm'; got 'loss'"),
    ({"totals": ["n"]}, ValueError,
     r"totals\['n'\] must be a record reduced by 'sum'.*reduce=\{'n': 'sum'\}"),
    ({"totals": "n"}, TypeError,
     r"totals must be a list of record names, e\.g\. \['ntokens'\]; got 'n'"),
    ({"records": [1]}, TypeError, r"records must be a list of record names.*; got \[1\]"),
    ({"per_epoch": 1}, TypeError, r"per_epoch must be True or False; got 1"),
    ({"flops_per_sample": 1.0}, ValueError, r"train/mfu must be given .* got 'no peak_flops'"),
    ({"peak_flops": 1.0}, ValueError, r"train/mfu must be given .* got 'only peak_flops'"),
    ({"flops_per_sample": 1.0, "flops_per_token": 1.0, "peak_flops": 1.0}, ValueError,
     r"flops_per_sample or flops_per_token must be given alone; got 'both'"),
    ({"flops_per_token": -1.0, "peak_flops": 1.0}, ValueError,
     r"flops_per_token must be a number > 0, e\.g\. .*; got -1\.0"),
    ({"flops_per_sample": 1.0, "peak_flops": float("inf")}, ValueError,
     r"peak_flops must be a number > 0"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "error", "match"), _BAD)
def test_bad_options_are_named(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        log_metrics(1, sinks=[], **kwargs)


def test_a_record_clashing_with_an_option_key_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"records must be named unlike published keys; got \['mfu'\]"
    ):
        drive(log_metrics(1, sinks=[recorder()[2]], flops_per_sample=1.0, peak_flops=1.0),
              [out(1.0, samples=1, records={"mfu": 0.5})])  # fmt: skip
    with pytest.raises(ValueError, match=r"a record must be named unlike its own 'train/total/n'"):
        drive(log_metrics(1, sinks=[recorder()[2]], reduce={"n": "sum"}, totals=["n"]),
              [out(1.0, records={"n": 1, "total": {"n": 2}})])  # fmt: skip


def test_jsonl_rows_of_a_resumed_run_hold_the_totals(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    step = make_step(_tokens_loss)
    plugin = log_metrics(4, sinks=[jsonl(path)], reduce={"ntokens": "sum"}, totals=["ntokens"])
    state = run(step, frozen_state(), _DATA, max_steps=4, plugins=[plugin])
    run(step, state, _DATA, max_steps=8, plugins=[plugin])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["train/ntokens"], r["train/total/ntokens"]) for r in lines] == [
        (4, 9, 9), (8, 22, 31)
    ]  # fmt: skip


def test_several_optimizers_log_every_group() -> None:
    model = torch.nn.Linear(2, 1)
    adam = torch.optim.Adam([model.weight], lr=0.1)
    sgd = torch.optim.SGD([model.bias], lr=0.01)
    state = TrainState(model=model, optimizer=[adam, sgd])
    rows, _, sink = recorder()
    step = make_step(lambda m, b: m(b).square().mean())
    run(step, state, [torch.randn(4, 2)], max_steps=1, plugins=[log_metrics(1, sinks=[sink])])
    assert (rows[0][1]["train/lr/0"], rows[0][1]["train/lr/1"]) == (0.1, 0.01)
