"""Sinks: JSON lines (no extra package), TensorBoard and W&B (real writes, read back); checks
at start; logs that follow a resume."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from toolkit import TrainState, make_step, run
from toolkit.plugins import checkpoints
from toolkit.plugins._metrics import log_metrics
from toolkit.plugins._sinks import RUN_FILE, Sink, _kept_lines, jsonl, png_dir, tensorboard, wandb


def EventAccumulator(*args: Any, **kwargs: Any) -> Any:  # TensorBoard's reader, imported here
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return EventAccumulator(*args, **kwargs)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _steps(path: Path) -> list[int]:
    return [row["step"] for row in _read_jsonl(path)]


# ------------------------------------------------------------------ the Sink protocol


def test_a_sink_of_two_functions_gets_a_start_and_images_that_do_nothing() -> None:
    seen: list[Any] = []
    sink = Sink(write=lambda step, m: seen.append((step, m)), close=lambda: seen.append("x"))
    assert sink.start(5) is None and sink.images(5, {"a": torch.zeros(2, 2)}) is None
    sink.write(5, {"a": 1.0})
    sink.close()
    assert seen == [(5, {"a": 1.0}), "x"]
    full = Sink(print, print, start=seen.append, images=lambda s, i: seen.append((s, i)))
    full.start(3)
    full.images(4, {})
    assert seen[-2:] == [3, (4, {})]


def test_start_refuses_a_step_that_is_not_a_count(tmp_path: Path) -> None:
    for bad in (-1, 1.0, "3", True):
        with pytest.raises(ValueError, match=r"Sink.start: step must be an int >= 0 .*got"):
            jsonl(tmp_path / "m.jsonl").start(bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ jsonl


def test_jsonl_writes_one_flushed_line_per_publish_and_creates_parents(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "metrics.jsonl"
    sink = jsonl(path)
    assert isinstance(sink, Sink)
    assert not path.parent.exists()  # lazy: a sink never written (rank > 0) creates nothing
    sink.write(10, {"train/loss": 0.5, "time/step": 0.01})
    # Flushed at once: another reader sees the line before close, so a crash loses nothing.
    assert _read_jsonl(path) == [{"step": 10, "train/loss": 0.5, "time/step": 0.01}]
    sink.write(20, {"train/loss": 0.25})
    assert _read_jsonl(path)[-1] == {"step": 20, "train/loss": 0.25}
    sink.close()
    sink.close()  # twice is harmless


def test_jsonl_start_creates_the_file_before_any_publish(tmp_path: Path) -> None:
    path = tmp_path / "run" / "m.jsonl"
    sink = jsonl(path)
    sink.start(0)
    assert path.exists() and path.read_text() == ""
    sink.close()


def test_jsonl_appends_after_close_and_continues_its_own_lines(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    first = jsonl(str(path))
    first.write(1, {"x": 1.0})
    first.close()
    first.write(2, {"x": 2.0})  # reopens in append mode
    first.close()
    first.start(0)  # a second fresh run with the same sink: its own lines are kept
    first.write(3, {"x": 3.0})
    first.close()
    assert _steps(path) == [1, 2, 3]


def test_jsonl_fresh_run_into_a_non_empty_file_refuses_by_default(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 10, "old": 1}\n{"step": 20, "old": 1}\n')
    sink = jsonl(path)
    message = (
        r"jsonl: '.*m.jsonl' already holds 2 lines of another run, and this run starts fresh "
        r"\(step 0\). Pass jsonl\(path, existing='replace'\) to start afresh, "
        r"existing='append' to add this run after them, or choose another path"
    )
    with pytest.raises(FileExistsError, match=message):
        sink.start(0)
    with pytest.raises(FileExistsError, match=message):
        sink.write(1, {"a": 1.0})  # used by hand, the first write is a fresh start
    assert _steps(path) == [10, 20]  # untouched


def test_jsonl_existing_append_and_replace(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 10, "old": 1}\n')
    appended = jsonl(path, existing="append")
    appended.start(0)
    appended.write(1, {"a": 1.0})
    appended.close()
    assert _steps(path) == [10, 1]
    replaced = jsonl(path, existing="replace")
    assert _steps(path) == [10, 1]  # nothing happens before the start
    replaced.start(0)
    replaced.write(2, {"a": 2.0})
    replaced.close()
    replaced.write(3, {"a": 3.0})  # reopened: appends to its own lines
    replaced.close()
    assert _steps(path) == [2, 3]
    with pytest.raises(ValueError, match=r"jsonl: existing must be one of \['refuse', 'replace'"):
        jsonl(path, existing="keep")


def test_jsonl_non_finite_values_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    sink = jsonl(path)
    sink.write(1, {"train/loss": float("nan"), "train/grad_norm": float("inf")})
    sink.close()
    (row,) = _read_jsonl(path)
    assert math.isnan(row["train/loss"]) and row["train/grad_norm"] == math.inf


def test_jsonl_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"jsonl: path must be a path .*got 3"):
        jsonl(3)  # type: ignore[arg-type]
    with pytest.raises(
        IsADirectoryError,
        match=r"jsonl: path must be a file, e.g. 'metrics.jsonl'; got '.*'",
    ):
        jsonl(tmp_path)


def test_jsonl_writes_each_line_to_the_os_at_once(tmp_path: Path) -> None:
    # Nothing sits in a Python buffer: another reader sees the line before any close.
    path = tmp_path / "m.jsonl"
    sink = jsonl(path)
    sink.write(1, {"train/loss": 0.5, 'odd "name"\n': -0.0})
    assert path.read_text() == '{"step": 1, "train/loss": 0.5, "odd \\"name\\"\\n": -0.0}\n'
    sink.close()


def test_jsonl_resumed_start_drops_the_lines_past_the_step(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(f'{{"step": {s}, "x": {s}}}\n' for s in (2, 4, 6, 7)))
    inode = path.stat().st_ino
    sink = jsonl(path)
    sink.start(4)
    assert _steps(path) == [2, 4]
    assert path.stat().st_ino != inode  # rewritten to a new file and renamed over
    assert [p.name for p in tmp_path.iterdir()] == ["m.jsonl"]  # no temporary file left
    sink.write(6, {"x": 60.0})
    sink.close()
    assert _steps(path) == [2, 4, 6]


def test_kept_lines_of_appended_runs_and_a_torn_last_line() -> None:
    def lines(*steps: int) -> bytes:
        return b"".join(b'{"step": %d}\n' % s for s in steps)

    # Two runs appended in one file: only the last one is cut at the resumed step.
    assert _kept_lines(lines(2, 4, 6, 2, 4, 6), 4) == lines(2, 4, 6, 2, 4)
    # Lines at one step (validation and train) stay together; a crash-cut line goes.
    assert _kept_lines(lines(2, 2, 4) + b'{"step": 6, "x', 4) == lines(2, 2, 4)
    # A line that is not a metrics object is kept where it is.
    assert _kept_lines(b"# note\n" + lines(2, 4), 2) == b"# note\n" + lines(2)
    data = lines(2, 4)
    assert _kept_lines(data, 4) == data


# ------------------------------------------------------------- two jsonl on one path


def test_two_jsonl_sinks_on_one_path_are_refused_at_start(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    (tmp_path / "sub").mkdir()
    first, second = jsonl(path), jsonl(tmp_path / "sub" / ".." / "m.jsonl")
    first.start(0)
    first.write(1, {"a": 1.0})
    first.write(2, {"a": 2.0})
    with pytest.raises(
        ValueError,
        match=r"jsonl: path must be written by one sink; got '.*m.jsonl'. Give each sink",
    ):
        second.start(1)
    assert _steps(path) == [1, 2]  # refused before touching the file (no cut at step 1)
    first.close()  # released: another sink may take the file now
    second.start(2)
    second.write(3, {"a": 3.0})
    second.close()
    assert _steps(path) == [1, 2, 3]


def test_two_jsonl_sinks_on_one_path_fail_a_run_before_its_first_publish(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.jsonl"
    model = torch.nn.Linear(2, 1)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = make_step(lambda m, b: m(b).mean())
    plugin = log_metrics(4, sinks=[jsonl(path), jsonl(path)])
    with pytest.raises(ValueError, match=r"jsonl: path must be written by one sink"):
        run(step, state, [torch.ones(1, 2)] * 8, max_steps=8, plugins=[plugin])
    assert path.read_text() == ""  # nothing published: refused at the start, not at step 4


# ----------------------------------------------------------------- checked at start


def _all_sinks(root: Path) -> dict[str, Sink]:
    return {
        "jsonl": jsonl(root / "m.jsonl"),
        "tensorboard": tensorboard(root / "tb"),
        "png_dir": png_dir(root / "png"),
        "wandb": wandb(dir=str(root / "wb"), mode="disabled"),
    }


@pytest.mark.parametrize("kind", ["jsonl", "tensorboard", "png_dir", "wandb"])
def test_a_parent_that_is_a_file_fails_at_start(tmp_path: Path, kind: str) -> None:
    (tmp_path / "file").write_text("not a folder")
    sink = _all_sinks(tmp_path / "file" / "run")[kind]  # made: nothing checked or created yet
    with pytest.raises(
        NotADirectoryError,
        match=rf"{kind}: cannot write in '.*file/run.*' \(Not a directory\); choose another",
    ):
        sink.start(0)


@pytest.mark.parametrize("kind", ["jsonl", "tensorboard", "png_dir", "wandb"])
def test_a_folder_that_cannot_be_written_fails_at_start(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    sink = _all_sinks(locked)[kind]
    match = rf"{kind}: cannot write in '.*locked.*' \(Permission denied\); choose another"
    try:
        if os.access(locked, os.W_OK):
            # Root writes anyway: the probe succeeds, which is right. Make the file system
            # refuse the probe instead, to see the error a user of a read-only folder gets.
            def refuse(*args: Any, **kwargs: Any) -> Any:
                raise PermissionError(13, "Permission denied")

            monkeypatch.setattr("toolkit.plugins._sinks.tempfile.TemporaryFile", refuse)
        with pytest.raises(PermissionError, match=match):
            sink.start(0)
    finally:
        locked.chmod(0o755)


# ------------------------------------------------------------------------ tensorboard


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def _next_second() -> None:
    """Wait for the next wall-clock second before a new event file goes into a used folder.

    TensorBoard reads a folder's event files in name order, and a name is the creation
    second, then a per-process counter compared as text ("...9" sorts after "...10"). A
    resumed process starts seconds later; a test reopening at once, after other tests made
    nine writers, would have the files read in the wrong order.
    """
    now = int(time.time())
    while int(time.time()) == now:
        time.sleep(0.01)


def test_tensorboard_writes_scalars_read_back(tmp_path: Path) -> None:
    log_dir = tmp_path / "tb"
    sink = tensorboard(log_dir)
    assert not log_dir.exists()  # the event file appears at the start or first write only
    sink.write(1, {"train/loss": 0.5, "train/lr": 0.1})
    sink.write(2, {"train/loss": 0.25})
    # Flushed after each write: readable before close.
    assert _scalars(log_dir)["train/loss"] == [(1, 0.5), (2, 0.25)]
    sink.close()
    sink.close()
    _next_second()
    sink.write(3, {"train/loss": 0.125})  # reopens (a new event file in the same dir)
    sink.close()
    scalars = _scalars(log_dir)
    assert scalars["train/loss"] == [(1, 0.5), (2, 0.25), (3, 0.125)]
    assert scalars["train/lr"] == [(1, pytest.approx(0.1))]


def test_tensorboard_resumed_start_purges_the_steps_past_it(tmp_path: Path) -> None:
    crashed = tensorboard(tmp_path)
    crashed.start(0)
    for step in (2, 4, 6, 7):
        crashed.write(step, {"loss": float(step)})
    crashed.close()
    _next_second()
    resumed = tensorboard(tmp_path)
    resumed.start(4)
    for step in (6, 8):
        resumed.write(step, {"loss": step + 0.5})
    resumed.close()
    assert _scalars(tmp_path)["loss"] == [(2, 2.0), (4, 4.0), (6, 6.5), (8, 8.5)]


def test_tensorboard_fresh_run_into_old_events_refuses_replaces_or_appends(
    tmp_path: Path,
) -> None:
    old = tensorboard(tmp_path)
    old.write(5, {"loss": 5.0})
    old.close()
    with pytest.raises(
        FileExistsError,
        match=r"tensorboard: '.*' already holds 1 event files of another run, and this run "
        r"starts fresh \(step 0\). Pass tensorboard\(log_dir, existing='replace'\)",
    ):
        tensorboard(tmp_path).start(0)
    _next_second()
    appended = tensorboard(tmp_path, existing="append")
    appended.start(0)
    appended.write(6, {"loss": 6.0})
    appended.close()
    assert _scalars(tmp_path)["loss"] == [(5, 5.0), (6, 6.0)]
    replaced = tensorboard(tmp_path, existing="replace")
    replaced.start(0)
    replaced.write(1, {"loss": 1.0})
    replaced.close()
    assert _scalars(tmp_path)["loss"] == [(1, 1.0)]
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    with pytest.raises(ValueError, match=r"tensorboard: existing must be one of \['refuse'"):
        tensorboard(tmp_path, existing=None)  # type: ignore[arg-type]


def test_tensorboard_bad_log_dir() -> None:
    with pytest.raises(TypeError, match=r"tensorboard: log_dir must be a path"):
        tensorboard(None)  # type: ignore[arg-type]


INSTALL = 'pip install -e ".[loggers]" from a checkout of toolkit'


def test_tensorboard_missing_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install tensorboard") as info:
        tensorboard(tmp_path / "tb")
    assert INSTALL in str(info.value) and '"toolkit[loggers]"' not in str(info.value)
    assert not (tmp_path / "tb").exists()


# ------------------------------------------------------------------------------ wandb


def test_wandb_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install wandb") as info:
        wandb(project="p")
    assert INSTALL in str(info.value) and '"toolkit[loggers]"' not in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"projct": "p"},
            TypeError,
            r"wandb: each argument must be one of wandb.init; got \['projct'\]",
        ),
        ({"mode": "offlin"}, ValueError, r"wandb: mode must be one of \['online', 'offline', "),
        ({"resume": "yes"}, ValueError, r"wandb: resume must be one of \['allow', 'never'"),
        ({"project": 3}, TypeError, r"wandb: project must be a str; got 3"),
        ({"name": ["a"]}, TypeError, r"wandb: name must be a str; got \['a'\]"),
        ({"tags": "baseline"}, TypeError, r"wandb: tags must be a list of str"),
        ({"dir": 5}, TypeError, r"wandb: dir must be a path"),
    ],
)
def test_wandb_bad_arguments_fail_when_the_sink_is_made(
    kwargs: dict, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        wandb(**kwargs)


class FakeWandb:
    """A stand-in ``wandb`` module that records init, log and finish."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.made = 0
        fake = self

        class Run:
            def __init__(self, run_id: str) -> None:
                self.id = run_id

            def log(self, data: dict, step: int) -> None:
                fake.calls.append(("log", self.id, step, dict(data)))

            def finish(self) -> None:
                fake.calls.append(("finish", self.id))

        class Image:
            def __init__(self, data: Any) -> None:
                self.data = data

        self.Run, self.Image = Run, Image

    def init(self, **kwargs: Any) -> Any:
        self.calls.append(("init", kwargs))
        if kwargs.get("id"):
            return self.Run(kwargs["id"])
        self.made += 1  # a new run, with a new id
        return self.Run(f"run{self.made}")

    def logged(self) -> list[tuple[str, int]]:
        return [(c[1], c[2]) for c in self.calls if c[0] == "log"]


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> FakeWandb:
    fake = FakeWandb()
    monkeypatch.setitem(
        sys.modules, "wandb", types.SimpleNamespace(init=fake.init, Image=fake.Image)
    )
    return fake


