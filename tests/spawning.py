"""Spawn gloo ranks for multi-process tests: a deadline, and one retry for a teardown abort.

gloo can abort (SIGABRT) while the interpreter shuts down even after a clean
barrier + destroy_process_group (5 of 55 runs without a barrier, when this was measured). A
Python exception in a rank is a real failure and is never retried. A hung rank fails its test
instead of the suite: every rank is killed once ``timeout`` seconds have passed.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _once(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int, timeout: float) -> None:
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{nprocs} ranks of {getattr(fn, '__name__', fn)} still running after "
                    f"{timeout:g} s: a collective is likely mismatched (a hang)."
                )
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)


def spawn(
    fn: Callable[..., None],
    make_args: Callable[[int], tuple[Any, ...]],
    nprocs: int,
    timeout: float = 300.0,
) -> None:
    """``fn(rank, *make_args(attempt))`` on ``nprocs`` ranks, killed after ``timeout`` s;
    once more if a rank died by a signal.

    ``make_args`` gets the attempt number (0, then 1) so that a retry can use a fresh
    rendezvous file and output paths: the first attempt's may be half-written.
    """
    try:
        _once(fn, make_args(0), nprocs, timeout)
    except mp.ProcessExitedException as exc:
        if exc.signal_name is None:
            raise
        _once(fn, make_args(1), nprocs, timeout)


def spawn_reports(
    fn: Callable[..., dict], tmp: Path, nprocs: int, *args: Any, timeout: float = 300.0
) -> list[dict]:
    """``fn(*args)`` on ``nprocs`` gloo ranks (one thread each, the group set up and torn
    down around it); the JSON report each rank's call returned, in rank order."""

    def make_args(attempt: int) -> tuple[Any, ...]:
        out = tmp / f"attempt{attempt}"
        out.mkdir()
        return fn, args, nprocs, str(out / "store"), str(out)

    spawn(_reporting, make_args, nprocs, timeout)
    out = max(tmp.glob("attempt*"))  # the attempt that completed
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nprocs)]


def _reporting(rank: int, fn: Callable[..., dict], args: tuple, world: int, store: str, out: str):
    torch.set_num_threads(1)
    with gloo_group(rank, world, store):
        Path(out, f"rank{rank}.json").write_text(json.dumps(fn(*args)))


@contextlib.contextmanager
def gloo_group(rank: int, world: int, store_path: str) -> Iterator[None]:
    """A gloo process group over a file store, torn down with a barrier first.

    The barrier runs only when the body succeeded (a failed rank must not wait for the
    others); without it gloo can abort at exit (see the module docstring).
    """
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world
    )
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def name_the_data_ranks(world: int) -> None:
    """Say that the ``world`` ranks hold different data, for a model without a DDP or FSDP2
    wrapper (a replayed or evaluated one): without a layout its metrics are each rank's own."""
    from torch.distributed.device_mesh import init_device_mesh

    from toolkit.distributed import Layout, set_layout

    set_layout(Layout(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), data=("dp",)))
