"""The ranks' window flags carried in DDP's own gradient all-reduce: no collective of their own.

Under DDP every rank ends the closing backward with the same averaged gradients, so the
finite check of the gradients, the clip and the scaler's overflow agree without any
exchange. What each rank knows alone is whether its own losses were finite and how many
micro-batches its loss function skipped (returned None). A communication hook sends those
three numbers with DDP's first gradient bucket of the window's closing backward, so the
verdict costs no collective beyond DDP's own: on small models, where an update takes a few
milliseconds, a separate all-reduce is a large part of it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from toolkit.distributed._group import data_parallel_group

__all__ = ["Carrier", "carrier_of", "skips_differ_carried"]

# Only dtypes that hold the small integer sums exactly ride along; a model whose gradients
# are bf16 or fp16 falls back to the step's own small all-reduce.
_EXACT = (torch.float32, torch.float64)


class Carrier:
    """A DDP model's hook state: the flags to send with the next sync, and what came back.

    ``outgoing`` is ``[loss, skipped, skipped**2]`` of this rank, set just before the
    closing backward (``loss``: the window's summed loss under the guard, else 0); the hook
    sums it over the ranks with the first bucket and leaves the sums in ``incoming`` by the
    time backward returns. The summed loss is finite when every rank's is (a sum of
    finite losses would overflow only past 3e38 in float32); the ranks skipped different
    numbers of micro-batches when ``skips**2 != world * squares`` (equal for equal counts
    only: Cauchy-Schwarz), exact in float32 for any realistic count.
    """

    __slots__ = ("__weakref__", "group", "incoming", "outgoing")

    def __init__(self, group: Any) -> None:
        self.group = group
        self.outgoing: torch.Tensor | None = None
        self.incoming: torch.Tensor | None = None

    def send(self, loss: torch.Tensor | None, skipped: int, like: torch.Tensor) -> None:
        """Flags for the next closing backward (``like``: a parameter, for the device)."""
        if skipped:
            skips = torch.tensor([float(skipped), float(skipped * skipped)], device=like.device)
        else:  # the common case: no tensor built per update
            skips = _zeros(like.device, 2)
        if loss is None:
            loss = _zeros(like.device, 1)
        self.outgoing = torch.cat([loss.reshape(1), skips])
        self.incoming = None

    def receive(self) -> torch.Tensor | None:
        """The reduced flags of the backward that just ran, or None if none were carried."""
        got, self.incoming, self.outgoing = self.incoming, None, None
        return got


_ZEROS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _zeros(device: torch.device, size: int) -> torch.Tensor:
    """A float32 zero vector of ``size``, made once per device (read, never written)."""
    found = _ZEROS.get((device, size))
    if found is None:
        found = _ZEROS[(device, size)] = torch.zeros(size, device=device)
    return found


def skips_differ_carried(sums: list[float], world: int) -> bool:
    """Whether the ranks skipped different numbers of micro-batches, from the carried sums.

    ``sums`` is ``[loss, sum of skipped, sum of skipped**2]`` over the ``world`` ranks: the
    counts are all equal exactly when ``sum**2 == world * sum of squares``.
    """
    _, skips, squares = sums
    return skips * skips != world * squares


# Per DDP model: its carrier, or None where a carrier cannot be installed.
_CARRIERS: weakref.WeakKeyDictionary[torch.nn.Module, Carrier | None] = weakref.WeakKeyDictionary()


def carrier_of(model: torch.nn.Module) -> Carrier | None:
    """The carrier of DDP ``model`` (its hook registered on first use), or None.

    None when the step's data-parallel group is not the group DDP averages over
    (``set_data_parallel_group`` named another), or when the model already has a
    communication hook of its own (DDP takes one): the step then all-reduces its flags
    itself, as it does under FSDP2.
    """
    try:
        return _CARRIERS[model]
    except KeyError:
        pass
    found: Carrier | None = None
    group = data_parallel_group(model)
    if group is not None and group is getattr(model, "process_group", None):
        found = Carrier(group)
        try:
            model.register_comm_hook(found, _hook)  # type: ignore[operator]
        except RuntimeError:  # "can only be called once": the user's own hook is there
            found = None
    _CARRIERS[model] = found
    return found


def _hook(carrier, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
    """DDP's allreduce_hook (divide, sum), with the flags appended to the first bucket."""
    group = carrier.group
    world = group.size()
    buffer = bucket.buffer()
    flags = carrier.outgoing
    if flags is None or bucket.index() != 0 or buffer.dtype not in _EXACT:
        buffer.div_(world)  # as torch's default allreduce_hook: the same result as no hook
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    carrier.outgoing = None
    size = buffer.numel()
    buffer.div_(world)
    packed = torch.cat([buffer, flags.to(buffer.dtype)])

    def unpack(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        summed = fut.value()[0]
        carrier.incoming = summed[size:]
        return summed[:size]

    return dist.all_reduce(packed, group=group, async_op=True).get_future().then(unpack)
