"""progress: live bar or plain lines, ETA without warm-up, throughput, rank 0 only."""

from __future__ import annotations

import functools
import io
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import rich.console
import torch
from counting import CountSyncs, count_tolists, read_as_on_an_accelerator

from toolkit import (
    Event,
    LoopInfo,
    LossSum,
    StepOutput,
    TrainState,
    clip,
    guard_nonfinite,
    make_step,
    run,
)
from toolkit.plugins import _progress
from toolkit.plugins._progress import progress


def recorded(terminal: bool) -> rich.console.Console:
    return rich.console.Console(record=True, force_terminal=terminal, width=120, file=io.StringIO())


class FakeTime:
    """A clock the loss function advances: update i takes ``seconds(i)`` (1-based)."""

    def __init__(self, seconds: Callable[[int], float]) -> None:
        self.now = 0.0
        self.calls = 0
        self.seconds = seconds

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.calls += 1
        self.now += self.seconds(self.calls)


def frozen_state(lr: float = 1e-3) -> TrainState:
    model = torch.nn.Linear(1, 1, bias=False)
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr))


def train(
    plugin: Callable[[Event], Any],
    clock: FakeTime,
    *,
    max_steps: int,
    state: TrainState | None = None,
    counts: bool = False,
    plugins_before: Sequence[Callable[[Event], Any]] = (),
    step_wrapper: Callable[[Any], Any] = lambda s: s,
) -> TrainState:
    """Batches of 4 samples whose value is the batch index; the loss is their mean."""

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> Any:
        clock.tick()
        base = model.weight.sum() * 0
        if counts:  # 10 tokens per batch
            return LossSum(base + batch.mean() * 10, torch.tensor(10))
        return base + batch.mean()

    data = [torch.full((4, 1), float(i)) for i in range(max_steps)]
    step = step_wrapper(make_step(loss_fn))
    state = state or frozen_state()
    return run(step, state, data, max_steps=max_steps, plugins=[*plugins_before, plugin])


def text(console: rich.console.Console) -> str:
    """What a reader sees: the live bar's renders, or the plain lines written to the file."""
    return console.export_text() if console.is_terminal else console.file.getvalue()


def lines(console: rich.console.Console) -> list[str]:
    return text(console).splitlines()


# ---------------------------------------------------------------- plain lines


def test_plain_lines_when_not_a_terminal() -> None:
    console, clock = recorded(terminal=False), FakeTime(lambda i: 1.0)
    train(progress(every=2, warmup=2, console=console, clock=clock), clock, max_steps=6)
    assert lines(console) == [
        "step 2/6 | loss 0.5 | lr 1.00e-03 | 4 samples/s",  # ETA not known yet: none timed
        "step 4/6 | loss 2.5 | lr 1.00e-03 | 4 samples/s | eta 0:00:02",
        "step 6/6 | loss 4.5 | lr 1.00e-03 | 4 samples/s | eta 0:00:00",
    ]


def test_refreshes_at_most_once_per_min_interval() -> None:
    # Updates take 0.25 s: with every=1 and min_interval=0.5, every second update is shown,
    # and each line is the mean over both updates since the previous line.
    console, clock = recorded(terminal=False), FakeTime(lambda i: 0.25)
    plugin = progress(every=1, warmup=0, console=console, clock=clock, min_interval=0.5)
    train(plugin, clock, max_steps=5)
    assert [line.split(" | ")[:2] for line in lines(console)] == [
        ["step 2/5", "loss 0.5"],  # batches 0 and 1
        ["step 4/5", "loss 2.5"],  # batches 2 and 3
        ["step 5/5", "loss 4"],  # the end is always shown
    ]


def test_min_interval_zero_refreshes_at_every_multiple() -> None:
    console, clock = recorded(terminal=False), FakeTime(lambda i: 1e-6)
    plugin = progress(every=1, warmup=0, console=console, clock=clock, min_interval=0)
    train(plugin, clock, max_steps=3)
    assert [line.split(" | ")[0] for line in lines(console)] == ["step 1/3", "step 2/3", "step 3/3"]


