"""early_stop: stop after `patience` evaluations without improvement, counters in the state."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from toolkit import TrainState, make_step, run
from toolkit.plugins._early_stop import early_stop
from toolkit.plugins._ema import ema
from toolkit.plugins._validation import validate


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))


def _state() -> TrainState:
    model = _model()
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))


_STEP = make_step(lambda m, b: (m(b) - 1.0).square().mean())


def _train(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, 2, generator=g) for _ in range(n)]


def _scripted(values: list[float]):
    """An eval_fn over one val batch that returns the next scripted loss at each evaluation."""
    calls: list[int] = []

    def eval_fn(model: torch.nn.Module, batch: torch.Tensor) -> dict[str, float]:
        calls.append(1)
        return {"loss": values[len(calls) - 1], "acc": -values[len(calls) - 1]}

    return eval_fn, calls


def _stop_run(values, **kwargs):
    eval_fn, calls = _scripted(values)
    every = kwargs.pop("every", 1)
    metric = kwargs.pop("metric", "val/loss")
    plugins = [validate(eval_fn, [torch.ones(1, 2)], every=every), early_stop(metric, **kwargs)]
    state = run(_STEP, _state(), _train(100), max_steps=len(values) * every, plugins=plugins)
    return state, calls


def test_early_stop_at_the_right_step_with_reason():
    state, calls = _stop_run([5.0, 4.0, 4.5, 4.2, 4.1, 3.0, 2.0], patience=3, every=4)
    # Improvements at evaluations 1, 2; then 3 without: stop at the 5th evaluation, step 20.
    assert state.step == 20 and len(calls) == 5
    assert state.stop == (
        "early_stop: val/loss did not improve by more than 0 for 3 evaluations (best 4 at step 8)"
    )
    assert state.extras["early_stop"]["bad"] == 3


def test_early_stop_counts_each_evaluation_once():
    # Many "step" events per evaluation (every=5): only new evaluations count.
    state, calls = _stop_run([1.0, 1.0, 1.0, 0.5], patience=2, every=5)
    assert state.step == 15 and len(calls) == 3


def test_early_stop_min_delta():
    values = [1.0, 0.95, 0.91, 0.85, 0.84]
    state, _ = _stop_run(values, patience=2, min_delta=0.1)
    # 0.95, 0.91 are not 0.1 better than 1.0: stop at step 3.
    assert state.step == 3
    assert "by more than 0.1 for 2 evaluations (best 1 at step 1)" in state.stop
    state, _ = _stop_run(values, patience=2, min_delta=0.05)
    # 0.95 is not better than 1.0 - 0.05 (not strictly), 0.91 is: then 0.85 (0.91-0.06), 0.84.
    assert state.stop is None and state.extras["early_stop"]["best"] == 0.85


def test_early_stop_mode_max():
    values = [1.0, 2.0, 3.0, 2.5, 3.0, 4.0]  # acc = -loss: -1, -2, -3, -2.5, -3, -4
    state, _ = _stop_run(values, metric="val/acc", patience=2, mode="max")
    # Higher is better: -1 is the best, -2 and -3 are worse: stop at evaluation 3.
    assert state.step == 3
    assert state.stop == (
        "early_stop: val/acc did not improve by more than 0 for 2 evaluations (best -1 at step 1)"
    )
    # The same values under mode="min" improve twice and stop later.
    state, _ = _stop_run(values, metric="val/acc", patience=2, mode="min")
    assert state.step == 5 and "(best -3 at step 3)" in state.stop


def test_early_stop_nan_never_improves():
    state, _ = _stop_run([1.0, float("nan"), float("nan"), 0.5], patience=2)
    assert state.step == 3 and "(best 1 at step 1)" in state.stop


def test_early_stop_resume_keeps_counters():
    eval_fn, _ = _scripted([1.0, 2.0, 3.0, 4.0])
    plugins = [validate(eval_fn, [torch.ones(1, 2)], every=1), early_stop(patience=3)]
    state = run(_STEP, _state(), _train(10), max_steps=2, plugins=plugins)
    assert state.stop is None and state.extras["early_stop"]["bad"] == 1
    state = run(_STEP, state, _train(10), max_steps=10, plugins=plugins)
    assert state.step == 4 and state.extras["early_stop"]["bad"] == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"metric": "loss"}, r"metric must be 'NAME/metric'.*got 'loss'"),
        ({"patience": 0}, r"patience must be an int >= 1"),
        ({"min_delta": -1.0}, r"min_delta must be a number >= 0"),
        ({"min_delta": math.nan}, r"min_delta must be a number >= 0"),
        ({"mode": "up"}, r"mode must be one of \['min', 'max'\]"),
        ({"key": ""}, r"early_stop: key must be a non-empty string"),
    ],
)
def test_early_stop_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        early_stop(**kwargs)


def test_early_stop_never_sees_the_entry():
    plugins = [validate(lambda m, b: {"loss": 1.0}, [torch.ones(1, 2)], every=1)]
    plugins.append(early_stop("valid/loss"))
    # One warning of its own at "end" (not a failure that run() turns into a warning).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = run(_STEP, _state(), _train(2), max_steps=2, plugins=plugins)
    assert [str(w.message)[:61] for w in caught] == [
        "early_stop: state.metrics never got a 'valid' entry to read '"
    ]
    assert caught[0].category is RuntimeWarning and "(entries: ['val'])" in str(caught[0].message)
    assert state.step == 2 and "early_stop" not in state.extras


def test_a_run_too_short_to_validate_ends_with_a_warning_not_an_error():
    # Before: KeyError at "end" (run() made it a warning saying the plugin failed).
    plugins = [
        validate(lambda m, b: {"loss": 1.0}, [torch.ones(1, 2)], every=10),
        early_stop("val/loss"),
    ]
    with pytest.warns(RuntimeWarning, match=r"^early_stop: state.metrics never got a 'val' entry"):
        state = run(_STEP, _state(), _train(3), max_steps=3, plugins=plugins)
    assert state.step == 3 and state.stop is None


def test_early_stop_under_its_own_key_next_to_another():
    steady, _ = _scripted([1.0] * 10)
    plugins = [
        validate(steady, [torch.ones(1, 2)], every=1),
        early_stop("val/loss", patience=3),
        early_stop("val/acc", patience=1, mode="max", key="stop_on_acc"),
    ]
    state = run(_STEP, _state(), _train(10), max_steps=10, plugins=plugins)
    assert state.step == 2 and state.stop.startswith("early_stop: val/acc did not improve")
    assert state.extras["early_stop"]["bad"] == 1 and state.extras["stop_on_acc"]["bad"] == 1
    assert state.extras["early_stop"]["metric"] == "val/loss"


def test_early_stop_does_not_mask_a_training_error():
    def bad_loss(m, b):
        raise RuntimeError("training failed")

    with pytest.raises(RuntimeError, match="training failed"):
        run(make_step(bad_loss), _state(), _train(2), max_steps=2, plugins=[early_stop()])


def test_early_stop_missing_sub_metric():
    plugins = [
        validate(lambda m, b: {"loss": 1.0}, [torch.ones(1, 2)], every=1),
        early_stop("val/acc"),
    ]
    message = r"'val/acc' must be a metric of state.metrics\['val'\], one of \['loss'\]; got 'acc'"
    with pytest.raises(KeyError, match=message):
        run(_STEP, _state(), _train(2), max_steps=2, plugins=plugins)


def test_early_stop_on_a_plugin_that_publishes_no_metrics():
    # ema keeps weights in state.extras and publishes nothing in state.metrics.
    plugins = [ema(0.5), early_stop("ema/loss")]
    with pytest.warns(RuntimeWarning, match=r"never got a 'ema' entry .* \(entries: \[\]\)"):
        state = run(_STEP, _state(), _train(2), max_steps=2, plugins=plugins)
    assert state.step == 2 and state.stop is None


def test_two_validations_under_their_own_keys_and_early_stop_on_one():
    steady, _ = _scripted([1.0] * 10)  # never improves after the first
    improving, _ = _scripted([5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.25, 0.1, 0.05, 0.01])
    val = [torch.ones(1, 2)]
    plugins = [
        validate(steady, val, every=1, key="a"),
        validate(improving, val, every=1, key="b"),
        early_stop("b/loss", patience=1),
    ]
    state = run(_STEP, _state(), _train(10), max_steps=6, plugins=plugins)
    assert state.stop is None and state.step == 6  # "b" kept improving
    assert state.metrics["a"]["values"]["loss"] == 1.0 and state.extras["a"]["best_step"] == 1
    assert state.extras["b"]["best"] == 0.5 and "val" not in state.extras | state.metrics
    state = run(
        _STEP,
        _state(),
        _train(10),
        max_steps=6,
        plugins=[*plugins[:2], early_stop("a/loss", patience=1)],
    )
    assert state.step == 2 and "a/loss did not improve" in state.stop
