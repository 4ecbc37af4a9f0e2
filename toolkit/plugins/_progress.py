"""progress: a rich progress bar (or plain lines in logs) with loss, LR, throughput and ETA."""

import dataclasses
import datetime
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import rich
import rich.console
from rich.cells import cell_len
from rich.progress import BarColumn, Progress, RenderableColumn, TextColumn
from rich.table import Column
from rich.text import Text

from toolkit._checks import check, check_bool, check_count
from toolkit.distributed._collectives import is_rank_zero
from toolkit.loop._run import Event, plugin_factory
from toolkit.plugins._interval import Interval, flat_scalars, read
from toolkit.plugins._metrics import warn_nonfinite
from toolkit.plugins._shared import due
from toolkit.step._state import TrainState
from toolkit.step._step import StepOutput


@dataclasses.dataclass(slots=True)
class _Bar:
    """progress's options, and its memory during a run on rank 0 (``shown`` None outside)."""

    every: int
    warmup: int
    clock: Callable[[], float]
    show: Sequence[str]
    counts: str
    min_interval: float
    records: Sequence[str]
    show_times: bool
    console: rich.console.Console | None  # as given; None for rich's global console
    shown: rich.console.Console | None = None  # the console drawn on in this run
    total: int | None = None  # updates in the run, when known
    # The outputs of each window since the last refresh, read at the refresh. Not the
    # events: their states may hold large extras.
    windows: list[tuple[StepOutput, ...]] = dataclasses.field(default_factory=list)
    lr: Any = None  # the last applied update's learning rate, once read
    times: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0])  # data, step
    warm_from: int = 0  # state.step from which updates are timed for the ETA
    warm_at: float | None = None  # clock() at that step, once reached
    last_time: float = 0.0  # clock() at the last refresh
    shown_step: int = 0  # state.step of the last line
    live: Progress | None = None
    info: RenderableColumn | None = None  # the live bar's fields
    nonfinite: bool = False  # a non-finite loss was reported in this run


@plugin_factory(order=90)
def progress(
    every: int = 10,
    *,
    warmup: int = 5,
    console: rich.console.Console | None = None,
    clock: Callable[[], float] = time.perf_counter,
    show: Sequence[str] = ("val", "val_ema", "memory"),
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
    rate the last update used, the latest metrics of each ``state.metrics`` entry named in
    ``show`` (by default the validation results of :func:`toolkit.plugins.validate` as
    ``val/<metric>``, those of the EMA weights under ``key="val_ema"``, and the peak memory
    of :func:`toolkit.plugins.peak_memory`), each marked with its update when measured at an
    earlier one (``val/loss 0.224 @100``), the mean gradient norm (when the step computes
    it, under :func:`toolkit.clip` or :func:`toolkit.guard_nonfinite`), samples/s and, when
    the loss reports target counts (:class:`toolkit.LossSum`), their rate (``counts``/s,
    tokens/s by default), and the ETA. With
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
    background thread): the step, the bar (green once finished) and the ETA, then the
    fields in the order above, which is their priority: where the terminal is too narrow,
    the bar shrinks and whole fields are dropped from the end, never cut inside a name or a
    value (at 80 columns the step, the bar, the ETA, the loss, the LR and the validation
    loss fit). Otherwise (CI logs, output redirected to a file) one plain line is written to
    the console's file and flushed per refresh, for example::

        step 200/900 | loss 0.4312 | lr 1.00e-03 | val/loss 0.451 @100 | 987 samples/s | eta 0:02:12

    The live bar is stopped at ``"end"``, also when training raised. Each refresh reads its
    values back at once, as :func:`toolkit.key_average` does (one host sync), and nothing
    in between. Only rank 0 shows anything (and does any work); the loss shown is rank 0's.
    A non-finite loss (no :func:`toolkit.guard_nonfinite` left its window out) is said once
    per run in a ``RuntimeWarning`` with its update, from the values read anyway.

    Args:
        every: updates between refreshes (>= 1).
        warmup: updates of this run left out of the ETA measurement (>= 0).
        console: the ``rich.console.Console`` to draw on; ``None`` uses rich's global
            console (standard output).
        clock: a function returning seconds (default ``time.perf_counter``), for the ETA
            and throughput; tests pass a fake clock for deterministic output.
        show: names of ``state.metrics`` entries (what plugins publish) whose values are
            shown as ``name/metric``, e.g. ``memory/peak_gib``.
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
    # Tuples first: a generator is read once.
    show, records = (tuple(n) if isinstance(n, Iterable) and not isinstance(n, str) else n
                     for n in (show, records))  # fmt: skip
    who = "progress"
    for name, names, what in (("show", show, "metrics entry"), ("records", records, "record")):
        ok = isinstance(names, tuple) and all(isinstance(n, str) for n in names)
        check(ok, who, name, f"a sequence of {what} names", names, "", TypeError)
    check_bool(who, "times", times)
    ok = isinstance(counts, str) and bool(counts)
    check(ok, who, "counts", "a non-empty str, e.g. 'tokens'", counts, "", TypeError)
    check_count(who, "every", every, 1, "updates between refreshes")
    check_count(who, "warmup", warmup, 0, "updates left out of the ETA")
    ok = isinstance(min_interval, (int, float)) and not isinstance(min_interval, bool)
    check(ok and min_interval >= 0, who, "min_interval", "a number of seconds >= 0", min_interval)
    ok = console is None or isinstance(console, rich.console.Console)
    check(ok, who, "console", "a rich.console.Console or None", console, "", TypeError)
    check(callable(clock), who, "clock", "a function returning seconds", clock, "", TypeError)
    bar = _Bar(every, warmup, clock, show, counts, min_interval, records, times, console)

    def plugin(event: Event) -> None:
        if event.kind == "step" and bar.shown is not None:  # None off rank 0, outside a run
            _step(bar, event)
        elif event.kind == "start" and is_rank_zero():
            _start(bar, event)
        elif event.kind == "end" and bar.shown is not None:
            try:
                if event.error is None and event.state.step != bar.shown_step:
                    _refresh(bar, event.state, bar.clock(), event.outs)
            finally:
                _stop(bar)

    return plugin


