"""progress: a rich progress bar (or plain lines in logs) with loss, LR, throughput and ETA."""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import rich
import rich.console
import rich.progress

from toolkit._checks import check_count
from toolkit.distributed._collectives import is_rank_zero
from toolkit.loop._run import Event, plugin_factory
from toolkit.plugins._interval import Interval, flat_scalars, read
from toolkit.plugins._shared import due, metric_entry
from toolkit.step._state import TrainState
from toolkit.step._step import StepOutput

__all__ = ["progress"]


def _rate(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}ms" if seconds < 1 else f"{seconds:.3g}s"


@dataclasses.dataclass(frozen=True)
class _Options:
    """progress's arguments, checked."""

    every: int
    warmup: int
    console: rich.console.Console | None
    clock: Callable[[], float]
    show: tuple[str, ...]
    counts: str
    min_interval: float
    records: tuple[str, ...]
    times: bool

    def __post_init__(self) -> None:
        for name, names in (("show", self.show), ("records", self.records)):
            if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
                what = "state.extras entry" if name == "show" else "the loss function's record"
                raise TypeError(
                    f"progress: {name} must be a sequence of {what} names; got {names!r}."
                )
        if not isinstance(self.times, bool):
            raise TypeError(f"progress: times must be True or False; got {self.times!r}.")
        if not isinstance(self.counts, str) or not self.counts:
            raise TypeError(
                f"progress: counts must be a non-empty str, e.g. 'tokens'; got {self.counts!r}."
            )
        check_count("progress", "every", self.every, 1, "updates between refreshes")
        check_count("progress", "warmup", self.warmup, 0, "updates left out of the ETA")
        interval = self.min_interval
        if (
            isinstance(interval, bool)
            or not isinstance(interval, (int, float))
            or not interval >= 0
        ):
            raise ValueError(
                f"progress: min_interval must be a number of seconds >= 0; got {interval!r}."
            )
        if self.console is not None and not isinstance(self.console, rich.console.Console):
            got = type(self.console).__name__
            raise TypeError(f"progress: console must be a rich.console.Console or None; got {got}.")
        if not callable(self.clock):
            got = type(self.clock).__name__
            raise TypeError(f"progress: clock must be a function returning seconds; got {got}.")


