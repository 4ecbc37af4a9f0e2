"""Errors name what was given, what was expected and the fix; warnings point at the user's
line; silent mistakes warn (issue 27 items 4 and 5).

Each test failed before its fix: a message without the fix, an AttributeError from inside
toolkit, a warning filed under toolkit's own file, or no warning at all.
"""

from __future__ import annotations

import io
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import rich.console
import torch
from counting import CountSyncs, count_tolists, read_as_on_an_accelerator

from toolkit import TrainState, causal_lm_loss, clip, guard_nonfinite, make_step, per_epoch, run
from toolkit.plugins import Sink, early_stop, log_metrics, progress, validate


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def _state(model: torch.nn.Module | None = None, **kwargs: Any) -> TrainState:
    model = model or _model()
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


X = torch.randn(4, 3)


def _hf_output(**fields: Any) -> Any:
    outputs = pytest.importorskip("transformers.modeling_outputs")
    return outputs.CausalLMOutput(**fields)


def _other_scheduler() -> TrainState:
    model = _model()
    stranger = torch.optim.SGD(model.parameters(), lr=0.1)
    return _state(model, scheduler=torch.optim.lr_scheduler.StepLR(stranger, 1))


def _returns_the_whole_output() -> None:
    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> Any:
        return _hf_output(loss=_loss(model, batch), logits=model(batch))

    make_step(loss_fn)(_state(), X)


_FIXES: list[tuple[Callable[[], Any], type, str]] = [
    (
        lambda: causal_lm_loss(_hf_output(logits=torch.zeros(1, 4, 10)), torch.zeros(1, 4)),
        TypeError,
        "causal_lm_loss: logits must be a tensor; got a CausalLMOutput. Pass the logits: "
        "causal_lm_loss(out.logits, labels).",
    ),
    (  # labels shifted by hand: the loss shifts them once more
        lambda: causal_lm_loss(torch.zeros(1, 4, 10), torch.zeros(1, 4, dtype=torch.long)[:, 1:]),
        ValueError,
        "causal_lm_loss: labels' shape must be logits' (1, 4); got (1, 3). Pass labels "
        "unshifted (input_ids): causal_lm_loss shifts them itself.",
    ),
    (
        _returns_the_whole_output,
        TypeError,
        "loss_fn returned CausalLMOutput; expected a scalar tensor, (loss, records), "
        "LossSum(total, count[, records]), or None to skip the batch. Return out.loss",
    ),
    (
        lambda: TrainState(model=_model(), optimizer=torch.optim.SGD(_model().parameters())),
        ValueError,
        "TrainState.optimizer: none of its 2 parameters belongs to the model, so training "
        "would never change the model. Build it over this model's parameters",
    ),
    (
        _other_scheduler,
        ValueError,
        "TrainState.scheduler: expected a scheduler over the state's optimizer; this StepLR "
        "steps another one. Build it over the one given as TrainState(optimizer=...)",
    ),
    (
        lambda: TrainState(model=(m := _model()), optimizer=m.parameters()),
        TypeError,
        "TrainState.optimizer: expected a torch.optim.Optimizer or a list of them; got "
        "generator. Build one over the parameters: torch.optim.AdamW(model.parameters(), ",
    ),
    (
        lambda: TrainState(model=(m := _model()), optimizer=list(m.parameters())),
        TypeError,
        "TrainState.optimizer: MultiOptimizer: optimizers[0] must be a torch.optim.Optimizer; "
        "got a Parameter. "
        "Build one over the parameters: torch.optim.AdamW(model.parameters(), ",
    ),
    (
        lambda: run(_state(), make_step(_loss), [X], max_steps=1),  # type: ignore[arg-type]
        TypeError,
        "run: state must be a TrainState; got a Step. The order is run(step, state, data, ",
    ),
    (
        lambda: clip(clip(make_step(_loss), max_norm=1.0), max_norm=2.0),
        ValueError,
        "clip: expected a step without clip; got one with it (clip applied twice to the same "
        "step). Apply it once: for other options, to the step it decorated.",
    ),
    (
        lambda: _state(scheduler=lambda step: 0.9**step),
        TypeError,
        "TrainState.scheduler: expected an LR scheduler from torch.optim.lr_scheduler (or a "
        "list of them); got function <lambda>. Build one over the optimizer: "
        "torch.optim.lr_scheduler.LambdaLR(optimizer, fn).",
    ),
    (
        lambda: per_epoch(lambda epoch: 0.5**epoch),
        TypeError,
        "per_epoch: scheduler: expected an LR scheduler from torch.optim.lr_scheduler; got "
        "function <lambda>. Build one over the optimizer: torch.optim.lr_scheduler.LambdaLR(",
    ),
]


@pytest.mark.parametrize(("build", "error", "message"), _FIXES)
def test_an_error_says_what_was_given_what_was_expected_and_the_fix(
    build: Callable[[], Any], error: type, message: str
) -> None:
    with pytest.raises(error, match="^" + re.escape(message)):
        build()


# --- warnings: at the user's line, once, with the fix ---------------------------------------


def _said(caught: list[warnings.WarningMessage], text: str) -> list[warnings.WarningMessage]:
    return [w for w in caught if text in str(w.message)]


