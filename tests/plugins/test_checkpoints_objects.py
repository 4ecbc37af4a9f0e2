"""checkpoints(objects=...): the plugin saves the extra objects and puts them back on resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from toolkit import TrainState, make_step, run
from toolkit.checkpoints import read_pointer
from toolkit.plugins import checkpoints


class _Seen:
    """A user object with a state of its own: how many updates it saw."""

    def __init__(self) -> None:
        self.updates = 0

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = state["updates"]


def test_the_plugin_saves_objects_and_a_resume_puts_them_back(tmp_path: Path) -> None:
    # Bug caught: objects= stored by the factory but not passed to the saves or the load
    # (the resumed counter would start at 0 again, or the load would refuse the checkpoint).
    def train(seen: _Seen, max_steps: int) -> TrainState:
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

        def count(event: Any) -> None:
            seen.updates += event.kind == "step"

        plugin = checkpoints(tmp_path, every=2, objects={"seen": seen})
        step = make_step(lambda m, b: m(b).square().mean())
        data = [torch.ones(3, 2)] * 8
        return run(step, state, data, max_steps=max_steps, plugins=[count, plugin])

    first = _Seen()
    train(first, 4)
    assert first.updates == 4 and read_pointer(tmp_path) == tmp_path / "step_000004"
    resumed = _Seen()
    assert train(resumed, 6).step == 6
    assert resumed.updates == 6  # 4 put back from the checkpoint, 2 more counted


def test_signals_given_as_a_generator_are_all_handled(tmp_path: Path) -> None:
    # Bug caught: the argument check read the generator up, so no handler was installed and
    # SIGUSR1 killed the process instead of stopping the run with a save.
    import os
    import signal

    import pytest

    model = torch.nn.Linear(2, 1)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    def send(event: Any) -> None:
        if event.kind == "step" and event.state.step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)

    plugin = checkpoints(tmp_path, signals=(s for s in [signal.SIGUSR1]))
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        with pytest.raises(SystemExit) as stopped:
            run(make_step(lambda m, b: m(b).sum()), state, [torch.ones(1, 2)] * 5, epochs=1,
                plugins=[send, plugin])  # fmt: skip
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert stopped.value.code == 128 + signal.SIGUSR1
    assert read_pointer(tmp_path) == tmp_path / "step_000002"
