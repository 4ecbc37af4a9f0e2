"""guard_nonfinite: rejected windows, counters, exhaustion, fp16 overflow.

A batch is ``(x, mode)``; ``mode`` says how the loss function makes it bad:

* ``"nan_input"``: a NaN in the input, so loss and gradients are NaN;
* ``"nan_loss"`` / ``"inf_loss"``: a non-finite constant added to the loss, gradients finite;
* ``"inf_grad"`` / ``"nan_grad"``: a hook writes inf/NaN into one element of the weight's
  gradient, the loss stays finite;
* ``"huge_grad"``: the loss times 1e30: finite in float32, but its gradients overflow fp16;
* ``"skip"``: the loss function returns ``None``; ``"ok"``: a finite batch.
"""

from __future__ import annotations

import copy
import math

import pytest
import reference
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from torch import nn

from toolkit import (
    GuardState,
    LossScaleError,
    NonFiniteError,
    TrainState,
    accumulate,
    amp_wrap,
    compose,
    guard_nonfinite,
    make_step,
)

BAD_LOSS = ["nan_input", "nan_loss", "inf_loss"]
BAD_GRAD_ONLY = ["inf_grad", "nan_grad"]
BAD = BAD_LOSS + BAD_GRAD_ONLY
BAD_GRADS = {"nan_input", "inf_grad", "nan_grad"}  # modes whose gradients are not finite


