"""to_host: exact values, one stack and one transfer per device."""

from __future__ import annotations

import pytest
import torch
from counting import CountOps

from toolkit._host import to_host


def test_groups_dtypes_exactly() -> None:
    values = [torch.tensor(1.5), torch.tensor(7, dtype=torch.int64), torch.tensor(0.25).double()]
    values.append(torch.tensor(2.0, dtype=torch.bfloat16))
    assert to_host(values) == [1.5, 7.0, 0.25, 2.0]
    assert to_host([torch.tensor(2**40 + 1)]) == [2**40 + 1]  # not rounded through float32
    assert to_host([]) == []


def test_one_stack_for_one_dtype() -> None:
    values = [torch.tensor(float(i)) for i in range(50)]
    with CountOps() as ops:
        assert to_host(values) == [float(i) for i in range(50)]
    assert ops.calls["stack.default"] == 1 and ops.calls["_local_scalar_dense.default"] == 0


def test_mixed_dtypes_cost_one_stack_per_dtype_and_one_transfer() -> None:
    values = [torch.tensor(0.5), torch.tensor(3), torch.tensor(1.5), torch.tensor(2**40 + 1)]
    with CountOps() as ops:
        assert to_host(values) == [0.5, 3.0, 1.5, float(2**40 + 1)]
    assert ops.calls["stack.default"] == 2 and ops.calls["cat.default"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_across_devices_in_the_callers_order() -> None:
    values = [torch.tensor(1.5, device="cuda"), torch.tensor(3), torch.tensor(0.5, device="cuda")]
    values.append(torch.tensor(7, device="cuda"))
    assert to_host(values) == [1.5, 3.0, 0.5, 7.0]
