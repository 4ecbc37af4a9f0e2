"""ema / ema_model against the closed-form exponential moving average, computed in float64."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit import TrainState, accumulate, guard_nonfinite, make_step, run
from toolkit.loop._run import Event, LoopInfo
from toolkit.plugins._ema import ema, ema_model
from toolkit.step._step import StepOutput


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _state(model: torch.nn.Module, lr: float = 0.1) -> TrainState:
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr))


def _data(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, generator=g) for _ in range(n)]


def _loss(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
    return (m(b) - b.sum(1, keepdim=True)).square().mean()


def _recorder(trajectory: list[dict[str, torch.Tensor]]):
    """A plugin that snapshots the weights (float64) at start and after each applied update."""

    def plugin(event: Event) -> None:
        if event.kind == "start" or (event.kind == "step" and event.out.updated):
            trajectory.append(
                {n: p.detach().double().clone() for n, p in event.state.model.named_parameters()}
            )

    return plugin


def _recorded_run(model: torch.nn.Module, steps: int, plugin) -> tuple[TrainState, list]:
    """``steps`` updates of ``model`` under ``plugin``, and the weights' trajectory."""
    trajectory: list = []
    data, plugins = _data(steps), [_recorder(trajectory), plugin]
    return run(make_step(_loss), _state(model), data, max_steps=steps, plugins=plugins), trajectory


def _closed_form(trajectory, decay: float, steps: list[int]) -> dict[str, torch.Tensor]:
    """decay^n * p_0 + sum_i (1 - decay) * decay^(n - i) * p_{s_i} over the EMA updates."""
    n = len(steps)
    out = {}
    for name, p0 in trajectory[0].items():
        total = decay**n * p0
        for i, s in enumerate(steps, start=1):
            total = total + (1 - decay) * decay ** (n - i) * trajectory[s][name]
        out[name] = total
    return out


def _assert_close(entry_params, expected) -> None:
    assert entry_params.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(entry_params[name].double(), value, rtol=1e-5, atol=1e-6)


def test_matches_closed_form_without_warmup():
    model = _model()
    trajectory: list = []
    plugins = [_recorder(trajectory), ema(0.8, warmup=False)]
    state = run(make_step(_loss), _state(model), _data(12), max_steps=12, plugins=plugins)
    entry = state.extras["ema"]
    assert entry["num_updates"] == 12 and entry["step"] == 12
    _assert_close(entry["params"], _closed_form(trajectory, 0.8, list(range(1, 13))))
    # The weights really moved, so the average is not trivially the last or first weights.
    last = trajectory[-1]["0.weight"]
    assert not torch.allclose(entry["params"]["0.weight"].double(), last, atol=1e-3)


def test_one_ema_plugin_follows_a_new_model_in_its_next_run():
    # Bug caught: the fused update's tensor lists cached for the first model and reused, so
    # the second run would average the first model's weights into the first entry.
    plugin = ema(0.8, warmup=False)
    run(make_step(_loss), _state(_model(0)), _data(3), max_steps=3, plugins=[plugin])
    state, trajectory = _recorded_run(_model(1), 4, plugin)
    _assert_close(state.extras["ema"]["params"], _closed_form(trajectory, 0.8, [1, 2, 3, 4]))


def test_warmup_schedule():
    model = _model()
    trajectory: list = []
    plugins = [_recorder(trajectory), ema(0.6, warmup=True)]
    state = run(make_step(_loss), _state(model), _data(20), max_steps=20, plugins=plugins)
    # 0.6 is reached at n = 13: the run covers the ramp and the plateau.
    # Independent recursion with d_n = min(decay, (1 + n) / (10 + n)), n = updates so far.
    expected = dict(trajectory[0])
    decays = []
    for n in range(20):
        d = min(0.6, (1 + n) / (10 + n))
        decays.append(d)
        expected = {k: d * v + (1 - d) * trajectory[n + 1][k] for k, v in expected.items()}
    assert decays[0] == pytest.approx(0.1) and decays[-1] == 0.6 and decays[5] < 0.6
    _assert_close(state.extras["ema"]["params"], expected)


def test_first_warmup_update_is_mostly_the_new_weights():
    state, trajectory = _recorded_run(_model(), 1, ema(0.999))
    expected = {k: 0.1 * trajectory[0][k] + 0.9 * trajectory[1][k] for k in trajectory[0]}
    _assert_close(state.extras["ema"]["params"], expected)


