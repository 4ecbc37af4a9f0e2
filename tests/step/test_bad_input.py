"""Misuse gets a clear error before anything changes, or a documented outcome.

Each test names the issue's item it covers; each failed on the code before the fix (a hang,
a silent acceptance, or an error from deep inside torch after the weights had moved).
"""

from __future__ import annotations

import math
import re
import threading

import pytest
import torch
from counting import CountSyncs
from torch.utils.data import DataLoader, TensorDataset

from toolkit import (
    Event,
    LossSum,
    TrainState,
    WindowState,
    accumulate,
    amp_wrap,
    clip,
    guard_nonfinite,
    make_step,
    run,
    unwrap,
)
from toolkit.plugins import progress


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def _state(model: torch.nn.Module | None = None, **kwargs) -> TrainState:
    model = model or _model()
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


X = torch.randn(4, 3)


# --- item 1: a window opened by another step -----------------------------------------------


@pytest.mark.parametrize("then", [1, 2])
def test_a_window_from_a_step_of_another_length_is_refused(then: int) -> None:
    state = _state()
    for _ in range(3):
        state, _ = accumulate(make_step(_loss), micro_batches=4)(state, X)
    other = make_step(_loss) if then == 1 else accumulate(make_step(_loss), micro_batches=then)
    message = (
        "the state's accumulation window was opened by a step of micro_batches=4 and holds 3 "
        f"micro-batch(es); this step has micro_batches={then}, so the window would never "
        "close as it should."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        other(state, X)


def test_a_window_of_the_same_length_closes_and_the_next_step_may_differ() -> None:
    state = _state()
    step4 = accumulate(make_step(_loss), micro_batches=4)
    for _ in range(4):
        state, out = step4(state, X)
    assert out.updated and state.window == WindowState()
    state, out = make_step(_loss)(state, X)  # at an update boundary any step may follow
    assert out.updated and state.step == 2


# --- item 3: an optimizer over another model's parameters ----------------------------------


def test_an_optimizer_over_another_model_is_refused_when_the_state_is_built() -> None:
    model, other = _model(), torch.nn.Linear(3, 1)
    message = (
        "TrainState.optimizer: none of its 2 parameters belongs to the model, so training "
        "would never change the model."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainState(model=model, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    state = _state(model)
    with pytest.raises(ValueError, match="none of its 2 parameters belongs to the model"):
        state.replace(optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


def test_an_optimizer_with_an_extra_learnable_parameter_is_fine() -> None:
    # A learnable loss temperature lives outside the model (CLIP's logit scale).
    model = _model()
    temperature = torch.nn.Parameter(torch.ones(()))
    optimizer = torch.optim.SGD([*model.parameters(), temperature], lr=0.1)
    TrainState(model=model, optimizer=optimizer)


# --- item 4: schedulers that cannot work --------------------------------------------------


def test_a_scheduler_that_is_not_one_is_refused() -> None:
    with pytest.raises(
        TypeError, match=r"^TrainState.scheduler: expected an LR scheduler .*'cosine'"
    ):
        _state(scheduler="cosine")


def test_a_scheduler_over_another_optimizer_or_none_is_refused() -> None:
    model = _model()
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(other, step_size=1)
    with pytest.raises(ValueError, match="over the state's optimizer; this StepLR steps another"):
        _state(model, scheduler=sched)
    with pytest.raises(ValueError, match="this StepLR steps no optimizer of the state"):
        TrainState(model=model, scheduler=sched)


def test_the_step_leaves_reduce_on_plateau_alone() -> None:
    # It needs a metric; validate() steps it. Before: TypeError from torch after the update.
    state = _state()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(state.optimizer, patience=0)
    state = state.replace(scheduler=plateau)
    before = plateau.state_dict()
    state, out = make_step(_loss)(state, X)
    assert out.updated and plateau.state_dict() == before


# --- item 5: LossSum counts -----------------------------------------------------------------


def _counted(count):
    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> LossSum:
        return LossSum(model(batch).square().sum(), count)

    return loss_fn


@pytest.mark.parametrize(
    ("count", "error", "message"),
    [
        (-2, ValueError, "LossSum: count must be a finite number >= 0; got -2. A negative count"),
        (math.inf, ValueError, "LossSum: count must be a finite number >= 0; got inf."),
        (math.nan, ValueError, "LossSum: count must be a finite number >= 0; got nan."),
        ("8", TypeError, "LossSum: count is a str ('8'); expected a number >= 0 or a one-elem"),
        (True, TypeError, "LossSum: count is a bool (True); expected a number >= 0 or a one-el"),
        (torch.tensor([3, 4]), TypeError, "count is a torch.int64 tensor of shape (2,); expected"),
        (torch.tensor(2.0j), TypeError, "count is a torch.complex64 tensor of shape (); expected"),
    ],
)
def test_a_bad_count_is_refused_before_backward(count, error: type, message: str) -> None:
    state = _state()
    with pytest.raises(error, match=re.escape(message)):
        make_step(_counted(count))(state, X)
    assert all(p.grad is None for p in state.model.parameters())


def test_a_window_whose_python_counts_sum_to_zero_is_skipped() -> None:
    state = _state()
    state = state.replace(scheduler=torch.optim.lr_scheduler.StepLR(state.optimizer, 1, 0.5))
    weights = _weights(state.model)
    step = accumulate(make_step(_counted(0)), micro_batches=2)
    state, first = step(state, X)
    state, out = step(state, X)
    assert out.closed and out.empty and not out.updated and not out.nonfinite
    assert not math.isfinite(first.loss) and state.step == 0  # total / 0
    assert state.optimizer.param_groups[0]["lr"] == 0.1  # the scheduler did not step
    assert all(torch.equal(a, b) for a, b in zip(weights, _weights(state.model)))
    assert all(p.grad is None for p in state.model.parameters())


def test_a_micro_batch_without_targets_in_a_window_with_some_is_fine() -> None:
    state = _state()
    step = accumulate(make_step(_counted(0)), micro_batches=2)
    state, _ = step(state, X)
    state, out = accumulate(make_step(_counted(4)), micro_batches=2)(state, X)
    assert out.updated and not out.empty


def test_tensor_counts_summing_to_zero_are_skipped_within_the_guards_sync() -> None:
    state = _state()
    step = guard_nonfinite(make_step(_counted(torch.tensor(0))))
    with CountSyncs() as syncs:
        state, out = step(state, X)
    assert syncs.count == 1  # the guard's, no new one
    assert out.empty and not out.updated and not out.nonfinite
    assert state.guard.notfinite_count == 0  # not a failure of the guard


def test_a_negative_tensor_total_raises_after_the_window_is_thrown_away() -> None:
    state = _state()
    weights = _weights(state.model)
    step = guard_nonfinite(make_step(_counted(torch.tensor(-3.0))))
    with pytest.raises(ValueError, match="negative total target count for the window, which"):
        step(state, X)
    assert all(torch.equal(a, b) for a, b in zip(weights, _weights(state.model)))
    assert all(p.grad is None for p in state.model.parameters())


def test_a_tensor_count_adds_no_sync_without_the_guard() -> None:
    state = _state()
    step = accumulate(make_step(_counted(torch.tensor(4))), micro_batches=2)
    with CountSyncs() as syncs:
        for _ in range(4):
            state, _ = step(state, X)
    assert syncs.count == 0


# --- item 6: a reused state; fields refused at construction ---------------------------------


def test_a_state_passed_to_a_step_cannot_be_used_again() -> None:
    state = _state()
    step = accumulate(make_step(_loss), micro_batches=2)
    newer, _ = step(state, X)
    with pytest.raises(ValueError, match=r"^this TrainState \(step 0\) was already passed to a"):
        step(state, X)
    newer, _ = step(newer, X)  # closes the window
    with pytest.raises(ValueError, match="already passed to a train step"):
        make_step(_loss)(state.replace(epoch=1), X)  # a copy of a consumed state too
    newer, _ = make_step(_loss)(newer, X)  # the latest state is fine


def test_a_skipped_batch_returns_the_same_state_which_stays_usable() -> None:
    state = _state()
    same, out = make_step(lambda m, b: None)(state, X)
    assert same is state and out.skipped
    make_step(_loss)(state, X)


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("step", -5, ValueError, "TrainState.step: expected an int >= 0; got -5."),
        ("step", "3", TypeError, "TrainState.step: expected an int >= 0; got '3'."),
        ("epoch", 1.0, TypeError, "TrainState.epoch: expected an int >= 0; got 1.0."),
        ("batches_seen", True, TypeError, "TrainState.batches_seen: expected an int >= 0"),
        ("extras", None, TypeError, "TrainState.extras: expected a mapping; got NoneType."),
        ("stop", True, TypeError, "TrainState.stop: expected None or a reason string; got bool."),
        ("window", (0, None), TypeError, "TrainState.window: expected a WindowState; got tuple"),
        ("scaler", "fp16", TypeError, "TrainState.scaler: expected a torch.amp.GradScaler or"),
    ],
)
def test_bad_fields_are_refused_at_construction_and_in_replace(
    field: str, value: object, error: type, message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        _state(**{field: value})
    with pytest.raises(error, match=re.escape(message)):
        _state().replace(**{field: value})


# --- item 8: errors that came from deep inside Python or torch -----------------------------


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: clip(1.0), TypeError, "clip: expected a Step from make_step(loss_fn) as the "),
        (
            lambda: clip(max_norm=1.0, norm_type="fro"),
            TypeError,
            "clip: norm_type must be a number > 0; got 'fro'.",
        ),
        (
            lambda: amp_wrap(dtype="fp16", scaler="yes"),
            TypeError,
            "amp_wrap: scaler must be a torch.amp.GradScaler or None; got 'yes'.",
        ),
        (
            lambda: amp_wrap(dtype="bf16", device_type="tpu"),
            ValueError,
            "amp_wrap: device_type must be a device type with autocast and a device here, such "
            "as 'cpu' or 'cuda'; got 'tpu'.",
        ),
        (lambda: unwrap(_model(), keep_compile="yes"), TypeError, "keep_compile must be True or"),
    ],
)
def test_argument_errors_name_the_mistake(build, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        build()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_autocast_on_a_missing_cuda_is_refused_instead_of_training_in_float32() -> None:
    message = "a device type with autocast and a device here, such as 'cpu' or 'cuda'; got 'cuda'."
    with pytest.raises(ValueError, match=re.escape(message)):
        amp_wrap(dtype="bf16", device_type="cuda")


# --- item 2: run() that can never reach max_steps ---------------------------------------


def _run_with_timeout(seconds: float, **kwargs) -> TrainState:
    """run() on a thread: a hang fails the test instead of blocking the suite."""
    result: dict = {}

    def target() -> None:
        try:
            result["state"] = run(**kwargs)
        except BaseException as exc:  # handed to the test below
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "run() did not return"
    if "error" in result:
        raise result["error"]
    return result["state"]


EMPTY = [
    pytest.param([], id="empty-list"),
    pytest.param(DataLoader(TensorDataset(torch.randn(0, 3)), batch_size=2), id="empty-loader"),
]


@pytest.mark.parametrize("data", EMPTY)
def test_data_without_batches_under_max_steps_raises_instead_of_spinning(data) -> None:
    message = "run: in epoch 0 the data yielded no batch, so no update can ever happen"
    with pytest.raises(ValueError, match=re.escape(message)):
        _run_with_timeout(30, step=make_step(_loss), state=_state(), data=data, max_steps=5)


def test_a_loss_function_that_skips_every_batch_raises_instead_of_spinning() -> None:
    message = "run: in epoch 0 the loss function skipped all 3 batches (returned None)"
    with pytest.raises(ValueError, match=re.escape(message)):
        _run_with_timeout(
            30, step=make_step(lambda m, b: None), state=_state(), data=[X] * 3, max_steps=5
        )


@pytest.mark.parametrize("data", EMPTY)
def test_data_without_batches_under_epochs_warns_once(data) -> None:
    with pytest.warns(RuntimeWarning, match="run: in epoch 0 the data yielded no batch; no update"):
        state = run(make_step(_loss), _state(), data, epochs=2)
    assert (state.step, state.epoch) == (0, 2)


def test_windows_spanning_passes_are_progress_not_a_stall() -> None:
    # 3 batches per pass, 4 micro-batches per update: the first pass closes no window.
    step = accumulate(make_step(_loss), micro_batches=4)
    state = _run_with_timeout(30, step=step, state=_state(), data=[X] * 3, max_steps=3)
    assert state.step == 3


# --- items 7 and 8 (run): data, state, plugins and the step's return -----------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"data": {"x": X}},
            TypeError,
            "run: data must be an iterable of batches (a DataLoader, a list); got a dict. To "
            "train on one batch n times, pass [batch] * n.",
        ),
        ({"state": {"model": 1}}, TypeError, "run: state must be a TrainState; got a dict."),
        (
            {"plugins": None},
            TypeError,
            "run: plugins must be a list of plugins; got NoneType; pass [plugin].",
        ),
        (
            {"plugins": progress()},
            TypeError,
            "run: plugins must be a list of plugins; got a single plugin; pass [plugin].",
        ),
        (
            {"plugins": ["progress"]},
            TypeError,
            "run: plugins[0] must be a plugin, plugin(event); got str ('progress'); build it",
        ),
        (
            {"plugins": [progress]},
            TypeError,
            "run: plugins[0] must be a plugin, plugin(event); got an uncalled plugin factory "
            "(<function progress",
        ),
    ],
)
def test_run_arguments_are_named_in_their_errors(kwargs: dict, error: type, message: str) -> None:
    arguments = {"state": _state(), "data": [X], "max_steps": 1, **kwargs}
    with pytest.raises(error, match=re.escape(message)):
        run(make_step(_loss), **arguments)


def test_a_step_returning_no_output_is_named() -> None:
    def bad_step(state: TrainState, batch: torch.Tensor):
        return state, None

    message = "run: the step returned (TrainState, NoneType); expected (TrainState, StepOutput)"
    with pytest.raises(TypeError, match=re.escape(message)):
        run(bad_step, _state(), [X], max_steps=1)


# --- item 10: the end of a run that trained well --------------------------------------------


def test_a_plugin_failing_at_the_end_does_not_cost_the_trained_state() -> None:
    def flaky_sink(event: Event) -> None:
        if event.kind == "end":
            raise ConnectionError("the logging service is down")

    with pytest.warns(RuntimeWarning, match="ConnectionError.*returns the trained state anyway"):
        state = run(make_step(_loss), _state(), [X] * 4, max_steps=4, plugins=[flaky_sink])
    assert state.step == 4
