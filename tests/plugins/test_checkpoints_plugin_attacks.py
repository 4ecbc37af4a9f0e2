"""The checkpoints plugin under a reviewer's attacks: an error after a signal is not
hidden by the exit, the folder's lock file is never followed elsewhere nor kept by a forked
child, data-parallel ranks with unequal shards resume, keep_best with a user's own metrics
plugin, changed scheduler arguments reported, Ctrl-C handed back after a signal-stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from toolkit import TrainState, make_step, run
from toolkit.checkpoints import list_checkpoints
from toolkit.plugins import Retention, checkpoints

TIMEOUT = 120


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


STEP = make_step(lambda m, b: m(b).square().mean())
DATA = [torch.ones(2, 2)] * 8


# --- an error after a signal ---------------------------------------------------------------

JOB = """
import errno, os, signal, sys, torch
from concurrent.futures import Future
import toolkit.plugins._checkpoints as plugin
from toolkit import TrainState, make_step, run
from toolkit.plugins import checkpoints

def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

def full_later(*args, **kwargs):  # a background save: its error comes at "end"
    written = Future()
    written.set_exception(OSError(errno.ENOSPC, "No space left on device"))
    return written

def loss(model, batch):
    loss.calls = getattr(loss, "calls", 0) + 1
    if loss.calls == 2:
        os.kill(os.getpid(), signal.SIGTERM)  # the job is preempted, and then:
        if sys.argv[2] == "loss":  # its DataLoader workers, signalled too, are gone
            raise RuntimeError("DataLoader worker (pid 123) is killed by signal: Terminated.")
        plugin.save_checkpoint, plugin.save_in_background = full, full_later  # or the disk is full
    return model(batch).square().mean()

model = torch.nn.Linear(2, 1)
state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
run(make_step(loss), state, [torch.ones(2, 2)] * 8, max_steps=6,
    plugins=[checkpoints(sys.argv[1], every=100, background=sys.argv[2] == "background")])
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("failing", "said"),
    [
        ("loss", "RuntimeError: DataLoader worker"),
        ("save", "OSError: [Errno 28] No space left on device"),
        ("background", "then the save failed: OSError(28, 'No space left on device')"),
    ],
)
def test_an_error_after_a_signal_propagates_instead_of_a_silent_exit(
    tmp_path: Path, failing: str, said: str
) -> None:
    # Bug caught: the plugin's SystemExit(143) replaced the error; Python printed nothing.
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt"), failing],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert said in done.stderr and "SIGTERM was received" in done.stderr, done.stderr


# --- the lock file ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_lock_file_that_is_not_a_regular_file_is_refused_untouched(tmp_path, kind) -> None:
    # Bug caught: os.open followed the symlink and wrote the holder's name over its target.
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "ckpt").mkdir()
    lock = tmp_path / "ckpt" / ".lock"
    lock.symlink_to(victim) if kind == "symlink" else os.mkfifo(lock)
    with pytest.raises(RuntimeError, match=r"\.lock'? is not a regular file"):
        run(STEP, _state(), DATA, max_steps=2, plugins=[checkpoints(tmp_path / "ckpt")])
    assert victim.read_text() == "precious" and not list_checkpoints(tmp_path / "ckpt")


def test_a_forked_child_does_not_keep_the_folder_locked(tmp_path: Path) -> None:
    # Bug caught: a forked child (a DataLoader worker) inherited the lock file and held the
    # lock after the run had released it.
    import fcntl

    children, (read_end, write_end) = [], os.pipe()

    def fork(event):
        if event.kind == "step" and not children:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process
                pid = os.fork()
            if pid == 0:  # lives on after the run, as a hung worker might
                os.read(read_end, 1)
                os._exit(0)
            children.append(pid)

    try:
        run(STEP, _state(), DATA, max_steps=2, plugins=[fork, checkpoints(tmp_path)])
        descriptor = os.open(tmp_path / ".lock", os.O_RDWR)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: the run ended
        finally:
            os.close(descriptor)
    finally:
        os.write(write_end, b"x")
        for pid in children:
            os.waitpid(pid, 0)
        os.close(read_end)
        os.close(write_end)


# --- data parallel: ranks with their own shards -----------------------------------------------


def _shards(rank: int, store: str, folder: str, phase: str, out: str) -> None:
    from spawning import gloo_group
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset

    samples = (37 if phase == "d" else 40, 39)[rank]  # per-rank shards: 10 batches each
    with gloo_group(rank, 2, store), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(2, 1))
        state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        data = DataLoader(TensorDataset(torch.ones(samples, 2)), batch_size=4)
        step = make_step(lambda m, b: m(b[0]).square().mean())
        plugins = [checkpoints(folder, every=3, per_epoch=True)]
        until = {"a": {"epochs": 1}, "b": {"max_steps": 13}, "c": {"max_steps": 15}}
        try:
            state = run(step, state, data, plugins=plugins, **until.get(phase, {"max_steps": 20}))
            said = f"step {state.step}"
        except ValueError as error:
            said = f"ValueError: {error}"
        said += "".join(
            f"\nwarning: {w.message}" for w in caught if "checkpoints" in str(w.message)
        )
    Path(out, f"rank{rank}.txt").write_text(said)


