"""one run per folder, resumes that say what they did, a changed
configuration reported (never a skipped sample), the epoch checkpoint of a loader with its own
generator, retention rules that save."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from toolkit import TrainState, make_step, run
from toolkit.checkpoints import list_checkpoints
from toolkit.checkpoints._manifest import read_manifest
from toolkit.plugins import Retention, checkpoints, validate


class Numbered(Dataset):
    """Sample i is the row [i, 1]: the loss function reads which samples a batch holds."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), 1.0])


def _loader(batch_size: int = 2) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    return DataLoader(Numbered(), batch_size=batch_size, shuffle=True, generator=generator)


def _state(lr: float = 0.1, scheduler: bool = False) -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    steps = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2) if scheduler else None
    return TrainState(model=model, optimizer=optimizer, scheduler=steps)


def _recording(seen: list[int]):
    def loss_fn(model, batch):
        seen.extend(int(i) for i in batch[:, 0])
        return model(batch).square().mean()

    return make_step(loss_fn)


def _crash_at(step: int):
    def plugin(event):
        if event.kind == "step" and event.state.step == step:
            raise KeyboardInterrupt("crash")  # not saved at the end: training raised

    return plugin


def test_an_epoch_checkpoint_resumes_the_loaders_own_generator_exactly(tmp_path: Path) -> None:
    # Bug caught: resumed at an epoch boundary, the fresh loader's generator replayed the
    # order of the first epoch instead of drawing the next one.
    uninterrupted: list[int] = []
    run(_recording(uninterrupted), _state(), _loader(), epochs=3)
    first: list[int] = []
    plugins = [_crash_at(8), checkpoints(tmp_path, per_epoch=True, at_end=False)]
    with pytest.raises(KeyboardInterrupt):
        run(_recording(first), _state(), _loader(), epochs=3, plugins=plugins)
    assert [i.step for i in list_checkpoints(tmp_path)] == [6]  # 6 batches per epoch
    resumed: list[int] = []
    run(_recording(resumed), _state(), _loader(), epochs=3, plugins=[checkpoints(tmp_path)])
    assert resumed == uninterrupted[12:]  # epochs 2 and 3, in their own orders


def test_resume_says_where_it_resumed_and_when_the_run_had_ended(tmp_path, capsys) -> None:
    run(_recording([]), _state(), _loader(), max_steps=4, plugins=[checkpoints(tmp_path)])
    assert capsys.readouterr().err == ""  # a fresh start says nothing
    run(_recording([]), _state(), _loader(), max_steps=9, plugins=[checkpoints(tmp_path)])
    line = f"checkpoints: resumed from {tmp_path / 'step_000004'} at update 4, epoch 0, batch 4\n"
    assert capsys.readouterr().err == line
    run(_recording([]), _state(), _loader(), max_steps=9, plugins=[checkpoints(tmp_path)])
    err = capsys.readouterr().err
    assert err.startswith(f"checkpoints: resumed from {tmp_path / 'step_000009'} at update 9")
    assert "the run had already reached its end" in err and err.count("\n") == 1


def test_a_changed_learning_rate_is_reported_and_the_saved_schedule_used(tmp_path) -> None:
    # Bug caught: the saved lr and schedule silently replaced the ones just constructed.
    plugin = checkpoints(tmp_path, at_end=True)
    run(_recording([]), _state(0.1, True), _loader(), max_steps=3, plugins=[plugin])
    assert read_manifest(tmp_path / "step_000003").settings["optimizer"][0]["lr"] == 0.1
    with pytest.warns(RuntimeWarning, match=r"optimizer\.0\.lr 0\.1 -> 0\.5") as caught:
        state = run(_recording([]), _state(0.5, True), _loader(), max_steps=4, plugins=[plugin])
    assert len(caught) == 1 and "scheduler.step_size" not in str(caught[0].message)
    assert "base_lrs" not in str(caught[0].message)  # the lr is said once, as the optimizer's
    assert "_last_lr" not in str(caught[0].message)
    assert "optimizer and scheduler values are used" in str(caught[0].message)
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.1**2)  # StepLR(2)
    refused = r"optimizer\.0\.lr 0\.1 -> 0\.5, and on_change='error' refuses a change"
    with pytest.raises(ValueError, match=refused) as error:
        state = _state(0.5, True)
        run(
            _recording([]),
            state,
            _loader(),
            max_steps=5,
            plugins=[checkpoints(tmp_path, on_change="error")],
        )
    assert "are used" not in str(error.value)  # what is refused and the fix, not the warning
    assert "Resume with the saved settings, or start afresh in another folder" in str(error.value)


