"""A data-parallel sub-group: 4 gloo ranks as 2 groups of 2, each group training its own model.

Tensor- or sequence-parallel jobs average gradients over a sub-group of the world. The
step must sum target counts and agree on the guard's verdict over that group only: summing
over the world would scale every gradient by the wrong count, and a NaN in one group would
make the other group skip a healthy window. Reference: one process per group, training on
the concatenation of its two ranks' micro-batches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import dp_jobs
import pytest
import torch
import torch.distributed as dist
from spawning import spawn_reports

from toolkit import (
    TrainState,
    data_parallel_group,
    evaluate,
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
UPDATES = 2


def _ddp(groups: list) -> tuple[torch.nn.Module, object]:
    group = groups[dist.get_rank() // GROUP]
    return torch.nn.parallel.DistributedDataParallel(dp_jobs.mlp(), process_group=group), (
        lambda p: p.detach()
    )


def _fsdp2(groups: list) -> tuple[torch.nn.Module, object]:
    from torch.distributed.device_mesh import init_device_mesh

    # Rows are the data-parallel groups: mesh["dp"] is {0, 1} or {2, 3}.
    mesh = init_device_mesh("cpu", (WORLD // GROUP, GROUP), mesh_dim_names=("other", "dp"))
    return dp_jobs.sharded_mlp(mesh["dp"]), lambda p: p.full_tensor()


def _given(groups: list) -> tuple[torch.nn.Module, object]:
    # DDP over the world's default group, told the sub-group by hand: the override wins.
    # (Only the count and verdict follow it; DDP itself averages over the world, so this
    # case is checked for the group read back, not for training.)
    model = torch.nn.parallel.DistributedDataParallel(dp_jobs.mlp())
    set_data_parallel_group(model, groups[dist.get_rank() // GROUP])
    return model, lambda p: p.detach()


def _logged_loss(model: torch.nn.Module, rank: int) -> list[float]:
    # log_metrics reduces over the model's group too: rank 0 publishes group 0's mean.
    seen: list[float] = []
    sink = Sink(write=lambda step, metrics: seen.append(metrics["train/loss"]), close=list)
    step = make_step(lambda m, x: m(x).sum() * 0 + rank)  # a loss equal to the rank
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    data = [torch.zeros(2, 4, dtype=torch.float64)]
    run(step, state, data, max_steps=1, plugins=[log_metrics(every=1, sinks=[sink])])
    return seen


def _groups_job() -> dict:
    rank = dist.get_rank()
    # new_group is collective: every rank creates both groups, in the same order.
    groups = [dist.new_group(list(range(g, g + GROUP))) for g in range(0, WORLD, GROUP)]
    report = {}
    for name, wrap in (("ddp", _ddp), ("fsdp2", _fsdp2), ("given", _given)):
        model, full = wrap(groups)
        report[name] = {"ranks": dist.get_process_group_ranks(data_parallel_group(model))}
        if name != "given":
            report[name].update(dp_jobs.train(model, full, UPDATES))
            # Evaluation sums over the same group: each group's mean of its own ranks.
            said = evaluate(lambda m, b: {"rank": float(rank)}, model, [None, None])
            report[name]["evaluated"] = said["rank"]
            report[name]["logged"] = _logged_loss(model, rank)
    return report


def test_counts_and_verdicts_stay_within_the_data_parallel_group(tmp_path: Path) -> None:
    reports = spawn_reports(_groups_job, tmp_path, WORLD, timeout=180)
    refs = [dp_jobs.reference(range(g, g + GROUP), UPDATES) for g in range(0, WORLD, GROUP)]
    assert refs[0] != refs[1]  # the groups train on different data
    for rank, report in enumerate(reports):
        group = rank // GROUP
        own = list(range(group * GROUP, (group + 1) * GROUP))
        assert report["given"]["ranks"] == own
        for name in ("ddp", "fsdp2"):
            assert report[name]["ranks"] == own, name
            dp_jobs.assert_params_close(report[name]["params"], refs[group])
            assert report[name]["evaluated"] == sum(own) / GROUP, (name, rank)
            assert report[name]["logged"] == ([sum(own) / GROUP] if rank == 0 else []), name
            rejected = group == 0  # the NaN was on rank 1
            assert report[name]["nan_window"] == {
                "updated": not rejected,
                "nonfinite": rejected,
                "notfinite_count": int(rejected),
                "unchanged": rejected,
            }, (name, rank)


def test_set_data_parallel_group_refuses_a_plain_module() -> None:
    with pytest.raises(TypeError, match="expected a DDP- or FSDP2-wrapped model; got a Linear"):
        set_data_parallel_group(torch.nn.Linear(2, 1), None)


def _hsdp_job() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    # HSDP: parameters sharded over "shard" (2 ranks), replicated over "replicate" (2).
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = dp_jobs.sharded_mlp(mesh)
    report = {"ranks": dist.get_process_group_ranks(data_parallel_group(model))}
    return report | dp_jobs.train(model, lambda p: p.full_tensor(), UPDATES)


def test_hsdp_on_a_2d_mesh_matches_one_process(tmp_path: Path) -> None:
    reports = spawn_reports(_hsdp_job, tmp_path, WORLD, timeout=120)
    want = dp_jobs.reference(range(WORLD), UPDATES)  # the 4 ranks' batches in one process
    for report in reports:
        assert report["ranks"] == list(range(WORLD))  # the whole 2-D mesh
        # Not bitwise: HSDP reduce-scatters over "shard", then all-reduces over
        # "replicate", so the gradient sums add the same terms in another order than one
        # process's backward does; float64 keeps the difference at rounding level.
        dp_jobs.assert_params_close(report["params"], want)
        # A NaN on rank 1 makes the whole mesh reject the window.
        assert report["nan_window"] == dp_jobs.REJECTED
