"""profile: torch.profiler over a window of updates writes Chrome traces that parse."""

from __future__ import annotations

import json

import pytest
import torch

from toolkit import TrainState, accumulate, make_step, run
from toolkit.loop._run import Event
from toolkit.plugins import _profiling
from toolkit.plugins._profiling import profile


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


_STEP = make_step(lambda m, b: m(b).square().mean())
_DATA = [torch.ones(4, 8)] * 20


def _names(trace: dict) -> set[str]:
    return {e.get("name", "") for e in trace["traceEvents"]}


def test_writes_a_chrome_trace_with_aten_ops(tmp_path):
    out = tmp_path / "run" / "profile"  # created by the plugin
    run(_STEP, _state(), _DATA, max_steps=6, plugins=[profile(out, wait=1, warmup=1, active=2)])
    files = sorted(p.name for p in out.iterdir())
    assert files == ["trace_step4.json"]
    path = out / files[0]
    assert path.stat().st_size > 0
    trace = json.loads(path.read_text())
    names = _names(trace)
    assert "aten::addmm" in names
    # Two recorded updates: two optimizer steps in the window.
    assert sum(1 for e in trace["traceEvents"] if e.get("name") == "Optimizer.step#SGD.step") == 2


def test_repeat_and_record_shapes(tmp_path):
    plugin = profile(tmp_path, wait=0, warmup=1, active=1, repeat=2, record_shapes=True)
    run(_STEP, _state(), _DATA, max_steps=8, plugins=[plugin])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace_step2.json", "trace_step4.json"]
    trace = json.loads((tmp_path / "trace_step2.json").read_text())
    addmm = [e for e in trace["traceEvents"] if e.get("name") == "aten::addmm"]
    assert addmm and all("Input Dims" in e.get("args", {}) for e in addmm)


def test_the_profiler_stops_once_every_cycle_is_written(tmp_path, monkeypatch):
    steps = []
    real_step = torch.profiler.profile.step
    monkeypatch.setattr(
        torch.profiler.profile, "step", lambda self: steps.append(1) or real_step(self)
    )
    plugin = profile(tmp_path, wait=0, warmup=1, active=1, repeat=2)
    run(_STEP, _state(), _DATA, max_steps=10, plugins=[plugin])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace_step2.json", "trace_step4.json"]
    assert len(steps) == 4  # two cycles of two updates; none for the 6 updates after


def test_repeat_zero_records_cycles_until_the_run_ends(tmp_path):
    plugin = profile(tmp_path, wait=0, warmup=1, active=1, repeat=0)
    run(_STEP, _state(), _DATA, max_steps=6, plugins=[plugin])
    names = ["trace_step2.json", "trace_step4.json", "trace_step6.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names


def test_profiled_step_covers_the_accumulation_window(tmp_path):
    step = accumulate(_STEP, micro_batches=3)
    run(step, _state(), _DATA, max_steps=3, plugins=[profile(tmp_path, wait=1, warmup=1, active=1)])
    trace = json.loads((tmp_path / "trace_step3.json").read_text())
    # One recorded update = three micro-batches = three forward matmuls per Linear layer.
    addmm = [e for e in trace["traceEvents"] if e.get("name") == "aten::addmm"]
    assert len(addmm) == 3 * 2


def test_stopped_on_error_and_partial_window_written(tmp_path):
    calls: list[int] = []

    def boom(event: Event) -> None:
        if event.kind == "step":
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("boom")

    boom.order = 100  # type: ignore[attr-defined]  # after profile, which records update 3
    with pytest.raises(RuntimeError, match="boom"):
        run(
            _STEP,
            _state(),
            _DATA,
            max_steps=10,
            plugins=[profile(tmp_path, wait=1, warmup=1, active=5), boom],
        )
    # The profiler was recording (update 3) and was stopped at "end": a trace exists,
    # and no profiler is left running (a new one can start).
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["trace_step3.json"]
    assert "aten::addmm" in _names(json.loads((tmp_path / files[0]).read_text()))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        pass


def test_run_ending_mid_window_writes_what_was_recorded(tmp_path):
    run(
        _STEP, _state(), _DATA, max_steps=4, plugins=[profile(tmp_path, wait=1, warmup=1, active=5)]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace_step4.json"]


def test_only_rank_zero_profiles(tmp_path, monkeypatch):
    monkeypatch.setattr(_profiling, "is_rank_zero", lambda: False)
    out = tmp_path / "traces"
    run(_STEP, _state(), _DATA, max_steps=6, plugins=[profile(out, wait=0, warmup=1, active=1)])
    assert not out.exists()


def test_no_warmup_keeps_torch_warning(tmp_path):
    # warmup=0 is allowed; torch warns that the first recorded step may be skewed.
    with pytest.warns(UserWarning, match="won't be using warmup"):
        run(
            _STEP,
            _state(),
            _DATA,
            max_steps=2,
            plugins=[profile(tmp_path, wait=0, warmup=0, active=1)],
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace_step1.json"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"wait": -1}, ValueError, r"wait must be an int >= 0; got -1"),
        ({"warmup": 1.5}, ValueError, r"warmup must be an int >= 0"),
        ({"active": 0}, ValueError, r"active must be an int >= 1; got 0"),
        ({"repeat": -2}, ValueError, r"repeat must be an int >= 0"),
        ({"record_shapes": "yes"}, TypeError, r"record_shapes must be True or False"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        profile(tmp_path, **kwargs)


def test_bad_out_dir():
    with pytest.raises(TypeError, match=r"out_dir must be a path .* got 3"):
        profile(3)
