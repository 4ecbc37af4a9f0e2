"""peak_memory: process peak RSS on the CPU (rss_peak_gib), CUDA peak allocated (peak_gib)."""

from __future__ import annotations

import sys

import pytest
import torch

from toolkit import TrainState, accumulate, make_step, run
from toolkit.loop._run import Event
from toolkit.plugins import _memory
from toolkit.plugins._memory import peak_memory


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


_STEP = make_step(lambda m, b: m(b).square().mean())
_DATA = [torch.ones(2, 3)] * 12


def _records(name: str = "rss_peak_gib"):  # on the CPU; "peak_gib" on CUDA
    seen: list[tuple[int, float]] = []

    def spy(event: Event) -> None:
        entry = event.state.metrics.get("memory")
        if entry is not None and (not seen or seen[-1][0] != entry["step"]):
            assert set(entry["values"]) == {name}  # one value, named by what it measures
            seen.append((entry["step"], entry["values"][name]))

    return seen, spy


def _vm_hwm_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    raise AssertionError("no VmHWM in /proc/self/status")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_cpu_value_is_the_process_high_water_mark():
    before = _vm_hwm_gib()
    seen, spy = _records()
    run(_STEP, _state(), _DATA, max_steps=4, plugins=[peak_memory(every=2), spy])
    after = _vm_hwm_gib()
    assert [s for s, _ in seen] == [2, 4]
    for _, peak in seen:
        # The kernel's high-water mark before and after brackets the recorded value.
        assert before * 0.99 <= peak <= after * 1.01
        assert 0.01 < peak < 1024  # a Python process with torch: tens of MiB to some GiB
    # A high-water mark never decreases.
    assert seen[0][1] <= seen[1][1]


def test_cadence_counts_applied_updates_only():
    seen, spy = _records()
    step = accumulate(_STEP, micro_batches=2)
    state = run(step, _state(), _DATA, max_steps=6, plugins=[peak_memory(every=3), spy])
    assert [s for s, _ in seen] == [3, 6]
    assert state.metrics["memory"]["step"] == 6
    assert set(state.metrics["memory"]["values"]) == {"rss_peak_gib"}  # not CUDA's name


def test_custom_key():
    state = run(_STEP, _state(), _DATA, max_steps=2, plugins=[peak_memory(every=1, key="mem")])
    assert state.metrics["mem"]["step"] == 2 and "memory" not in state.metrics


def test_cuda_branch_with_fakes(monkeypatch):
    # No GPU on this machine: the CUDA calls are replaced by fakes that script the allocator's
    # peak. This checks the plugin's logic (device choice, units, reset after each record),
    # not a real CUDA device.
    device = torch.device("cuda", 0)
    calls: list[tuple[str, torch.device]] = []
    peaks = iter([7 * 2**30, 3 * 2**30, 2**29])  # the first, before training, is dropped

    def max_memory_allocated(dev):
        calls.append(("max", dev))
        return next(peaks)

    def reset_peak_memory_stats(dev):
        calls.append(("reset", dev))

    monkeypatch.setattr(_memory, "_cuda_device", lambda model: device)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset_peak_memory_stats)
    seen, spy = _records("peak_gib")
    run(_STEP, _state(), _DATA, max_steps=4, plugins=[peak_memory(every=2), spy])
    assert seen == [(2, 3.0), (4, 0.5)]
    # Read-and-reset at start (the reading dropped), then at each record.
    assert calls == [("max", device), ("reset", device)] * 3


def test_cuda_device_detection():
    assert _memory._cuda_device(torch.nn.Linear(1, 1)) is None
    assert _memory._cuda_device(torch.nn.Linear(1, 1, device="meta")) is None
    assert _memory._cuda_device(torch.nn.ReLU()) is None  # no parameters


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_of_a_model_on_the_gpu():
    assert _memory._cuda_device(torch.nn.Linear(1, 1, device="cuda")) == torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every": 0}, r"every must be an int >= 1"),
        ({"every": True}, r"every must be an int >= 1"),
        ({"key": ""}, r"key must be a non-empty string"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        peak_memory(**kwargs)
