"""a second signal cannot cut the shutdown short; Ctrl-C saves.

Each test runs a small job in a subprocess (with a timeout) and signals it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from toolkit.checkpoints import list_checkpoints
from toolkit.plugins._checkpoints import SIGNAL_EVERY

pytestmark = pytest.mark.slow  # subprocesses that import torch
TIMEOUT = 120

JOB = """
import sys, time, torch
from toolkit import TrainState, make_step, run
from toolkit.plugins import checkpoints

def announce(event):
    if event.kind == "step":
        print("step", event.state.step, flush=True)
        time.sleep(0.05)

def slow_end(event):  # after checkpoints (order 80) and progress (90)
    if event.kind == "end":
        print("ending", flush=True)
        time.sleep(1.0)
        print("ended", flush=True)

slow_end.order = 95
model = torch.nn.Linear(2, 1)
state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
step = make_step(lambda m, b: m(b).square().mean())
plugins = [checkpoints(sys.argv[1], at_end=False), announce, slow_end]
run(step, state, [torch.ones(2, 2)] * 10_000, max_steps=10_000, plugins=plugins)
"""


def _job(tmp_path: Path) -> subprocess.Popen:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])},
    )


def _killer(job: subprocess.Popen) -> threading.Timer:
    """Kills ``job`` after TIMEOUT s: a job hung without a word would block readline()."""
    timer = threading.Timer(TIMEOUT, job.kill)
    timer.start()
    return timer


def _until(job: subprocess.Popen, line: str) -> None:
    assert job.stdout is not None
    timer = _killer(job)
    try:
        found = any(got.strip() == line for got in iter(job.stdout.readline, ""))
    finally:
        timer.cancel()
    assert found, f"the job ended (or was killed after {TIMEOUT} s) before {line!r}"


def _finish(job: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = job.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        job.kill()
        job.communicate()
        raise
    return job.returncode, out


def test_a_second_sigterm_during_the_ends_does_not_cut_them_short(tmp_path: Path) -> None:
    # Bug caught: the handlers went back at the checkpoints plugin's end, so the second
    # SIGTERM killed the process (-15) inside the end of a later plugin.
    job = _job(tmp_path)
    _until(job, "step 3")
    job.send_signal(signal.SIGTERM)
    _until(job, "ending")
    time.sleep(0.2)
    job.send_signal(signal.SIGTERM)
    code, out = _finish(job)
    assert code == 143 and out.splitlines()[-1] == "ended", (code, out)
    assert len(list_checkpoints(tmp_path / "ckpt")) == 1


def test_the_exit_status_follows_the_signal_that_stopped_the_run(tmp_path: Path) -> None:
    # Bug caught: a SIGTERM after the stopping SIGUSR1 made the exit status 143, the
    # status of a signal that stopped nothing.
    job = _job(tmp_path)
    _until(job, "step 3")
    job.send_signal(signal.SIGUSR1)
    time.sleep(0.01)  # handled first: the next update stops the run
    job.send_signal(signal.SIGTERM)
    code, out = _finish(job)
    assert code == 128 + signal.SIGUSR1, (code, out)
    assert len(list_checkpoints(tmp_path / "ckpt")) == 1


def test_ctrl_c_saves_and_exits_130(tmp_path: Path) -> None:
    # Bug caught: SIGINT was not among the default signals: KeyboardInterrupt, no save.
    job = _job(tmp_path)
    _until(job, "step 3")
    job.send_signal(signal.SIGINT)
    code, out = _finish(job)
    assert code == 130, (code, out)
    steps = [3] + [int(line.split()[1]) for line in out.splitlines() if line.startswith("step")]
    assert [i.step for i in list_checkpoints(tmp_path / "ckpt")] == [steps[-1]]  # the last


DDP_IMPORTS = """
import atexit, os, sys, time, torch
from torch.nn.parallel import DistributedDataParallel
from toolkit import TrainState, make_step, run
from toolkit.distributed import process_group
from toolkit.plugins import checkpoints

@atexit.register
def count_gloo_threads():  # gloo's threads still running as Python shuts down can abort it
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm").read())
        except OSError:  # a thread that ended meanwhile
            pass
    gloo = sum("gloo" in name for name in names)
    os.write(1, f"gloo threads at exit {os.environ['RANK']}: {gloo}\\n".encode())
"""
DDP_MAIN = """
def main():  # the model a local: gloo's threads end with it, before Python shuts down
    with process_group(seed=0) as launch:
        model = DistributedDataParallel(torch.nn.Linear(2, 1))
        state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        step = make_step(lambda m, b: m(b).square().mean())
        plugins = [checkpoints(sys.argv[1], at_end=False), plugin]
        run(step, state, [torch.ones(2, 2)] * BATCHES, max_steps=BATCHES, plugins=plugins)

main()
"""
TORCHRUN_JOB = (
    DDP_IMPORTS
    + """
def plugin(event):
    if event.kind == "start":
        os.write(1, f"pid {os.environ['RANK']} {os.getpid()}\\n".encode())  # one write, whole
    if event.kind == "step":
        time.sleep(0.02)
