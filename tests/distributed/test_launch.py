"""toolkit.distributed: joining a job from the launcher's environment.

In one process (a world of one, bad environments) and on 2 spawned ranks that rendezvous
the way ``srun`` with exported variables does (rank 0 hosts the store). The torchrun path,
restarts included, is tests/distributed/test_torchrun.py's.
"""

from __future__ import annotations

import contextlib
import datetime
import doctest
import inspect
import json
import pathlib
import random
import socket

import pytest
import torch
import torch.distributed as dist
from spawning import spawn

import toolkit.distributed
from toolkit.distributed import process_group, setup, teardown

LAUNCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
)


@pytest.fixture(autouse=True)
def _plain_environment(monkeypatch: pytest.MonkeyPatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():  # a failed test must not leave its group to the next
        dist.destroy_process_group()


@pytest.mark.parametrize("name", toolkit.distributed.__all__)
def test_public_names_are_documented_with_examples_that_run(name: str) -> None:
    obj = getattr(toolkit.distributed, name)
    doc = inspect.getdoc(obj) or ""
    sections = ("Attributes:",) if inspect.isclass(obj) else ("Args:", "Returns:", "Raises:")
    assert [s for s in (*sections, "Example:") if s not in doc] == [], name
    tests = [t for t in doctest.DocTestFinder().find(obj, name, globs={}) if t.examples]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    assert tests and runner.summarize(verbose=False).failed == 0


def test_without_a_launcher_the_process_is_a_world_of_one() -> None:
    launch = setup(seed=7)
    try:
        assert (launch.rank, launch.world_size, launch.local_rank, launch.restart) == (0, 1, 0, 0)
        assert (launch.device, launch.backend, launch.seed) == (torch.device("cpu"), "gloo", 7)
        assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        assert torch.initial_seed() == 7
        drawn = random.random()
        random.seed(7)
        assert drawn == random.random()
    finally:
        teardown()
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        ({"RANK": "0"}, r"setup: WORLD_SIZE must be set with RANK; got None. Export both"),
        ({"RANK": "one", "WORLD_SIZE": "2"}, r"RANK must be an integer >= 0; got 'one'"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK must be below WORLD_SIZE=2; got 2"),
        (
            {"RANK": "1", "WORLD_SIZE": "2"},
            r"MASTER_ADDR must be set when WORLD_SIZE > 1; got None. Launch with torchrun",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "x"},
            r"TORCHELASTIC_RESTART_COUNT must be an integer",
        ),
    ],
)
def test_a_malformed_environment_is_named(
    environment: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        setup()
    assert not dist.is_initialized()


def test_a_local_rank_beyond_the_gpus_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        ValueError, match=r"LOCAL_RANK must be below the 2 CUDA devices of this machine; got 3"
    ):
        setup()


def test_on_cuda_the_backend_is_nccl_bound_to_the_ranks_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # toolkit's own exchanges need no CPU backend (test_collective_devices.py), so none is asked.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    asked: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(
        dist, "init_process_group", lambda backend, **kw: asked.append((backend, kw["device_id"]))
    )
    launch = setup()
    assert (launch.backend, asked) == ("nccl", [("nccl", torch.device("cuda", 0))])


def test_setting_up_twice_is_refused() -> None:
    setup()
    with pytest.raises(RuntimeError, match=r"got 'initialised'. Call toolkit.distributed.teardown"):
        setup()
    teardown()


@pytest.mark.parametrize(
    ("raised", "barrier"), [(None, True), (SystemExit(143), True), (ValueError("x"), False)]
)
def test_the_barrier_runs_unless_the_body_failed(
    raised: BaseException | None, barrier: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real_barrier = dist.barrier
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier") or real_barrier())
    expected = pytest.raises(type(raised)) if raised is not None else contextlib.nullcontext()
    with expected, process_group():
        if raised is not None:
            raise raised
    assert calls == (["barrier"] if barrier else [])
    assert not dist.is_initialized()  # destroyed either way


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, port: int, out: str) -> None:
    import os

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="1",
    )
    with process_group(seed=3, timeout=datetime.timedelta(seconds=30)) as launch:
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        fields = [launch.rank, launch.world_size, launch.local_rank, launch.restart, launch.seed]
        drawn = torch.rand(1).item()
    pathlib.Path(out, f"rank{rank}.json").write_text(json.dumps([*fields, total.item(), drawn]))


@pytest.mark.slow
def test_two_ranks_meet_through_a_store_hosted_by_rank_0(tmp_path: pathlib.Path) -> None:
    def arguments(attempt: int) -> tuple[int, str]:
        out = tmp_path / str(attempt)
        out.mkdir()
        return _free_port(), str(out)

    spawn(_rank, arguments, nprocs=2, timeout=90)
    out = sorted(tmp_path.iterdir())[-1]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r[:6] for r in results] == [[0, 2, 0, 1, 3, 3.0], [1, 2, 1, 1, 4, 3.0]]
    assert results[0][6] != results[1][6]  # seeded per rank: different draws
