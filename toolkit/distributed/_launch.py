"""setup, teardown and process_group: see :mod:`toolkit.distributed`."""

import atexit
import contextlib
import dataclasses
import datetime
import gc
import os
import random
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from toolkit._checks import check


@dataclasses.dataclass(frozen=True)
class Launch:
    """Where this process stands in the job, as :func:`setup` found it.

    Attributes:
        rank: this process's global rank, ``0 <= rank < world_size``.
        world_size: the number of processes in the job.
        local_rank: its rank on this machine (the index of its GPU on a CUDA job).
        device: the device it trains on: ``cuda:<local_rank>`` when CUDA is available,
            else ``cpu`` (or the one given to :func:`setup`).
        backend: the backend of the default process group (``"gloo"``, or ``"nccl"`` on
            CUDA).
        restart: how many times torchrun restarted the group before this attempt
            (``TORCHELASTIC_RESTART_COUNT``; 0 on the first attempt and without torchrun).
        seed: the seed this process was seeded with (``seed + rank``), or None.

    Example:
        >>> from toolkit.distributed import process_group
        >>> with process_group() as launch:
        ...     print(launch.rank, launch.world_size, launch.device, launch.device_ids)
        0 1 cpu None
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    restart: int
    seed: int | None

    @property
    def device_ids(self) -> list[int] | None:
        """``DistributedDataParallel(model, device_ids=launch.device_ids)``: None on CPU."""
        return [self.device.index] if self.device.type == "cuda" else None


def setup(
    *, seed: int | None = None, device: str | torch.device | None = None,
    backend: str | None = None, timeout: datetime.timedelta | None = None,
) -> Launch:  # fmt: skip
    """Join the job's default process group from the torchrun environment.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` and
    ``TORCHELASTIC_RESTART_COUNT``. Without ``RANK`` (a plain ``python train.py``) the
    process is a world of one over an in-memory store. On CUDA it calls
    ``torch.cuda.set_device(local_rank)``, one device per rank. It registers ``gc.collect``
    to run at exit, so that a DDP model in a reference cycle frees gloo's threads while Python
    is whole (docs/distributed.md). The store is the rendezvous store prefixed per restart
    attempt (see the module docstring); under torchrun every rank is a client of the
    agent's store, otherwise (``srun`` setting the variables itself) rank 0 hosts it.

    Args:
        seed: when given, seeds Python's ``random``, NumPy (when installed) and torch (CPU
            and CUDA) with ``seed + rank``, so each rank draws its own dropout masks and
            augmentations. DDP copies rank 0's weights to the others when it wraps the
            model; FSDP2 does not, so build an FSDP2 model under the same seed on every
            rank (``with torch.random.fork_rng(): torch.manual_seed(seed); model = ...``).
        device: the device to train on; default ``cuda:<LOCAL_RANK>`` when CUDA is
            available, else ``cpu``.
        backend: the process group's backend; default ``"nccl"`` for a CUDA device and
            ``"gloo"`` otherwise.
        timeout: how long a collective waits for the other ranks before failing (torch's
            default when None: 30 minutes for gloo, 10 for NCCL).

    Returns:
        A :class:`Launch` describing this process.

    Raises:
        RuntimeError: a default process group is initialised already (call
            :func:`teardown` first).
        ValueError: a malformed environment (``RANK`` without ``WORLD_SIZE``, a value that
            is not an integer, a rank outside the world), or ``LOCAL_RANK`` beyond the
            CUDA devices of this machine.

    Example:
        >>> import torch
        >>> from toolkit.distributed import setup, teardown
        >>> launch = setup(seed=0)          # python or torchrun: same script
        >>> model = torch.nn.Linear(4, 2).to(launch.device)
        >>> model = torch.nn.parallel.DistributedDataParallel(model, device_ids=launch.device_ids)
        >>> launch.seed, torch.distributed.get_world_size()
        (0, 1)
        >>> teardown()
    """
    fix = "Call toolkit.distributed.teardown() first, or use the group you have."
    ok = not dist.is_initialized()
    check(ok, "setup", "the process group", "uninitialised", "initialised", fix, RuntimeError)
    env, rank, world_size, local_rank = os.environ, 0, 1, 0
    if "RANK" in env:  # launched by torchrun (or srun exporting the variables)
        check("WORLD_SIZE" in env, "setup", "WORLD_SIZE", "set with RANK", None, "Export both.")
        rank, world_size = _int(env, "RANK", 0), _int(env, "WORLD_SIZE", 1)
        check(rank < world_size, "setup", "RANK", f"below WORLD_SIZE={world_size}", rank)
        local_rank = _int(env, "LOCAL_RANK", rank)
    restart = _int(env, "TORCHELASTIC_RESTART_COUNT", 0)
    if device is None and torch.cuda.is_available():  # one CUDA device per rank
        count = torch.cuda.device_count()
        fix = f"Start at most {count} processes per node, or pass device='cpu'."
        expected = f"below the {count} CUDA devices of this machine"
        check(local_rank < count, "setup", "LOCAL_RANK", expected, local_rank, fix)
        device = torch.device("cuda", local_rank)
    chosen = torch.device(device or "cpu")
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    backend = backend or ("nccl" if chosen.type == "cuda" else "gloo")
    store = _store(env, rank, world_size, restart, timeout)
    # device_id binds NCCL to this rank's device, so barrier() and the first collective use it.
    device_id = chosen if chosen.type == "cuda" else None
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, device_id=device_id, timeout=timeout
    )
    # A model in a reference cycle (torch's state-dict walkers leave some) holds the group,
    # and so gloo's threads, until Python's last collection while it shuts down, which they
    # can abort (-6): collect while Python is whole (docs/distributed.md). Once per process.
    atexit.unregister(gc.collect)
    atexit.register(gc.collect)
    own_seed = None if seed is None else seed + rank
    if own_seed is not None:  # Python's, torch's (CUDA too) and NumPy's generators
        random.seed(own_seed)
        torch.manual_seed(own_seed)
        with contextlib.suppress(ImportError):  # numpy is optional
            import numpy

            numpy.random.seed(own_seed % 2**32)
    return Launch(rank, world_size, local_rank, chosen, backend, restart, own_seed)


def teardown(*, barrier: bool = True) -> None:
    """Leave the default process group: a barrier, then ``destroy_process_group``.

    Without the barrier, gloo can abort a process at exit (``terminate called without an
    active exception``) when the ranks destroy the group at different moments. Skip it
    (``barrier=False``) when this rank failed: the others may never reach theirs. Nothing
    happens when no group is initialised. gloo's threads end only when the group object is
    freed, and a DDP model holds it: keep the model local to a function, whose end frees it
    before Python shuts down (docs/distributed.md).

    Args:
        barrier: wait for every rank before destroying the group.

    Returns:
        None.

    Raises:
        RuntimeError: the barrier failed (another rank died, or the timeout passed); the
            group is destroyed anyway.

    Example:
        >>> from toolkit.distributed import setup, teardown
        >>> launch = setup()
        >>> teardown()
        >>> teardown()  # nothing to end: a no-op
    """
    if dist.is_initialized():
        try:
            if barrier:
                dist.barrier()
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def process_group(
    *, seed: int | None = None, device: str | torch.device | None = None,
    backend: str | None = None, timeout: datetime.timedelta | None = None,
) -> Iterator[Launch]:  # fmt: skip
    """:func:`setup`, then the body, then :func:`teardown`.

    The barrier of the tear-down runs when the body ended well or by ``SystemExit`` (the
    checkpoints plugin exits every rank after the same update on a signal); after any
    other exception this rank leaves without waiting, and torchrun stops the others.

    Args:
        seed: as in :func:`setup`.
        device: as in :func:`setup`.
        backend: as in :func:`setup`.
        timeout: as in :func:`setup`.

    Returns:
        A context manager whose value is the :class:`Launch`.

    Raises:
        RuntimeError: as :func:`setup` and :func:`teardown`.
        ValueError: as :func:`setup`.

    Example:
        >>> import torch
        >>> from toolkit.distributed import process_group
        >>> with process_group(seed=1) as launch:
        ...     total = torch.ones(1)
        ...     torch.distributed.all_reduce(total)  # sums over the ranks: one here
        >>> total.item(), torch.distributed.is_initialized()
        (1.0, False)
    """
    launch = setup(seed=seed, device=device, backend=backend, timeout=timeout)
    try:
        yield launch
    except BaseException as error:
        teardown(barrier=isinstance(error, SystemExit))
        raise
    teardown()


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name, str(default))
    check(text.isdecimal(), "setup", name, "an integer >= 0", text)
    return int(text)


def _store(
    env: Mapping[str, str], rank: int, world_size: int, restart: int,
    timeout: datetime.timedelta | None,
) -> dist.Store:  # fmt: skip
    if "MASTER_ADDR" not in env:
        fix = "Launch with torchrun, or export MASTER_ADDR and MASTER_PORT (rank 0's host, a port)."
        check(world_size == 1, "setup", "MASTER_ADDR", "set when WORLD_SIZE > 1", None, fix)
        return dist.HashStore()  # a world of one: nobody to meet
    # torchrun's agent hosts the store (every worker is a client) and keeps it across
    # restarts; elsewhere rank 0 hosts it.
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    port, master = _int(env, "MASTER_PORT", 29500), not agent and rank == 0
    timeout = timeout or datetime.timedelta(minutes=30)
    store = dist.TCPStore(env["MASTER_ADDR"], port, world_size, is_master=master, timeout=timeout)
    return dist.PrefixStore(f"toolkit/attempt_{restart}", store)
