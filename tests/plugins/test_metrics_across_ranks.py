"""log_metrics on 2 gloo ranks: the global count-weighted mean, one collective per publish;
record keys that differ between the ranks refused on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from spawning import name_the_data_ranks, spawn_reports
from test_metrics import LOOP, drive, frozen_state, out, recorder

from toolkit import Event
from toolkit.plugins._metrics import log_metrics

# Per rank, two updates: a window of two micro-batches, then one of one. (loss, count).
_RANKS = {0: [(1.0, 1), (3.0, 1), (5.0, 2)], 1: [(2.0, 3), (6.0, 1), (4.0, 5)]}


def _job() -> dict:
    rank = dist.get_rank()
    name_the_data_ranks(2)  # the replayed model has no data-parallel wrapper
    calls = [0]
    all_reduce = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counting  # what sum_over_ranks calls
    rows, _, sink = recorder()
    ticks = iter([0.0, 10.0])  # the run's start, then the publish: 10 s
    plugin = log_metrics(
        2,
        sinks=[sink],
        reduce={"n": "sum", "peak": "max", "low": "min"},
        totals=["n"],
        per_epoch=True,
        flops_per_sample=1.0,
        peak_flops=1.0,
        clock=lambda: next(ticks),
    )
    state = frozen_state()
    outs = [
        out(loss, count=c, samples=c, records={"n": c, "peak": loss, "low": loss, "acc": loss},
            updated=i != 0)
        for i, (loss, c) in enumerate(_RANKS[rank])
    ]  # fmt: skip
    collectives = []

    def send(event: Event) -> None:
        nonlocal state
        before = calls[0]
        new = plugin(event)
        state = new if new is not None else state
        collectives.append((event.kind, calls[0] - before))

    send(Event("start", state, LOOP))
    state = state.replace(step=1)
    send(Event("step", state, LOOP, outs[1], 0.0, 0.0, None, tuple(outs[:2])))
    state = state.replace(step=2)
    send(Event("step", state, LOOP, outs[2], 0.0, 0.0, None, (outs[2],)))
    state = state.replace(epoch=1)
    send(Event("epoch_end", state, LOOP))
    send(Event("end", state, LOOP))
    result = {"rows": rows, "collectives": collectives, "extras": dict(state.extras)}
    # Different record keys on the ranks are refused, on every rank alike.
    try:
        drive(log_metrics(1, sinks=[recorder()[2]]), [out(1.0, records={f"key{rank}": 1.0})])
    except ValueError as exc:
        result["refused"] = str(exc)
    return result


@pytest.mark.slow
def test_two_ranks_publish_the_global_weighted_mean_with_one_collective(tmp_path: Path) -> None:
    results = spawn_reports(_job, tmp_path, 2, timeout=120)
    # One all-reduce per publish (the step-2 interval, the epoch), none per other update,
    # the same on both ranks; "end" has nothing left to publish.
    expected = [("start", 0), ("step", 0), ("step", 1), ("epoch_end", 1), ("end", 0)]
    assert [[tuple(c) for c in r["collectives"]] for r in results] == [expected, expected]
    assert results[1]["rows"] == []  # only rank 0 writes
    for rank, result in enumerate(results):
        assert f"different keys (this rank: ['key{rank}', 'loss'])" in result["refused"]
    (step, m), (epoch_step, e) = results[0]["rows"]
    tokens = [c for rank in (0, 1) for _, c in _RANKS[rank]]
    weighted = sum(loss * c for rank in (0, 1) for loss, c in _RANKS[rank]) / sum(tokens)
    assert step == 2 and m["train/loss"] == pytest.approx(46 / 13) == weighted
    assert m["train/acc"] == pytest.approx(46 / 13)
    assert (m["train/n"], m["train/peak"], m["train/low"]) == (13, 6.0, 1.0)
    assert m["train/samples_per_s"] == pytest.approx(13 / 10)
    assert m["train/mfu"] == pytest.approx(13 / 10 / 2)  # two devices
    assert m["train/total/n"] == 13
    assert epoch_step == 2 and e["train/epoch_loss"] == pytest.approx(46 / 13)
    # Every rank holds the same (global) totals in its state.
    assert [r["extras"] for r in results] == [
        {"log_metrics": {"totals": {"n": 13}, "through": 2}}
    ] * 2
