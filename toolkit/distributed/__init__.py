"""Start and end a multi-process job: the torchrun boilerplate as three plain functions.

``torchrun --standalone --nproc_per_node=2 train.py`` starts two processes and tells each its
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and where the rendezvous store is (``MASTER_ADDR``,
``MASTER_PORT``). :func:`setup` reads them, picks the device and the backend, joins the
default process group and seeds the process; :func:`teardown` ends it with a barrier first;
:func:`process_group` is the two around a ``with`` block. Without torchrun (no ``RANK`` in
the environment) the same script is a world of one process, so ``python train.py`` works
too.

Why not ``dist.init_process_group()`` alone:

* **Elastic restarts.** After torchrun restarts the group (``--max-restarts``, a worker lost),
  the new workers rendezvous in the agent's store, which still holds the previous attempt's
  keys: the dead rank's gloo address among them. With torch 2.13, ``env://`` init then
  connects to that address and fails or hangs (2 of 3 runs of a 2-rank job whose rank 1 was
  SIGKILLed, one of them until the timeout). :func:`setup` joins through a store prefixed
  per attempt (``TORCHELASTIC_RESTART_COUNT``), so each attempt reads only its own keys
  (3 of 3 runs restarted cleanly, and the kill test of ``tests/distributed/test_torchrun.py``).
* **Tear-down.** gloo can abort the process at exit when ranks destroy the group at
  different moments (about 1 run in 10 without a barrier); :func:`teardown` waits for every
  rank first.
* **Backends.** ``"nccl"`` on CUDA, ``"gloo"`` on the CPU, bound to the rank's device
  (``device_id``). toolkit needs no second backend: its few small exchanges go on the
  device the group's backend reduces (``toolkit/distributed/_collectives.py`` says what
  crosses ranks and when). Pass ``backend="cuda:nccl,cpu:gloo"`` for CPU collectives of
  your own.
"""

from toolkit.distributed._launch import Launch, process_group, setup, teardown
from toolkit.distributed._layout import Groups, Layout, current_layout, init_layout, set_layout

__all__ = [
    "Groups", "Launch", "Layout", "current_layout", "init_layout", "process_group", "set_layout",
    "setup", "teardown",
]  # fmt: skip