def test_every_updates_on_multiples_only():
    model = _model()
    trajectory: list = []
    plugins = [_recorder(trajectory), ema(0.7, warmup=False, every=3)]
    state = run(make_step(_loss), _state(model), _data(10), max_steps=10, plugins=plugins)
    entry = state.extras["ema"]
    assert entry["num_updates"] == 3 and entry["step"] == 9
    _assert_close(entry["params"], _closed_form(trajectory, 0.7, [3, 6, 9]))


def test_updates_only_on_applied_updates_with_accumulation():
    model = _model()
    trajectory: list = []
    calls: list[tuple[int, int]] = []

    def spy(event: Event) -> None:
        if event.kind == "step":
            calls.append((len(event.outs), event.state.extras["ema"]["num_updates"]))

    step = accumulate(make_step(_loss), micro_batches=3)
    plugins = [_recorder(trajectory), ema(0.6, warmup=False), spy]
    state = run(step, _state(model), _data(12), max_steps=4, plugins=plugins)
    assert state.extras["ema"]["num_updates"] == 4
    # One event per window of 3 micro-batches, each adding one EMA update.
    assert calls == [(3, 1), (3, 2), (3, 3), (3, 4)]
    _assert_close(state.extras["ema"]["params"], _closed_form(trajectory, 0.6, [1, 2, 3, 4]))


def test_rejected_window_does_not_update():
    model = _model()
    data = _data(4)
    data[1] = torch.full((5, 3), float("nan"))
    trajectory: list = []
    step = guard_nonfinite(make_step(_loss), max_retries=2)
    plugins = [_recorder(trajectory), ema(0.5, warmup=False)]
    state = run(step, _state(model), data, max_steps=3, plugins=plugins)
    assert state.guard.total_notfinite == 1 and state.step == 3
    assert state.extras["ema"]["num_updates"] == 3
    _assert_close(state.extras["ema"]["params"], _closed_form(trajectory, 0.5, [1, 2, 3]))


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)
    )


def test_buffers_averaged_and_integer_buffers_copied():
    model = _bn_model()
    means: list[torch.Tensor] = [model[1].running_mean.double().clone()]

    def record(event: Event) -> None:
        if event.kind == "step" and event.out.updated:
            means.append(event.state.model[1].running_mean.double().clone())

    plugins = [record, ema(0.75, warmup=False, buffers=True)]
    state = run(make_step(_loss), _state(model), _data(6), max_steps=6, plugins=plugins)
    held = state.extras["ema"]["buffers"]
    assert set(held) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    expected = 0.75**6 * means[0] + sum(0.25 * 0.75 ** (6 - i) * means[i] for i in range(1, 7))
    torch.testing.assert_close(held["1.running_mean"].double(), expected, rtol=1e-5, atol=1e-6)
    assert held["1.num_batches_tracked"].dtype == torch.long
    assert held["1.num_batches_tracked"].item() == 6 == model[1].num_batches_tracked.item()
    averaged = ema_model(state)
    torch.testing.assert_close(averaged[1].running_mean, held["1.running_mean"])
    assert not torch.equal(averaged[1].running_mean, model[1].running_mean)


def test_buffers_off_keeps_live_buffers_in_ema_model():
    model = _bn_model()
    state = run(make_step(_loss), _state(model), _data(4), max_steps=4, plugins=[ema(0.9)])
    assert state.extras["ema"]["buffers"] == {}
    averaged = ema_model(state)
    torch.testing.assert_close(averaged[1].running_mean, model[1].running_mean)
    torch.testing.assert_close(averaged[0].weight, state.extras["ema"]["params"]["0.weight"])


def test_resume_keeps_the_average():
    data = _data(10)
    trajectory: list = []
    model = _model()
    state = run(
        make_step(_loss),
        _state(model),
        data,
        max_steps=4,
        plugins=[_recorder(trajectory), ema(0.8, warmup=False)],
    )
    # A "checkpoint": weights and extras copied out, loaded into a fresh model and optimizer.
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    extras = {
        "ema": {
            **state.extras["ema"],
            # Saved in another dtype: adopting it must convert to the weights' dtype.
            "params": {k: v.double() for k, v in state.extras["ema"]["params"].items()},
        }
    }
    fresh = _model(seed=5)
    fresh.load_state_dict(saved)
    resumed = _state(fresh).replace(
        step=state.step,
        batches_seen=state.batches_seen,
        data_state=state.data_state,  # where in the data the first run stopped
        extras=extras,
    )
    later: list = []
    resumed = run(
        make_step(_loss),
        resumed,
        data,
        max_steps=9,
        plugins=[_recorder(later), ema(0.8, warmup=False)],
    )
    entry = resumed.extras["ema"]
    assert entry["num_updates"] == 9 and entry["step"] == 9
    assert all(t.dtype == torch.float32 for t in entry["params"].values())
    full = trajectory + later[1:]  # later[0] is the resumed start, equal to trajectory[-1]
    _assert_close(entry["params"], _closed_form(full, 0.8, list(range(1, 10))))