def _start(bar: _Bar, event: Event) -> None:
    _stop(bar)  # a run that ended without "end"
    shown = bar.console if bar.console is not None else rich.get_console()
    now, step, bar.total, bar.lr = bar.clock(), event.state.step, event.loop.total_steps, None
    bar.shown, bar.last_time, bar.shown_step = shown, now, step
    bar.warm_from, bar.warm_at = step + bar.warmup, now if bar.warmup == 0 else None
    if shown.is_terminal:
        # The step count, the bar and the ETA are never cut (no_wrap); the fields are the one
        # column the table may narrow, cut at its end with an ellipsis (no_wrap Text).
        whole, bar.info = Column(no_wrap=True), RenderableColumn(Text(""), table_column=Column())
        columns = (
            TextColumn("{task.fields[head]}", table_column=whole),
            # Green when finished: rich's default is grey on 16 colours, as if empty.
            BarColumn(min(40, shown.width // 5), finished_style="green", table_column=whole),
            TextColumn("{task.fields[eta]}", table_column=whole),
        )
        # Redrawn at refreshes only (no auto_refresh): no thread competing with training.
        bar.live = Progress(*columns, bar.info, console=shown, auto_refresh=False)
        bar.live.add_task("", total=bar.total, completed=step, head=_head(step, bar.total), eta="")
        bar.live.start()


def _step(bar: _Bar, event: Event) -> None:
    bar.windows.append(event.outs)
    bar.times = [bar.times[0] + event.data_time, bar.times[1] + event.step_time]
    # Start the ETA clock after the update that ends the warm-up.
    if bar.warm_at is None and bar.warm_from == event.state.step and event.out.updated:  # type: ignore[union-attr]
        bar.warm_at = bar.clock()
    if due(event, bar.every) and (now := bar.clock()) - bar.last_time >= bar.min_interval:
        _refresh(bar, event.state, now)


def _refresh(bar: _Bar, state: TrainState, now: float, open_window: Any = ()) -> None:
    windows, interval = len(bar.windows), Interval()
    flatten = functools.partial(flat_scalars, chosen=frozenset(bar.records), who="progress")
    read(interval, bar.windows, open_window, flatten if bar.records else None)  # one host sync
    bar.windows.clear()
    bar.lr = interval.lr if interval.lr is not None else bar.lr
    elapsed, bar.last_time = now - bar.last_time, now
    loss = _mean(interval, "loss")
    bar.nonfinite = bar.nonfinite or warn_nonfinite("progress", loss, state.step)
    fields = [  # by priority: where the line is too narrow, the last ones are dropped whole
        f"loss {loss:.4g}" if loss is not None else "",
        f"lr {float(bar.lr):.2e}" if bar.lr is not None else "",
        *(field for name in bar.show for field in _entry_fields(state, name)),
        f"grad_norm {interval.norm_total / interval.norms:.3g}" if interval.norms else "",
        *(f"{name} {m:.4g}" for name in bar.records if (m := _mean(interval, name)) is not None),
        _per_second(interval.samples, elapsed, "samples"),
        _per_second(interval.targets, elapsed, bar.counts),
    ]
    if bar.show_times and windows:  # seconds per update since the last refresh
        fields += [f"{n} {_duration(t / windows)}" for n, t in zip(("data", "step"), bar.times)]
    bar.times = [0.0, 0.0]
    bar.shown_step, eta, head = state.step, _eta(bar, now, state.step), _head(state.step, bar.total)
    if bar.live is None:
        # A plain line straight to the console's file: rendering it through rich would cost
        # ~100x more, for nothing to style in a log.
        line = " | ".join(part for part in (head, *fields, eta) if part)
        print(line, file=bar.shown.file, flush=True)  # type: ignore[union-attr]
        return
    width = bar.shown.width  # type: ignore[union-attr]
    room = width - cell_len(head) - cell_len(eta) - 3  # for the bar and the fields (3 gaps)
    least = max(6, width // 5 - 10)  # the bar's least width: 6 at 80 columns, 22 at 160
    info = _fit(fields, room - least)
    bar.live.columns[1].bar_width = max(least, min(40, width // 5, room - cell_len(info)))  # type: ignore[union-attr]
    bar.info.renderable = Text(info, no_wrap=True, overflow="ellipsis")  # type: ignore[union-attr]
    bar.live.update(bar.live.task_ids[0], completed=state.step, head=head, eta=eta)
    bar.live.refresh()


def _entry_fields(state: TrainState, name: str) -> list[str]:
    """The fields of another plugin's metrics ``name`` (``name/metric value``), each marked
    ``@step`` when measured at an earlier update than this one."""
    if name not in state.metrics:
        return []
    step, values = state.metrics[name]["step"], state.metrics[name]["values"]
    mark = f" @{step}" if step < state.step else ""
    return [f"{name}/{k} {v:.3g}{mark}" for k, v in values.items() if isinstance(v, (int, float))]


def _fit(fields: Sequence[str], width: int) -> str:
    """The first ``fields`` that fit ``width`` cells together: whole ones, never cut."""
    kept = list(filter(None, fields))
    while cell_len("  ".join(kept)) > width:
        kept.pop()
    return "  ".join(kept)


def _stop(bar: _Bar) -> None:
    bar.windows.clear()
    bar.times = [0.0, 0.0]
    bar.shown, live, bar.live, bar.nonfinite = None, bar.live, None, False
    if live is not None:
        live.stop()


def _mean(interval: Interval, name: str) -> float | None:
    total, weight = interval.sums.get(name, (0.0, 0))
    return total / weight if weight else None


def _per_second(count: float | None, elapsed: float, what: str) -> str:
    rate = count / elapsed if count is not None and elapsed > 0 else None
    return "" if rate is None else f"{rate:{'.0f' if rate >= 100 else '.3g'}} {what}/s"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}ms" if seconds < 1 else f"{seconds:.3g}s"


def _head(step: int, total: int | None) -> str:
    return f"step {step}/{total}" if total is not None else f"step {step}"


def _eta(bar: _Bar, now: float, step: int) -> str:
    timed = step - bar.warm_from  # updates since the ETA clock started
    if bar.warm_at is None or bar.total is None or timed <= 0:
        return ""
    seconds = (now - bar.warm_at) / timed * max(bar.total - step, 0)
    return f"eta {datetime.timedelta(seconds=round(seconds))}"