def test_wandb_starts_its_run_at_start_logs_with_step_and_finishes(
    fake_wandb: FakeWandb, tmp_path: Path
) -> None:
    sink = wandb(project="p", dir=str(tmp_path))
    assert fake_wandb.calls == []  # nothing at creation: ranks that never start make no run
    sink.start(0)
    sink.write(5, {"train/loss": 0.5})
    sink.write(6, {"train/loss": 0.4})
    sink.close()
    sink.close()
    sink.write(7, {"train/loss": 0.3})  # after close: the same run continues
    sink.close()
    assert fake_wandb.calls == [
        ("init", {"project": "p", "dir": str(tmp_path)}),
        ("log", "run1", 5, {"train/loss": 0.5}),
        ("log", "run1", 6, {"train/loss": 0.4}),
        ("finish", "run1"),
        ("init", {"project": "p", "dir": str(tmp_path), "id": "run1", "resume": "allow"}),
        ("log", "run1", 7, {"train/loss": 0.3}),
        ("finish", "run1"),
    ]
    stored = json.loads((tmp_path / "wandb" / RUN_FILE).read_text())
    assert stored == {"id": "run1", "step": 7}


def test_wandb_resume_continues_the_stored_run_without_resending_steps(
    fake_wandb: FakeWandb, tmp_path: Path
) -> None:
    crashed = wandb(project="p", dir=str(tmp_path))
    crashed.start(0)
    for step in (2, 4, 6, 7):
        crashed.write(step, {"loss": float(step)})
    # No close: the process died. A new process resumes from the checkpoint at step 4.
    resumed = wandb(project="p", dir=str(tmp_path))
    resumed.start(4)
    for step in (6, 8, 10):
        resumed.write(step, {"loss": float(step)})
    resumed.close()
    assert fake_wandb.calls[5] == (
        "init",
        {"project": "p", "dir": str(tmp_path), "id": "run1", "resume": "allow"},
    )
    # W&B steps only increase: 6 was logged before the crash and is not sent again.
    assert fake_wandb.logged() == [("run1", s) for s in (2, 4, 6, 7, 8, 10)]
    fresh = wandb(project="p", dir=str(tmp_path))
    fresh.start(0)  # a fresh run: a new W&B run, recorded as the one to resume
    fresh.write(2, {"loss": 2.0})
    fresh.close()
    assert fake_wandb.logged()[-1] == ("run2", 2)
    assert json.loads((tmp_path / "wandb" / RUN_FILE).read_text()) == {"id": "run2", "step": 2}