def test_default_min_interval_is_a_tenth_of_a_second() -> None:
    console, clock = recorded(terminal=False), FakeTime(lambda i: 0.03)
    train(progress(every=1, warmup=0, console=console, clock=clock), clock, max_steps=8)
    # 0.03 s per update: due at 4 updates (0.12 s), then at 8 (the end).
    assert [line.split(" | ")[0] for line in lines(console)] == ["step 4/8", "step 8/8"]


def test_a_last_line_at_end_when_the_run_stops_between_refreshes() -> None:
    console, clock = recorded(terminal=False), FakeTime(lambda i: 1.0)
    train(progress(every=2, warmup=0, console=console, clock=clock), clock, max_steps=5)
    assert [line.split(" | ")[:2] for line in lines(console)] == [
        ["step 2/5", "loss 0.5"],
        ["step 4/5", "loss 2.5"],
        ["step 5/5", "loss 4"],
    ]


def test_default_console_is_standard_output(capsys: pytest.CaptureFixture[str]) -> None:
    clock = FakeTime(lambda i: 1.0)
    train(progress(every=1, warmup=0, clock=clock), clock, max_steps=2)
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in out] == ["step 1/2", "step 2/2"]


# ---------------------------------------------------------------- live bar


def test_live_bar_in_a_terminal_is_refreshed_and_stopped() -> None:
    console, clock = recorded(terminal=True), FakeTime(lambda i: 1.0)
    train(progress(every=2, warmup=2, console=console, clock=clock), clock, max_steps=4)
    text = console.export_text()
    assert "━" in text  # a bar was drawn
    assert "step 2/4" in text and "loss 0.5  lr 1.00e-03  4 samples/s" in text
    assert "step 4/4" in text and "eta 0:00:00 loss 2.5  lr 1.00e-03  4 samples/s" in text
    raw = console.file.getvalue()
    assert raw.startswith("\x1b[?25l") and raw.endswith("\x1b[?25h")  # cursor hidden, restored
    # Stopped: a new live display may start on the same console.
    with rich.progress.Progress(console=console, auto_refresh=False):
        pass


def _every(name: str, every: int, metrics: dict[str, float]):
    """A plugin publishing ``metrics`` as ``state.metrics[name]`` every ``every`` updates."""

    def plugin(event: Event) -> TrainState | None:
        if event.kind == "step" and event.out.updated and event.state.step % every == 0:  # type: ignore[union-attr]
            entry = {"step": event.state.step, "values": metrics}
            return event.state.replace(metrics={**event.state.metrics, name: entry})
        return None

    return plugin


@functools.cache
def _live_frames(width: int) -> dict[str, str]:
    """Each refresh of the last 200 updates of a 1000-update run on a terminal of ``width``
    columns and 16 colours, by its step count, with validation and EMA validation every 100
    updates, peak memory, grad_norm and tokens/s: more fields than any of these widths holds."""
    console = rich.console.Console(
        record=True, force_terminal=True, width=width, file=io.StringIO(), color_system="standard"
    )
    clock = FakeTime(lambda i: 1.0)
    val = _every("val", 100, {"loss": 0.2241234, "accuracy": 0.9375123, "perplexity": 1.2856})
    ema = _every("val_ema", 100, {"loss": 0.2141234, "accuracy": 0.9475123})
    memory = _every("memory", 1, {"peak_gib": 1.51234})
    plugin = progress(every=50, warmup=1, console=console, clock=clock)
    wrapper = lambda s: clip(s, max_norm=1.0)  # noqa: E731
    train(plugin, clock, max_steps=1000, plugins_before=[val, ema, memory], counts=True,
          step_wrapper=wrapper, state=frozen_state().replace(step=800))  # fmt: skip
    rendered = console.export_text(clear=False).split("step ")[1:]
    frames = ["step " + frame.rstrip("\n") for frame in rendered]
    assert all(len(frame) <= width for frame in frames)
    styled = console.export_text(styles=True).split("step ")[-1]
    return {frame.split()[1]: frame for frame in frames} | {"styled": styled}


