"""Decorators commute, reject reuse and impossible combinations, and explain bad input."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch

from toolkit import (
    Step,
    StepOutput,
    TrainState,
    accumulate,
    amp_wrap,
    clip,
    compose,
    guard_nonfinite,
    make_step,
    transform_grads,
)


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).float(), y)


_MODEL = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))

# Every decorator, configured. That they commute is a training property, tested against the
# hand-written loop in test_equivalence.py (test_any_order_of_any_subset_...).
DECORATORS = {
    "amp": lambda: amp_wrap(dtype="bf16"),
    "accumulate": lambda: accumulate(micro_batches=2),
    "clip": lambda: clip(max_norm=0.3, max_value=0.05),
    "guard": lambda: guard_nonfinite(max_retries=1),
    "grads": lambda: transform_grads(lambda grads: None),
}


def test_direct_and_factory_forms_agree() -> None:
    direct = clip(accumulate(make_step(_loss), micro_batches=3), max_norm=2.0)
    factory = compose(clip(max_norm=2.0), accumulate(micro_batches=3))(make_step(_loss))
    assert direct == factory


@pytest.mark.parametrize("name", list(DECORATORS))
def test_applying_a_decorator_twice_raises_at_decoration(name: str) -> None:
    once = DECORATORS[name]()(make_step(_loss))
    with pytest.raises(ValueError, match="applied twice to the same step"):
        DECORATORS[name]()(once)
    with pytest.raises(ValueError, match="applied twice"):
        compose(DECORATORS[name](), DECORATORS[name]())(make_step(_loss))


@pytest.mark.parametrize("order", [("amp", "guard"), ("guard", "amp")])
def test_fp16_with_accepting_guard_is_impossible_in_either_order(order: tuple[str, str]) -> None:
    parts = {"amp": amp_wrap(dtype="fp16"), "guard": guard_nonfinite(on_exhaust="accept")}
    with pytest.raises(ValueError, match=r"on_exhaust='accept'.*fp16.*GradScaler always skips"):
        compose(*(parts[o] for o in order))(make_step(_loss))


def test_decorating_something_else_than_a_step() -> None:
    with pytest.raises(TypeError, match=r"^clip: expected a Step from make_step\(loss_fn\) as"):
        clip(_loss, max_norm=1.0)
    with pytest.raises(TypeError, match="got float 1.0. Pass options by keyword"):
        clip(1.0)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="got a Step .a Step is decorated directly"):
        make_step(make_step(_loss))
    with pytest.raises(TypeError, match="expected a callable loss_fn"):
        make_step(3)


def test_compose_takes_any_function_from_step_to_step() -> None:
    def tighter_clip(step: Step) -> Step:
        return clip(step, max_norm=0.1)

    step = compose(tighter_clip, accumulate(micro_batches=2))(make_step(_loss))
    assert (step.clipping.max_norm, step.accumulation.micro_batches) == (0.1, 2)


def test_compose_refuses_what_is_not_a_step_decorator() -> None:
    with pytest.raises(
        TypeError, match=r"^compose: each must be a function Step -> Step, .*; got 3\."
    ):
        compose(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got Step"):
        compose(make_step(_loss))  # a step takes (state, batch), not a step
    with pytest.raises(TypeError, match=r"<lambda>' returned must be a Step; got <class 'int'>"):
        compose(lambda step: 3)(make_step(_loss))  # type: ignore[arg-type, return-value]
    # A factory that was never configured says what it misses when applied.
    with pytest.raises(ValueError, match="clip: expected max_norm and/or max_value"):
        compose(clip)(make_step(_loss))


def test_transform_grads_refuses_what_is_not_a_function() -> None:
    with pytest.raises(
        TypeError,
        match=r"^transform_grads: the arguments after the step must be one or more functions",
    ):
        transform_grads(make_step(_loss))
    with pytest.raises(TypeError, match=r"got \['int'\]"):
        transform_grads(make_step(_loss), 3)  # type: ignore[call-overload]


@pytest.mark.parametrize("returned", [3, [torch.zeros(1)]])
def test_transform_grads_returning_something_else_fails_clearly(returned: object) -> None:
    step = transform_grads(make_step(_loss), lambda grads: returned)
    model = copy.deepcopy(_MODEL)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters()))
    batch = (torch.randn(4, 6), torch.randint(0, 3, (4,)))
    with pytest.raises(
        TypeError, match=r"returned a (int|list of 1); expected None .* a list of 4"
    ):
        step(state, batch)


# --- bad input: each error names what was expected, what was given, and the fix ---------


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (
            lambda: accumulate(micro_batches=0),
            ValueError,
            "accumulate: micro_batches must be an int >= 1; got 0.",
        ),
        (
            lambda: accumulate(micro_batches=2.0),
            TypeError,
            "accumulate: micro_batches must be an int >= 1; got 2.0.",
        ),
        (
            lambda: clip(max_norm=0.0),
            ValueError,
            "clip: max_norm must be a number > 0; got 0.0.",
        ),
        (lambda: clip(max_norm=-1), ValueError, "max_norm must be a number > 0; got -1"),
        (lambda: clip(max_value=0), ValueError, "max_value must be a number > 0; got 0"),
        (lambda: clip(), ValueError, "clip: expected max_norm and/or max_value; got neither."),
        (lambda: clip(max_norm="1"), TypeError, "clip: max_norm must be a number > 0; got '1'."),
        (lambda: clip(max_norm=1.0, norm_type=0), ValueError, "norm_type must be a number > 0"),
        (
            lambda: clip(max_norm=1.0, norm_type=-math.inf),
            ValueError,
            "norm_type must be a number > 0",
        ),
        (
            lambda: clip(max_norm=1.0, norm_type=math.nan),
            ValueError,
            "norm_type must be a number > 0",
        ),
        (
            lambda: amp_wrap(dtype="fp8"),
            ValueError,
            "amp_wrap: dtype must be 'bf16', 'fp16', torch.bfloat16 or torch.float16; got 'fp8'.",
        ),
        (
            lambda: amp_wrap(dtype=torch.float32),
            ValueError,
            "dtype must be 'bf16', 'fp16', torch.bfloat16 or torch.float16; got torch.float32. "
            "For float32 training leave amp_wrap out.",
        ),
        (
            lambda: amp_wrap(dtype="bf16", scaler=torch.amp.GradScaler("cpu")),
            ValueError,
            "amp_wrap: dtype must be 'fp16' with a GradScaler; got 'bf16'.",
        ),
        (
            lambda: amp_wrap(dtype="fp16", scaler=torch.amp.GradScaler("cpu", enabled=False)),
            ValueError,
            "amp_wrap: scaler.is_enabled() must be True; got False.",
        ),
        (
            lambda: amp_wrap(dtype="fp16", min_scale=0),
            ValueError,
            "amp_wrap: min_scale must be a number > 0, e.g. 1e-4; got 0.",
        ),
        (
            lambda: guard_nonfinite(max_retries=-1),
            ValueError,
            "guard_nonfinite: max_retries must be an int >= 0; got -1.",
        ),
        (
            lambda: guard_nonfinite(max_retries=None),
            TypeError,
            "guard_nonfinite: max_retries must be an int >= 0; got None.",
        ),
        (
            lambda: accumulate(),  # type: ignore[call-overload]
            TypeError,
            "accumulate: micro_batches must be an int >= 1; got None.",
        ),
        (
            lambda: amp_wrap(),  # type: ignore[call-overload]
            ValueError,
            "amp_wrap: dtype must be 'bf16', 'fp16', torch.bfloat16 or torch.float16; got None.",
        ),
        (
            lambda: guard_nonfinite(on_exhaust="ignore"),
            ValueError,
            "on_exhaust must be one of ['raise', 'skip', 'accept']; got 'ignore'",
        ),
    ],
)
def test_bad_decorator_arguments(build, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        build()


def _state() -> TrainState:
    model = torch.nn.Linear(3, 2)
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


_X = torch.randn(4, 3)


@pytest.mark.parametrize(
    ("loss_fn", "error", "message"),
    [
        (
            lambda m, b: m(b),
            ValueError,
            "loss_fn must return a scalar loss (a 0-d tensor); got a tensor of shape (4, 2). "
            "Reduce it first: loss.mean()",
        ),
        (
            lambda m, b: (m(b).mean(), m(b).mean(), {}),
            TypeError,
            "loss_fn returned tuple(Tensor, Tensor, dict); expected a scalar tensor, "
            "(loss, records)",
        ),
        (
            lambda m, b: (m(b).mean(), None),
            TypeError,
            "loss_fn returned tuple(Tensor, NoneType); expected",
        ),
        (lambda m, b: 1.5, TypeError, "loss_fn returned float; expected a scalar"),
        (lambda m, b: ("loss", {}), TypeError, "loss_fn returned tuple(str, dict); expected"),
        (
            lambda m, b: m(b).mean().detach(),
            ValueError,
            "loss_fn returned a loss that does not require grad",
        ),
    ],
)
def test_bad_loss_fn_returns(loss_fn, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        make_step(loss_fn)(_state(), _X)


def test_state_without_optimizer() -> None:
    state = TrainState(model=torch.nn.Linear(3, 2))
    with pytest.raises(
        TypeError,
        match=re.escape(
            "a train step needs TrainState.optimizer; got None. Build the state with one: "
            "TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()))."
        ),
    ):
        make_step(lambda m, b: m(b).mean())(state, _X)


def test_something_else_than_a_state() -> None:
    with pytest.raises(
        TypeError, match="needs TrainState.optimizer; got a Linear, not a TrainState"
    ):
        make_step(lambda m, b: m(b).mean())(torch.nn.Linear(3, 2), _X)  # type: ignore[arg-type]


def test_state_with_wrong_types() -> None:
    with pytest.raises(TypeError, match="TrainState.model: expected a torch.nn.Module; got dict"):
        TrainState(model={})
    with pytest.raises(TypeError, match="TrainState.optimizer: expected a torch.optim.Optimizer"):
        TrainState(model=torch.nn.Linear(1, 1), optimizer="adam")
    with pytest.raises(TypeError, match=r"replace: the names must be fields; got \['stpe'\]"):
        _state().replace(stpe=1)


# --- options that change behaviour --------------------------------------------------------


@pytest.mark.parametrize("norm_type", [1.0, 3.0, math.inf])
def test_clip_norm_type_matches_torch(norm_type: float) -> None:
    # The step's pre-clip norm and the clipped update equal torch.nn.utils.clip_grad_norm_'s.
    x, y = torch.randn(6, 6) * 5, torch.randint(0, 3, (6,))
    ours, ref = copy.deepcopy(_MODEL), copy.deepcopy(_MODEL)
    opt = torch.optim.SGD(ours.parameters(), lr=0.5)
    state = TrainState(model=ours, optimizer=opt)
    step = clip(make_step(_loss), max_norm=0.01, norm_type=norm_type)
    state, out = step(state, (x, y))
    _loss(ref, (x, y)).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type=norm_type)
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    assert torch.equal(out.grad_norm, norm) and norm > 0.01
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_amp_dtype_objects_and_strings_are_the_same_configuration() -> None:
    loss = lambda m, b: m(b).mean()  # noqa: E731
    assert amp_wrap(make_step(loss), dtype=torch.bfloat16) == amp_wrap(
        make_step(loss), dtype="bf16"
    )
    assert amp_wrap(make_step(loss), dtype=torch.float16) == amp_wrap(make_step(loss), dtype="FP16")


def test_a_scaler_in_the_state_wins_over_the_one_given_to_amp_wrap() -> None:
    # The resume path: the state restored from a checkpoint carries its scaler.
    resumed = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    given = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    state = _state().replace(scaler=resumed)
    state, _ = amp_wrap(make_step(lambda m, b: m(b).mean()), dtype="fp16", scaler=given)(state, _X)
    assert state.scaler is resumed
    assert resumed._scale is not None and given._scale is None  # only the resumed one ran


def test_amp_device_type_is_the_autocast_device() -> None:
    seen: list[torch.dtype] = []

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        out = model(batch)
        seen.append(out.dtype)
        return out.float().mean()

    model = torch.nn.Linear(4, 2)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    # "cpu" given explicitly: CPU autocast is on, so the Linear runs in bf16.
    state, _ = amp_wrap(make_step(loss_fn), dtype="bf16", device_type="cpu")(state, _X_4)
    assert seen == [torch.bfloat16]


_X_4 = torch.randn(3, 4)


def test_the_fast_output_of_an_open_window_is_the_keyword_built_one() -> None:
    # The step builds it positionally for speed; a reordered or added field of StepOutput
    # must not shift its flags.
    model = copy.deepcopy(_MODEL)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = accumulate(make_step(lambda m, b: (_loss(m, b), {"acc": 1.0})), micro_batches=2)
    _, out = step(state, (torch.randn(8, 6), torch.randint(0, 3, (8,))))
    expected = StepOutput(
        loss=out.loss, records={"acc": 1.0}, count=None, samples=8, updated=False, closed=False
    )
    assert out == expected and type(out) is StepOutput and len(out) == len(StepOutput._fields)
