"""to_device: move every tensor of a nested batch to a device, as a plain function."""

from typing import TypeVar

import torch

from toolkit._checks import check_bool
from toolkit._tree import map_nested_tensor

T = TypeVar("T")


def to_device(batch: T, device: torch.device | str | int, *, non_blocking: bool = False) -> T:
    """Move every tensor of ``batch`` to ``device``; containers and other leaves are kept.

    The batch may nest dicts (any mapping), lists, tuples, namedtuples and dataclasses, as
    :func:`map_nested_tensor` walks them; strings, numbers and ``None`` stay as they are.
    An object with a ``.to`` method that is not a container (a torch_geometric ``Data``) is
    moved by its own ``.to(device, non_blocking=...)``; a module is left as it is, and so
    is a transformers ``Cache``: it has no ``.to`` (see :func:`map_nested_tensor`).
    A tensor already on ``device`` is returned as it is (no copy).

    ``non_blocking=True`` lets a host-to-accelerator copy overlap with work already queued,
    but only from pinned (page-locked) memory: build the loader with
    ``DataLoader(..., pin_memory=True)`` (or ``tensor.pin_memory()``). From pageable memory
    the copy is synchronous whatever the flag. The copy is ordered on the current stream,
    so kernels that use the batch afterwards see it complete; reading it on the host
    (``.item()``, ``.tolist()``) before a synchronisation would not. Copies to the CPU are
    best left blocking.

    Use it inside the loss function (``inputs, targets = to_device(batch, "cuda",
    non_blocking=True)``), or around the loader: ``(to_device(b, device) for b in loader)``
    (a generator is one pass; pass the loader itself to :func:`run` for epochs and exact
    resume, and move inside the loss function).

    Args:
        batch: a tensor or a nesting of containers holding tensors.
        device: where to move them: a ``torch.device``, ``"cuda:0"``, ``"cpu"``, an index.
        non_blocking: asynchronous host-to-device copy from pinned memory (see above).

    Returns:
        A batch of the same structure and container types, its tensors on ``device``.

    Raises:
        TypeError: ``device`` is not a device, a device string or an index, or
            ``non_blocking`` is not a bool.
        RuntimeError: ``device`` names a device type or index that is not available here.

    Example:
        >>> import torch
        >>> from toolkit import to_device
        >>> batch = {"x": torch.ones(2, 3), "y": [torch.tensor(1)], "name": "a"}
        >>> moved = to_device(batch, "cpu")
        >>> moved["x"].device.type, moved["y"][0].device.type, moved["name"]
        ('cpu', 'cpu', 'a')
    """
    check_bool("to_device", "non_blocking", non_blocking)
    try:
        target = torch.device(device)  # type: ignore[arg-type]
    except (TypeError, RuntimeError):
        got = f"{type(device).__name__} {device!r:.40}"
        raise TypeError(
            f"to_device: device must be a torch.device, 'cuda:0', 0; got {got}."
        ) from None
    return map_nested_tensor(lambda t: t.to(target, non_blocking=non_blocking), batch)
