"""Reading 0-d tensors back to Python with one device-to-host transfer per device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["to_host"]


def _all_on_cpu(tensors: Sequence[torch.Tensor]) -> bool:  # tests stand the CPU in for a GPU
    return all(t.is_cpu for t in tensors)


def to_host(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Python values of 0-d tensors, with one device-to-host transfer per device (usually one).

    When every tensor is on the CPU there is nothing to wait for, and each value is read as
    it is (``.item()``: exact, an int for an integer tensor), which costs less than stacking.
    Otherwise the tensors of each device are stacked per dtype, and their bytes copied to
    the host at once and read back in their dtypes: the same values and types as on the
    CPU (an int stays an int, beside float losses too).

    Example:
        >>> import torch
        >>> to_host([torch.tensor(0.5), torch.tensor(3), torch.tensor(2.0).double()])
        [0.5, 3, 2.0]
    """
    if _all_on_cpu(tensors):
        return [t.item() for t in tensors]
    groups: dict[torch.device, dict[torch.dtype, list[int]]] = {}  # indices by device, dtype
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, {}).setdefault(t.dtype, []).append(i)
    values: list[float] = [0.0] * len(tensors)
    for by_dtype in groups.values():
        parts = [torch.stack([tensors[i] for i in ix]) for ix in by_dtype.values()]
        # One transfer of the raw bytes, each dtype viewed back on the host: exact, an int
        # for an integer tensor as .item() gives (a cast to one dtype would turn ints to floats).
        raw = torch.cat([part.view(torch.uint8) for part in parts]).cpu()
        chunks = raw.split([part.numel() * part.element_size() for part in parts])
        for ix, part, chunk in zip(by_dtype.values(), parts, chunks):
            for i, value in zip(ix, chunk.clone().view(part.dtype).tolist()):
                values[i] = value
    return values