STALE = "  val/loss 0.224 @900  val/accuracy 0.938 @900  val/perplexity 1.29 @900"


@pytest.mark.parametrize(
    ("width", "at_950", "at_1000"),
    [
        # At 80 columns: the step, the bar, the ETA, the loss, the LR and validation's loss.
        (80, STALE[:21], "  val/loss 0.224"),
        (100, STALE[:21], "  val/loss 0.224  val/accuracy 0.938"),
        (160, STALE, STALE.replace(" @900", "") + "  val_ema/loss 0.214"),
    ],
)  # fmt: skip
def test_fields_by_priority_dropped_whole_from_the_end(
    width: int, at_950: str, at_1000: str
) -> None:
    # Priority: loss, lr, the `show` entries (validation, its EMA, memory), then the rest;
    # a value measured at an earlier update is marked with it (validation ran at update 900).
    frames = {
        step: re.sub("━[━╸╺]*|[╸╺]━*", "BAR", frame) for step, frame in _live_frames(width).items()
    }
    assert frames["950/1000"] == f"step 950/1000 BAR eta 0:00:50 loss 124.5  lr 1.00e-03{at_950}"
    assert frames["1000/1000"] == f"step 1000/1000 BAR eta 0:00:00 loss 174.5  lr 1.00e-03{at_1000}"


def test_a_finished_bar_is_green_on_16_colours_not_grey() -> None:
    styled = _live_frames(80)["styled"]  # the last render: 1000/1000
    assert "\x1b[32m━━━━━━" in styled  # green (rich's default, 8: grey, reads as empty)
    assert "\x1b[90m" not in styled.split(" eta ")[0]


@pytest.mark.parametrize("terminal", [False, True])
def test_display_stops_cleanly_when_training_raises(terminal: bool) -> None:
    console, clock = recorded(terminal), FakeTime(lambda i: 1.0)

    def boom(event: Event) -> None:
        if event.kind == "step" and event.state.step == 3:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        train(
            progress(every=2, console=console, clock=clock),
            clock,
            max_steps=6,
            plugins_before=[boom],
        )
    steps = [s for s in ("step 2/6", "step 3/6") if s in text(console)]
    assert steps == ["step 2/6"]  # no sync and no line after the error
    if terminal:
        assert console.file.getvalue().endswith("\x1b[?25h")
        with rich.progress.Progress(console=console, auto_refresh=False):
            pass


# ---------------------------------------------------------------- ETA


def test_eta_leaves_the_warm_up_updates_out() -> None:
    # Five slow updates (compilation, caches), then one second each.
    console, clock = recorded(False), FakeTime(lambda i: 100.0 if i <= 5 else 1.0)
    train(progress(every=10, warmup=5, console=console, clock=clock), clock, max_steps=20)
    assert [line.split(" | ")[-1] for line in lines(console)] == ["eta 0:00:10", "eta 0:00:00"]


def test_eta_without_warm_up_includes_everything() -> None:
    console, clock = recorded(False), FakeTime(lambda i: 100.0 if i <= 5 else 1.0)
    train(progress(every=10, warmup=0, console=console, clock=clock), clock, max_steps=20)
    assert lines(console)[0].endswith("eta 0:08:25")  # 505 s / 10 updates x 10 left


