"""The checkpoints plugin: periodic saves, retention, resume, signals, and the kill test.

The subprocess tests run tests/resumable_job.py, a job that resumes itself with
``checkpoints(..., resume="latest")``; each has a timeout.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from toolkit import TrainState, make_step, run
from toolkit.checkpoints import list_checkpoints, read_pointer
from toolkit.plugins import Retention, checkpoints, ema, validate

JOB = Path(__file__).resolve().parents[1] / "resumable_job.py"
TIMEOUT = 120


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.2), torch.nn.Linear(4, 1))
    return TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.05))


def _step():
    return make_step(lambda m, b: m(b).square().mean())


DATA = [torch.randn(5, 3, generator=torch.Generator().manual_seed(i)) for i in range(6)]


def _steps(folder: Path) -> list[int]:
    return [i.step for i in list_checkpoints(folder)]


def test_periodic_saves_keep_the_newest_and_point_to_it(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    plugin = checkpoints(folder, every=2, keep=Retention(keep_last=2))
    run(_step(), _state(), DATA, max_steps=9, plugins=[plugin])
    assert _steps(folder) == [8, 9]  # every 2, and at the end; the two newest kept
    assert read_pointer(folder) == folder / "step_000009"


def test_off_the_main_thread_it_says_that_signals_keep_their_handlers(tmp_path: Path) -> None:
    # Bug caught: a run in a worker thread silently left SIGTERM to kill the job unsaved.
    caught: list[warnings.WarningMessage] = []

    def train() -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            run(_step(), _state(), DATA, max_steps=2, plugins=[checkpoints(tmp_path / "c")])
        caught.extend(seen)

    worker = threading.Thread(target=train)
    worker.start()
    worker.join(TIMEOUT)
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert any("not on the main thread" in m and "SIGTERM" in m for m in messages), messages
    assert _steps(tmp_path / "c") == [2]  # it still saves


def test_retention_rules_are_a_union(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    plugin = checkpoints(
        folder, every=1, keep=Retention(keep_last=1, keep_every=4, keep_steps=(3,))
    )
    run(_step(), _state(), DATA, max_steps=9, plugins=[plugin])
    assert _steps(folder) == [3, 4, 8, 9]


def test_the_same_command_resumes_and_ends_where_an_uninterrupted_run_does(tmp_path: Path) -> None:
    reference = run(_step(), _state(), DATA, max_steps=10, plugins=[ema(0.8)])
    folder = tmp_path / "ckpt"
    run(_step(), _state(), DATA, max_steps=6, plugins=[ema(0.8), checkpoints(folder, every=3)])
    torch.manual_seed(99)  # another process: the RNG must come from the checkpoint
    resumed = run(_step(), _state(), DATA, max_steps=10, plugins=[ema(0.8), checkpoints(folder)])
    assert resumed.step == 10
    for p, q in zip(reference.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)
    for name, t in reference.extras["ema"]["params"].items():
        assert torch.equal(t, resumed.extras["ema"]["params"][name])


def test_resume_none_refuses_a_folder_with_checkpoints(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    run(_step(), _state(), DATA, max_steps=2, plugins=[checkpoints(folder)])
    message = "already holds checkpoints (step_000002) and resume=None; pass resume='latest'"
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run(_step(), _state(), DATA, max_steps=4, plugins=[checkpoints(folder, resume=None)])


def test_resume_from_a_given_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    plugin = checkpoints(folder, every=2, keep=Retention(keep_last=3))
    run(_step(), _state(), DATA, max_steps=6, plugins=[plugin])
    state = run(
        _step(),
        _state(),
        DATA,
        max_steps=5,
        plugins=[checkpoints(tmp_path / "other", resume=folder / "step_000004")],
    )
    assert state.step == 5


def _eval_fn(model: torch.nn.Module, batch: torch.Tensor) -> dict:
    return {"loss": model(batch).square().mean()}


def test_keep_best_keeps_the_best_by_a_validation_metric_and_restores_it(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    val = [DATA[0]]
    plugin = checkpoints(
        folder, every=1, keep=Retention(keep_best=1, metric="val/loss"), restore_best=True
    )
    state = run(
        _step(), _state(), DATA, max_steps=8, plugins=[validate(_eval_fn, val, every=1), plugin]
    )
    infos = {i.step: i for i in list_checkpoints(folder)}
    scores = {s: i.metrics["val/loss"] for s, i in infos.items()}
    best = min(scores, key=scores.__getitem__)
    assert set(infos) == {best, 8}
    # restore_best: the model holds the best checkpoint's weights, evaluated again here.
    with torch.no_grad():
        state.model.eval()
        again = _eval_fn(state.model, val[0])["loss"].item()
    assert again == pytest.approx(scores[best], rel=1e-6)


def test_restore_best_needs_keep_best() -> None:
    said = r"keep\.keep_best must be >= 1 with restore_best=True, which picks the best checkpoint"
    with pytest.raises(ValueError, match=said + r".*keep=Retention\(keep_best=1, metric="):
        checkpoints("x", restore_best=True)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"every": 0}, ValueError, "checkpoints: every must be an int >= 1"),
        ({"resume": 3}, TypeError, "checkpoints: resume must be 'latest', a checkpoint folder or"),
        ({"signals": "TERM"}, TypeError, "checkpoints: signals must be a sequence of signal"),
        ({"exit_code": "0"}, TypeError, "checkpoints: exit_code must be an int or None"),
        ({"on_error": "ignore"}, ValueError, "checkpoints: on_error must be one of"),
        (
            {"keep": 3},
            TypeError,
            "keep must be a toolkit.checkpoints.Retention, e.g. keep=Retention(keep_last=3); got 3",
        ),
        ({"background": 1}, TypeError, "checkpoints: background must be True or False"),
        ({"per_epoch": "yes"}, TypeError, "checkpoints: per_epoch must be True or False"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        checkpoints("x", **kwargs)


def test_a_failing_write_raises_and_leaves_earlier_checkpoints(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "ckpt"
    run(_step(), _state(), DATA, max_steps=2, plugins=[checkpoints(folder)])
    import toolkit.checkpoints._save as saving

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(saving, "write_tensors", disk_full)
    with pytest.raises(OSError, match="No space left"):
        run(_step(), _state(), DATA, max_steps=4, plugins=[checkpoints(folder, every=1)])
    assert _steps(folder) == [2] and [p.name for p in folder.glob(".*")] == [".lock"]


def test_on_error_warn_keeps_training(tmp_path, monkeypatch) -> None:
    import toolkit.checkpoints._save as saving

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(saving, "write_tensors", disk_full)
    with pytest.warns(RuntimeWarning, match="a save failed and training goes on"):
        state = run(
            _step(),
            _state(),
            DATA,
            max_steps=3,
            plugins=[checkpoints(tmp_path / "ckpt", every=1, on_error="warn", at_end=False)],
        )
    assert state.step == 3


def test_background_saves_write_the_same_checkpoints(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    run(
        _step(),
        _state(),
        DATA,
        max_steps=6,
        plugins=[checkpoints(folder, every=2, background=True)],
    )
    assert _steps(folder) == [6] and read_pointer(folder) == folder / "step_000006"
    state = run(_step(), _state(), DATA, max_steps=6, plugins=[checkpoints(folder)])
    assert state.step == 6


def test_an_open_window_at_the_end_is_not_saved_and_said(tmp_path: Path) -> None:
    from toolkit import accumulate

    step = accumulate(_step(), micro_batches=4)
    with pytest.warns(RuntimeWarning, match="ended with an open accumulation window"):
        run(step, _state(), DATA, epochs=1, plugins=[checkpoints(tmp_path / "ckpt", every=1)])
    assert _steps(tmp_path / "ckpt") == [1]


def test_per_epoch_saves_at_each_epoch_end_scored_by_per_epoch_validation(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    val = [DATA[0]]
    plugin = checkpoints(
        folder, per_epoch=True, at_end=False, keep=Retention(keep_best=3, metric="val/loss")
    )
    plugins = [validate(_eval_fn, val, per_epoch=True), plugin]
    run(_step(), _state(), DATA, epochs=3, plugins=plugins)
    infos = list_checkpoints(folder)
    assert [i.step for i in infos] == [6, 12, 18]  # 6 batches per epoch
    assert all("val/loss" in i.metrics for i in infos)  # validated before the save


def test_per_epoch_resumes_at_the_next_epoch_exactly(tmp_path: Path) -> None:
    reference = run(_step(), _state(), DATA, epochs=3)
    folder = tmp_path / "ckpt"
    run(
        _step(),
        _state(),
        DATA,
        epochs=2,
        plugins=[checkpoints(folder, per_epoch=True, at_end=False)],
    )
    assert _steps(folder) == [12]
    torch.manual_seed(99)
    resumed = run(_step(), _state(), DATA, epochs=3, plugins=[checkpoints(folder, at_end=False)])
    assert (resumed.step, resumed.epoch) == (18, 3)
    for p, q in zip(reference.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)


def test_per_epoch_inside_an_open_window_saves_at_the_update_that_closes_it(tmp_path) -> None:
    from toolkit import accumulate

    folder = tmp_path / "ckpt"
    step = accumulate(_step(), micro_batches=4)  # 6 batches per epoch: windows straddle
    plugin = checkpoints(folder, per_epoch=True, at_end=False, keep=Retention(keep_last=10))
    state = run(step, _state(), DATA, epochs=2, plugins=[plugin])
    assert state.step == 3
    # Epoch 1 ends after batch 6, inside update 2 (batches 5-8): saved at update 2. Epoch 2
    # ends after batch 12, which closes update 3: saved there.
    assert _steps(folder) == [2, 3]
    resumed = run(step, _state(), DATA, epochs=2, plugins=[checkpoints(folder, at_end=False)])
    assert resumed.step == 3


# --- subprocesses: signals and kills -----------------------------------------------------


def _job(folder: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    command = [sys.executable, str(JOB), "--ckpt", str(folder / "ckpt"), *extra]
    command += ["--out", str(folder / "result.json")]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def _read_until(job: subprocess.Popen, prefix: str, deadline: float) -> list[str]:
    lines = []
    assert job.stdout is not None
    while time.time() < deadline:
        line = job.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
        if line.startswith(prefix):
            return lines
    _kill(job)
    raise AssertionError(f"no line starting with {prefix!r}: {lines[-20:]}")


def _kill(job: subprocess.Popen) -> None:
    job.kill()
    job.wait(timeout=TIMEOUT)
    assert job.stdout is not None
    job.stdout.close()


def _finish(job: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = job.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        _kill(job)
        raise
    return job.returncode, out


def _uninterrupted(tmp_path: Path, *extra: str) -> dict:
    code, out = _finish(_job(tmp_path / "reference", *extra))
    assert code == 0, out
    return json.loads((tmp_path / "reference" / "result.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGUSR1, 138)])
def test_a_signal_saves_stops_and_exits_128_plus_signal(tmp_path, signum, code) -> None:
    job = _job(tmp_path)
    _read_until(job, "step 5", time.time() + TIMEOUT)
    job.send_signal(signum)
    returncode, out = _finish(job)
    assert returncode == code, out
    stopped = [int(line.split()[1]) for line in out.splitlines() if line.startswith("step")]
    saved = _steps(tmp_path / "ckpt")
    assert saved[-1] == (stopped[-1] if stopped else 5)  # the update in progress, then saved
    # The same command continues from there and ends as an uninterrupted run does.
    returncode, out = _finish(_job(tmp_path))
    resumed = f"checkpoints: resumed from {tmp_path / 'ckpt' / f'step_{saved[-1]:06d}'} at update"
    assert returncode == 0 and out.startswith(resumed), out  # rank 0 says so, on stderr
    assert out.splitlines()[1] == f"start {saved[-1]}", out
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == _uninterrupted(tmp_path)


@pytest.mark.slow
def test_a_signal_during_a_save_waits_for_it(tmp_path: Path) -> None:
    job = _job(tmp_path, "--slow-save", "1.0", "--exit-code", "0")
    before = _read_until(job, "saving", time.time() + TIMEOUT)  # inside the save of step 2
    job.send_signal(signal.SIGTERM)
    returncode, out = _finish(job)
    assert returncode == 0, out  # exit_code=0, as for a requeue
    assert _steps(tmp_path / "ckpt") == [2]  # that save finished, and no second one
    assert (*before, *out.splitlines()).count("saving") == 1


@pytest.mark.slow
def test_a_signal_before_the_first_update(tmp_path: Path) -> None:
    job = _job(tmp_path, "--slow-first", "1.5")
    _read_until(job, "start 0", time.time() + TIMEOUT)  # waiting for the first batch
    job.send_signal(signal.SIGTERM)
    returncode, out = _finish(job)
    assert returncode == 143, out
    assert _steps(tmp_path / "ckpt") == [1]  # the update in progress finished and was saved
    returncode, out = _finish(_job(tmp_path))
    assert returncode == 0 and out.splitlines()[1] == "start 1", out


@pytest.mark.slow
def test_killed_at_random_moments_and_resumed_it_ends_bitwise_as_uninterrupted(
    tmp_path: Path,
) -> None:
    """SIGKILL at several moments, some during a save."""
    reference = _uninterrupted(tmp_path, "--pad-mb", "16")
    rng = random.Random(4)
    folder = tmp_path / "killed"
    during_save = 0
    for kill in range(6):
        job = _job(folder, "--pad-mb", "16")
        _read_until(job, "start", time.time() + TIMEOUT)
        if kill % 2 == 0:  # wait for a save in progress: its temporary folder exists
            deadline = time.time() + 20
            while time.time() < deadline and not any(
                p.name.startswith(".tmp-") for p in (folder / "ckpt").glob(".*")
            ):
                time.sleep(0.002)
            during_save += any(p.name.startswith(".tmp-") for p in (folder / "ckpt").glob(".*"))
        else:
            time.sleep(rng.uniform(0.0, 0.4))
        _kill(job)
    returncode, out = _finish(_job(folder, "--pad-mb", "16"))
    assert returncode == 0, out
    assert during_save >= 2  # the kills really hit saves in progress
    result = json.loads((folder / "result.json").read_text())
    assert result["seen"] == reference["seen"]  # no batch repeated or skipped
    assert result == reference  # parameters, optimizer state and EMA bitwise


# --- two ranks: one process per rank, launched here so that each rank's exit
# code and pid are known; a FileStore file per launch -------------------------------------


def _ranks(folder: Path, launch: int, *extra: str) -> list[subprocess.Popen]:
    folder.mkdir(exist_ok=True)
    store = folder / f"store{launch}"
    return [
        _job(folder, "--world", "2", "--rank", str(rank), "--store", str(store), *extra)
        for rank in range(2)
    ]


def _finish_all(jobs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    try:
        return [_finish(job) for job in jobs]
    finally:
        for job in jobs:
            if job.poll() is None:
                _kill(job)


def _results(folder: Path) -> list[dict]:
    return [json.loads((folder / f"result.json.rank{r}").read_text()) for r in range(2)]


@pytest.mark.slow
def test_two_ddp_ranks_killed_at_random_moments_resume_bitwise(tmp_path: Path) -> None:
    """The kill test on 2 DDP ranks (both killed, as torchrun
    tears the group down); each rank's dropout RNG and data position come back."""
    extra = ("--wrap", "ddp", "--pad-mb", "8")
    reference = tmp_path / "reference"
    assert [code for code, _ in _finish_all(_ranks(reference, 0, *extra))] == [0, 0]
    folder = tmp_path / "killed"
    rng = random.Random(11)
    during_save = 0
    for kill in range(3):
        jobs = _ranks(folder, kill, *extra)
        for job in jobs:
            _read_until(job, "start", time.time() + TIMEOUT)
        if kill != 1:  # wait for a save in progress: its temporary folder exists
            deadline = time.time() + 20
            while time.time() < deadline and not any(
                p.name.startswith(".tmp-") for p in (folder / "ckpt").glob(".*")
            ):
                time.sleep(0.002)
            during_save += any(p.name.startswith(".tmp-") for p in (folder / "ckpt").glob(".*"))
        else:
            time.sleep(rng.uniform(0.0, 0.3))
        for job in jobs:
            _kill(job)
    outcomes = _finish_all(_ranks(folder, 9, *extra))
    assert [code for code, _ in outcomes] == [0, 0], outcomes
    assert during_save >= 1
    assert _results(folder) == _results(reference)  # both ranks, bitwise, same batches