"""
    + DDP_MAIN.replace("BATCHES", "100_000")
)


def _torchrun(script: Path, job_text: str, folder: Path, said: str) -> tuple[Any, dict]:
    """A 2-rank torchrun of ``job_text`` on ``folder``, and each rank's pid, read from the
    first line of it that starts with ``said`` (``said RANK PID``)."""
    script.write_text(textwrap.dedent(job_text))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", str(script), str(folder)]
    job = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    pids: dict[str, int] = {}
    assert job.stdout is not None
    timer = _killer(job)
    try:
        while len(pids) < 2 and (line := job.stdout.readline()):
            if line.startswith(said):
                pids[line.split()[1]] = int(line.split()[2])
    finally:
        timer.cancel()
    assert len(pids) == 2, (
        f"torchrun ended (or was killed after {TIMEOUT} s) before both ranks said {said!r}: "
        + job.communicate()[0]
    )
    return job, pids


def test_under_torchrun_every_rank_exits_128_plus_signal(tmp_path: Path) -> None:
    # Bug caught: the rank that exited last was killed (-15) by torchrun's SIGTERM while
    # Python shut down, its handlers put back, in about half of the launches.
    for launch in range(3):
        job, pids = _torchrun(tmp_path / "job.py", TORCHRUN_JOB, tmp_path / f"ckpt{launch}", "pid ")
        time.sleep(0.3)
        os.kill(pids["1"], signal.SIGTERM)  # one rank only: both stop after the same update
        _both_ranks_exited_143(*_finish(job))


def _both_ranks_exited_143(code: int, out: str) -> None:
    """torchrun failed because both ranks exited 143 (its "exitcode" lines), and both left
    no gloo thread running at Python's exit."""
    ranks = [line for line in out.splitlines() if line.strip().startswith("exitcode")]
    codes = [line.split(":")[1].split()[0] for line in ranks]
    assert code != 0 and codes == ["143", "143"], out[-3000:]
    _no_gloo_thread_at_exit(out)


def _no_gloo_thread_at_exit(out: str) -> None:
    """Both ranks reached Python's exit with no gloo thread left (a -6 came from gloo's
    threads still running while the interpreter shut down: docs/distributed.md)."""
    counts = [line for line in out.splitlines() if "gloo threads at exit" in line]
    assert sorted(counts) == [f"gloo threads at exit {rank}: 0" for rank in (0, 1)], out[-3000:]


TORCHRUN_EXCHANGE_JOB = (
    DDP_IMPORTS
    + """
import gc
gc.disable()  # the model's cycles (torch's state-dict walkers leave some) live on to exit

def plugin(event):  # before the checkpoints plugin's exchange after update 10
    if event.kind == "step" and event.state.step == 10:
        os.write(1, f"at10 {os.environ['RANK']} {os.getpid()}\\n".encode())
        if os.environ["RANK"] == "0":
            time.sleep(3.0)  # rank 1 waits for it inside the exchange meanwhile
"""
    + DDP_MAIN.replace("BATCHES", "40")
)


def test_a_signal_that_arrives_while_the_ranks_exchange_stops_the_run_at_the_next(tmp_path):
    # Bug caught: the handler's flag was overwritten by the exchange's result (0) when the
    # signal arrived while the rank waited in it: the signal was lost, the run trained on.
    # And: with the model in a cycle at exit (no collection since), gloo's threads ran on
    # while Python shut down, unless setup()'s collection at exit freed it.
    folder = tmp_path / "ckpt"
    job, pids = _torchrun(tmp_path / "job.py", TORCHRUN_EXCHANGE_JOB, folder, "at10 ")
    time.sleep(1.0)  # rank 1 is in the exchange, waiting for rank 0
    os.kill(pids["1"], signal.SIGTERM)
    _both_ranks_exited_143(*_finish(job))
    assert [i.step for i in list_checkpoints(folder)] == [2 * SIGNAL_EVERY]  # the next exchange


TORCHRUN_ENDED_JOB = (
    DDP_IMPORTS
    + """
def main():  # the model a local: gloo's threads end with it, before Python shuts down
    with process_group(seed=0) as launch:
        model = DistributedDataParallel(torch.nn.Linear(2, 1))
        state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        step = make_step(lambda m, b: m(b).square().mean())
        run(step, state, [torch.ones(2, 2)] * 4, max_steps=4, plugins=[checkpoints(sys.argv[1])])
        os.write(1, f"returned {os.environ['RANK']} {os.getpid()}\\n".encode())
        time.sleep(2.0)  # the work after run(), and the teardown: a SIGTERM arrives here
        os.write(1, f"exiting {os.environ['RANK']}\\n".encode())

main()
"""
)


def test_a_sigterm_after_a_data_parallel_run_returned_leaves_it_to_exit_0(tmp_path) -> None:
    # Bug caught: the handlers went back when run() returned, so a SIGTERM in the teardown
    # (torchrun's, to the ranks still exiting) killed the rank (-15) and torchrun exited 1
    # although the final checkpoint was written.
    folder = tmp_path / "ckpt"
    job, pids = _torchrun(tmp_path / "job.py", TORCHRUN_ENDED_JOB, folder, "returned ")
    os.kill(pids["1"], signal.SIGTERM)
    code, out = _finish(job)
    assert code == 0 and "exiting 1" in out, out[-3000:]
    assert [i.step for i in list_checkpoints(folder)] == [4]
    _no_gloo_thread_at_exit(out)
