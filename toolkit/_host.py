"""Reading 0-d tensors back to Python with one device-to-host transfer per device."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

__all__ = ["to_host"]

_IS_CPU = operator.attrgetter("is_cpu")


def _all_on_cpu(tensors: Sequence[torch.Tensor]) -> bool:
    return all(map(_IS_CPU, tensors))


def to_host(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Python values of 0-d tensors, with one device-to-host transfer per device (usually one).

    When every tensor is on the CPU there is nothing to wait for, and each value is read as
    it is (``.item()``: exact, an int for an integer tensor), which costs less than stacking.
    Otherwise the tensors of each device are stacked and copied with one ``.tolist()``:
    tensors of one dtype as they are, mixed dtypes (integer counts beside float losses)
    stacked per dtype, cast to float64 (exact below 2**53) and concatenated.

    Example:
        >>> import torch
        >>> to_host([torch.tensor(0.5), torch.tensor(3), torch.tensor(2.0).double()])
        [0.5, 3, 2.0]
    """
    if not tensors:
        return []
    if _all_on_cpu(tensors):
        return list(map(torch.Tensor.item, tensors))
    if len({t.dtype for t in tensors}) == 1:
        try:
            return torch.stack(list(tensors)).tolist()  # type: ignore[no-any-return]
        except RuntimeError:
            pass  # tensors on several devices (a count made on the CPU, model parallelism)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    values: list[float] = [0.0] * len(tensors)
    for indices in by_device.values():
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in indices:
            by_dtype.setdefault(tensors[i].dtype, []).append(i)
        parts = [torch.stack([tensors[i] for i in ix]).double() for ix in by_dtype.values()]
        flat = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()
        for i, v in zip((i for ix in by_dtype.values() for i in ix), flat):
            values[i] = v
    return values
