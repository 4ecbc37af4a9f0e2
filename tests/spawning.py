"""mp.spawn for multi-rank gloo tests, retried once if a rank dies by a signal at teardown.

gloo can abort (SIGABRT) while the interpreter shuts down even after a clean
barrier + destroy_process_group (shared/research/feasibility.md, item 1c: 5 of 55 runs
without a barrier). A Python exception in a rank is a real failure and is never retried.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def spawn(
    fn: Callable[..., None], make_args: Callable[[int], tuple[Any, ...]], nprocs: int
) -> None:
    """``mp.spawn(fn, make_args(attempt), nprocs)``, once more if a rank died by a signal.

    ``make_args`` gets the attempt number (0, then 1) so that a retry can use a fresh
    rendezvous file and output paths: the first attempt's may be half-written.
    """
    try:
        mp.spawn(fn, args=make_args(0), nprocs=nprocs, join=True)
    except mp.ProcessExitedException as exc:
        if exc.signal_name is None:
            raise
        mp.spawn(fn, args=make_args(1), nprocs=nprocs, join=True)


@contextlib.contextmanager
def gloo_group(rank: int, world: int, store_path: str) -> Iterator[None]:
    """A gloo process group over a file store, torn down with a barrier first.

    The barrier runs only when the body succeeded (a failed rank must not wait for the
    others); without it gloo can abort at exit (feasibility notes, item 1c).
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
