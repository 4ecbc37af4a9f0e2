"""Loop and data workflows of other trainers: short windows at a
pass's end, "epoch_start", evaluate(), a loss function reading the update number,
to_device, the window's batches in the "step" event. References are hand-written loops.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from toolkit import (
    Event,
    LossSum,
    TrainState,
    accumulate,
    evaluate,
    make_step,
    run,
    to_device,
)
from toolkit.plugins import validate


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _data(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(2 + i % 3, 3, generator=g), torch.randn(2 + i % 3, 1, generator=g))
        for i in range(n)
    ]


def _mse(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _summed(model: torch.nn.Module, batch) -> LossSum:
    x, y = batch
    return LossSum(torch.nn.functional.mse_loss(model(x), y, reduction="sum"), y.numel())


def _state(model: torch.nn.Module) -> TrainState:
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


# -- item 1: the short window at a pass's end ------------------------------------------------


def _counting(updates: list[int]):
    def plugin(event: Event) -> None:
        if event.kind == "step" and event.out is not None and event.out.updated:
            updates.append(event.state.step)

    return plugin


@pytest.mark.parametrize(
    ("partial_window", "sized", "want"),
    [("epoch", True, 46), ("epoch", False, 46), ("end", True, 45), ("carry", True, 45)],
)
def test_pytorch_accelerated_counts_46_updates_for_2_epochs_of_45_batches(
    partial_window: Any, sized: bool, want: int
) -> None:
    data = [torch.ones(1, 3)] * 45
    source = data if sized else _Unsized(data)
    step = accumulate(make_step(lambda m, b: m(b).square().mean()), micro_batches=2)
    updates: list[int] = []
    state = run(
        step,
        _state(_model()),
        source,
        epochs=2,
        plugins=[_counting(updates)],
        partial_window=partial_window,
    )  # type: ignore[arg-type]
    assert state.step == want and len(updates) == want
    # 'end' applies the window left at the very end (90 = 45 windows, none left);
    # 'carry' leaves nothing either here: the test below has one left.


class _Unsized:
    """Re-iterable without a length: the loop reads one batch ahead to know the last."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __iter__(self):
        return iter(self.items)


