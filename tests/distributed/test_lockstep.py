"""A loss function returning None on one DDP rank only: a clear error on every rank, no hang.

Two gloo ranks under DDP, accumulation of 2. Each rank counts the Nones of its open window;
at the window's close the counts are compared over the group, riding on DDP's own gradient
all-reduce of the closing micro-batch (toolkit's comm hook appends them to the first
bucket): no collective of their own, guard or not. On a model with a comm hook of the
user's, they ride on the guard's verdict all-reduce or, without a guard and fp16, on one
small all-reduce of their own. Ranks whose windows drifted apart still pair their closing
collectives (DDP syncs gradients only on the closing micro-batch), so both reach the
comparison and raise. The test counts ``dist.all_reduce`` calls per update (toolkit's hook
makes DDP's bucket all-reduce one of them). A rank that returns None from some update on,
for ever, fails on every rank too: once it has skipped a window's worth of micro-batches it
joins the closing all-reduce with zeros and its count.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from spawning import spawn_reports

from toolkit import TrainState, accumulate, compose, guard_nonfinite, make_step

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built"),
    pytest.mark.skipif(sys.platform != "linux", reason="gloo over FileStore tested on Linux"),
]

WORLD, K = 2, 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _ddp(own_hook: bool, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model under DDP; ``own_hook``: with the user's comm hook, so toolkit's is refused
    and the flags travel in an all-reduce of their own (as they do for bf16 gradients,
    whose sums would not be exact)."""
    model = torch.nn.parallel.DistributedDataParallel(_model().to(dtype))
    if own_hook:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        model.register_comm_hook(None, allreduce_hook)
    return model


def _batches(rank: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(3, 4, generator=g) for _ in range(n)]


def _loss(model: torch.nn.Module, batch: torch.Tensor):
    if torch.isnan(batch).all():  # the "skip me" marker of these tests
        return None
    return model(batch).square().mean()


SKIP = torch.full((3, 4), float("nan"))
# A batch the loss functions below treat specially: _loss_nan makes its loss NaN with
# finite gradients (a NaN added as a constant), _counted_loss gives it no targets.
MARKED = torch.full((3, 4), 7.0)


def _loss_nan(model: torch.nn.Module, batch: torch.Tensor):
    loss = model(batch).square().mean()
    return loss + float("nan") if bool((batch == 7.0).all()) else loss


