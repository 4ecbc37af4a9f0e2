"""A DDP rank whose loss function returns None for every batch from some update on: every
rank fails with the lockstep error, instead of a gloo abort.

The skipping rank never runs the closing backward that the others wait in (their gradient
all-reduce); once it has skipped a window's worth of micro-batches it takes part in that
all-reduce with zeros and its skip count, so every rank compares the counts and raises.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from spawning import spawn

from toolkit import TrainState, accumulate, compose, guard_nonfinite, make_step

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built"),
    pytest.mark.skipif(sys.platform != "linux", reason="gloo over FileStore tested on Linux"),
]

WORLD, K, CALLS = 2, 2, 10


def _loss(model: torch.nn.Module, batch: torch.Tensor):
    if torch.isnan(batch).all():  # the "skip me" marker
        return None
    return model(batch).square().mean()


def _run(guarded: bool, skipping: tuple[int, ...]) -> dict:
    """Calls 0-3 on every rank, then None from call 4 on for the ranks in ``skipping``."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    step = accumulate(make_step(_loss), micro_batches=K)
    step = compose(guard_nonfinite())(step) if guarded else step
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(rank)
    report: dict = {"error": None, "closed": []}
    try:
        for i in range(CALLS):
            batch = torch.randn(3, 4, generator=g)
            skip = rank in skipping and i >= 4
            state, out = step(state, torch.full((3, 4), float("nan")) if skip else batch)
            if out.closed:
                report["closed"].append([out.updated, out.empty])
    except ValueError as error:
        report["error"] = str(error)
    report["step"] = state.step
    report["params"] = [p.detach().tolist() for p in model.parameters()]
    return report


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD
    )
    try:
        report = {
            f"{guarded}_{skipping}": _run(guarded, skipping)
            for guarded in (False, True)
            for skipping in ((1,), (0, 1))
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("skip_forever")

    def attempt_args(attempt: int) -> tuple[str, str]:
        out = tmp / f"attempt{attempt}"
        out.mkdir()
        return str(out / "store"), str(out)

    spawn(_worker, attempt_args, nprocs=WORLD, timeout=60)
    out = max(tmp.glob("attempt*"))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("guarded", [False, True])
def test_a_rank_skipping_forever_fails_on_every_rank(reports: list[dict], guarded: bool) -> None:
    for report in reports:
        run = report[f"{guarded}_(1,)"]
        assert run["error"] is not None
        assert "returned None on some ranks of the data-parallel group" in run["error"]
        assert "from 0 to 2 skipped micro-batches" in run["error"]
        assert run["step"] == 2  # two windows, then nothing applied
    assert reports[0][f"{guarded}_(1,)"]["params"] == reports[1][f"{guarded}_(1,)"]["params"]


@pytest.mark.parametrize("guarded", [False, True])
def test_every_rank_skipping_alike_applies_nothing(reports: list[dict], guarded: bool) -> None:
    for report in reports:
        run = report[f"{guarded}_(0, 1)"]
        assert run["error"] is None and run["step"] == 2
        # Two windows applied; each later window of skips only closed empty.
        assert run["closed"] == [[True, False]] * 2 + [[False, True]] * 3
    assert reports[0][f"{guarded}_(0, 1)"]["params"] == reports[1][f"{guarded}_(0, 1)"]["params"]