def test_an_unchanged_configuration_resumes_without_a_warning(tmp_path: Path) -> None:
    run(_recording([]), _state(0.1, True), _loader(), max_steps=3, plugins=[checkpoints(tmp_path)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = run(
            _recording([]),
            _state(0.1, True),
            _loader(),
            max_steps=5,
            plugins=[checkpoints(tmp_path)],
        )
    assert state.step == 5


def test_a_changed_batch_size_resumes_at_the_first_unseen_sample(tmp_path: Path) -> None:
    # Bug caught: 4 batches of 2 seen, then batch size 4: 4 batches of 4 were skipped
    # (16 samples: 8 of them never seen).
    order: list[int] = []
    run(_recording(order), _state(), _loader(2), epochs=1)
    seen: list[int] = []
    run(_recording(seen), _state(), _loader(2), max_steps=4, plugins=[checkpoints(tmp_path)])
    after: list[int] = []
    with pytest.warns(RuntimeWarning, match=r"data\.batch_size 2 -> 4.*after 2 batches") as said:
        run(_recording(after), _state(), _loader(4), epochs=1, plugins=[checkpoints(tmp_path)])
    assert seen + after == order  # every sample of the pass once, in the pass's order
    assert [w.filename for w in said] == [__file__]  # the run() line (was the plugin's own)


def test_a_batch_size_that_splits_a_seen_batch_goes_on_with_its_unseen_samples(tmp_path) -> None:
    # Bug caught: 3 batches of 2 seen, then batch size 4: the position was rounded down to 1
    # batch of 4, and samples 4 and 5 were trained again.
    run(_recording([]), _state(), _loader(2), max_steps=3, plugins=[checkpoints(tmp_path)])
    order: list[int] = []
    run(_recording(order), _state(), _loader(2), epochs=1)
    after: list[int] = []
    with pytest.warns(RuntimeWarning, match=r"after 1 batch and 2 samples\)"):
        run(_recording(after), _state(), _loader(4), epochs=1, plugins=[checkpoints(tmp_path)])
    assert after == order[6:]  # from the first unseen sample: a short batch of 2, then 4s


def test_a_changed_dataset_mid_pass_is_refused(tmp_path: Path) -> None:
    data = [torch.ones(2, 2)] * 6
    run(_recording([]), _state(), data, max_steps=2, plugins=[checkpoints(tmp_path)])
    with pytest.raises(ValueError, match=r"stopped 2 batches into a pass.*samples 12 -> 16"):
        run(_recording([]), _state(), data + data[:2], max_steps=4, plugins=[checkpoints(tmp_path)])


def test_keep_every_and_keep_steps_save_at_their_steps(tmp_path: Path) -> None:
    # Bug caught: they only decided which saves to keep; without every=, none was made.
    plugin = checkpoints(
        tmp_path, keep=Retention(keep_every=4, keep_steps=(3,), keep_last=0), at_end=False
    )
    run(_recording([]), _state(), _loader(), max_steps=10, plugins=[plugin])
    assert [i.step for i in list_checkpoints(tmp_path)] == [3, 4, 8]


def _val(model, batch):
    return {"loss": model(batch).square().mean()}


def test_a_keep_best_metric_its_validation_does_not_publish_is_refused_at_once(tmp_path) -> None:
    # Bug caught: a typo kept no best checkpoint, silently.
    plugins = [
        validate(_val, [torch.ones(2, 2)], every=2),
        checkpoints(tmp_path, every=2, keep=Retention(keep_best=1, metric="val/los")),
    ]
    with pytest.raises(ValueError, match=r"keep_best ranks by 'val/los'.*\['val/loss'\]"):
        run(_recording([]), _state(), _loader(), max_steps=4, plugins=plugins)


def test_a_keep_best_metric_of_no_plugin_is_said_at_the_end(tmp_path: Path) -> None:
    # A user's plugin claims no prefix: a save cannot tell a typo from a metric still to come.
    plugins = [
        validate(_val, [torch.ones(2, 2)], every=2),
        checkpoints(
            tmp_path, every=2, keep=Retention(keep_best=1, metric="vall/loss"), restore_best=True
        ),
    ]
    said = r"no checkpoint in .* holds keep_best's 'vall/loss'.*keeps its final weights"
    with pytest.warns(RuntimeWarning, match=said):
        run(_recording([]), _state(), _loader(), max_steps=4, plugins=plugins)


def test_a_keep_best_metric_not_yet_published_is_waited_for(tmp_path: Path) -> None:
    plugins = [
        validate(_val, [torch.ones(2, 2)], every=4),
        checkpoints(tmp_path, every=2, keep=Retention(keep_best=1, metric="val/loss")),
    ]
    run(_recording([]), _state(), _loader(), max_steps=6, plugins=plugins)
    assert [i.step for i in list_checkpoints(tmp_path)] == [4, 6]  # the best, the newest


# --- one run per folder: two real processes ----------------------------------------------

JOB = """
import sys, time, torch
from toolkit import TrainState, make_step, run
from toolkit.plugins import checkpoints

def hold(event):
    if event.kind == "start":
        print("started", flush=True)
        time.sleep(float(sys.argv[2]))

model = torch.nn.Linear(2, 1)
state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
step = make_step(lambda m, b: m(b).square().mean())
run(step, state, [torch.ones(2, 2)] * 4, max_steps=4, plugins=[checkpoints(sys.argv[1]), hold])
print("done", flush=True)
"""


def _start(script: Path, folder: Path, hold: float) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.Popen(
        [sys.executable, str(script), str(folder), str(hold)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


@pytest.mark.slow
def test_a_second_run_in_one_folder_is_refused_until_the_first_dies(tmp_path: Path) -> None:
    # Bug caught: the second run trained into the first's folder, pruning its saves.
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    folder = tmp_path / "ckpt"
    first = _start(script, folder, 60)
    try:
        assert first.stdout is not None and first.stdout.readline() == "started\n"
        out, _ = _start(script, folder, 0).communicate(timeout=120)
        assert f"{str(folder)!r} is in use by the run of pid {first.pid} on " in out, out
        assert "done" not in out
        first.kill()  # SIGKILL: no handler runs; the kernel frees the lock
        first.wait(timeout=120)
        deadline = time.time() + 120
        out, _ = _start(script, folder, 0).communicate(timeout=deadline - time.time())
        assert out.endswith("done\n"), out
        assert f"the run of pid {first.pid} on " in out and "ended without letting" in out, out
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=120)
        if first.stdout is not None:
            first.stdout.close()


def test_a_lock_its_holder_never_let_go_is_taken_over_with_a_line_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Bug caught: a lock left by a killed run was taken over without a word. A line, as the
    # resume line is, not a warning: under -W error a warning would fail every relaunch.
    run(_recording([]), _state(), _loader(), max_steps=2, plugins=[checkpoints(tmp_path)])
    assert (tmp_path / ".lock").read_text() == ""  # let go: no holder named
    (tmp_path / ".lock").write_text("the run of pid 4242 on node17".ljust(200))  # then killed
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(_recording([]), _state(), _loader(), max_steps=3, plugins=[checkpoints(tmp_path)])
        said = r"the run of pid 4242 on node17 ended without letting .* go \(killed\?\); taken over"
        assert re.search(said, capsys.readouterr().err)
        run(_recording([]), _state(), _loader(), max_steps=4, plugins=[checkpoints(tmp_path)])
    assert "taken over" not in capsys.readouterr().err  # the run before let go


def test_keep_full_reaches_retention_and_older_kept_checkpoints_hold_the_model(tmp_path) -> None:
    plugin = checkpoints(tmp_path, every=1, keep=Retention(keep_last=3, keep_full=1))
    run(_recording([]), _state(), _loader(), max_steps=4, plugins=[plugin])
    infos = list_checkpoints(tmp_path)
    assert [(i.step, i.model_only) for i in infos] == [(2, True), (3, True), (4, False)]
    assert infos[-1].rules is not None and infos[-1].rules.keep_full == 1


def _read_only(monkeypatch: pytest.MonkeyPatch, folder: Path) -> dict[str, tuple[int, int]]:
    """Make ``folder`` act as read-only storage; return its listing, to compare after.

    Tests run as root, whom chmod does not stop, and a read-only bind mount needs privileges
    a test runner may lack; so the narrowest point is patched: ``os.open`` of
    ``folder/.lock``, the run's first write there and where EROFS came from. A write that
    slipped past it (a save, a pointer, a cleanup) shows as a changed listing."""
    real = os.open

    def refuse(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if Path(path) == folder / ".lock":
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    return _listing(folder)


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def test_a_finished_run_on_read_only_storage_resumes_and_returns(tmp_path, monkeypatch, capsys):
    # Before: OSError: [Errno 30] Read-only file system: '.../.lock' at start.
    run(_recording([]), _state(), _loader(), max_steps=4, plugins=[checkpoints(tmp_path)])
    capsys.readouterr()
    before = _read_only(monkeypatch, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = run(
            _recording([]), _state(), _loader(), max_steps=4, plugins=[checkpoints(tmp_path)]
        )
    assert state.step == 4 and _listing(tmp_path) == before
    assert "resumed from" in (err := capsys.readouterr().err) and "reached its end" in err


def test_a_run_that_must_save_on_read_only_storage_fails_at_start_or_warns(
    tmp_path, monkeypatch
) -> None:
    # Before: OSError: [Errno 30] Read-only file system: '.../.lock', with either on_error.
    run(_recording([]), _state(), _loader(), max_steps=4, plugins=[checkpoints(tmp_path)])
    before = _read_only(monkeypatch, tmp_path)
    seen: list[int] = []
    with pytest.raises(PermissionError, match="read-only: copy it to writable storage"):
        run(_recording(seen), _state(), _loader(), max_steps=6, plugins=[checkpoints(tmp_path)])
    assert seen == [] and _listing(tmp_path) == before  # refused before any update
    plugin = checkpoints(tmp_path, on_error="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = run(_recording(seen), _state(), _loader(), max_steps=6, plugins=[plugin])
    assert [str(w.message) for w in caught if "nothing will be saved" in str(w.message)]
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert state.step == 6 and len(seen) == 4 and _listing(tmp_path) == before