def _poison_grad(weight: torch.Tensor, value: float) -> torch.Tensor:
    """``weight`` itself, but backward writes ``value`` into one element of its gradient."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[0, 0] = value
        return grad

    poisoned = weight * 1.0
    poisoned.register_hook(hook)
    return poisoned


def _loss_fn(model: nn.Linear, batch):
    x, mode = batch
    if mode == "skip":
        return None
    if mode == "nan_input":
        x = x.clone()
        x[0, 0] = math.nan
    weight = model.weight
    if mode in ("inf_grad", "nan_grad"):
        weight = _poison_grad(weight, math.inf if mode == "inf_grad" else math.nan)
    loss = nn.functional.linear(x, weight, model.bias).float().square().mean()
    if mode == "nan_loss":
        loss = loss + math.nan
    elif mode == "inf_loss":
        loss = loss + math.inf
    elif mode == "huge_grad":
        loss = loss * 1e30
    return loss


def _batch(mode: str, seed: int = 0) -> tuple[torch.Tensor, str]:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(seed)), mode


def _state(seed: int = 0, momentum: float = 0.9) -> TrainState:
    gen = torch.Generator().manual_seed(seed)
    model = nn.Linear(4, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return TrainState(model=model, optimizer=opt, scheduler=sched)


def _snapshot(state: TrainState) -> tuple:
    return (
        [p.detach().clone() for p in state.model.parameters()],
        copy.deepcopy(state.optimizer.state_dict()),
        copy.deepcopy(state.scheduler.state_dict()),
    )


def _assert_unchanged(state: TrainState, snapshot: tuple) -> None:
    """Parameters, optimizer state and scheduler state are exactly as in ``snapshot``."""
    params, opt_sd, sched_sd = snapshot
    for p, q in zip(state.model.parameters(), params):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0, equal_nan=True)
    now = state.optimizer.state_dict()
    assert now["param_groups"] == opt_sd["param_groups"]
    assert now["state"].keys() == opt_sd["state"].keys()
    for i, slots in opt_sd["state"].items():
        for key, value in slots.items():
            torch.testing.assert_close(now["state"][i][key], value, rtol=0, atol=0, equal_nan=True)
    assert state.scheduler.state_dict() == sched_sd


def _grads_cleared(state: TrainState) -> bool:
    return all(p.grad is None for p in state.model.parameters())


def _exhausted(n: int, r: int, total: int) -> str:
    return (
        rf"guard_nonfinite: {n} consecutive accumulation windows had a non-finite loss or "
        rf"gradient \(max_retries={r}; {total} rejected in total\)"
    )


# --------------------------------------------------------------------------- float32 guard


@pytest.mark.parametrize("bad_first", [True, False])
@pytest.mark.parametrize("mode", BAD)
def test_a_nonfinite_window_is_thrown_away(mode, bad_first):
    state = _state()
    step = compose(accumulate(micro_batches=2), guard_nonfinite(max_retries=3))(make_step(_loss_fn))
    for seed in (1, 2):  # one good update first, so momentum buffers and the scheduler moved
        state, out = step(state, _batch("ok", seed))
    assert out.updated and state.step == 1
    before = _snapshot(state)
    hand = copy.deepcopy((state.model, state.optimizer, state.scheduler))

    window = [_batch(mode, 3), _batch("ok", 4)]
    state, out = step(state, window[0] if bad_first else window[1])
    assert not out.closed and state.window.micro_step == 1
    state, out = step(state, window[1] if bad_first else window[0])

    assert out.closed and out.nonfinite and not out.updated and not out.overflow
    assert state.step == 1 and state.window.micro_step == 0
    assert state.guard == GuardState(notfinite_count=1, total_notfinite=1, total_overflow=0)
    assert _grads_cleared(state)
    _assert_unchanged(state, before)
    assert out.grad_norm is not None  # reported, and non-finite exactly when a grad was
    assert math.isfinite(out.grad_norm) == (mode not in BAD_GRADS)
    # out.loss is the closing micro-batch's own loss.
    assert math.isfinite(out.loss) == (bad_first or mode in BAD_GRAD_ONLY)

    # The next window is the retry, and it starts clean: the same update as a hand-written
    # loop that never saw the rejected window.
    for seed in (5, 6):
        state, out = step(state, _batch("ok", seed))
    assert out.updated and not out.nonfinite and state.step == 2
    assert state.guard == GuardState(notfinite_count=0, total_notfinite=1, total_overflow=0)
    model, opt, sched = hand
    reference.train(
        model, opt, sched, _loss_fn, [_batch("ok", 5), _batch("ok", 6)], micro_batches=2
    )
    for p, q in zip(state.model.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert state.scheduler.state_dict() == sched.state_dict()


@pytest.mark.parametrize("max_retries", [0, 1, 3])
def test_raises_when_a_window_fails_with_max_retries_used_up(max_retries):
    state = _state()
    step = guard_nonfinite(make_step(_loss_fn), max_retries=max_retries)
    state, _ = step(state, _batch("ok"))
    before = _snapshot(state)
    for i in range(max_retries):
        state, out = step(state, _batch(BAD[i % len(BAD)], i))
        assert out.nonfinite and not out.updated
        assert state.guard.notfinite_count == i + 1
    with pytest.raises(
        NonFiniteError, match=_exhausted(max_retries + 1, max_retries, max_retries + 1)
    ):
        step(state, _batch("nan_input"))
    # Even the window that raised leaves no gradients behind, and nothing was applied.
    assert _grads_cleared(state)
    _assert_unchanged(state, before)


def test_an_applied_update_resets_the_consecutive_count():
    state = _state()
    step = guard_nonfinite(make_step(_loss_fn), max_retries=1)
    for i in range(4):  # bad, ok, bad, ok, ...: never two failures in a row
        state, out = step(state, _batch("nan_loss", i))
        assert state.guard == GuardState(1, i + 1, 0)
        state, out = step(state, _batch("ok", i))
        assert out.updated and state.guard == GuardState(0, i + 1, 0) and state.step == i + 1
    state, _ = step(state, _batch("inf_loss"))
    with pytest.raises(NonFiniteError, match=_exhausted(2, 1, 6)):
        step(state, _batch("inf_loss"))


def test_on_exhaust_skip_keeps_skipping():
    state = _state()
    step = guard_nonfinite(make_step(_loss_fn), max_retries=1, on_exhaust="skip")
    before = _snapshot(state)
    for i in range(6):
        state, out = step(state, _batch(BAD[i % len(BAD)], i))
        assert out.nonfinite and not out.updated and out.closed
        assert state.guard == GuardState(i + 1, i + 1, 0) and state.step == 0
        assert _grads_cleared(state)
    _assert_unchanged(state, before)
    state, out = step(state, _batch("ok"))
    assert out.updated and state.guard == GuardState(0, 6, 0) and state.step == 1


@pytest.mark.parametrize("mode", ["nan_input", "inf_grad", "inf_loss"])
def test_on_exhaust_accept_applies_the_update(mode):
    state = _state()
    step = guard_nonfinite(make_step(_loss_fn), max_retries=1, on_exhaust="accept")
    before = _snapshot(state)
    state, out = step(state, _batch(mode, 1))
    assert not out.updated and out.nonfinite and state.step == 0
    _assert_unchanged(state, before)

    state, out = step(state, _batch(mode, 2))
    assert out.updated and out.nonfinite and state.step == 1
    assert state.guard == GuardState(2, 2, 0)
    assert state.scheduler.last_epoch == 1 and _grads_cleared(state)
    params_finite = all(bool(p.isfinite().all()) for p in state.model.parameters())
    assert params_finite == (mode not in BAD_GRADS)  # non-finite gradients went in
    if mode == "inf_loss":  # finite gradients: a normal update happened
        assert not torch.equal(state.model.weight, before[0][0])


def test_skipped_micro_batches_do_not_touch_the_guard():
    state = _state()
    step = compose(accumulate(micro_batches=2), guard_nonfinite(max_retries=0))(make_step(_loss_fn))
    state, _ = step(state, _batch("ok"))
    state, out = step(state, _batch("skip"))
    assert out.skipped and not out.nonfinite and state.window.micro_step == 1
    state, out = step(state, _batch("ok", 1))
    assert out.updated and state.guard == GuardState()


# ------------------------------------------------------------------- stateful, vs a reference


class _Reference:
    """The guard's semantics in plain Python: what each call must do, and the counters."""

    def __init__(self, k: int, max_retries: int, on_exhaust: str):
        self.k, self.r, self.on_exhaust = k, max_retries, on_exhaust
        self.step = self.micro = self.count = self.total = 0
        self.bad = self.bad_grads = self.poisoned = False

    def feed(self, mode: str) -> tuple[bool, bool, bool, bool] | str:
        """Returns (updated, closed, skipped, nonfinite), or "raise"."""
        if mode == "skip":
            return False, False, True, False
        self.bad |= mode != "ok" or self.poisoned  # non-finite parameters poison every batch
        self.bad_grads |= mode in BAD_GRADS or self.poisoned
        self.micro += 1
        if self.micro < self.k:
            return False, False, False, False
        bad, bad_grads = self.bad, self.bad_grads
        self.micro, self.bad, self.bad_grads = 0, False, False
        if not bad:
            self.count, self.step = 0, self.step + 1
            return True, True, False, False
        self.count, self.total = self.count + 1, self.total + 1
        if self.count <= self.r or self.on_exhaust == "skip":
            return False, True, False, True
        if self.on_exhaust == "raise":
            return "raise"
        self.step, self.poisoned = self.step + 1, self.poisoned or bad_grads
        return True, True, False, True


