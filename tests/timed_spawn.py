"""Spawn gloo ranks with a deadline: a hung rank fails the test instead of the suite.

Like ``spawning.spawn`` (one retry when a rank dies by a signal at gloo teardown, never for
a Python exception), but every rank is killed once ``timeout`` seconds have passed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

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
    timeout: float = 120.0,
) -> None:
    """``fn(rank, *make_args(attempt))`` on ``nprocs`` ranks, killed after ``timeout`` s."""
    try:
        _once(fn, make_args(0), nprocs, timeout)
    except mp.ProcessExitedException as exc:
        if exc.signal_name is None:
            raise
        _once(fn, make_args(1), nprocs, timeout)
