"""progress: a rich progress bar (or plain lines in logs) with loss, LR, throughput and ETA."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import rich
import rich.console
import rich.progress
import torch

from toolkit._checks import check_count
from toolkit._distributed import is_rank_zero
from toolkit._host import to_host
from toolkit._loop import Event
from toolkit._state import TrainState
from toolkit._step import StepOutput
from toolkit.plugins._entries import metric_entry
from toolkit.plugins._weighting import columns, weigh

__all__ = ["progress"]


def _rate(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _check(
    every: Any, warmup: Any, console: Any, clock: Any, show: Any, counts: Any, min_interval: Any
) -> None:
    if not isinstance(show, tuple) or not all(isinstance(name, str) for name in show):
        raise TypeError(
            f"progress: show must be a sequence of state.extras entry names; got {show!r}. "
            'Example: progress(show=("val", "memory")).'
        )
    if not isinstance(counts, str) or not counts:
        raise TypeError(
            f"progress: counts must be a non-empty str such as 'tokens'; got {counts!r}."
        )
    check_count(
        "progress", "every", every, 1, "updates between refreshes", "Example: progress(every=10)."
    )
    check_count(
        "progress",
        "warmup",
        warmup,
        0,
        "updates left out of the ETA",
        "Example: progress(every=10, warmup=5).",
    )
    if (
        isinstance(min_interval, bool)
        or not isinstance(min_interval, (int, float))
        or not min_interval >= 0
    ):
        raise ValueError(
            f"progress: min_interval must be a number of seconds >= 0; got {min_interval!r}. "
            "Example: progress(every=10, min_interval=0.1); 0 refreshes at every multiple."
        )
    if console is not None and not isinstance(console, rich.console.Console):
        raise TypeError(
            f"progress: console must be a rich.console.Console or None; got "
            f"{type(console).__name__}. Example: progress(console=Console(stderr=True))."
        )
    if not callable(clock):
        raise TypeError(
            f"progress: clock must be a function returning seconds; got {type(clock).__name__}."
        )


def progress(
    every: int = 10,
    *,
    warmup: int = 5,
    console: rich.console.Console | None = None,
    clock: Callable[[], float] = time.perf_counter,
    show: Sequence[str] = ("val", "memory"),
    counts: str = "tokens",
    min_interval: float = 0.1,
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
    and the peak memory of :func:`toolkit.plugins.peak_memory`), and the ETA.

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

    The live bar is stopped at ``"end"``, also when training raised. Values are synced to
    the host only at a refresh, once (one ``.tolist()``; on the CPU each value is read
    directly, with nothing to wait for). Only rank 0 shows anything (and
    does any work); the loss shown is rank 0's.

    Args:
        every: updates between refreshes (>= 1).
        warmup: updates of this run left out of the ETA measurement (>= 0).
        console: the ``rich.console.Console`` to draw on; ``None`` uses rich's global
            console (standard output).
        clock: a function returning seconds (default ``time.perf_counter``), for the ETA
            and throughput; tests pass a fake clock for deterministic output.
        show: names of ``state.extras`` entries (of the ``{"step", "metrics"}`` form plugins
            publish) whose metrics are shown as ``name/metric``; ``memory`` is shown
            without the prefix.
        counts: what the loss's target counts are, for the rate label (``"tokens"``,
            ``"targets"``, ``"pixels"``...).
        min_interval: seconds (by ``clock``) that must have passed since the previous
            refresh for a refresh to happen (>= 0; default 0.1).

    Returns:
        The plugin, a function ``plugin(event) -> None``.

    Raises:
        ValueError: ``every`` is not an int >= 1, ``warmup`` not an int >= 0, or
            ``min_interval`` not a number >= 0.
        TypeError: ``console`` is not a rich Console, ``clock`` is not callable, ``show`` is
            not a sequence of names, or ``counts`` not a non-empty string.

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
    """
    # A tuple before checking, so that a generator is not used up by the check.
    shown_entries = (
        tuple(show) if isinstance(show, Iterable) and not isinstance(show, str) else show
    )
    _check(every, warmup, console, clock, shown_entries, counts, min_interval)

    # The outputs of each window since the last refresh (the last one closes it), read at
    # the refresh: per update the plugin only appends and compares, since code run between
    # two steps finds cold caches. Not the events: their states may hold large extras.
    windows: list[tuple[StepOutput, ...]] = []
    live: dict[str, Any] = {}
    run: dict[str, Any] = {}
    due_at = [-1]  # state.step of the warm-up's end, while the ETA clock has not started

    def start(event: Event) -> None:
        windows.clear()
        shown = console if console is not None else rich.get_console()
        now = clock()
        run.update(
            console=shown,
            total=event.loop.total_steps,
            lr=None,
            warm_at=now if warmup == 0 else None,
            warm_from=event.state.step + warmup,
            last_time=now,
            shown_step=event.state.step,
        )
        due_at[0] = event.state.step + warmup if warmup else -1
        if shown.is_terminal:
            bar = rich.progress.Progress(
                rich.progress.TextColumn("{task.fields[head]}"),
                rich.progress.BarColumn(),
                rich.progress.TextColumn("{task.fields[info]}"),
                console=shown,
                auto_refresh=False,  # redrawn at refreshes only: no thread competing with training
            )
            live["bar"] = bar
            live["task"] = bar.add_task(
                "train",
                total=run["total"],
                completed=event.state.step,
                head=_head(event.state.step, run["total"]),
                info="",
            )
            bar.start()

    def refresh(state: TrainState, now: float, open_window: Sequence[StepOutput] = ()) -> None:
        # Windows the guard rejected are left out: their losses are not training's.
        outs = [o for window in windows if not window[-1].nonfinite for o in window]
        outs += open_window
        applied = [window[-1] for window in windows if window[-1].updated]
        windows.clear()
        norms = [o.grad_norm for o in applied if o.grad_norm is not None]
        if applied:
            run["lr"] = applied[-1].lr
        lr = run["lr"]
        lr_tensor = [lr.reshape(())] if isinstance(lr, torch.Tensor) else []
        cols = columns(outs)
        values = to_host([*cols.tensors, *norms, *lr_tensor])  # the one host sync of a refresh
        sums = weigh(cols, values)
        own = values[len(cols.tensors) :]  # the norms, then the LR
        elapsed = now - run["last_time"]
        run["last_time"] = now

        parts = []
        if sums.weight:
            parts.append(f"loss {sums.loss / sums.weight:.4g}")
        if lr is not None:
            parts.append(f"lr {(own[-1] if lr_tensor else float(lr)):.2e}")
        if norms:
            parts.append(f"grad_norm {sum(own[: len(norms)]) / len(norms):.3g}")
        if elapsed > 0 and sums.samples is not None:
            parts.append(f"{_rate(sums.samples / elapsed)} samples/s")
        if elapsed > 0 and sums.targets is not None:
            parts.append(f"{_rate(sums.targets / elapsed)} {counts}/s")
        for entry_name in shown_entries:
            parsed = metric_entry(state.extras.get(entry_name))
            if parsed is not None:
                prefix = "" if entry_name == "memory" else f"{entry_name}/"
                for name, value in parsed[1].items():
                    if isinstance(value, (int, float)):
                        parts.append(f"{prefix}{name} {value:.4g}")
        eta = _eta(run, now, state.step)
        if eta is not None:
            parts.append(f"eta {eta}")
        run["shown_step"] = state.step
        display(state.step, " | ".join(parts))

    def display(step: int, info: str) -> None:
        head = _head(step, run["total"])
        bar = live.get("bar")
        if bar is None:
            # A plain line straight to the console's file: rendering it through rich would
            # cost ~100x more, for nothing to style in a log.
            file = run["console"].file
            file.write(f"{head} | {info}\n" if info else f"{head}\n")
            file.flush()
        else:
            bar.update(live["task"], completed=step, head=head, info=info)
            bar.refresh()

    def due(state: TrainState) -> None:
        """An applied update made ``state.step`` the warm-up's end or a multiple of every."""
        if state.step == due_at[0]:
            run["warm_at"] = clock()
            due_at[0] = -1
        if state.step % every == 0:
            now = clock()
            if now - run["last_time"] >= min_interval:
                refresh(state, now)

    def plugin(event: Event) -> None:
        kind = event.kind
        if kind == "step":
            if run:  # empty off rank 0 and outside a run
                windows.append(event.outs)
                step = event.state.step
                if (step % every == 0 or step == due_at[0]) and event.out.updated:  # type: ignore[union-attr]
                    due(event.state)
        elif kind == "start":
            run.clear()
            windows.clear()
            if is_rank_zero():
                start(event)
        elif kind == "end" and run:
            try:
                if event.error is None and event.state.step != run["shown_step"]:
                    refresh(event.state, clock(), event.outs)
            finally:
                windows.clear()
                bar = live.pop("bar", None)
                if bar is not None:
                    bar.stop()
                run.clear()
        return None

    return plugin


def _head(step: int, total: int | None) -> str:
    return f"step {step}/{total}" if total is not None else f"step {step}"


def _eta(run: Mapping[str, Any], now: float, step: int) -> str | None:
    timed = step - run["warm_from"]  # updates since the ETA clock started
    if run["warm_at"] is None or run["total"] is None or timed <= 0:
        return None
    per_update = (now - run["warm_at"]) / timed
    seconds = per_update * max(run["total"] - step, 0)
    return str(datetime.timedelta(seconds=round(seconds)))