def test_wandb_a_damaged_run_file_is_named(fake_wandb: FakeWandb, tmp_path: Path) -> None:
    (tmp_path / "wandb").mkdir()
    for text in ('{"id": "r1"', '{"id": 3, "step": 4}', "[]"):
        (tmp_path / "wandb" / RUN_FILE).write_text(text)
        with pytest.raises(
            ValueError,
            match=r"wandb: cannot read the W&B run to resume from '.*toolkit-run.json' .*Delete",
        ):
            wandb(dir=str(tmp_path)).start(4)
    assert fake_wandb.calls == []


def test_wandb_an_explicit_id_is_used_as_given(fake_wandb: FakeWandb, tmp_path: Path) -> None:
    sink = wandb(dir=str(tmp_path), id="mine", resume="must")
    sink.start(3)
    assert fake_wandb.calls == [("init", {"dir": str(tmp_path), "id": "mine", "resume": "must"})]
    sink.close()


def test_one_sink_shared_by_two_plugins_is_started_once_and_released_at_the_second_close(
    fake_wandb: FakeWandb, tmp_path: Path
) -> None:
    sink = wandb(dir=str(tmp_path))
    sink.start(0)  # log_metrics
    sink.start(0)  # log_images: the run is already open at this step
    sink.write(2, {"loss": 1.0})
    sink.close()  # log_metrics's end: log_images may still record
    sink.images(2, {"samples": torch.zeros(1, 2, 2)})
    sink.close()
    assert [c[0] for c in fake_wandb.calls] == ["init", "log", "log", "finish"]


