"""Every collective of toolkit's collective layer puts its tensor on the group's device.

The rule (``_collectives._device``): CUDA under NCCL, else the CPU. An NCCL group cannot
reduce a CPU tensor, and this machine has no GPU, so the NCCL rule is checked on 2 spawned
gloo ranks whose group says it is NCCL: ``dist.get_backend`` reports ``"nccl"`` and
``torch.cuda.current_device`` reports 0, so the real rule answers ``cuda:0``; the test maps
that answer to the ``lazy`` device (TorchScript's lazy tensors: not the CPU, and they hold
values). ``all_reduce`` and ``broadcast`` are wrapped: each notes a tensor that is not on
that device, then reduces a CPU copy over gloo and copies the result back. A collective that
builds its tensor on the CPU whatever the rule says is named in the report (checked: with
``device=`` removed from ``broadcast_int``, ``agree`` or ``max_over_ranks``, or
``all_reduce_`` reducing where the tensor is, the test fails and names the entry points).
"""

from __future__ import annotations

import errno
import json
import pathlib
import types
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawning import spawn

from toolkit.distributed import _collectives

CUDA = torch.device("cuda", 0)


def _fake_nccl(monkeypatch: pytest.MonkeyPatch, device: torch.device, wrong: list[str]) -> None:
    """Make the group report NCCL, and check every tensor the module reduces or broadcasts."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    rule = _collectives._device

    def mapped(group: Any) -> torch.device:
        found = rule(group)
        assert found == CUDA, f"the rule put an NCCL group's tensors on {found}"
        return device

    monkeypatch.setattr(_collectives, "_device", mapped)
    for name in ("all_reduce", "broadcast"):
        monkeypatch.setattr(dist, name, _checked(getattr(dist, name), name, device, wrong))


def _checked(
    real: Callable[..., Any], name: str, device: torch.device, wrong: list[str]
) -> Callable[..., Any]:
    def collective(tensor: torch.Tensor, *args: Any, async_op: bool = False, **kw: Any) -> Any:
        if tensor.device != device:  # noted, not raised: the other rank must not hang
            wrong.append(f"{name} of a tensor on {tensor.device}")
        host = tensor.cpu()
        real(host, *args, **kw)
        tensor.copy_(host)
        if not async_op:
            return None
        done: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        done.set_result([tensor])
        return types.SimpleNamespace(get_future=lambda: done)

    return collective


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        value = call()
    except Exception as error:  # the outcome is what the test compares
        return [type(error).__name__, getattr(error, "errno", None), str(error)]
    if isinstance(value, torch.Tensor):
        return [value.tolist(), str(value.device)]
    return value


def _carried(rank: int, group: Any, lazy: torch.device) -> list[Any]:
    """The DDP hook on a first bucket: gradients averaged, the flags summed beside them."""
    carrier = _collectives.BucketFlags(group)
    like = torch.zeros(1, device=lazy)
    carrier.send(torch.tensor(1.0 + rank, device=lazy), rank, like)
    buffer = torch.tensor([2.0 * (rank + 1), 4.0], device=lazy)
    bucket = types.SimpleNamespace(buffer=lambda: buffer, index=lambda: 0)
    grads = _collectives._hook(carrier, bucket).wait()
    received = carrier.receive()
    assert received is not None
    return [grads.tolist(), received.tolist()]


def _entry_points(rank: int, lazy: torch.device) -> dict[str, Callable[[], Any]]:
    group = dist.group.WORLD
    c = _collectives
    mine = OSError(errno.ENOSPC, "disk full") if rank == 1 else None
    flags = torch.tensor([float(rank), -float(rank)])  # as the step's, on a CPU model
    on_group = torch.tensor([float(rank)], device=lazy)
    return {
        "agree": lambda: c.agree(None, group, "who"),
        "agree, rank 1 failed": lambda: c.agree(mine, group, "who"),
        "broadcast_int": lambda: c.broadcast_int(41 + rank, group, src=1),
        "broadcast_text": lambda: c.broadcast_text(f"rank {rank}: é", group, src=1),
        "max_over_ranks": lambda: c.max_over_ranks(3 + 4 * rank, group),
        "sum_over_ranks": lambda: c.sum_over_ranks("who", {"a": (rank, 1.0)}, [2.0], group),
        "check_even": lambda: c.check_even(5, group),
        "check_even, uneven": lambda: c.check_even(5 + rank, group),
        "all_reduce_, a CPU model's flags": lambda: c.all_reduce_(flags, dist.ReduceOp.MAX, group),
        "all_reduce_ keeps the tensor": lambda: (
            c.all_reduce_(on_group, dist.ReduceOp.SUM, group) is on_group
        ),
        "the DDP carrier's hook": lambda: _carried(rank, group, lazy),
    }


def _rank(rank: int, store: str, out: str) -> None:
    import torch._lazy.ts_backend

    torch._lazy.ts_backend.init()
    lazy = torch.zeros(1, device="lazy").device
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    report: dict[str, Any] = {}
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            for name, call in _entry_points(rank, lazy).items():
                wrong: list[str] = []
                _fake_nccl(monkeypatch, lazy, wrong)
                report[name] = {"outcome": _outcome(call), "wrong": wrong}
                monkeypatch.undo()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    pathlib.Path(out, f"rank{rank}.json").write_text(json.dumps(report))


EXPECTED = {
    "agree": None,
    "broadcast_int": 42,
    "broadcast_text": "rank 1: é",
    "max_over_ranks": 7,
    "sum_over_ranks": [{"a": [1.0, 2.0]}, [4.0]],
    "check_even": None,
    "all_reduce_, a CPU model's flags": [[1.0, 0.0], "cpu"],
    "all_reduce_ keeps the tensor": True,
    "the DDP carrier's hook": [[3.0, 4.0], [3.0, 1.0, 1.0]],
}


@pytest.mark.slow
def test_every_collective_puts_its_tensor_on_the_nccl_groups_device(tmp_path) -> None:
    def arguments(attempt: int) -> tuple[str, str]:
        out = tmp_path / str(attempt)
        out.mkdir()
        return str(out / "store"), str(out)

    spawn(_rank, arguments, nprocs=2, timeout=120)
    out = sorted(p for p in tmp_path.iterdir() if p.is_dir())[-1]
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, report in enumerate(reports):
        assert {name: got["wrong"] for name, got in report.items() if got["wrong"]} == {}
        outcomes = {name: got["outcome"] for name, got in report.items()}
        assert {name: outcomes[name] for name in EXPECTED} == EXPECTED, rank
        uneven = outcomes["check_even, uneven"]
        assert uneven[0] == "ValueError" and "different lengths" in uneven[2]
    failed = [report["agree, rank 1 failed"]["outcome"] for report in reports]
    assert failed[1] == ["OSError", errno.ENOSPC, "[Errno 28] disk full"]  # its own
    assert failed[0] == [
        "OSError",
        errno.ENOSPC,
        "[Errno 28] who: rank 1 of the group failed: [Errno 28] disk full",
    ]


@pytest.mark.parametrize(
    ("backend", "device"),
    [("nccl", "cuda:3"), ("cuda:nccl,cpu:gloo", "cuda:3"), ("gloo", "cpu")],
)
def test_the_rule_puts_nccl_groups_on_the_current_cuda_device(
    backend: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _collectives._device(None) == torch.device(device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_under_a_real_nccl_group_every_collective_runs() -> None:
    from toolkit.distributed import process_group

    c = _collectives
    with process_group() as launch:  # on CUDA: nccl alone, no CPU backend
        group = dist.group.WORLD
        assert (launch.backend, c._device(group)) == ("nccl", launch.device)
        c.agree(None, group, "who")
        with pytest.raises(OSError, match="disk full"):
            c.agree(OSError(errno.ENOSPC, "disk full"), group, "who")
        assert c.broadcast_int(42, group) == 42
        assert c.broadcast_text("é", group) == "é"
        assert c.max_over_ranks(7, group) == 7
        c.check_even(5, group)
        flags = c.all_reduce_(torch.tensor([1.0, 0.0]), dist.ReduceOp.MAX, group)
        assert (flags.tolist(), flags.device.type) == ([1.0, 0.0], "cpu")
