"""DDP and FSDP2 over gloo on 2 CPU ranks: accumulation, counts and the guard across ranks.

One mp.spawn per wrapper runs every scenario (spawning costs seconds); each rank writes its
findings to a file and the test asserts on them. Reference: one process training on the
concatenation of both ranks' micro-batches.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from spawning import spawn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from toolkit import LossSum, TrainState, accumulate, clip, compose, guard_nonfinite, make_step

pytestmark = pytest.mark.slow

WORLD = 2
K = 3  # micro-batches per update


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    ).double()


def _micro_batches(rank: int, update: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Unequal sizes across micro-batches and ranks: the count normalisation must be global.
    g = torch.Generator().manual_seed(100 * update + rank)
    sizes = [2 + rank + i for i in range(K)]
    return [
        (
            torch.randn(n, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g),
        )
        for n in sizes
    ]


def _counted(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
    x, y = batch
    total = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
    return LossSum(total, torch.tensor(y.shape[0]))


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        report: dict = {}
        model = torch.nn.parallel.DistributedDataParallel(_model())
        allreduce_calls: list[int] = []

        def counting_hook(state, bucket):
            allreduce_calls.append(1)
            return allreduce_hook(state, bucket)

        model.register_comm_hook(dist.group.WORLD, counting_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        step = compose(accumulate(micro_batches=K), clip(max_norm=10.0), guard_nonfinite())(
            make_step(_counted)
        )
        state = TrainState(model=model, optimizer=opt)
        calls_per_micro = []
        for update in range(3):
            for batch in _micro_batches(rank, update):
                before = len(allreduce_calls)
                state, out = step(state, batch)
                calls_per_micro.append(len(allreduce_calls) - before)
        report["params"] = [p.detach().tolist() for p in model.module.parameters()]
        report["allreduce_calls"] = calls_per_micro
        report["step"] = state.step

        # A NaN on rank 1 only: both ranks must reject the window and stay in lockstep.
        params_before = [p.detach().clone() for p in model.parameters()]
        for i, (x, y) in enumerate(_micro_batches(rank, 9)):
            if rank == 1 and i == 0:
                x = x.clone()
                x[0, 0] = float("nan")
            state, out = step(state, (x, y))
        report["nan_window"] = {
            "updated": out.updated,
            "nonfinite": out.nonfinite,
            "notfinite_count": state.guard.notfinite_count,
            "unchanged": all(torch.equal(a, b) for a, b in zip(params_before, model.parameters())),
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()  # see feasibility notes: avoids a gloo teardown abort
    finally:
        dist.destroy_process_group()


def _reference() -> list[list]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for update in range(3):
        batches = [b for r in range(WORLD) for b in _micro_batches(r, update)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        loss = torch.nn.functional.cross_entropy(model(x), y)  # mean over all targets
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().tolist() for p in model.parameters()]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
@pytest.mark.skipif(sys.platform != "linux", reason="gloo over FileStore tested on Linux")
def test_ddp_accumulation_with_counts_guard_and_lockstep(tmp_path: Path) -> None:
    def attempt_args(attempt: int) -> tuple[str, str]:
        out = tmp_path / f"attempt{attempt}"
        out.mkdir()
        return str(out / "store"), str(out)

    spawn(_worker, attempt_args, nprocs=WORLD)
    out = max(tmp_path.glob("attempt*"))  # the attempt that completed
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    ref = _reference()
    for report in reports:
        # Gradient all-reduce only on the micro-batch that closes the window (no_sync before).
        assert all(c == 0 for c in report["allreduce_calls"][0::K]), report["allreduce_calls"]
        assert all(c == 0 for c in report["allreduce_calls"][1::K]), report["allreduce_calls"]
        assert all(c > 0 for c in report["allreduce_calls"][2::K]), report["allreduce_calls"]
        assert report["step"] == 3
        for got, want in zip(report["params"], ref):
            torch.testing.assert_close(
                torch.tensor(got, dtype=torch.float64),
                torch.tensor(want, dtype=torch.float64),
                rtol=1e-12,
                atol=1e-12,
            )
        assert report["nan_window"] == {
            "updated": False,
            "nonfinite": True,
            "notfinite_count": 1,
            "unchanged": True,
        }
    assert reports[0]["params"] == reports[1]["params"]


if __name__ == "__main__":  # pragma: no cover - manual run
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    pytest.main([__file__, "-q"])


def _fsdp2_worker(rank: int, store_path: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        model = _model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # FSDP2 (torch 2.13) reduce-scatters gradients through this call; count it.
        calls: list[int] = []
        original = dist.reduce_scatter_single

        def counting(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        dist.reduce_scatter_single = counting
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        step = compose(accumulate(micro_batches=K), clip(max_norm=10.0), guard_nonfinite())(
            make_step(_counted)
        )
        state = TrainState(model=model, optimizer=opt)
        per_micro = []
        for update in range(3):
            for batch in _micro_batches(rank, update):
                before = len(calls)
                state, out = step(state, batch)
                per_micro.append(len(calls) - before)
        report: dict = {
            "params": [p.full_tensor().tolist() for p in model.parameters()],
            "reduce_scatters": per_micro,
            "step": state.step,
            "grad_norm_is_plain": type(out.grad_norm) is torch.Tensor,
        }
        before_nan = [p.full_tensor() for p in model.parameters()]
        for i, (x, y) in enumerate(_micro_batches(rank, 9)):
            if rank == 1 and i == 0:
                x = x.clone()
                x[0, 0] = float("nan")
            state, out = step(state, (x, y))
        report["nan_window"] = {
            "updated": out.updated,
            "nonfinite": out.nonfinite,
            "unchanged": all(
                torch.equal(a, b.full_tensor()) for a, b in zip(before_nan, model.parameters())
            ),
        }
        Path(out_dir, f"fsdp2_rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
@pytest.mark.skipif(sys.platform != "linux", reason="gloo over FileStore tested on Linux")
def test_fsdp2_accumulation_with_counts_clip_and_guard(tmp_path: Path) -> None:
    def attempt_args(attempt: int) -> tuple[str, str]:
        out = tmp_path / f"attempt{attempt}"
        out.mkdir()
        return str(out / "store"), str(out)

    spawn(_fsdp2_worker, attempt_args, nprocs=WORLD)
    out = max(tmp_path.glob("attempt*"))
    reports = [json.loads((out / f"fsdp2_rank{r}.json").read_text()) for r in range(WORLD)]
    ref = _reference()
    for report in reports:
        # Sync suppressed until the micro-batch that closes the window.
        counts = report["reduce_scatters"]
        assert counts[0::K] == [0, 0, 0] and counts[1::K] == [0, 0, 0], counts
        assert all(c > 0 for c in counts[2::K]), counts
        assert report["step"] == 3 and report["grad_norm_is_plain"]
        for got, want in zip(report["params"], ref):
            torch.testing.assert_close(
                torch.tensor(got, dtype=torch.float64),
                torch.tensor(want, dtype=torch.float64),
                rtol=1e-12,
                atol=1e-12,
            )
        assert report["nan_window"] == {"updated": False, "nonfinite": True, "unchanged": True}