@pytest.mark.slow
def test_sigterm_to_one_fsdp2_rank_stops_both_after_the_same_update_bf16(tmp_path: Path) -> None:
    """SIGTERM to rank 1 only; FSDP2 with a bf16 policy."""
    extra = ("--wrap", "fsdp2", "--bf16", "--every", "0")
    reference = tmp_path / "reference"
    assert [code for code, _ in _finish_all(_ranks(reference, 0, *extra))] == [0, 0]
    folder = tmp_path / "stopped"
    jobs = _ranks(folder, 1, *extra)
    _read_until(jobs[1], "step 3", time.time() + TIMEOUT)
    jobs[1].send_signal(signal.SIGTERM)
    outcomes = _finish_all(jobs)
    assert [code for code, _ in outcomes] == [143, 143], outcomes
    last = [
        [int(line.split()[1]) for line in out.splitlines() if line.startswith("step")][-1]
        for _, out in outcomes
    ]
    assert last[0] == last[1] and last[0] >= 3  # rank 0 ran on until the same update
    assert _steps(folder / "ckpt") == [last[0]]  # one checkpoint, at that update
    outcomes = _finish_all(_ranks(folder, 2, *extra))
    assert [code for code, _ in outcomes] == [0, 0], outcomes
    starts = [
        [line for line in out.splitlines() if line.startswith("start")] for _, out in outcomes
    ]
    assert starts == [[f"start {last[0]}"]] * 2, outcomes
    assert [out.count("checkpoints: resumed from") for _, out in outcomes] == [1, 0]  # rank 0
    assert _results(folder) == _results(reference)  # FSDP2 + bf16 resumes bitwise


def test_an_optimizer_parameter_outside_the_model_is_refused_before_training(tmp_path) -> None:
    state = _state()
    temperature = torch.nn.Parameter(torch.ones(()))
    state.optimizer.add_param_group({"params": [temperature]})
    trained = []
    with pytest.raises(ValueError, match=r"is not a parameter of the model.*register it"):
        run(_step(), state, DATA, max_steps=2, plugins=[checkpoints(tmp_path), trained.append])
    assert "step" not in [e.kind for e in trained]  # refused at "start", before any update