class GuardMachine(RuleBasedStateMachine):
    """accumulate(k) + guard_nonfinite(max_retries=r, on_exhaust=...) against _Reference."""

    @initialize(
        k=st.integers(1, 3),
        max_retries=st.integers(0, 3),
        on_exhaust=st.sampled_from(["raise", "skip", "accept"]),
    )
    def build(self, k, max_retries, on_exhaust):
        self.config = (k, max_retries, on_exhaust)
        self.step_fn = compose(
            accumulate(micro_batches=k),
            guard_nonfinite(max_retries=max_retries, on_exhaust=on_exhaust),
        )(make_step(_loss_fn))
        self.calls = 0
        self._restart()

    def _restart(self) -> None:
        """A fresh run, as a user would start one after a NonFiniteError."""
        self.ref = _Reference(*self.config)
        self.state = _state(seed=self.calls)

    def _feed(self, mode: str) -> None:
        self.calls += 1
        batch = _batch(mode, self.calls)
        before = _snapshot(self.state)
        expected = self.ref.feed(mode)
        if expected == "raise":
            n, r = self.ref.count, self.ref.r
            with pytest.raises(NonFiniteError, match=_exhausted(n, r, self.ref.total)):
                self.step_fn(self.state, batch)
            assert _grads_cleared(self.state)
            _assert_unchanged(self.state, before)
            self._restart()
            return
        self.state, out = self.step_fn(self.state, batch)
        assert (out.updated, out.closed, out.skipped, out.nonfinite) == expected
        assert not out.overflow
        assert (out.grad_norm is not None) == out.closed
        if not out.updated:
            _assert_unchanged(self.state, before)
        if out.closed:
            assert _grads_cleared(self.state)

    @rule()
    def finite_batch(self):
        self._feed("ok")

    @rule(mode=st.sampled_from(BAD))
    def nonfinite_batch(self, mode):
        self._feed(mode)

    @rule()
    def skipped_batch(self):
        self._feed("skip")

    @invariant()
    def counters_match_the_reference(self):
        ref, state = self.ref, self.state
        assert state.step == ref.step
        assert state.window.micro_step == ref.micro
        assert state.guard == GuardState(ref.count, ref.total, 0)
        assert state.scheduler.last_epoch == state.step  # stepped once per applied update
        if not ref.poisoned:
            assert all(bool(p.isfinite().all()) for p in state.model.parameters())


TestGuardMachine = pytest.mark.slow(GuardMachine.TestCase)  # 120 runs of 30 steps: about 4 s
TestGuardMachine.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)