def _nan_run(plugin: Callable[..., Any]) -> list[warnings.WarningMessage]:
    """Six updates, the third on a NaN batch (no guard): every mean after it is NaN."""
    data = [X, X, torch.full_like(X, float("nan")), X, X, X]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(make_step(_loss), _state(), data, max_steps=6, plugins=[plugin])
    return caught


def _sink() -> Sink:
    return Sink(write=lambda step, metrics: None, close=lambda: None)


def _console() -> rich.console.Console:
    return rich.console.Console(file=io.StringIO(), width=100)


@pytest.mark.parametrize(
    ("name", "plugin"),
    [
        ("log_metrics", lambda: log_metrics(every=2, sinks=[_sink()])),
        ("progress", lambda: progress(every=2, min_interval=0, console=_console())),
    ],
)
def test_a_nonfinite_loss_without_the_guard_warns_once_at_the_run_line(
    name: str, plugin: Callable[[], Any]
) -> None:
    caught = _nan_run(plugin())
    (said,) = _said(caught, "guard_nonfinite")  # updates 4 and 6 are NaN too: said once
    assert str(said.message).startswith(
        f"{name}: the mean loss of the updates up to update 4 is nan"
    )
    assert said.category is RuntimeWarning and said.filename == __file__


def test_no_warning_when_the_guard_leaves_the_nonfinite_window_out() -> None:
    data = [X, X, torch.full_like(X, float("nan")), X, X, X]
    step = guard_nonfinite(make_step(_loss), on_exhaust="skip")
    plugins = [log_metrics(every=2, sinks=[_sink()]), progress(every=2, console=_console())]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = run(step, _state(), data, max_steps=5, plugins=plugins)
    assert state.guard.total_notfinite == 1


def _reads(monkeypatch: pytest.MonkeyPatch, value: float) -> tuple[int, list[int]]:
    read_as_on_an_accelerator(monkeypatch)
    tolists = count_tolists(monkeypatch)
    data = [X, torch.full_like(X, value), X, X]
    plugins = [
        log_metrics(every=2, sinks=[_sink()]),
        progress(every=2, min_interval=0, console=_console()),
    ]
    with warnings.catch_warnings(record=True), CountSyncs() as syncs:
        warnings.simplefilter("always")
        run(make_step(_loss), _state(), data, max_steps=4, plugins=plugins)
    return syncs.count, tolists


@pytest.mark.parametrize("value", [1.0, float("nan")])
def test_the_nonfinite_check_reads_nothing_more(monkeypatch: pytest.MonkeyPatch, value) -> None:
    # The plugins check the means they read anyway: finite or not, no sync and one read (of
    # two losses) per publish and per refresh.
    assert _reads(monkeypatch, value) == (0, [2, 2, 2, 2])


def test_records_left_out_are_reported_at_the_run_line() -> None:
    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> Any:
        return _loss(model, batch), {"logits": model(batch)}  # not a scalar: not logged

    with pytest.warns(RuntimeWarning, match=r"records \['logits'\] are not numbers") as caught:
        run(
            make_step(loss_fn),
            _state(),
            [X],
            max_steps=1,
            plugins=[log_metrics(1, sinks=[_sink()])],
        )
    assert [w.filename for w in caught] == [__file__]  # was toolkit/plugins/_metrics.py


@pytest.mark.parametrize("budget", [{"max_steps": 0}, {"epochs": 0}, {"max_steps": 0, "epochs": 3}])
def test_a_budget_of_zero_warns_that_nothing_will_run(budget: dict[str, int]) -> None:
    name = next(iter(budget))
    message = f"run: {name}=0: no update will run; give {name} >= 1, or evaluate() alone."
    with pytest.warns(RuntimeWarning, match=re.escape(message)) as caught:
        state = run(make_step(_loss), _state(), [X], **budget)
    assert state.step == 0 and [w.filename for w in caught] == [__file__]


def _stepping_the_scheduler_too(event: Any) -> None:  # a user's plugin stepping it again
    if event.kind == "step":
        event.state.scheduler.step()


def _scheduled_state() -> TrainState:
    state = _state()
    return state.replace(scheduler=torch.optim.lr_scheduler.StepLR(state.optimizer, 1))


def _weightless(model: torch.nn.Module, batch: torch.Tensor) -> Any:
    return {"loss": 1.0}, 0


WARNED_IN_PLUGINS = [  # each warned at a toolkit line before: run's, or validate's
    ("early_stop: state.metrics never got a 'val' entry", lambda: [early_stop("val/loss")]),
    ("validate: every batch of the pass", lambda: [validate(_weightless, [X], at_end=True)]),
    ("the LR scheduler was stepped outside", lambda: [_stepping_the_scheduler_too]),
]


@pytest.mark.parametrize(("start", "plugins"), WARNED_IN_PLUGINS)
def test_plugin_and_step_warnings_point_at_the_run_line(start: str, plugins) -> None:
    state = _scheduled_state()
    with pytest.warns(Warning, match=re.escape(start)) as caught:
        run(make_step(_loss), state, [X, X, X], max_steps=3, plugins=plugins())
    assert {w.filename for w in caught if str(w.message).startswith(start)} == {__file__}
