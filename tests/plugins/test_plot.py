"""toolkit.plot: PNGs of a metrics.jsonl, read back; its errors; the shell tool."""

from __future__ import annotations

import doctest
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import toolkit.plot
from toolkit import TrainState, clip, make_step, run
from toolkit.plot import group_of, main, plot_metrics, read_series
from toolkit.plugins import jsonl, log_metrics, validate

image = pytest.importorskip("matplotlib.image", reason="toolkit.plot needs the plot extra")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _write(path: pathlib.Path, lines: list[object]) -> pathlib.Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _decoded(path: pathlib.Path) -> tuple[int, int]:
    """Height and width of a PNG read back by matplotlib, checked to show something."""
    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[2] in (3, 4), pixels.shape
    assert float(pixels[..., :3].std()) > 0.01  # not a blank canvas
    return pixels.shape[0], pixels.shape[1]


@pytest.mark.slow  # matplotlib draws several PNGs: seconds each
def test_every_group_of_a_full_file_is_written_and_decodes(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from matplotlib.figure import Figure

    drawn: dict[str, list[tuple[str, list[str]]]] = {}  # PNG name -> [(axis, [series])]
    save = Figure.savefig

    def record(figure: Figure, target: pathlib.Path, **kwargs: object) -> None:
        axes = [
            (ax.get_ylabel(), [line.get_label() for line in ax.get_lines()]) for ax in figure.axes
        ]
        drawn[pathlib.Path(target).stem] = axes
        save(figure, target, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    lines = [
        {
            "step": step,
            "train/loss": 2.0 / step,
            "train/accuracy": 0.1 * step,
            "train/lr": 0.1,
            "train/lr/0": 0.1,
            "train/lr/head": 0.01,
            "train/grad_norm": 1.0 + step,
            "train/samples_per_s": 1000.0 + step,
            "train/tokens_per_s": 9000.0,
            "train/mfu": 0.3,
            "time/data": 0.001,
            "time/step": 0.01,
            "train/total/tokens": 100 * step,
            "train/nonfinite": 0.0,
            "memory/peak_gib": 0.5,
            "memory/rss_peak_gib": 0.5,
            "note": "not a number",
        }
        for step in (10, 20, 30)
    ]
    lines.insert(2, {"step": 20, "val/loss": 1.0, "val/accuracy": 0.5, "val_ema/accuracy": 0.6})
    path = _write(tmp_path / "metrics.jsonl", lines)

    written = plot_metrics(path, tmp_path / "pngs")

    names = ["loss", "learning_rate", "grad_norm", "throughput", "metrics", "memory", "counters"]
    assert written == [tmp_path / "pngs" / f"{name}.png" for name in names]
    # The axes of each PNG and the series drawn on each: train and val on one axis.
    assert drawn == {
        "loss": [("loss", ["train/loss", "val/loss"])],
        "learning_rate": [("learning rate", ["train/lr", "train/lr/0", "train/lr/head"])],
        "grad_norm": [("gradient norm", ["train/grad_norm"])],
        "throughput": [
            ("samples/s", ["train/samples_per_s"]),
            ("tokens/s", ["train/tokens_per_s"]),
            ("MFU", ["train/mfu"]),
            ("seconds per update", ["time/data", "time/step"]),
        ],
        "metrics": [("accuracy", ["train/accuracy", "val/accuracy", "val_ema/accuracy"])],
        "memory": [
            ("CUDA peak allocated (GiB)", ["memory/peak_gib"]),
            ("process peak RSS, CPU (GiB)", ["memory/rss_peak_gib"]),
        ],
        "counters": [
            ("train/total/tokens", ["train/total/tokens"]),
            ("train/nonfinite", ["train/nonfinite"]),
        ],
    }
    for target in written:
        assert _decoded(target)[1] == 800


@pytest.mark.slow  # matplotlib draws several PNGs: seconds each
def test_a_loss_over_decades_is_on_a_log_scale_and_memory_starts_at_zero(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from matplotlib.figure import Figure

    drawn: dict[str, tuple[str, str, tuple[float, float], str]] = {}  # ylabel -> its look
    save = Figure.savefig

    def record(figure: Figure, target: pathlib.Path, **kwargs: object) -> None:
        figure.draw_without_rendering()  # lays the tick labels out, the offset text included
        for ax in figure.axes:
            look = ax.get_yscale(), ax.get_ylim(), ax.yaxis.get_offset_text().get_text()
            drawn[ax.get_ylabel()] = look
        save(figure, target, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    lines = [
        {
            "step": step,
            "train/loss": 5.0 / step,  # 5 down to 0.005: three decades
            "train/accuracy": 0.999 + step * 1e-8,  # flat: matplotlib would offset its ticks
            "train/grad_norm": 0.0 if step == 1 else 1.0 / step,  # a zero: no log scale
            "memory/rss_peak_gib": 0.4687 + step * 7e-7,  # a high-water mark, nearly flat
        }
        for step in range(1, 1001, 9)
    ]
    plot_metrics(_write(tmp_path / "metrics.jsonl", lines))
    assert drawn["loss"][0] == "log"
    assert drawn["accuracy"][0] == drawn["gradient norm"][0] == "linear"
    assert drawn["accuracy"][2] == ""  # ticks read as values, not as offsets from 0.999
    scale, (bottom, top), offset = drawn["process peak RSS, CPU (GiB)"]
    assert (scale, bottom, offset) == ("linear", 0.0, "") and 0.47 < top < 0.6
    plot_metrics(_write(tmp_path / "metrics.jsonl", [{"step": 1, "memory/peak_gib": 2.0}]))
    assert drawn["CUDA peak allocated (GiB)"][1][0] == 0.0


def test_default_folder_is_plots_beside_the_file(tmp_path: pathlib.Path) -> None:
    path = _write(tmp_path / "metrics.jsonl", [{"step": 1, "train/loss": 1.0}])
    assert plot_metrics(path) == [tmp_path / "plots" / "loss.png"]
    _decoded(tmp_path / "plots" / "loss.png")


@pytest.mark.slow  # matplotlib draws several PNGs: seconds each
def test_a_real_run_s_metrics_are_drawn_in_their_groups(tmp_path: pathlib.Path) -> None:
    """The key names are those log_metrics and validate really write."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(10)]

    def loss_fn(m, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(m(x), y)

    def eval_fn(m, batch):
        return {"loss": loss_fn(m, batch)}

    path = tmp_path / "run" / "metrics.jsonl"
    state = TrainState(model=model, optimizer=opt, scheduler=sched)
    run(
        clip(max_norm=10.0)(make_step(loss_fn)),
        state,
        data,
        epochs=2,
        plugins=[
            validate(eval_fn, data[:2], every=5),
            log_metrics(every=5, sinks=[jsonl(path)]),
        ],
    )
    series, notes = read_series(path)
    assert notes == []
    assert series["train/lr"][1][:2] == [0.05, 0.025]  # StepLR halves after 5 updates
    assert "val/loss" in series and "train/loss" in series
    written = [p.name for p in plot_metrics(path)]
    assert written[:4] == ["loss.png", "learning_rate.png", "grad_norm.png", "throughput.png"]
    for name in written:
        _decoded(tmp_path / "run" / "plots" / name)


def test_group_of_names_each_kind_of_key() -> None:
    assert group_of("train/epoch_loss") == ("loss", "loss")
    assert group_of("val_ema/loss") == ("loss", "loss")
    assert group_of("train/lr/1") == ("learning_rate", "learning rate")
    assert group_of("train/grad_norm") == ("grad_norm", "gradient norm")
    assert group_of("train/tokens_per_s") == ("throughput", "tokens/s")
    assert group_of("time/step") == ("throughput", "seconds per update")
    assert group_of("train/total/tokens") == ("counters", "train/total/tokens")
    assert group_of("train/overflow") == ("counters", "train/overflow")
    assert group_of("memory/peak_gib") == ("memory", "CUDA peak allocated (GiB)")
    assert group_of("memory/rss_peak_gib") == ("memory", "process peak RSS, CPU (GiB)")
    assert group_of("memory/other") == ("memory", "memory/other")
    assert group_of("train/f1/macro") == ("metrics", "f1/macro")
    assert group_of("custom") == ("metrics", "custom")


def test_a_rerun_replaces_the_old_run_and_a_resume_what_followed_its_checkpoint(
    tmp_path: pathlib.Path,
) -> None:
    # Run 1 published 10..30 and was killed; its resume from the checkpoint at 20 published
    # 30 and 40 again. Then a fresh run was appended to the same file.
    killed = [{"step": s, "train/loss": float(s)} for s in (10, 20, 30)]
    resumed = [{"step": s, "train/loss": s + 0.5} for s in (30, 40)]
    path = _write(tmp_path / "metrics.jsonl", killed + resumed)
    series, notes = read_series(path)
    assert series == {"train/loss": ([10, 20, 30, 40], [10.0, 20.0, 30.5, 40.5])}
    assert notes == []  # same step again: that key's later value wins, no line is dropped
    resumed = [{"step": s, "train/loss": s + 0.5} for s in (20, 30)]
    series, notes = read_series(_write(tmp_path / "metrics.jsonl", killed + resumed))
    assert series == {"train/loss": ([10, 20, 30], [10.0, 20.5, 30.5])}
    assert notes == [
        "line 4: step 20 after step 30 (a rerun or a resume): 2 earlier line(s) dropped"
    ]
    rerun = [{"step": s, "train/loss": -float(s)} for s in (10, 20)]
    path = _write(tmp_path / "metrics.jsonl", killed + rerun)
    series, notes = read_series(path)
    assert series == {"train/loss": ([10, 20], [-10.0, -20.0])}
    assert notes == [
        "line 4: step 10 after step 30 (a rerun or a resume): 3 earlier line(s) dropped"
    ]


def test_non_finite_values_are_gaps_and_non_numbers_are_left_out(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "train/loss": NaN, "flag": true, "tags": [1], "none": null}\n'
        '{"step": 2, "train/loss": Infinity}\n'
        "\n"
        '{"step": 3, "train/loss": 1}\n'
    )
    series, _ = read_series(path)
    assert list(series) == ["train/loss"]
    steps, values = series["train/loss"]
    assert steps == [1, 2, 3]
    assert math.isnan(values[0]) and math.isnan(values[1]) and values[2] == 1.0


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("", r"must be a file of published lines; got 'an empty file'"),
        ("\n  \n", r"must be a file of published lines; got 'an empty file'"),
        (
            '{"step": 1, "note": "x"}\n',
            r"must be a file of numbers besides the steps; got \['note'\]",
        ),
        ('{"step": 1}\n{"step": 2', r"line 2 must be a JSON object .*; got '\{\"step\": 2'"),
        ("[1, 2]\n", r"line 1 must be a JSON object such as .*; got \[1, 2\]"),
        ('{"train/loss": 1.0}\n', r'line 1 must be an object with an integer "step"; got None'),
        ('{"step": "3", "train/loss": 1.0}\n', r"integer \"step\"; got '3'"),
    ],
)
def test_bad_files_are_refused_with_the_line_and_the_fix(
    tmp_path: pathlib.Path, content: str, match: str
) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        plot_metrics(path)
    assert not (tmp_path / "plots").exists()


def test_a_folder_or_a_missing_file_is_named(tmp_path: pathlib.Path) -> None:
    with pytest.raises(IsADirectoryError, match=r"Did you mean '.*metrics\.jsonl'"):
        plot_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"No such file .*'.*nope\.jsonl'"):
        plot_metrics(tmp_path / "nope.jsonl")


def test_missing_matplotlib_names_the_extra(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path / "metrics.jsonl", [{"step": 1, "train/loss": 1.0}])
    # None in sys.modules makes the import raise ImportError, as if it were not installed.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r'needs matplotlib.*pip install -e "\.\[plot\]"'):
        plot_metrics(path)
    assert main([str(path)]) == 1


def test_main_prints_notes_and_paths_or_the_error(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [{"step": s, "train/loss": 1.0} for s in (1, 2, 1)]
    path = _write(tmp_path / "metrics.jsonl", lines)
    assert main([str(path), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "note: line 3: step 1 after step 2 (a rerun or a resume): 2 earlier line(s) dropped",
        str(tmp_path / "out" / "loss.png"),
    ]
    path.write_text("")
    assert main([str(path)]) == 1
    assert "an empty file" in capsys.readouterr().err


@pytest.mark.slow  # starts Python processes: seconds each
def test_python_dash_m_toolkit_plot(tmp_path: pathlib.Path) -> None:
    path = _write(tmp_path / "metrics.jsonl", [{"step": 1, "train/loss": 1.0}])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "toolkit.plot", str(path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(tmp_path / "plots" / "loss.png")]
    _decoded(tmp_path / "plots" / "loss.png")
    path.write_text("")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "an empty file" in done.stderr, done


def test_docstring_examples_run(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.chdir(tmp_path)
    failed, attempted = doctest.testmod(toolkit.plot, optionflags=doctest.ELLIPSIS)
    assert attempted >= 5 and failed == 0