def test_resume_with_other_model_is_a_clear_error():
    state = _state(_model()).replace(
        extras={
            "ema": {"step": 1, "num_updates": 1, "buffers": {}, "params": {"w": torch.zeros(1)}}
        }
    )
    with pytest.raises(ValueError, match=r"does not match the model's params.*drop"):
        run(make_step(_loss), state, _data(1), max_steps=1, plugins=[ema()])


def test_resume_with_other_buffer_option_is_a_clear_error():
    model = _bn_model()
    state = run(make_step(_loss), _state(model), _data(2), max_steps=2, plugins=[ema()])
    with pytest.raises(ValueError, match=r"ema\(buffers=, frozen=\) options"):
        run(make_step(_loss), state, _data(2), max_steps=3, plugins=[ema(buffers=True)])


def test_ema_model_is_a_separate_eval_copy():
    model = _model()
    state = run(make_step(_loss), _state(model), _data(5), max_steps=5, plugins=[ema(0.5)])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    averaged = ema_model(state)
    assert averaged is not model and not averaged.training and model.training
    for name, p in averaged.named_parameters():
        torch.testing.assert_close(p, state.extras["ema"]["params"][name])
    for name, v in model.state_dict().items():
        assert torch.equal(v, before[name])
    # Different from the live weights (the average lags behind them).
    assert not torch.allclose(averaged[0].weight, model[0].weight)
    # Changing the copy does not reach the training model or the average.
    with torch.no_grad():
        averaged[0].weight.add_(1.0)
    assert torch.equal(model[0].weight, before["0.weight"])
    assert not torch.equal(averaged[0].weight, state.extras["ema"]["params"]["0.weight"])


def test_names_are_those_of_the_unwrapped_model():
    from torch.optim.swa_utils import AveragedModel

    inner = _model()
    wrapped = AveragedModel(inner)  # a .module wrapper (of a copy) that toolkit.unwrap peels
    # The optimizer is over the copy's parameters, the ones the loss uses (over inner's, as
    # this test once was, nothing would train).
    optimizer = torch.optim.SGD(wrapped.module.parameters(), lr=0.1)
    state = TrainState(model=wrapped, optimizer=optimizer)
    step = make_step(lambda m, b: _loss(m.module, b))
    state = run(step, state, _data(3), max_steps=3, plugins=[ema(0.9)])
    assert set(state.extras["ema"]["params"]) == {n for n, _ in inner.named_parameters()}
    averaged = ema_model(state)
    assert type(averaged) is torch.nn.Sequential
    trained, average = wrapped.module.state_dict(), averaged.state_dict()
    for name, initial in inner.state_dict().items():
        # It trained, and the average lies strictly between the start and the live weights.
        assert not torch.equal(trained[name], initial), name
        assert not torch.equal(average[name], initial) and not torch.equal(
            average[name], trained[name]
        )


def test_ema_model_without_entry_is_a_clear_error():
    message = r"key must be a key of state.extras, one of \[\]; got 'ema'. Add ema\(key='ema'\)"
    with pytest.raises(KeyError, match=message):
        ema_model(_state(_model()))