@pytest.mark.parametrize("same_plugin", [False, True])
def test_eta_restarts_after_a_resume(same_plugin: bool) -> None:
    console = recorded(False)
    clock = FakeTime(lambda i: 1.0)
    plugin = progress(every=10, warmup=5, console=console, clock=clock)
    state = train(plugin, clock, max_steps=10)
    # The resumed run warms up again (slow), then takes 2 s per update.
    clock.seconds = lambda i: 100.0 if i <= 15 else 2.0
    if not same_plugin:  # a restarted process builds its plugins anew
        plugin = progress(every=10, warmup=5, console=console, clock=clock)
    train(plugin, clock, max_steps=30, state=state)
    tail = [(line.split(" | ")[0], line.split(" | ")[-1]) for line in lines(console)]
    assert tail == [
        ("step 10/10", "eta 0:00:00"),
        ("step 20/30", "eta 0:00:20"),  # 2 s x 10 left: the slow warm-up is left out again
        ("step 30/30", "eta 0:00:00"),
    ]


def test_no_total_no_eta() -> None:
    class Batches:  # re-iterable without a length: the total is unknown
        def __iter__(self) -> Iterator[torch.Tensor]:
            return iter([torch.ones(4, 1)] * 3)

    console, clock = recorded(False), FakeTime(lambda i: 1.0)

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        clock.tick()
        return model.weight.sum() * 0 + batch.mean()

    plugin = progress(every=1, warmup=0, console=console, clock=clock)
    run(make_step(loss_fn), frozen_state(), Batches(), epochs=1, plugins=[plugin])
    assert lines(console) == [f"step {i} | loss 1 | lr 1.00e-03 | 4 samples/s" for i in (1, 2, 3)]


# ---------------------------------------------------------------- what a line shows


def test_tokens_per_second_only_when_counts_are_reported() -> None:
    console, clock = recorded(False), FakeTime(lambda i: 0.5)
    train(progress(every=2, console=console, clock=clock), clock, max_steps=2, counts=True)
    (line,) = lines(console)
    assert "| 8 samples/s | 20 tokens/s" in line  # 8 samples, 20 tokens in 1 s
    console, clock = recorded(False), FakeTime(lambda i: 0.5)
    train(progress(every=2, console=console, clock=clock), clock, max_steps=2)
    assert "tokens/s" not in lines(console)[0]


def test_batches_without_a_leading_dimension_weigh_one_and_show_no_sample_rate() -> None:
    console, clock = recorded(terminal=False), FakeTime(lambda i: 1.0)

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        clock.tick()
        return model.weight.sum() * 0 + batch  # a 0-d batch: no sample count

    data = [torch.tensor(float(i)) for i in range(4)]
    plugin = progress(every=2, warmup=0, console=console, clock=clock)
    run(make_step(loss_fn), frozen_state(), data, max_steps=4, plugins=[plugin])
    assert [line.split(" | ")[:3] for line in lines(console)] == [
        ["step 2/4", "loss 0.5", "lr 1.00e-03"],
        ["step 4/4", "loss 2.5", "lr 1.00e-03"],
    ]
    assert "samples/s" not in text(console)


def test_count_rate_label_is_configurable() -> None:
    console, clock = recorded(False), FakeTime(lambda i: 0.5)
    train(
        progress(every=2, console=console, clock=clock, counts="targets"),
        clock,
        max_steps=2,
        counts=True,
    )
    (line,) = lines(console)
    assert "| 20 targets/s" in line and "tokens/s" not in line


def _publishes(name: str, metrics: dict[str, float]):
    def plugin(event: Event) -> TrainState | None:
        if event.kind == "step" and event.out is not None and event.out.updated:
            entry = {"step": event.state.step, "values": metrics}
            return event.state.replace(metrics={**event.state.metrics, name: entry})
        return None

    return plugin


def test_validation_metrics_are_shown_by_default_and_show_selects_entries() -> None:
    val = _publishes("val", {"loss": 0.25, "accuracy": 0.9375})
    other = _publishes("other", {"score": 3.0})
    console, clock = recorded(False), FakeTime(lambda i: 1.0)
    train(
        progress(every=1, console=console, clock=clock),
        clock,
        max_steps=1,
        plugins_before=[val, other],
    )
    (line,) = lines(console)
    assert "| lr 1.00e-03 | val/loss 0.25 | val/accuracy 0.938 | 4 samples/s" in line
    assert "other/" not in line
    console, clock = recorded(False), FakeTime(lambda i: 1.0)
    train(
        progress(every=1, console=console, clock=clock, show=(n for n in ["other"])),
        clock,
        max_steps=1,
        plugins_before=[val, other],
    )
    (line,) = lines(console)
    assert "| other/score 3 |" in line and "val/" not in line  # a generator works too


