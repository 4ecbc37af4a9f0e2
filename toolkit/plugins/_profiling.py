"""profile: torch.profiler over a window of updates, Chrome traces written to a folder."""

import os
import warnings
from typing import Any

import torch
from torch.profiler import ProfilerActivity

from toolkit._checks import check_bool, check_count, check_path
from toolkit.distributed._collectives import is_rank_zero
from toolkit.loop._run import Event, Plugin, plugin_factory

_PER_CYCLE = ".*Profiler clears events at the end of each cycle"


@plugin_factory(order=60)
def profile(
    out_dir: str | os.PathLike[str], *, wait: int = 1, warmup: int = 1, active: int = 3,
    repeat: int = 1, record_shapes: bool = False,
) -> Plugin:  # fmt: skip
    """A plugin running ``torch.profiler`` over a window of updates and writing Chrome traces.

    The profiler starts at ``"start"`` with ``torch.profiler.schedule(wait=wait,
    warmup=warmup, active=active, repeat=repeat)`` and advances one schedule step after each
    *applied* update (so a profiled step covers all micro-batches of its accumulation
    window). Each cycle skips ``wait`` updates, runs ``warmup`` updates with the profiler on
    but discarded, records ``active`` updates, then writes
    ``out_dir/trace_step{N}.json`` (``N`` = ``state.step`` at the end of the recorded
    window); ``repeat=0`` repeats cycles until the run ends. The profiler stops after the last
    cycle, or at ``"end"`` (also when training raised), which writes a partially recorded
    window too. Activities
    are the CPU, plus CUDA when ``torch.cuda.is_available()``. Only rank 0 profiles. Open a
    trace in https://ui.perfetto.dev or ``chrome://tracing``.

    Args:
        out_dir: folder for the traces (created when missing), e.g. the run folder.
        wait: updates skipped at the start of each cycle (>= 0).
        warmup: updates profiled but discarded, to skip profiler start-up cost (>= 0).
        active: updates recorded per cycle (>= 1).
        repeat: number of cycles; 0 for as many as the run allows (>= 0).
        record_shapes: record operator input shapes (bigger traces).

    Returns:
        The plugin, ``plugin(event) -> None``: it records traces and changes no state.

    Raises:
        ValueError: a negative count, ``active < 1``.
        TypeError: ``record_shapes`` not a bool, ``out_dir`` not a path.

    Example:
        >>> import json, pathlib, tempfile, torch
        >>> from toolkit import TrainState, make_step, run
        >>> from toolkit.plugins import profile
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> step = make_step(lambda m, b: m(b).square().mean())
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     plugin = profile(tmp, wait=1, warmup=1, active=2)
        ...     state = run(step, state, [torch.ones(4, 2)] * 6, max_steps=6, plugins=[plugin])
        ...     names = sorted(p.name for p in pathlib.Path(tmp).iterdir())
        ...     trace = json.loads((pathlib.Path(tmp) / names[0]).read_text())
        >>> names, "traceEvents" in trace
        (['trace_step4.json'], True)
    """
    folder = check_path("profile", "out_dir", out_dir)
    for name, value, least in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1)):
        check_count("profile", name, value, least)
    check_count("profile", "repeat", repeat, 0)
    check_bool("profile", "record_shapes", record_shapes)
    running: Any = None  # the profiler (one run at a time)
    trace_step = 0  # the state.step its next trace is named after
    schedule = torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=repeat)

    def export(prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(str(folder / f"trace_step{trace_step}.json"))

    def plugin(event: Event) -> None:
        nonlocal running, trace_step
        prof = running
        if event.kind == "start" and is_rank_zero():
            folder.mkdir(parents=True, exist_ok=True)
            cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            running = torch.profiler.profile(
                activities=[ProfilerActivity.CPU, *cuda], schedule=schedule,
                on_trace_ready=export, record_shapes=record_shapes,
            )  # fmt: skip
            trace_step = event.state.step
            running.start()
        elif prof is not None and event.out is not None and event.out.updated:
            trace_step = event.state.step
            # Dropped while it steps: a profiler that failed mid-transition crashes the process
            # in stop() (torch 2.13), so one whose step raises is never stopped.
            running = None
            with warnings.catch_warnings():
                # Each cycle is exported on its own, which is what this warning is about.
                warnings.filterwarnings("ignore", message=_PER_CYCLE, category=UserWarning)
                prof.step()
            if repeat and prof.step_num >= repeat * (wait + warmup + active):
                # Every cycle is written: stop now rather than pay a profiler step (tens of
                # microseconds) per update for the rest of the run.
                prof.stop()
            else:
                running = prof
        elif prof is not None and event.kind == "end":
            running = None
            prof.stop()  # writes the window being recorded, if any

    return plugin