@pytest.mark.slow
def test_ranks_with_unequal_shards_resume_and_refuse_together(tmp_path: Path) -> None:
    # Bug caught: each rank compared its own shard (39 samples) with rank 0's recorded one
    # (40): rank 1 warned falsely at an epoch boundary, refused the legal resume inside a
    # pass, and rank 0 died with "Connection closed by peer" (or waited).
    from spawning import spawn

    folder = tmp_path / "ckpt"
    for phase in "abcd":

        def arguments(attempt: int, phase: str = phase) -> tuple[str, str, str, str]:
            out = tmp_path / f"{phase}{attempt}"
            out.mkdir()
            return str(out / "store"), str(folder), phase, str(out)

        spawn(_shards, arguments, nprocs=2, timeout=90)
        out = sorted(tmp_path.glob(f"{phase}?"))[-1]
        said = [(out / f"rank{rank}.txt").read_text() for rank in (0, 1)]
        if phase != "d":  # a, then resumed at an epoch boundary (b) and inside a pass (c)
            steps = {"a": 10, "b": 13, "c": 15}[phase]
            assert said == [f"step {steps}"] * 2, said  # and no false warning on either rank
        else:  # rank 0's shard changed inside a pass: both ranks refuse, none hangs
            assert said[0].startswith("ValueError: checkpoints: the checkpoint stopped 5 batches")
            assert "samples 40 -> 37" in said[0], said
            assert said[1].startswith("ValueError: checkpoints: rank 0 of the group failed"), said


# --- keep_best with a user's own metrics plugin ------------------------------------------------


def _my_eval(event):  # a user's evaluation, publishing in state.metrics every 4 updates
    if event.kind == "step" and event.out.updated and event.state.step % 4 == 0:
        entry = {"step": event.state.step, "values": {"acc": event.state.step / 10}}
        return event.state.replace(metrics={**event.state.metrics, "myeval": entry})
    return None


def test_keep_best_ranks_by_a_user_plugins_metric(tmp_path: Path) -> None:
    # Bug caught: a user plugin declares no key, so the first save (step 2, before any
    # evaluation) raised "which no plugin publishes".
    plugin = checkpoints(
        tmp_path, every=2, keep=Retention(keep_best=1, metric="myeval/acc", mode="max")
    )
    run(STEP, _state(), DATA, max_steps=10, plugins=[_my_eval, plugin])
    assert [(i.step, dict(i.metrics)) for i in list_checkpoints(tmp_path)] == [
        (8, {"myeval/acc": 0.8}),
        (10, {}),
    ]


def test_a_keep_best_metric_of_a_published_entry_that_lacks_it_is_refused(tmp_path) -> None:
    plugin = checkpoints(
        tmp_path, every=2, keep=Retention(keep_best=1, metric="myeval/acu", mode="max")
    )
    with pytest.raises(ValueError, match=r"'myeval/acu', which no plugin.*\['myeval/acc'\]"):
        run(STEP, _state(), DATA, max_steps=10, plugins=[_my_eval, plugin])
    assert [i.step for i in list_checkpoints(tmp_path)] == [2]  # refused at step 4's save


def test_a_keep_best_metric_never_published_is_said_at_the_end(tmp_path: Path) -> None:
    plugin = checkpoints(
        tmp_path, every=2, keep=Retention(keep_best=1, metric="myevall/acc", mode="max")
    )
    with pytest.warns(RuntimeWarning, match=r"no checkpoint in .* holds keep_best's 'myevall/acc'"):
        run(STEP, _state(), DATA, max_steps=10, plugins=[_my_eval, plugin])


# --- changed scheduler arguments -------------------------------------------------------------


def _scheduled(milestones: list[int], factor: float) -> TrainState:
    from torch.optim import lr_scheduler

    state = _state()
    optimizer = state.optimizer
    schedulers = [
        lr_scheduler.MultiStepLR(optimizer, milestones),
        lr_scheduler.LambdaLR(optimizer, lambda epoch: factor),
    ]
    sequence = lr_scheduler.SequentialLR(optimizer, schedulers, milestones=[milestones[-1]])
    return state.replace(scheduler=sequence)


def test_changed_arguments_of_a_nested_scheduler_are_reported(tmp_path: Path) -> None:
    # Bug caught: only constructor arguments at the top level were recorded; SequentialLR's
    # milestones and its schedulers' were not, and a resume used the old ones silently.
    run(STEP, _scheduled([2, 4], 1.0), DATA, max_steps=3, plugins=[checkpoints(tmp_path)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same arguments: no warning
        run(STEP, _scheduled([2, 4], 1.0), DATA, max_steps=4, plugins=[checkpoints(tmp_path)])
    with pytest.warns(RuntimeWarning) as caught:
        run(STEP, _scheduled([50, 80], 0.5), DATA, max_steps=6, plugins=[checkpoints(tmp_path)])
    said = str(caught[0].message)
    assert "scheduler._milestones.0 4 -> 80" in said, said
    assert "scheduler._schedulers.0.milestones (2, 1, 4, 1) -> (50, 1, 80, 1)" in said, said
    assert "last_epoch" not in said and "_step_count" not in said, said


# --- Ctrl-C after a signal-stop, in a process that goes on -------------------------------------


def test_ctrl_c_works_again_after_a_signal_stop_that_was_caught(tmp_path: Path) -> None:
    # Bug caught: the flag-only SIGINT handler stayed, so in a notebook (which catches the
    # SystemExit) Ctrl-C did nothing for the rest of the process.
    stopping = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    before = {signum: signal.getsignal(signum) for signum in stopping}

    def loss(model, batch):
        if not hasattr(loss, "sent"):
            loss.sent = True
            os.kill(os.getpid(), signal.SIGINT)  # the notebook's interrupt button
        return model(batch).square().mean()

    try:
        with pytest.raises(SystemExit) as stopped:
            run(make_step(loss), _state(), DATA, max_steps=4, plugins=[checkpoints(tmp_path)])
        assert stopped.value.code == 130 and [i.step for i in list_checkpoints(tmp_path)] == [1]
        assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]  # flag-only
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