def test_windows_the_guard_rejected_are_left_out_of_the_loss() -> None:
    console, clock = recorded(terminal=False), FakeTime(lambda i: 1.0)

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        clock.tick()
        return model.weight.sum() * 0 + batch.mean()

    data = [torch.full((4, 1), v) for v in (1.0, 2.0, float("nan"), 3.0)]
    step = guard_nonfinite(make_step(loss_fn), max_retries=3)
    plugin = progress(every=3, warmup=0, console=console, clock=clock)
    run(step, frozen_state(), data, max_steps=3, plugins=[plugin])
    assert [line.split(" | ")[:2] for line in lines(console)] == [["step 3/3", "loss 2"]]


def test_grad_norm_shown_when_the_step_computes_it() -> None:
    console, clock = recorded(False), FakeTime(lambda i: 1.0)
    train(
        progress(every=1, console=console, clock=clock),
        clock,
        max_steps=1,
        step_wrapper=lambda s: clip(s, max_norm=1.0),
    )
    assert "| grad_norm 0 |" in lines(console)[0]  # the loss does not depend on the weights
    console, clock = recorded(False), FakeTime(lambda i: 1.0)
    train(progress(every=1, console=console, clock=clock), clock, max_steps=1)
    assert "grad_norm" not in lines(console)[0]


def test_peak_memory_is_shown_with_its_prefix_like_any_entry() -> None:
    def memory(event: Event) -> TrainState | None:
        if event.kind == "step":
            entry = {"step": event.state.step, "values": {"peak_gib": 1.5}}
            return event.state.replace(metrics={**event.state.metrics, "memory": entry})
        return None

    console, clock = recorded(False), FakeTime(lambda i: 1.0)
    train(
        progress(every=1, console=console, clock=clock),
        clock,
        max_steps=1,
        plugins_before=[memory],
    )
    assert "| lr 1.00e-03 | memory/peak_gib 1.5 | 4 samples/s" in lines(console)[0]


def test_one_host_sync_per_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    read_as_on_an_accelerator(monkeypatch)
    tolists = count_tolists(monkeypatch)
    console, clock = recorded(False), FakeTime(lambda i: 1.0)
    with CountSyncs() as syncs:
        train(
            progress(every=3, console=console, clock=clock),
            clock,
            max_steps=6,
            counts=True,
            step_wrapper=lambda s: clip(s, max_norm=1.0),
        )
    assert syncs.count == 0
    assert tolists == [3 * 3, 3 * 3]  # per refresh: 3 x (loss, count, grad norm), at once


# ---------------------------------------------------------------- ranks and bad input


