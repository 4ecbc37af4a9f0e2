"""Counting helpers for sync tests: aten calls through the dispatcher, and host copies."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from toolkit import _host


class CountOps(TorchDispatchMode):
    """Counts every aten call (stack, cat, _local_scalar_dense...) made while active, by name.

    TorchDispatchMode is torch's extension point for this and must be subclassed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[func.__name__] += 1
        return func(*args, **(kwargs or {}))


class CountSyncs(CountOps):
    """Counts aten._local_scalar_dense calls: .item(), float(tensor), bool(tensor).

    These are the reads that block on an accelerator. (On CPU, ``Tensor.tolist()`` reads
    memory without dispatching, so it is not counted; tests that care use
    :func:`count_tolists`.)
    """

    @property
    def count(self) -> int:
        return self.calls["_local_scalar_dense.default"]


def count_tolists(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Spy on ``Tensor.tolist``: the returned list gets the element count of each call."""
    sizes: list[int] = []
    original = torch.Tensor.tolist

    def counting_tolist(self: torch.Tensor) -> Any:
        sizes.append(self.numel())
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    return sizes


def read_as_on_an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``to_host`` take its accelerator path for CPU tensors too.

    On the CPU it reads each value with ``.item()`` (there is nothing to synchronise); on an
    accelerator it stacks and makes one ``.tolist()`` per device. Tests that count the host
    reads a GPU run makes call this first, so that the CPU stands in for the device.
    """
    monkeypatch.setattr(_host, "_all_on_cpu", lambda tensors: False)