@pytest.mark.slow
def test_wandb_offline_run_writes_its_files_and_a_resume_reuses_its_id(tmp_path: Path) -> None:
    # A real wandb run, offline; in a subprocess because wandb starts a service process and
    # hooks the interpreter (stdout, excepthook), which does not belong inside pytest.
    code = textwrap.dedent(
        """
        import warnings
        warnings.simplefilter("error")
        import wandb as w
        from toolkit.plugins._sinks import wandb
        sink = wandb(project="toolkit-test")
        sink.start(0)
        sink.write(1, {"train/loss": 0.5})
        sink.write(2, {"train/loss": 0.25, "val/accuracy": 0.875})
        first = w.run.id
        sink.close()
        resumed = wandb(project="toolkit-test")
        resumed.start(1)  # a resume from a checkpoint at step 1
        print(first, w.run.id)
        resumed.write(2, {"train/loss": 0.5})  # logged before: not sent again
        resumed.write(3, {"train/loss": 0.125})
        resumed.close()
        """
    )
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CONSOLE": "off",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-2000:]
    first, again = result.stdout.split()[-2:]
    assert first == again
    assert json.loads((tmp_path / "wandb" / RUN_FILE).read_text()) == {"id": first, "step": 3}
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(f"-{first}" in r.name for r in runs)  # same id twice
    data = [next(r.glob("*.wandb")).read_bytes() for r in runs]
    # The runs' record logs hold each logged key followed by its value as JSON (protobuf
    # field 16, length-prefixed). Matching the key too: a bare b"0.5" also turns up in
    # `_runtime` when the machine is slow (CI failed on that once).
    assert _wandb_values(data[0], b"train/loss") == {b"0.5", b"0.25"}
    assert _wandb_values(data[0], b"val/accuracy") == {b"0.875"}
    assert _wandb_values(data[1], b"train/loss") == {b"0.125"}  # step 2 not sent again


