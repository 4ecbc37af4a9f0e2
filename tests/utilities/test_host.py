"""to_host: exact values; on the CPU one read per value, else one stack and transfer per device."""

from __future__ import annotations

import pytest
import torch
from counting import CountOps, read_as_on_an_accelerator

from toolkit._host import to_host


@pytest.mark.parametrize("accelerator_path", [False, True])
def test_groups_dtypes_exactly(monkeypatch: pytest.MonkeyPatch, accelerator_path: bool) -> None:
    if accelerator_path:
        read_as_on_an_accelerator(monkeypatch)
    values = [torch.tensor(1.5), torch.tensor(7, dtype=torch.int64), torch.tensor(0.25).double()]
    values.append(torch.tensor(2.0, dtype=torch.bfloat16))
    assert to_host(values) == [1.5, 7, 0.25, 2.0]
    assert to_host([torch.tensor(2**40 + 1)]) == [2**40 + 1]  # not rounded through float32
    assert to_host([torch.tensor(0.5), torch.tensor(2**40 + 1)]) == [0.5, 2**40 + 1]
    assert to_host([]) == []


def test_on_the_cpu_each_value_is_read_as_it_is() -> None:
    values = [torch.tensor(0.1), torch.tensor(3), torch.tensor(True)]
    values.append(torch.tensor(0.1, dtype=torch.float64))
    with CountOps() as ops:
        got = to_host(values)
    assert got == [torch.tensor(0.1).item(), 3, True, 0.1]
    assert [type(v) for v in got] == [float, int, bool, float]
    assert ops.calls["stack.default"] == 0 and ops.calls["_local_scalar_dense.default"] == 4


def test_one_stack_for_one_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    read_as_on_an_accelerator(monkeypatch)
    values = [torch.tensor(float(i)) for i in range(50)]
    with CountOps() as ops:
        assert to_host(values) == [float(i) for i in range(50)]
    assert ops.calls["stack.default"] == 1 and ops.calls["_local_scalar_dense.default"] == 0


def test_mixed_dtypes_cost_one_stack_per_dtype_and_one_transfer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    read_as_on_an_accelerator(monkeypatch)
    values = [torch.tensor(0.5), torch.tensor(3), torch.tensor(1.5), torch.tensor(2**40 + 1)]
    with CountOps() as ops:
        assert to_host(values) == [0.5, 3, 1.5, 2**40 + 1]
    assert ops.calls["stack.default"] == 2 and ops.calls["cat.default"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_across_devices_in_the_callers_order() -> None:
    values = [torch.tensor(1.5, device="cuda"), torch.tensor(3), torch.tensor(0.5, device="cuda")]
    values.append(torch.tensor(7, device="cuda"))
    got = to_host(values)
    assert got == [1.5, 3, 0.5, 7] and [type(v) for v in got] == [float, int, float, int]


def test_the_accelerator_path_gives_the_values_and_types_the_cpu_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Bug caught: mixed dtypes were cast to float64 together, so a count read on a GPU came
    # back as 3.0 where the CPU gives 3 (exact below 2**53, as float64 holds it).
    values = [torch.tensor(0.1), torch.tensor(3), torch.tensor(True), torch.tensor(2**52 + 1)]
    values += [torch.tensor(0.1, dtype=torch.float64), torch.tensor(1.5, dtype=torch.bfloat16)]
    values += [torch.tensor(-7, dtype=torch.int8), torch.tensor(2.5, dtype=torch.float16)]
    on_cpu = to_host(values)
    read_as_on_an_accelerator(monkeypatch)
    on_accelerator = to_host(values)
    assert (
        on_accelerator
        == on_cpu
        == [torch.tensor(0.1).item(), 3, True, 2**52 + 1, 0.1, 1.5, -7, 2.5]
    )
    assert [type(v) for v in on_accelerator] == [type(v) for v in on_cpu]
    assert [type(v) for v in on_cpu] == [float, int, bool, int, float, float, int, float]