def test_step_without_start_initialises_lazily():
    model = _model()
    state = _state(model)
    loop = LoopInfo(None, None, None, 1, 0, None)
    out = StepOutput(torch.tensor(0.0), {}, None, None, True, True)
    plugin = ema(0.9, buffers=False)
    state = plugin(Event("step", state.replace(step=1), loop, out))
    entry = state.extras["ema"]
    assert entry["num_updates"] == 0 and entry["step"] == 1
    for name, p in model.named_parameters():
        assert torch.equal(entry["params"][name], p) and entry["params"][name] is not p


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"decay": 1.0}, ValueError, r"decay must be a number in \[0, 1\), e.g. 0.999; got 1.0"),
        ({"decay": -0.1}, ValueError, r"decay must be"),
        ({"decay": "0.9"}, ValueError, r"decay must be"),
        ({"every": 0}, ValueError, r"every must be an int >= 1"),
        ({"every": 1.5}, ValueError, r"every must be an int >= 1"),
        ({"warmup": 1}, TypeError, r"warmup must be True or False"),
        ({"buffers": None}, TypeError, r"buffers must be True or False"),
        ({"key": ""}, ValueError, r"key must be a non-empty string"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ema(**kwargs)


@settings(max_examples=15, deadline=None)
@given(
    decay=st.floats(0.0, 0.99),
    every=st.integers(1, 3),
    steps=st.integers(0, 7),
    warmup=st.booleans(),
)
def test_property_matches_recursion(decay, every, steps, warmup):
    model = _model()
    trajectory: list = []
    plugins = [_recorder(trajectory), ema(decay, warmup=warmup, every=every)]
    with warnings.catch_warnings():  # steps=0: no update, the average stays the start
        warnings.filterwarnings("ignore", "run: max_steps=0")
        state = run(make_step(_loss), _state(model), _data(steps), max_steps=steps, plugins=plugins)
    expected, n = dict(trajectory[0]), 0
    for s in range(every, steps + 1, every):
        d = min(decay, (1 + n) / (10 + n)) if warmup else decay
        expected = {k: d * v + (1 - d) * trajectory[s][k] for k, v in expected.items()}
        n += 1
    assert state.extras["ema"]["num_updates"] == n
    _assert_close(state.extras["ema"]["params"], expected)


def test_custom_key_for_the_average_and_for_ema_model():
    model = _model()
    state = run(
        make_step(_loss), _state(model), _data(3), max_steps=3, plugins=[ema(0.5, key="slow")]
    )
    assert "slow" in state.extras and "ema" not in state.extras
    averaged = ema_model(state, key="slow")
    expected = state.extras["slow"]["params"]
    assert all(torch.equal(p, expected[name]) for name, p in averaged.named_parameters())
    with pytest.raises(KeyError):
        ema_model(state)  # the default key holds nothing


def test_frozen_parameters_are_not_averaged_and_ema_model_takes_them_from_the_model():
    # Bug caught: the average copied every parameter, frozen ones too (a second copy of a
    # frozen base); ema_model must still return the whole model.
    model = _model()
    model[0].requires_grad_(False)
    state, trajectory = _recorded_run(model, 6, ema(0.8, warmup=False))
    params = state.extras["ema"]["params"]
    assert sorted(params) == ["2.bias", "2.weight"]
    assert sum(t.numel() for t in params.values()) == 5  # not 21: the frozen 16 are not held
    trainable = [{k: v for k, v in t.items() if k.startswith("2.")} for t in trajectory]
    _assert_close(params, _closed_form(trainable, 0.8, list(range(1, 7))))
    averaged = ema_model(state)
    assert averaged.state_dict().keys() == model.state_dict().keys()
    torch.testing.assert_close(averaged[0].weight, model[0].weight, rtol=0, atol=0)
    torch.testing.assert_close(averaged[2].weight, params["2.weight"], rtol=0, atol=0)


def test_frozen_true_averages_every_parameter():
    model = _model()
    model[0].requires_grad_(False)
    state = run(make_step(_loss), _state(model), _data(2), max_steps=2, plugins=[ema(frozen=True)])
    assert sorted(state.extras["ema"]["params"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    torch.testing.assert_close(ema_model(state)[0].weight, model[0].weight, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"unexpected \['0.bias', '0.weight'\]"):
        run(make_step(_loss), state, _data(2), max_steps=3, plugins=[ema()])


def test_frozen_true_copies_an_integer_parameter():
    # An integer parameter (a frozen lookup table, say) cannot be averaged: like an integer
    # buffer, it is copied (a lerp on it raised before the float/int grouping of the lists).
    model = _model()
    model.register_parameter("table", torch.nn.Parameter(torch.arange(3), requires_grad=False))
    plugin = ema(0.5, frozen=True)
    state = run(make_step(_loss), _state(model), _data(2), max_steps=1, plugins=[plugin])
    with torch.no_grad():
        model.table.add_(10)
    state = run(make_step(_loss), state, _data(2), max_steps=2, plugins=[plugin])
    assert state.extras["ema"]["params"]["table"].tolist() == [10, 11, 12]
