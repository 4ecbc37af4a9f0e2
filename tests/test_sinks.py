"""Sinks: JSON lines (no extra package), TensorBoard and W&B (real writes, read back)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from toolkit.plugins._sinks import Sink, jsonl, tensorboard, wandb


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


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


def test_jsonl_appends_after_close_and_across_sinks(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    first = jsonl(str(path))
    first.write(1, {"x": 1.0})
    first.close()
    first.write(2, {"x": 2.0})  # reopens in append mode
    first.close()
    second = jsonl(path)  # a resumed run continues the same file
    second.write(3, {"x": 3.0})
    second.close()
    assert [r["step"] for r in _read_jsonl(path)] == [1, 2, 3]


def test_jsonl_mode_w_replaces_the_old_file_once(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 10, "old": 1}\n')
    sink = jsonl(path, mode="w")
    assert path.read_text() == '{"step": 10, "old": 1}\n'  # nothing happens before a write
    sink.write(1, {"a": 1.0})
    sink.close()
    sink.write(2, {"a": 2.0})  # reopened: appends to its own lines
    sink.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    with pytest.raises(ValueError, match="mode must be 'a' .append. or 'w' .replace.; got 'x'"):
        jsonl(path, mode="x")


def test_jsonl_non_finite_values_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    sink = jsonl(path)
    sink.write(1, {"train/loss": float("nan"), "train/grad_norm": float("inf")})
    sink.close()
    (row,) = _read_jsonl(path)
    assert math.isnan(row["train/loss"]) and row["train/grad_norm"] == math.inf


def test_jsonl_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"jsonl: path must be a path .*got int"):
        jsonl(3)  # type: ignore[arg-type]
    with pytest.raises(
        IsADirectoryError,
        match=r"jsonl: path must be a file, e.g. '.*metrics.jsonl'; got the directory",
    ):
        jsonl(tmp_path)


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_tensorboard_writes_scalars_read_back(tmp_path: Path) -> None:
    log_dir = tmp_path / "tb"
    sink = tensorboard(log_dir)
    assert not log_dir.exists()  # the event file appears at the first write only
    sink.write(1, {"train/loss": 0.5, "train/lr": 0.1})
    sink.write(2, {"train/loss": 0.25})
    # Flushed after each write: readable before close.
    assert _scalars(log_dir)["train/loss"] == [(1, 0.5), (2, 0.25)]
    sink.close()
    sink.close()
    sink.write(3, {"train/loss": 0.125})  # reopens (a new event file in the same dir)
    sink.close()
    scalars = _scalars(log_dir)
    assert scalars["train/loss"] == [(1, 0.5), (2, 0.25), (3, 0.125)]
    assert scalars["train/lr"] == [(1, pytest.approx(0.1))]


def test_tensorboard_bad_log_dir() -> None:
    with pytest.raises(TypeError, match=r"tensorboard: log_dir must be a path"):
        tensorboard(None)  # type: ignore[arg-type]


def test_tensorboard_missing_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install tensorboard") as info:
        tensorboard(tmp_path / "tb")
    assert 'pip install "toolkit[loggers]"' in str(info.value)
    assert not (tmp_path / "tb").exists()


def test_wandb_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install wandb") as info:
        wandb(project="p")
    assert 'pip install "toolkit[loggers]"' in str(info.value)


def test_wandb_inits_lazily_logs_with_step_and_finishes(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []

    class FakeRun:
        def log(self, metrics: dict, step: int) -> None:
            calls.append(("log", step, dict(metrics)))

        def finish(self) -> None:
            calls.append(("finish",))

    def init(**kwargs: object) -> FakeRun:
        calls.append(("init", kwargs))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    sink = wandb(project="p", id="abc", resume="allow")
    assert calls == []  # nothing at creation: ranks that never write start no run
    sink.write(5, {"train/loss": 0.5})
    sink.write(6, {"train/loss": 0.4})
    sink.close()
    sink.close()
    sink.write(7, {"train/loss": 0.3})  # after close: a new run with the same arguments
    assert calls == [
        ("init", {"project": "p", "id": "abc", "resume": "allow"}),
        ("log", 5, {"train/loss": 0.5}),
        ("log", 6, {"train/loss": 0.4}),
        ("finish",),
        ("init", {"project": "p", "id": "abc", "resume": "allow"}),
        ("log", 7, {"train/loss": 0.3}),
    ]


@pytest.mark.slow
def test_wandb_offline_run_writes_its_files(tmp_path: Path) -> None:
    # A real wandb run, offline; in a subprocess because wandb starts a service process and
    # hooks the interpreter (stdout, excepthook), which does not belong inside pytest.
    code = textwrap.dedent(
        """
        import warnings
        warnings.simplefilter("error")
        from toolkit.plugins._sinks import wandb
        sink = wandb(project="toolkit-test")
        sink.write(1, {"train/loss": 0.5})
        sink.write(2, {"train/loss": 0.25, "val/accuracy": 0.875})
        sink.close()
        """
    )
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CONSOLE": "off",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-2000:]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (log,) = runs[0].glob("*.wandb")
    data = log.read_bytes()
    # The run's record log holds the logged keys and values (protobuf strings).
    for needle in (b"train/loss", b"0.25", b"val/accuracy", b"0.875"):
        assert needle in data


def test_jsonl_writes_each_line_to_the_os_at_once(tmp_path: Path) -> None:
    # Nothing sits in a Python buffer: another reader sees the line before any close.
    path = tmp_path / "m.jsonl"
    sink = jsonl(path)
    sink.write(1, {"train/loss": 0.5, 'odd "name"\n': -0.0})
    assert path.read_text() == '{"step": 1, "train/loss": 0.5, "odd \\"name\\"\\n": -0.0}\n'
    sink.close()