@pytest.mark.parametrize("terminal", [False, True])
def test_silent_on_other_ranks(monkeypatch: pytest.MonkeyPatch, terminal: bool) -> None:
    monkeypatch.setattr(_progress, "is_rank_zero", lambda: False)
    console, clock = recorded(terminal), FakeTime(lambda i: 1.0)
    train(progress(every=1, console=console, clock=clock), clock, max_steps=3)
    assert console.file.getvalue() == ""


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"every": 0}, ValueError, r"progress: every must be an int >= 1 .*got 0"),
        ({"every": 2.0}, ValueError, r"progress: every must be an int >= 1"),
        ({"warmup": -1}, ValueError, r"progress: warmup must be an int >= 0 .*got -1"),
        ({"console": io.StringIO()}, TypeError, r"console must be a rich.console.Console"),
        ({"clock": 3.0}, TypeError, r"clock must be a function returning seconds; got 3.0"),
        ({"show": "val"}, TypeError, r"show must be a sequence of .*entry names.*; got 'val'"),
        ({"counts": ""}, TypeError, r"counts must be a non-empty str, e.g. 'tokens'; got ''"),
        ({"min_interval": -1}, ValueError, r"min_interval must be a number of seconds >= 0"),
        ({"min_interval": "0.1"}, ValueError, r"min_interval must be a number .*got '0.1'"),
        ({"min_interval": float("nan")}, ValueError, r"min_interval must be a number"),
        ({"min_interval": True}, ValueError, r"min_interval must be a number"),
        ({"records": "acc"}, TypeError, r"records must be a sequence of record names; got 'acc'"),
        ({"records": [1]}, TypeError, r"records must be a sequence .*; got \(1,\)"),
        ({"times": 1}, TypeError, r"times must be True or False; got 1"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        progress(**kwargs)


# ---------------------------------------------------------------- records and times


def _plain(plugin_kwargs: dict) -> tuple[Callable[[Event], Any], rich.console.Console]:
    console = recorded(False)
    ticks = iter(range(100))
    plugin = progress(2, console=console, clock=lambda: next(ticks), min_interval=0, warmup=0,
                      **plugin_kwargs)  # fmt: skip
    return plugin, console


def test_chosen_records_are_shown_as_their_weighted_mean() -> None:
    # Update 1: 1 token of accuracy 1, 3 tokens of accuracy 0; update 2: 4 of 0.5, with
    # logits kept for another plugin (not a scalar, not chosen: ignored).
    batches = [(1, 1.0), (3, 0.0), (4, 0.5), (4, 0.5)]

    def loss_fn(model: torch.nn.Module, batch: tuple) -> LossSum:
        n, acc = batch
        records = {"acc": torch.tensor(acc), "other": 9.0, "logits": torch.ones(n, 3)}
        return LossSum(model.weight.sum() * 0 + n, n, records)

    plugin, console = _plain({"records": ["acc"]})
    run(make_step(loss_fn), frozen_state(), batches, max_steps=4, plugins=[plugin])
    first, second = lines(console)
    assert "| acc 0.25 |" in first and "| acc 0.5 |" in second  # (1*1 + 3*0) / 4
    assert "other" not in first + second


def test_a_chosen_record_that_is_not_a_scalar_is_refused() -> None:
    plugin, _ = _plain({"records": ["logits"]})
    loss_fn = lambda m, b: (m.weight.sum() * 0 + b, {"logits": torch.ones(2, 3)})  # noqa: E731
    with pytest.raises(
        ValueError, match=r"progress: record 'logits' must be a number or a one-element"
    ):
        run(make_step(loss_fn), frozen_state(), [1.0, 2.0], max_steps=2, plugins=[plugin])


def test_times_show_the_mean_data_and_step_time_per_update() -> None:
    plugin, console = _plain({"times": True})
    state = frozen_state()
    loop = LoopInfo(None, None, None, 1, 0, 4)
    plugin(Event("start", state, loop))
    times = [(0.002, 0.010), (0.004, 0.030), (0.5, 2.0), (1.5, 4.0)]
    for i, (data_time, step_time) in enumerate(times, start=1):
        state = state.replace(step=i)
        o = StepOutput(torch.tensor(1.0), {}, None, 4, True, True, lr=0.1)
        plugin(Event("step", state, loop, o, data_time, step_time, None, (o,)))
    first, second = lines(console)
    assert "| 8 samples/s | data 3ms | step 20ms | eta" in first  # (2 + 4) / 2, (10 + 30) / 2
    assert "| data 1s | step 3s | eta" in second
    plugin, console = _plain({})
    plugin(Event("start", state.replace(step=0), loop))
    plugin(Event("step", state.replace(step=2), loop, o, 0.5, 0.5, None, (o,)))
    assert "data" not in text(console)