@plugin_factory(order=90)
def progress(
    every: int = 10,
    *,
    warmup: int = 5,
    console: rich.console.Console | None = None,
    clock: Callable[[], float] = time.perf_counter,
    show: Sequence[str] = ("val", "memory"),
    counts: str = "tokens",
    min_interval: float = 0.1,
    records: Sequence[str] = (),
    times: bool = False,
) -> Callable[[Event], TrainState | None]:
    """A plugin showing training progress: a rich bar in a terminal, plain lines otherwise.

    Every ``every`` updates (when ``state.step`` is a multiple of ``every``), at most once
    per ``min_interval`` seconds, and at the end, it shows: the step out of the run's total
    (when known), the count-weighted mean loss of the micro-batches since the last refresh
    (those of windows that :func:`toolkit.guard_nonfinite` rejected left out), the learning
    rate the last update used, the mean gradient norm (when the step computes it, under
    :func:`toolkit.clip` or :func:`toolkit.guard_nonfinite`), samples/s and, when the loss
    reports target counts (:class:`toolkit.LossSum`), their rate (``counts``/s, tokens/s by
    default), the latest metrics of each ``state.extras`` entry named in ``show`` (by
    default the validation results of :func:`toolkit.plugins.validate` as ``val/<metric>``,
    and the peak memory of :func:`toolkit.plugins.peak_memory`), and the ETA. With
    ``records``, it also shows those records of the loss function (flattened with "/",
    e.g. ``"accuracy"`` or ``"acc/top1"``), each the count-weighted mean over the
    micro-batches since the last refresh (as the loss is; a record missing from some is
    averaged over those that have it); with ``times=True``, the mean seconds per update
    spent waiting for data and in the step (``data 1.2ms | step 35ms``), as ``run``
    measured them.

    The time limit is tqdm's ``mininterval``: faster than about ten refreshes a second a
    display is unreadable and a log floods, and each refresh costs a host sync and some
    formatting. A refresh due less than ``min_interval`` after the previous one is left
    out; its micro-batches count into the next one, so every line is still the mean over
    all micro-batches since the line before. ``min_interval=0`` refreshes at every
    multiple of ``every``.

    The ETA is the time per update measured from the ``warmup``-th update of this run (so
    compilation and cache warm-up are left out, and the measurement restarts after a
    resume) times the updates left; it appears once an update has been timed.

    When the console is a terminal, a live bar is drawn (refreshed only at those points: no
    background thread). Otherwise (CI logs, output redirected to a file) one plain line is
    written to the console's file and flushed per refresh, for example::

        step 20/100 | loss 0.4312 | lr 1.00e-03 | grad_norm 0.53 | 1234 samples/s | eta 0:00:12

    The live bar is stopped at ``"end"``, also when training raised. Each refresh reads its
    values back at once, as :func:`toolkit.key_average` does (one host sync), and nothing
    in between. Only rank 0 shows anything (and does any work); the loss shown is rank 0's.

    Args:
        every: updates between refreshes (>= 1).
        warmup: updates of this run left out of the ETA measurement (>= 0).
        console: the ``rich.console.Console`` to draw on; ``None`` uses rich's global
            console (standard output).
        clock: a function returning seconds (default ``time.perf_counter``), for the ETA
            and throughput; tests pass a fake clock for deterministic output.
        show: names of ``state.extras`` entries (of the ``{"step", "metrics"}`` form plugins
            publish) whose metrics are shown as ``name/metric``, e.g. ``memory/peak_gib``.
        counts: what the loss's target counts are, for the rate label (``"tokens"``,
            ``"targets"``, ``"pixels"``...).
        min_interval: seconds (by ``clock``) that must have passed since the previous
            refresh for a refresh to happen (>= 0; default 0.1).
        records: names of the loss function's records to show (numbers or one-element
            tensors; a named record of another kind raises when read).
        times: show the data and step time per update.

    Returns:
        The plugin, a function ``plugin(event) -> None``.

    Raises:
        ValueError: ``every`` is not an int >= 1, ``warmup`` not an int >= 0, or
            ``min_interval`` not a number >= 0.
        TypeError: ``console`` is not a rich Console, ``clock`` is not callable, ``show`` or
            ``records`` is not a sequence of names, ``counts`` not a non-empty string, or
            ``times`` not a bool; (while training) a record in ``records`` that is not a
            number.
        ValueError: (while training) a record in ``records`` that is a tensor of several
            elements.

    Example:
        >>> import io, itertools, torch
        >>> from rich.console import Console
        >>> from toolkit import TrainState, make_step, run
        >>> from toolkit.plugins import progress
        >>> model = torch.nn.Linear(1, 1, bias=False)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
        >>> step = make_step(lambda m, b: m(b).sum() * 0 + b.mean())  # loss = batch mean
        >>> data = [torch.full((4, 1), float(i)) for i in range(4)]
        >>> console = Console(file=io.StringIO(), width=100)  # not a terminal: plain lines
        >>> ticks = itertools.count()  # a fake clock: one second per call
        >>> plugin = progress(every=2, warmup=1, console=console, clock=lambda: next(ticks))
        >>> _ = run(step, state, data, max_steps=4, plugins=[plugin])
        >>> print(console.file.getvalue(), end="")
        step 2/4 | loss 0.5 | lr 0.00e+00 | 4 samples/s | eta 0:00:02
        step 4/4 | loss 2.5 | lr 0.00e+00 | 8 samples/s | eta 0:00:00

        A record of the loss function (the share of inputs above 2), shown as its mean:

        >>> def loss_fn(m, b):
        ...     return m(b).sum() * 0 + b.mean(), {"above_2": (b > 2).float().mean()}
        >>> console = Console(file=io.StringIO(), width=100)
        >>> plugin = progress(every=2, warmup=1, console=console, clock=lambda: next(ticks),
        ...                   records=["above_2"])
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
        >>> _ = run(make_step(loss_fn), state, data, max_steps=4, plugins=[plugin])
        >>> print(console.file.getvalue(), end="")
        step 2/4 | loss 0.5 | lr 0.00e+00 | above_2 0 | 4 samples/s | eta 0:00:02
        step 4/4 | loss 2.5 | lr 0.00e+00 | above_2 0.5 | 8 samples/s | eta 0:00:00
    """
    # Tuples before checking, so that a generator is not used up by the check.
    options = _Options(
        every,
        warmup,
        console,
        clock,
        _names(show),
        counts,
        min_interval,
        _names(records),
        times,
    )
    memory = _Memory()

    def plugin(event: Event) -> None:
        kind = event.kind
        if kind == "step":
            if memory.console is not None:  # None off rank 0 and outside a run
                _step(memory, options, event)
        elif kind == "start":
            _stop(memory)
            if is_rank_zero():
                _start(memory, options, event)
        elif kind == "end" and memory.console is not None:
            try:
                if event.error is None and event.state.step != memory.shown_step:
                    _refresh(memory, options, event.state, options.clock(), event.outs)
            finally:
                _stop(memory)
        return None

    return plugin


@dataclasses.dataclass(slots=True)
class _Memory:
    """progress's memory during a run on rank 0; ``console`` is None outside one."""

    console: rich.console.Console | None = None
    total: int | None = None  # updates in the run, when known
    # The outputs of each window since the last refresh, read at the refresh. Not the
    # events: their states may hold large extras.
    windows: list[tuple[StepOutput, ...]] = dataclasses.field(default_factory=list)
    lr: Any = None  # the last applied update's learning rate, once read
    data_time: float = 0.0  # seconds since the last refresh (with times=True)
    step_time: float = 0.0
    warm_step: int = -1  # state.step that ends the warm-up; -1 once the ETA clock runs
    warm_from: int = 0  # state.step from which updates are timed for the ETA
    warm_at: float | None = None  # clock() at that step
    last_time: float = 0.0  # clock() at the last refresh
    shown_step: int = 0  # state.step of the last line
    bar: rich.progress.Progress | None = None
    task: Any = None


