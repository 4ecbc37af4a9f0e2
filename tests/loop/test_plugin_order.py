"""The order of the plugin list does not change a run: run() calls plugins in a fixed order.

The built-in plugins read each other's entries in ``state.extras`` (validate evaluates ema's
average, early_stop reads validate's entry, log_metrics publishes both and peak_memory's,
checkpoints save them, progress shows them). Whatever order they are listed in, a run and a
resumed run write the same metrics and the same checkpoints.
"""

from __future__ import annotations

import io
import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from toolkit import TrainState, make_step, run
from toolkit.plugins import (
    Retention,
    checkpoints,
    early_stop,
    ema,
    ema_model,
    jsonl,
    log_metrics,
    peak_memory,
    progress,
    validate,
)

# Measured, not computed: they differ between any two runs, whatever the order.
_MEASURED = ("time/data", "time/step", "memory/rss_peak_gib")
_NAMES = ("ema", "validate", "early_stop", "peak_memory", "log_metrics", "checkpoints", "progress")


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


def _eval(model: torch.nn.Module, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"loss": model(batch).square().mean()}


def _data() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    train = [torch.randn(4, 2, generator=generator) for _ in range(8)]
    return train, [torch.randn(3, 2, generator=generator)]


def _plugins(folder: Path, order: tuple[str, ...], console: Console) -> list[Any]:
    _, val = _data()
    ticks = itertools.count()  # a fake clock: deterministic throughput in the metrics
    built = {
        "ema": ema(0.5),
        "validate": validate(_eval, val, every=2, model=ema_model),
        "early_stop": early_stop("val/loss", patience=2),
        "peak_memory": peak_memory(every=2),
        "log_metrics": log_metrics(
            2, sinks=[jsonl(folder / "metrics.jsonl")], clock=lambda: next(ticks)
        ),
        "checkpoints": checkpoints(folder / "ckpt", every=2, keep=Retention(keep_last=100)),
        "progress": progress(every=2, console=console, clock=lambda: 0.0, min_interval=0),
    }
    return [built[name] for name in order]


def _train(folder: Path, order: tuple[str, ...], stops: tuple[int, ...]) -> str:
    """Train to each of ``stops`` in turn, each run resuming the last (a fresh process's way)."""
    console = Console(file=io.StringIO(), width=200)
    for max_steps in stops:
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        plugins = _plugins(folder, order, console)
        run(make_step(_loss), state, _data()[0], epochs=3, max_steps=max_steps, plugins=plugins)
    return console.file.getvalue()  # type: ignore[attr-defined, no-any-return]


def _outcome(folder: Path, shown: str) -> dict[str, Any]:
    """What the run left: metric records (measured values left out), checkpoints, progress."""
    records = []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records.append({k: (k if k in _MEASURED else v) for k, v in record.items()})
    saved = {}
    for checkpoint in sorted((folder / "ckpt").glob("step_*")):
        model = load_file(checkpoint / "model.safetensors")
        extras = load_file(checkpoint / "extras.safetensors")
        saved[checkpoint.name] = {name: t.tolist() for name, t in {**model, **extras}.items()}
    # progress shows the peak memory too: measured, so its digits are left out.
    lines = [line.split(" | memory/")[0] for line in shown.splitlines()]
    return {"records": records, "checkpoints": saved, "progress": lines}


def _orders() -> list[tuple[str, ...]]:
    rotations = [_NAMES[i:] + _NAMES[:i] for i in range(len(_NAMES))]
    shuffled = []
    for seed in range(3):
        names = list(_NAMES)
        random.Random(seed).shuffle(names)
        shuffled.append(tuple(names))
    return [*rotations, tuple(reversed(_NAMES)), *shuffled]


@pytest.mark.parametrize(
    "stops", [(6,), pytest.param((3, 6), marks=pytest.mark.slow)], ids=["crash-free", "resumed"]
)
def test_the_order_of_the_plugin_list_does_not_change_the_run(tmp_path: Path, stops) -> None:
    outcomes = []
    for index, order in enumerate(_orders()):
        folder = tmp_path / str(index)
        outcomes.append((order, _outcome(folder, _train(folder, order, stops))))
    reference = outcomes[0][1]
    # The run does what the plugins are for: evaluations of the average, logged, saved.
    resumed = len(stops) > 1  # the first run ends at step 3: its last interval is published
    assert [r["step"] for r in reference["records"]] == ([2, 3, 4, 6] if resumed else [2, 4, 6])
    assert all("val/loss" in r and "memory/rss_peak_gib" in r for r in reference["records"][-2:])
    expected = ["step_000002", "step_000004", "step_000006"]
    if resumed:
        expected.insert(1, "step_000003")  # the first run's last step, resumed from
    assert list(reference["checkpoints"]) == expected
    assert "extras/ema/params/weight" in reference["checkpoints"]["step_000006"]
    heads = [line.split(" | ")[0] for line in reference["progress"]]
    assert heads == (["step 2/3", "step 3/3"] if resumed else ["step 2/6"]) + [
        "step 4/6",
        "step 6/6",
    ]
    for order, outcome in outcomes[1:]:
        assert outcome == reference, f"plugins listed as {order} changed the run"
