"""Host syncs, counted: aten._local_scalar_dense calls made by a train step.

Counts do not depend on the machine, so they can be asserted: zero on micro-batches that do
not close a window; at most one per update with the guard (or fp16), zero without them.
"""

from __future__ import annotations

import pytest
import torch
from counting import CountSyncs

from toolkit import (
    LossSum,
    TrainState,
    accumulate,
    amp_wrap,
    clip,
    compose,
    guard_nonfinite,
    make_step,
)


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).float(), y)


def _counted(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
    x, y = batch
    total = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
    return LossSum(total, torch.tensor(y.shape[0]))


def _state(optimizer: str) -> TrainState:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    else:  # fused AdamW skips on found_inf inside the kernel, with no sync of its own
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return TrainState(model=model, optimizer=opt, scheduler=sched)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(6, 8), torch.randint(0, 4, (6,))) for _ in range(n)]


def _per_call_syncs(step, state: TrainState, batches) -> list[int]:
    counts = []
    for batch in batches:
        with CountSyncs() as counter:
            state, _ = step(state, batch)
        counts.append(counter.count)
    return counts


DECORATIONS = {
    "plain": [],
    "accumulate": [accumulate(micro_batches=4)],
    "accumulate+clip_norm+clip_value": [
        accumulate(micro_batches=4),
        clip(max_norm=0.5, max_value=0.1),
    ],
    "accumulate+bf16+clip": [accumulate(micro_batches=4), amp_wrap(dtype="bf16"), clip(max_norm=1)],
}


@pytest.mark.parametrize("optimizer", ["sgd", "fused_adamw"])
@pytest.mark.parametrize("name", list(DECORATIONS))
def test_no_sync_without_guard(name: str, optimizer: str) -> None:
    step = compose(*DECORATIONS[name])(make_step(_loss))
    counts = _per_call_syncs(step, _state(optimizer), _batches(8))
    assert counts == [0] * 8


@pytest.mark.parametrize("optimizer", ["sgd", "fused_adamw"])
def test_counts_add_no_sync(optimizer: str) -> None:
    step = accumulate(make_step(_counted), micro_batches=4)
    assert _per_call_syncs(step, _state(optimizer), _batches(8)) == [0] * 8


@pytest.mark.parametrize("optimizer", ["sgd", "fused_adamw"])
def test_guard_syncs_once_per_update_and_never_per_micro_batch(optimizer: str) -> None:
    step = compose(accumulate(micro_batches=4), clip(max_norm=1.0), guard_nonfinite())(
        make_step(_loss)
    )
    counts = _per_call_syncs(step, _state(optimizer), _batches(12))
    assert counts == [0, 0, 0, 1] * 3


def test_guard_alone_syncs_once_per_update() -> None:
    step = guard_nonfinite(make_step(_loss))
    assert _per_call_syncs(step, _state("sgd"), _batches(3)) == [1, 1, 1]


@pytest.mark.parametrize("with_guard", [False, True])
def test_fp16_shares_one_sync_per_update(with_guard: bool) -> None:
    # fp16 must know whether the scaler skipped (to hold the scheduler back): one sync per
    # update, which the guard shares; fused AdamW consumes found_inf without one of its own.
    decorators = [amp_wrap(dtype="fp16"), accumulate(micro_batches=2), clip(max_norm=1.0)]
    if with_guard:
        decorators.append(guard_nonfinite())
    step = compose(*decorators)(make_step(_loss))
    counts = _per_call_syncs(step, _state("fused_adamw"), _batches(4))
    assert counts == [0, 1, 0, 1]


def test_fp16_unfused_optimizer_adds_no_sync_of_the_scaler() -> None:
    # GradScaler.step would .item() found_inf for an unfused optimizer; the step already
    # knows the answer from its single sync and calls optimizer.step() itself.
    step = compose(amp_wrap(dtype="fp16"), guard_nonfinite())(make_step(_loss))
    assert _per_call_syncs(step, _state("sgd"), _batches(3)) == [1, 1, 1]