def _start(memory: _Memory, options: _Options, event: Event) -> None:
    shown = options.console if options.console is not None else rich.get_console()
    now, step, warmup = options.clock(), event.state.step, options.warmup
    memory.console, memory.total, memory.lr = shown, event.loop.total_steps, None
    memory.warm_step = step + warmup if warmup else -1
    memory.warm_from, memory.warm_at = step + warmup, now if warmup == 0 else None
    memory.last_time, memory.shown_step = now, step
    if shown.is_terminal:
        memory.bar = rich.progress.Progress(
            rich.progress.TextColumn("{task.fields[head]}"),
            rich.progress.BarColumn(),
            rich.progress.TextColumn("{task.fields[info]}"),
            console=shown,
            auto_refresh=False,  # redrawn at refreshes only: no thread competing with training
        )
        head = _head(step, memory.total)
        memory.task = memory.bar.add_task(
            "train", total=memory.total, completed=step, head=head, info=""
        )
        memory.bar.start()


def _step(memory: _Memory, options: _Options, event: Event) -> None:
    memory.windows.append(event.outs)
    if options.times:
        memory.data_time += event.data_time
        memory.step_time += event.step_time
    # Start the ETA clock after the update that ends the warm-up.
    if memory.warm_step == event.state.step and event.out.updated:  # type: ignore[union-attr]
        memory.warm_at, memory.warm_step = options.clock(), -1
    if due(event, options.every):
        now = options.clock()
        if now - memory.last_time >= options.min_interval:
            _refresh(memory, options, event.state, now)


def _refresh(
    memory: _Memory,
    options: _Options,
    state: TrainState,
    now: float,
    open_window: Sequence[StepOutput] = (),
) -> None:
    windows, interval = len(memory.windows), Interval()
    chosen = frozenset(options.records)
    flatten = (lambda record: flat_scalars(record, chosen, "progress")) if chosen else None
    read(interval, memory.windows, open_window, flatten)  # the one host sync of a refresh
    memory.windows.clear()
    memory.lr = interval.lr if interval.lr is not None else memory.lr
    elapsed, memory.last_time = now - memory.last_time, now
    parts = []
    for name in ("loss", *options.records):
        total, weight = interval.sums.get(name, (0.0, 0))
        if weight:
            parts.append(f"{name} {total / weight:.4g}")
        if name == "loss" and memory.lr is not None:
            parts.append(f"lr {float(memory.lr):.2e}")
        if name == "loss" and interval.norms:
            parts.append(f"grad_norm {interval.norm_total / interval.norms:.3g}")
    if elapsed > 0 and interval.samples is not None:
        parts.append(f"{_rate(interval.samples / elapsed)} samples/s")
    if elapsed > 0 and interval.targets is not None:
        parts.append(f"{_rate(interval.targets / elapsed)} {options.counts}/s")
    if options.times and windows:
        parts.append(f"data {_duration(memory.data_time / windows)}")
        parts.append(f"step {_duration(memory.step_time / windows)}")
    memory.data_time = memory.step_time = 0.0
    for entry_name in options.show:
        parsed = metric_entry(state.extras.get(entry_name))
        for name, value in parsed[1].items() if parsed is not None else ():
            if isinstance(value, (int, float)):
                parts.append(f"{entry_name}/{name} {value:.4g}")
    eta = _eta(memory, now, state.step)
    if eta is not None:
        parts.append(f"eta {eta}")
    memory.shown_step = state.step
    _display(memory, state.step, " | ".join(parts))


def _display(memory: _Memory, step: int, info: str) -> None:
    head = _head(step, memory.total)
    if memory.bar is None:
        # A plain line straight to the console's file: rendering it through rich would cost
        # ~100x more, for nothing to style in a log.
        file = memory.console.file  # type: ignore[union-attr]
        file.write(f"{head} | {info}\n" if info else f"{head}\n")
        file.flush()
    else:
        memory.bar.update(memory.task, completed=step, head=head, info=info)
        memory.bar.refresh()


def _stop(memory: _Memory) -> None:
    memory.windows.clear()
    memory.data_time = memory.step_time = 0.0
    memory.console = None
    bar, memory.bar = memory.bar, None
    if bar is not None:
        bar.stop()


def _names(names: Any) -> Any:
    return tuple(names) if isinstance(names, Iterable) and not isinstance(names, str) else names


def _head(step: int, total: int | None) -> str:
    return f"step {step}/{total}" if total is not None else f"step {step}"


def _eta(memory: _Memory, now: float, step: int) -> str | None:
    timed = step - memory.warm_from  # updates since the ETA clock started
    if memory.warm_at is None or memory.total is None or timed <= 0:
        return None
    seconds = (now - memory.warm_at) / timed * max(memory.total - step, 0)
    return str(datetime.timedelta(seconds=round(seconds)))
