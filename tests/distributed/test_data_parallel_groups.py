"""A data-parallel sub-group: 4 gloo ranks as 2 groups of 2, each group training its own model.

Tensor- or sequence-parallel jobs average gradients over a sub-group of the world. The
step must sum target counts and agree on the guard's verdict over that group only: summing
over the world would scale every gradient by the wrong count, and a NaN in one group would
make the other group skip a healthy window. Reference: one process per group, training on
the concatenation of its two ranks' micro-batches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from spawning import spawn

from toolkit import (
    LossSum,
    TrainState,
    accumulate,
    clip,
    compose,
    data_parallel_group,
    evaluate,
    guard_nonfinite,
    make_step,
    run,
    set_data_parallel_group,
)
from toolkit.plugins import Sink, log_metrics

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built"),
    pytest.mark.skipif(sys.platform != "linux", reason="gloo over FileStore tested on Linux"),
]

WORLD, GROUP = 4, 2
K = 2  # micro-batches per update
UPDATES = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    ).double()


def _micro_batches(rank: int, update: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Sizes differ by rank, so a count summed over the wrong ranks changes the result.
    g = torch.Generator().manual_seed(100 * update + rank)
    sizes = [1 + rank + 2 * i for i in range(K)]
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


def _ddp(groups: list) -> tuple[torch.nn.Module, object]:
    group = groups[dist.get_rank() // GROUP]
    return torch.nn.parallel.DistributedDataParallel(_model(), process_group=group), (
        lambda p: p.detach()
    )


def _fsdp2(groups: list) -> tuple[torch.nn.Module, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Rows are the data-parallel groups: mesh["dp"] is {0, 1} or {2, 3}.
    mesh = init_device_mesh("cpu", (WORLD // GROUP, GROUP), mesh_dim_names=("other", "dp"))
    model = _model()
    for layer in model.children():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, lambda p: p.full_tensor()


def _given(groups: list) -> tuple[torch.nn.Module, object]:
    # DDP over the world's default group, told the sub-group by hand: the override wins.
    # (Only the count and verdict follow it; DDP itself averages over the world, so this
    # case is checked for the group read back, not for training.)
    model = torch.nn.parallel.DistributedDataParallel(_model())
    set_data_parallel_group(model, groups[dist.get_rank() // GROUP])
    return model, lambda p: p.detach()


def _train(model: torch.nn.Module, full) -> dict:
    rank = dist.get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step = compose(accumulate(micro_batches=K), clip(max_norm=10.0), guard_nonfinite())(
        make_step(_counted)
    )
    state = TrainState(model=model, optimizer=opt)
    for update in range(UPDATES):
        for batch in _micro_batches(rank, update):
            state, out = step(state, batch)
    report: dict = {"params": [full(p).tolist() for p in model.parameters()]}
    # A NaN on rank 1 only: its group (0, 1) rejects the window, the other group applies it.
    before = [full(p).clone() for p in model.parameters()]
    for i, (x, y) in enumerate(_micro_batches(rank, 9)):
        if rank == 1 and i == 0:
            x = x.clone()
            x[0, 0] = float("nan")
        state, out = step(state, (x, y))
    report["nan_window"] = {
        "updated": out.updated,
        "nonfinite": out.nonfinite,
        "unchanged": all(torch.equal(a, full(b)) for a, b in zip(before, model.parameters())),
    }
    return report


def _logged_loss(model: torch.nn.Module, rank: int) -> list[float]:
    # log_metrics reduces over the model's group too: rank 0 publishes group 0's mean.
    seen: list[float] = []
    sink = Sink(write=lambda step, metrics: seen.append(metrics["train/loss"]), close=list)
    step = make_step(lambda m, x: m(x).sum() * 0 + rank)  # a loss equal to the rank
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    data = [torch.zeros(2, 4, dtype=torch.float64)]
    run(step, state, data, max_steps=1, plugins=[log_metrics(every=1, sinks=[sink])])
    return seen


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD
    )
    try:
        # new_group is collective: every rank creates both groups, in the same order.
        groups = [dist.new_group(list(range(g, g + GROUP))) for g in range(0, WORLD, GROUP)]
        report = {}
        for name, wrap in (("ddp", _ddp), ("fsdp2", _fsdp2), ("given", _given)):
            model, full = wrap(groups)
            group = data_parallel_group(model)
            report[name] = {"ranks": dist.get_process_group_ranks(group)}
            if name != "given":
                report[name].update(_train(model, full))
                # Evaluation sums over the same group: each group's mean of its own ranks.
                said = evaluate(lambda m, b: {"rank": float(rank)}, model, [None, None])
                report[name]["evaluated"] = said["rank"]
                report[name]["logged"] = _logged_loss(model, rank)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _reference(group: int) -> list[list]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ranks = range(group * GROUP, (group + 1) * GROUP)
    for update in range(UPDATES):
        batches = [b for r in ranks for b in _micro_batches(r, update)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        torch.nn.functional.cross_entropy(model(x), y).backward()  # mean over the group
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().tolist() for p in model.parameters()]


def test_counts_and_verdicts_stay_within_the_data_parallel_group(tmp_path: Path) -> None:
    def attempt_args(attempt: int) -> tuple[str, str]:
        out = tmp_path / f"attempt{attempt}"
        out.mkdir()
        return str(out / "store"), str(out)

    spawn(_worker, attempt_args, nprocs=WORLD, timeout=180)
    out = max(tmp_path.glob("attempt*"))
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    refs = [_reference(g) for g in range(WORLD // GROUP)]
    assert refs[0] != refs[1]  # the groups train on different data
    for rank, report in enumerate(reports):
        group = rank // GROUP
        own = list(range(group * GROUP, (group + 1) * GROUP))
        assert report["given"]["ranks"] == own
        for name in ("ddp", "fsdp2"):
            assert report[name]["ranks"] == own, name
            for got, want in zip(report[name]["params"], refs[group]):
                torch.testing.assert_close(
                    torch.tensor(got, dtype=torch.float64),
                    torch.tensor(want, dtype=torch.float64),
                    rtol=1e-12,
                    atol=1e-12,
                )
            assert report[name]["evaluated"] == sum(own) / GROUP, (name, rank)
            assert report[name]["logged"] == ([sum(own) / GROUP] if rank == 0 else []), name
            rejected = group == 0  # the NaN was on rank 1
            assert report[name]["nan_window"] == {
                "updated": not rejected,
                "nonfinite": rejected,
                "unchanged": rejected,
            }, (name, rank)


def test_set_data_parallel_group_refuses_a_plain_module() -> None:
    with pytest.raises(TypeError, match="expected a DDP- or FSDP2-wrapped model; got a Linear"):
        set_data_parallel_group(torch.nn.Linear(2, 1), None)


def _hsdp_worker(rank: int, store_path: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD
    )
    try:
        # HSDP: parameters sharded over "shard" (2 ranks), replicated over "replicate" (2).
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = _model()
        for layer in model.children():
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        group = data_parallel_group(model)
        report = {"ranks": dist.get_process_group_ranks(group)}
        report.update(_train(model, lambda p: p.full_tensor()))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _one_process() -> list[list]:
    """The 4 ranks' micro-batches in one process: the result HSDP must reproduce."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for update in range(UPDATES):
        batches = [b for r in range(WORLD) for b in _micro_batches(r, update)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        torch.nn.functional.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().tolist() for p in model.parameters()]


def test_hsdp_on_a_2d_mesh_matches_one_process(tmp_path: Path) -> None:
    def attempt_args(attempt: int) -> tuple[str, str]:
        out = tmp_path / f"attempt{attempt}"
        out.mkdir()
        return str(out / "store"), str(out)

    spawn(_hsdp_worker, attempt_args, nprocs=WORLD, timeout=120)
    out = max(tmp_path.glob("attempt*"))
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    want = _one_process()
    for report in reports:
        assert report["ranks"] == list(range(WORLD))  # the whole 2-D mesh
        # Not bitwise: HSDP reduce-scatters over "shard", then all-reduces over
        # "replicate", so the gradient sums add the same terms in another order than one
        # process's backward does; float64 keeps the difference at rounding level.
        for got, ref in zip(report["params"], want):
            torch.testing.assert_close(
                torch.tensor(got, dtype=torch.float64),
                torch.tensor(ref, dtype=torch.float64),
                rtol=1e-12,
                atol=1e-12,
            )
        # A NaN on rank 1 makes the whole mesh reject the window.
        assert report["nan_window"] == {"updated": False, "nonfinite": True, "unchanged": True}