def _scenario(
    guarded: bool,
    nones: dict[int, list[int]],
    own_hook: bool = False,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Train over 6 calls with None at the given call indices per rank; report."""
    rank = dist.get_rank()
    model = _ddp(own_hook, dtype)
    step = accumulate(make_step(_loss), micro_batches=K)
    if guarded:
        step = compose(guard_nonfinite())(step)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting
    report: dict = {"error": None, "per_update": []}
    try:
        for i, batch in enumerate(_batches(rank, 6)):
            before = len(calls)
            state, out = step(state, (SKIP if i in nones.get(rank, []) else batch).to(dtype))
            if out.closed:
                report["per_update"].append(len(calls) - before)
    except ValueError as error:
        report["error"] = str(error)
    finally:
        dist.all_reduce = original
    report["step"] = state.step
    report["params"] = [p.detach().tolist() for p in model.parameters()]
    return report


SCENARIOS = {
    "guard_one_rank": (True, {1: [0]}),
    "plain_one_rank": (False, {0: [3]}),
    "guard_all_ranks": (True, {0: [1], 1: [1]}),
    "plain_all_ranks": (False, {0: [1], 1: [1]}),
    "guard_one_rank_own_hook": (True, {1: [0]}, True),
    "plain_one_rank_own_hook": (False, {0: [3]}, True),
    "guard_all_ranks_own_hook": (True, {0: [1], 1: [1]}, True),
    "plain_all_ranks_own_hook": (False, {0: [1], 1: [1]}, True),
    "guard_one_rank_bf16": (True, {1: [0]}, False, torch.bfloat16),
    "guard_all_ranks_bf16": (True, {0: [1], 1: [1]}, False, torch.bfloat16),
}


def _nan_loss_on_one_rank(own_hook: bool) -> dict:
    """Rank 1's first loss is NaN, its gradients finite: both ranks must reject window 0."""
    rank = dist.get_rank()
    model = _ddp(own_hook)
    step = compose(guard_nonfinite())(accumulate(make_step(_loss_nan), micro_batches=K))
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    rejected = []
    for i, batch in enumerate(_batches(rank, 6)):
        state, out = step(state, MARKED if (rank, i) == (1, 0) else batch)
        if out.closed:
            rejected.append(out.nonfinite)
    return {"rejected": rejected, "params": [p.detach().tolist() for p in model.parameters()]}


def _fp16(own_hook: bool) -> dict:
    """fp16 + guard under DDP; rank 1's third batch overflows the loss: every window's
    decision must agree across ranks, whichever way the flags travel."""
    from toolkit import amp_wrap

    rank = dist.get_rank()
    model = _ddp(own_hook)
    step = compose(amp_wrap(dtype="fp16"), guard_nonfinite())(
        accumulate(make_step(_loss), micro_batches=K)
    )
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    windows = []
    for i, batch in enumerate(_batches(rank, 6)):
        state, out = step(state, batch * 1e5 if (rank, i) == (1, 2) else batch)
        if out.closed:
            windows.append([out.updated, out.nonfinite, out.overflow])
    return {"windows": windows, "params": [p.detach().tolist() for p in model.parameters()]}


def _counted_loss(model: torch.nn.Module, batch: torch.Tensor):
    from toolkit import LossSum

    count = 0 if bool((batch == 7.0).all()) else batch.shape[0]  # 7.0: a batch of no targets
    return LossSum(model(batch).square().sum() * (count > 0), count)


def _empty_window() -> dict:
    """LossSum counts: window 0 holds no target on either rank, window 1 none on rank 1."""
    rank = dist.get_rank()
    model = _ddp(own_hook=False)
    step = compose(guard_nonfinite())(accumulate(make_step(_counted_loss), micro_batches=K))
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    windows = []
    for i, batch in enumerate(_batches(rank, 6)):
        empty = i in (0, 1) or (rank == 1 and i in (2, 3))
        state, out = step(state, MARKED if empty else batch)
        if out.closed:
            windows.append([out.updated, out.empty])
    return {"windows": windows, "params": [p.detach().tolist() for p in model.parameters()]}


def _skip_forever(guarded: bool, skipping: tuple[int, ...]) -> dict:
    """Calls 0-3 on every rank, then None from call 4 on for the ranks in ``skipping``."""
    rank = dist.get_rank()
    model = _ddp(own_hook=False)
    step = accumulate(make_step(_loss), micro_batches=K)
    step = compose(guard_nonfinite())(step) if guarded else step
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    report: dict = {"error": None, "closed": []}
    try:
        for i, batch in enumerate(_batches(rank, 10)):
            state, out = step(state, SKIP if rank in skipping and i >= 4 else batch)
            if out.closed:
                report["closed"].append([out.updated, out.empty])
    except ValueError as error:
        report["error"] = str(error)
    return report | {"step": state.step, "params": [p.tolist() for p in model.parameters()]}


def _job() -> dict:
    report = {name: _scenario(*args) for name, args in SCENARIOS.items()}
    for own_hook in (False, True):
        report[f"nan_loss_own_hook_{own_hook}"] = _nan_loss_on_one_rank(own_hook)
        report[f"fp16_own_hook_{own_hook}"] = _fp16(own_hook)
    report["empty_window"] = _empty_window()
    for guarded in (False, True):
        for skipping in ((1,), (0, 1)):
            report[f"forever_{guarded}_{skipping}"] = _skip_forever(guarded, skipping)
    return report


def _reference(skipped_call: int) -> list:
    """One process, both ranks' batches, the skipped call left out on every rank."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_rank = [
        [b for i, b in enumerate(_batches(r, 6)) if i != skipped_call] for r in range(WORLD)
    ]
    for update in range(2):  # 5 accepted calls per rank: 2 updates, one micro-batch left open
        window = [b for r in range(WORLD) for b in per_rank[r][K * update : K * update + K]]
        sum(model(b).square().mean() for b in window).div(len(window)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().tolist() for p in model.parameters()]


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn_reports(_job, tmp_path_factory.mktemp("lockstep"), WORLD, timeout=90)


@pytest.mark.parametrize(
    "name",
    [
        "guard_one_rank",
        "plain_one_rank",
        "guard_one_rank_own_hook",
        "plain_one_rank_own_hook",
        "guard_one_rank_bf16",
    ],
)
def test_none_on_one_rank_raises_on_every_rank(reports: list[dict], name: str) -> None:
    for report in reports:
        error = report[name]["error"]
        assert error is not None, name
        assert "returned None on some ranks of the data-parallel group" in error
        assert "from 0 to 1 skipped micro-batches" in error
    # Nothing was applied from the window that disagreed.
    assert reports[0][name]["params"] == reports[1][name]["params"]


def test_none_on_every_rank_alike_is_a_skip(reports: list[dict]) -> None:
    want = _reference(skipped_call=1)
    for name in (
        "guard_all_ranks",
        "plain_all_ranks",
        "guard_all_ranks_own_hook",
        "plain_all_ranks_own_hook",
    ):
        for report in reports:
            assert report[name]["error"] is None and report[name]["step"] == 2
            for got, ref in zip(report[name]["params"], want):
                torch.testing.assert_close(torch.tensor(got), torch.tensor(ref))


def test_the_check_rides_on_ddps_gradient_all_reduce(reports: list[dict]) -> None:
    for report in reports:
        # Python-level all_reduce calls per update: DDP's gradient bucket, through toolkit's
        # hook, carrying the None counts (and the guard's loss flag): nothing else.
        assert report["guard_all_ranks"]["per_update"] == [1, 1]
        assert report["plain_all_ranks"]["per_update"] == [1, 1]
        # With the user's hook (the bucket's all-reduce, counted too): the guard's verdict
        # carries the counts, or without a guard one small all-reduce of their own.
        assert report["guard_all_ranks_own_hook"]["per_update"] == [2, 2]
        assert report["plain_all_ranks_own_hook"]["per_update"] == [2, 2]
        # bf16 gradients: toolkit's hook sends the bucket alone, the flags go on their own.
        assert report["guard_all_ranks_bf16"]["per_update"] == [2, 2]
        assert report["guard_all_ranks_bf16"]["error"] is None


@pytest.mark.parametrize("own_hook", [False, True])
def test_a_nan_loss_with_finite_gradients_on_one_rank_is_rejected_on_every_rank(
    reports: list[dict], own_hook: bool
) -> None:
    # Rank 0's loss and the averaged gradients are finite: only rank 1's flag, carried to
    # rank 0, makes it reject the window too; the replicas stay equal.
    name = f"nan_loss_own_hook_{own_hook}"
    for report in reports:
        assert report[name]["rejected"] == [True, False, False]
    assert reports[0][name]["params"] == reports[1][name]["params"]


def test_fp16_decisions_agree_across_ranks_and_flag_routes(reports: list[dict]) -> None:
    carried, alone = (reports[0][f"fp16_own_hook_{h}"] for h in (False, True))
    # [updated, nonfinite, overflow] per window: the first overflows the scaler's initial
    # scale (as fp16 runs do), the second holds rank 1's inf loss (the guard's, on both
    # ranks), the third applies.
    assert carried["windows"] == [[False, False, True], [False, True, False], [True, False, False]]
    for report in reports[1:]:
        assert report["fp16_own_hook_False"] == carried  # both ranks decided alike
    assert alone == carried  # flags with the gradients or on their own: the same training


def test_a_window_without_targets_on_every_rank_is_skipped_on_every_rank(
    reports: list[dict],
) -> None:
    # The count's sum over the ranks decides: 0 in window 0 (skipped as empty), rank 0's
    # targets in window 1 (applied on both).
    for report in reports:
        assert report["empty_window"]["windows"] == [[False, True], [True, False], [True, False]]
    assert reports[0]["empty_window"]["params"] == reports[1]["empty_window"]["params"]


@pytest.mark.parametrize("guarded", [False, True])
def test_a_rank_skipping_forever_fails_on_every_rank(reports: list[dict], guarded: bool) -> None:
    name = f"forever_{guarded}_(1,)"
    for report in reports:
        run = report[name]
        assert run["error"] is not None
        assert "returned None on some ranks of the data-parallel group" in run["error"]
        assert "from 0 to 2 skipped micro-batches" in run["error"]
        assert run["step"] == 2  # two windows, then nothing applied
    assert reports[0][name]["params"] == reports[1][name]["params"]


@pytest.mark.parametrize("guarded", [False, True])
def test_every_rank_skipping_alike_applies_nothing(reports: list[dict], guarded: bool) -> None:
    name = f"forever_{guarded}_(0, 1)"
    for report in reports:
        run = report[name]
        assert run["error"] is None and run["step"] == 2
        # Two windows applied; each later window of skips only closed empty.
        assert run["closed"] == [[True, False]] * 2 + [[False, True]] * 3
    assert reports[0][name]["params"] == reports[1][name]["params"]