# ---------------------------------------------------------------------------------- fp16


def _fp16_step(*, guard: bool, k: int = 1, **amp):
    decorators = [amp_wrap(dtype="fp16", **amp), accumulate(micro_batches=k)]
    if guard:
        decorators.append(guard_nonfinite(max_retries=0))  # any counted failure would raise
    return compose(*decorators)(make_step(_loss_fn))


@pytest.mark.parametrize(("guard", "k"), [(True, 1), (True, 2), (False, 1)])
def test_fp16_scaler_overflows_are_not_failures(guard, k):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    step = _fp16_step(guard=guard, k=k, scaler=scaler)
    state = _state()
    overflows = 0
    for i in range(60):  # halving from 2**40 until the gradients fit in fp16
        before = _snapshot(state)
        scale = scaler.get_scale()
        for j in range(k):
            state, out = step(state, _batch("ok", 10 * i + j))
        assert out.closed and not out.nonfinite
        if out.updated:
            break
        overflows += 1
        assert out.overflow
        assert state.step == 0 and state.scheduler.last_epoch == 0
        assert state.guard == GuardState(notfinite_count=0, total_notfinite=0, total_overflow=i + 1)
        assert scaler.get_scale() == scale / 2 and state.scaler is scaler
        assert _grads_cleared(state)
        _assert_unchanged(state, before)
    assert out.updated and not out.overflow
    assert overflows >= 20  # 2**40 overflows fp16 gradients for many halvings
    assert state.step == 1 and state.scheduler.last_epoch == 1
    assert state.guard == GuardState(0, 0, overflows)


@pytest.mark.parametrize("mode", ["huge_grad", "inf_grad"])
def test_fp16_nonfinite_gradients_with_a_finite_loss_are_overflows(mode):
    step = _fp16_step(guard=True, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))
    state, out = step(_state(), _batch(mode))
    assert math.isfinite(out.loss)
    assert out.overflow and not out.nonfinite and not out.updated
    assert state.guard == GuardState(0, 0, 1) and state.step == 0
    state, out = step(state, _batch("ok"))
    assert out.updated and state.guard == GuardState(0, 0, 1) and state.step == 1


def test_fp16_loss_scale_collapsing_below_the_floor_raises():
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    step = _fp16_step(guard=True, scaler=scaler, min_scale=0.1)
    state = _state()
    for i in range(3):  # the scale halves 1 -> 0.5 -> 0.25 -> 0.125, all above the floor
        state, out = step(state, _batch("huge_grad", i))
        assert out.overflow and state.guard == GuardState(0, 0, i + 1)
    with pytest.raises(LossScaleError, match=r"loss scale fell to 0\.0625, below min_scale=0\.1"):
        step(state, _batch("huge_grad", 3))
    assert state.step == 0 and state.scheduler.last_epoch == 0


@pytest.mark.parametrize("mode", BAD_LOSS)
def test_fp16_nonfinite_loss_is_counted_by_the_guard(mode):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    step = compose(amp_wrap(dtype="fp16", scaler=scaler), guard_nonfinite(max_retries=1))(
        make_step(_loss_fn)
    )
    state = _state()
    before = _snapshot(state)
    state, out = step(state, _batch(mode))
    assert out.nonfinite and not out.overflow and not out.updated
    assert state.guard == GuardState(notfinite_count=1, total_notfinite=1, total_overflow=0)
    assert state.step == 0 and _grads_cleared(state)
    _assert_unchanged(state, before)
    state, out = step(state, _batch("ok"))
    assert out.updated and state.guard == GuardState(0, 1, 0)
    state, _ = step(state, _batch(mode, 1))
    with pytest.raises(NonFiniteError, match=_exhausted(2, 1, 3)):
        step(state, _batch(mode, 2))


def test_fp16_nan_loss_near_the_scale_floor_is_the_guards_failure() -> None:
    # The scaler also backs off for a NaN loss; the guard's diagnosis must win over the
    # loss-scale floor, which would otherwise blame the scale.
    model = torch.nn.Linear(4, 2)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = compose(
        amp_wrap(dtype="fp16", scaler=torch.amp.GradScaler("cpu", init_scale=1.0), min_scale=0.9),
        guard_nonfinite(max_retries=1),
    )(make_step(lambda m, b: m(b).float().mean() * b.sum()))
    state, out = step(state, torch.full((1, 4), float("nan")))  # scale 1 -> 0.5 < min_scale
    assert out.nonfinite and not out.overflow
    assert state.guard == GuardState(notfinite_count=1, total_notfinite=1, total_overflow=0)