def _hand_loop(model, data, k, epochs, per_pass: bool, counted: bool) -> None:
    """Windows of k, the short one at each pass's end (per_pass) or only at the very end,
    with the mean over its micro-batches (by the total count when counted)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stream = [list(data) for _ in range(epochs)]
    windows = []
    if per_pass:
        for items in stream:
            windows += [items[i : i + k] for i in range(0, len(items), k)]
    else:
        flat = [b for items in stream for b in items]
        windows = [flat[i : i + k] for i in range(0, len(flat), k)]
    for window in windows:
        # One backward per micro-batch, as a hand-written accumulation loop does.
        if counted:
            for b in window:
                torch.as_tensor(_summed(model, b).total).backward()
            count = sum(b[1].numel() for b in window)
            for p in model.parameters():
                p.grad.mul_(1.0 / count)
        else:
            # The mean over the window's m micro-batches: each loss / k, then the
            # gradients times k / m when m < k.
            for b in window:
                (_mse(model, b) / k).backward()
            if len(window) < k:
                for p in model.parameters():
                    p.grad.mul_(k / len(window))
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("counted", [True, False])
@pytest.mark.parametrize("partial_window", ["epoch", "end"])
def test_a_short_window_is_the_mean_over_its_micro_batches(
    partial_window: str, counted: bool
) -> None:
    data, k, epochs = _data(7), 3, 2
    model, ref = _model(), _model()
    step = accumulate(make_step(_summed if counted else _mse), micro_batches=k)
    state = run(step, _state(model), data, epochs=epochs, partial_window=partial_window)  # type: ignore[arg-type]
    _hand_loop(ref, data, k, epochs, per_pass=partial_window == "epoch", counted=counted)
    assert state.step == (6 if partial_window == "epoch" else 5)
    assert state.window.micro_step == 0
    for got, want in zip(model.parameters(), ref.parameters()):
        assert torch.equal(got, want)  # the same arithmetic: bitwise


def test_a_short_window_mean_equals_the_plain_mean_up_to_rounding() -> None:
    # The normalisation is the mean over the short window, not over k (the bug of
    # pytorch_accelerated, which divides the last partial group by the full k).
    data, k = _data(2), 3
    model, ref = _model(), _model()
    step = accumulate(make_step(_mse), micro_batches=k)
    run(step, _state(model), data, epochs=1, partial_window="epoch")
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.stack([_mse(ref, b) for b in data]).mean().backward()
    opt.step()
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_close_true_closes_a_window_of_one() -> None:
    model, ref = _model(), _model()
    step = accumulate(make_step(_mse), micro_batches=4)
    batch = _data(1)[0]
    state, out = step(_state(model), batch, close=True)
    assert out.closed and out.updated and state.step == 1 and state.window.micro_step == 0
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _mse(ref, batch).backward()
    opt.step()
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_partial_window_refuses_unknown_values_and_steps_without_close() -> None:
    step = make_step(_mse)
    with pytest.raises(ValueError, match="partial_window must be one of .*; got 'last'"):
        run(step, _state(_model()), _data(2), epochs=1, partial_window="last")  # type: ignore[arg-type]

    def wrapper(state, batch):
        return step(state, batch)

    with pytest.raises(TypeError, match="got a function without close=; pass a step of make_step"):
        run(wrapper, _state(_model()), _data(2), epochs=1, partial_window="epoch")


def test_total_steps_counts_the_short_windows() -> None:
    infos = []
    step = accumulate(make_step(_mse), micro_batches=2)
    run(
        step,
        _state(_model()),
        _data(5),
        epochs=3,
        partial_window="epoch",
        plugins=[lambda e: infos.append(e.loop) if e.kind == "start" else None],
    )
    assert infos[0].total_steps == 9  # 3 per pass: 2, 2, 1
    infos.clear()
    run(
        step,
        _state(_model()),
        _data(5),
        epochs=3,
        partial_window="end",
        plugins=[lambda e: infos.append(e.loop) if e.kind == "start" else None],
    )
    assert infos[0].total_steps == 8  # 15 micro-batches: 7 windows of 2 and one of 1


# -- item 2: epoch_start, evaluate, the update number ---------------------------------------


def test_epoch_start_comes_before_each_pass_and_can_stop_the_run() -> None:
    seen = []

    def plugin(event: Event) -> TrainState | None:
        seen.append((event.kind, event.state.epoch, event.state.step))
        if event.kind == "epoch_start" and event.state.epoch == 2:
            return event.state.replace(stop="enough")
        return None

    state = run(make_step(_mse), _state(_model()), _data(2), epochs=5, plugins=[plugin])
    assert [s for s in seen if s[0] == "epoch_start"] == [
        ("epoch_start", 0, 0),
        ("epoch_start", 1, 2),
        ("epoch_start", 2, 4),
    ]
    assert state.stop == "enough" and state.step == 4


def test_evaluate_is_validates_evaluation_without_training() -> None:
    def eval_fn(model, batch):
        x, y = batch
        return {"mse": torch.nn.functional.mse_loss(model(x), y), "n": float(len(x))}

    data, model = _data(5), _model()
    model.train()
    got = evaluate(eval_fn, model, data)
    with pytest.warns(RuntimeWarning, match=r"run: max_steps=0: no update will run"):
        state = run(
            make_step(_mse),
            _state(copy.deepcopy(model)),
            data,
            max_steps=0,
            plugins=[validate(eval_fn, data, at_end=True, monitor="mse")],
        )
    assert got == state.metrics["val"]["values"]
    with torch.no_grad():  # count-weighted: the mean over samples
        want = sum(((model(x) - y) ** 2).sum() for x, y in data) / sum(len(x) for x, _ in data)
    assert got["mse"] == pytest.approx(want.item(), rel=1e-6)
    assert model.training
    assert evaluate(eval_fn, _state(model), data) == got  # a TrainState works too


def test_evaluate_refuses_bad_arguments() -> None:
    with pytest.raises(TypeError, match="evaluate: eval_fn must be callable"):
        evaluate("loss", _model(), _data(1))  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match="evaluate: model must be a torch.nn.Module or a TrainState; got a dict"
    ):
        evaluate(lambda m, b: {}, {}, _data(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="evaluate: data must be an iterable of batches"):
        evaluate(lambda m, b: {}, _model(), 3)  # type: ignore[arg-type]


def test_a_loss_function_with_a_step_parameter_reads_the_update_number() -> None:
    seen = []

    def loss_fn(model, batch, step):
        seen.append(step)
        weight = min(1.0, step / 2)  # an auxiliary loss warmed up over 2 updates
        return _mse(model, batch) * (1 + weight)

    def keyword_only(model, batch, *, step):
        return _mse(model, batch) * (1 + min(1.0, step / 2))

    model, ref = _model(), _model()
    state = run(accumulate(make_step(loss_fn), micro_batches=2), _state(model), _data(8), epochs=1)
    assert seen == [0, 0, 1, 1, 2, 2, 3, 3]  # state.step, the same within a window
    run(accumulate(make_step(keyword_only), micro_batches=2), _state(ref), _data(8), epochs=1)
    assert state.step == 4
    for got, want in zip(model.parameters(), ref.parameters()):
        assert torch.equal(got, want)

    # A loss function without it is called with two arguments, as before.
    def scaled(model: Any, batch: Any, scale: float = 2.0) -> torch.Tensor:
        return _mse(model, batch) * scale

    run(make_step(scaled), _state(_model()), _data(1), epochs=1)


# -- item 4: to_device -----------------------------------------------------------------------


def test_to_device_moves_every_tensor_and_keeps_the_rest() -> None:
    batch = {"x": torch.ones(2, 3), "pair": (torch.zeros(1), "name"), "n": 3, "none": None}
    moved: Any = to_device(batch, "meta")
    assert moved["x"].device.type == "meta" and moved["pair"][0].device.type == "meta"
    assert moved["pair"][1] == "name" and moved["n"] == 3 and moved["none"] is None
    assert type(moved["pair"]) is tuple
    same: Any = to_device(batch, torch.device("cpu"), non_blocking=True)
    assert same["x"] is batch["x"]  # already there: no copy


def test_to_device_refuses_bad_arguments() -> None:
    with pytest.raises(TypeError, match="to_device: device must be a torch.device.*got list"):
        to_device(torch.ones(1), ["cpu"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="to_device: non_blocking must be True or False; got 1"):
        to_device(torch.ones(1), "cpu", non_blocking=1)  # type: ignore[arg-type]


# -- item 9: the window's batches in the step event ------------------------------------------


def test_step_events_carry_the_windows_batches_as_given() -> None:
    data = _data(5)
    events: list[Event] = []
    step = accumulate(make_step(_mse), micro_batches=2)
    run(step, _state(_model()), data, epochs=1, plugins=[events.append])
    steps = [e for e in events if e.kind == "step"]
    assert [len(e.batches) for e in steps] == [2, 2]
    assert all(
        a is b for e, want in zip(steps, (data[0:2], data[2:4])) for a, b in zip(e.batches, want)
    )
    end = events[-1]
    assert end.kind == "end" and len(end.batches) == 1 and end.batches[0] is data[4]