def _wandb_values(data: bytes, key: bytes) -> set[bytes]:
    pattern = re.escape(key) + rb"\x82\x01([\x01-\x7f])"
    return {data[m.end() : m.end() + m.group(1)[0]] for m in re.finditer(pattern, data)}


# ------------------------------------------------------------------ logs follow the resume


def _train(
    folder: Path, sinks: list[Sink], max_steps: int, crash_after: int | None = None
) -> TrainState:
    """10 updates of a small regression, logged every 2, checkpointed every 4."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 3, generator=generator) for _ in range(10)]

    def crash(event: Any) -> None:
        if event.kind == "step" and event.state.step == crash_after:
            raise RuntimeError("the machine went away")

    crash.order = 100  # type: ignore[attr-defined]  # after toolkit's plugins
    plugins = [
        log_metrics(2, sinks=sinks),
        checkpoints(folder / "ckpt", every=4, at_end=False),
        crash,
    ]
    return run(
        make_step(lambda m, b: m(b).square().mean()),
        state,
        data,
        max_steps=max_steps,
        plugins=plugins,
    )


def test_a_resumed_run_continues_its_logs_with_each_step_once(
    tmp_path: Path, fake_wandb: FakeWandb
) -> None:
    reference = tmp_path / "reference.jsonl"
    _train(tmp_path / "ref", [jsonl(reference)], max_steps=10)

    out = tmp_path / "run"

    def sinks() -> list[Sink]:  # what each process builds anew
        return [jsonl(out / "m.jsonl"), tensorboard(out / "tb"), wandb(dir=str(out))]

    with pytest.raises(RuntimeError, match="the machine went away"):
        _train(out, sinks(), max_steps=10, crash_after=7)
    # The crashed run published 2, 4, 6 and its partial interval at 7; it saved step 4.
    assert _steps(out / "m.jsonl") == [2, 4, 6, 7]
    saved = sorted(p.name for p in (out / "ckpt").iterdir() if p.name != ".lock")  # one writer
    assert saved == ["latest", "step_000004"]

    _next_second()
    state = _train(out, sinks(), max_steps=10)  # resumes from step 4
    assert state.step == 10
    rows, expected = _read_jsonl(out / "m.jsonl"), _read_jsonl(reference)
    assert [r["step"] for r in rows] == [2, 4, 6, 8, 10]
    # Each line is the uninterrupted run's, to the bit (the resume is exact).
    assert [r["train/loss"] for r in rows] == [r["train/loss"] for r in expected]
    tb = _scalars(out / "tb")["train/loss"]
    assert [s for s, _ in tb] == [2, 4, 6, 8, 10]
    assert [v for _, v in tb] == pytest.approx([r["train/loss"] for r in expected], rel=1e-6)
    # W&B: one run; the resumed process continued it and sent only the steps after 7.
    inits = [c[1] for c in fake_wandb.calls if c[0] == "init"]
    assert inits == [{"dir": str(out)}, {"dir": str(out), "id": "run1", "resume": "allow"}]
    assert [s for _, s in fake_wandb.logged()] == [2, 4, 6, 7, 8, 10]


def test_a_run_failing_in_the_update_after_a_checkpoint_logs_each_step_once(tmp_path) -> None:
    # Bug caught (found by test_multinode.py's first version): the failed run logged
    # its open window at the checkpoint's step, a line the resumed run kept: [2, 2, 4, 6].
    from toolkit import accumulate

    data = [(torch.randn(4, 3, generator=torch.Generator().manual_seed(i)),) for i in range(12)]
    calls = [0]

    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor]) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == fail_at:  # micro-batch 2 of update 3, just after step_000002
            raise RuntimeError("lost a peer")
        return model(batch[0]).pow(2).mean()

    for fail_at in (6, None):
        calls[0] = 0
        model = torch.nn.Linear(3, 1)
        state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        plugins = [
            checkpoints(tmp_path / "ckpt", every=2, resume="latest"),
            log_metrics(every=2, sinks=[jsonl(tmp_path / "metrics.jsonl")]),
        ]
        try:
            run(accumulate(make_step(loss_fn), micro_batches=2), state, data, max_steps=6,
                plugins=plugins)  # fmt: skip
        except RuntimeError:
            assert fail_at == 6
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4, 6]
