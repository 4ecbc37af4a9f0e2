"""Reading 0-d tensors back to Python with one device-to-host transfer per device."""

from collections.abc import Sequence

import torch


def to_host(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Python values of 0-d tensors, with one device-to-host transfer per device (usually one).

    When every tensor is on the CPU there is nothing to wait for, and each value is read as
    it is (``.item()``: exact, an int for an integer tensor), which costs less than stacking.
    Otherwise the tensors of each device are stacked and copied with one ``.tolist()``:
    tensors of one dtype as they are, mixed dtypes (integer counts beside float losses)
    stacked per dtype, cast to float64 and concatenated, then read back as the CPU gives
    them (an int for an integer tensor: exact below 2**53, a bool for a bool).

    Example:
        >>> import torch
        >>> to_host([torch.tensor(0.5), torch.tensor(3), torch.tensor(2.0).double()])
        [0.5, 3, 2.0]
    """
    if _all_on_cpu(tensors):
        return [tensor.item() for tensor in tensors]
    groups: dict[torch.device, dict[torch.dtype, list[int]]] = {}  # indices by device, dtype
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, {}).setdefault(t.dtype, []).append(i)
    values: list[float] = [0.0] * len(tensors)
    for by_dtype in groups.values():
        parts = [torch.stack([tensors[i] for i in ix]) for ix in by_dtype.values()]
        flat = (torch.cat([p.double() for p in parts]) if len(parts) > 1 else parts[0]).tolist()
        for i, value in zip((i for ix in by_dtype.values() for i in ix), flat):
            values[i] = _python_type(tensors[i].dtype)(value)
    return values


def _all_on_cpu(tensors: Sequence[torch.Tensor]) -> bool:  # tests stand the CPU in for a GPU
    return all(tensor.is_cpu for tensor in tensors)


def _python_type(dtype: torch.dtype) -> type:
    """The type ``.item()`` gives for ``dtype``."""
    return bool if dtype is torch.bool else float if dtype.is_floating_point else int
