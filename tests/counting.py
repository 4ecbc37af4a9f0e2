"""CountSyncs: counts device-to-host reads made through the dispatcher, for sync tests."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CountSyncs(TorchDispatchMode):
    """Counts aten._local_scalar_dense calls: .item(), float(tensor), bool(tensor).

    These are the reads that block on an accelerator. (On CPU, ``Tensor.tolist()`` reads
    memory without dispatching, so it is not counted; tests that care spy on it directly.)
    TorchDispatchMode is torch's extension point for this and must be subclassed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))
