"""Pictures of a run: PNG plots of a metrics.jsonl written by ``log_metrics``.

    python -m toolkit.plot runs/a/metrics.jsonl              # PNGs into runs/a/plots/
    python -m toolkit.plot runs/a/metrics.jsonl --out DIR    # PNGs into DIR

One PNG per group of metrics, for whatever keys the file has, each with the update number
(``step``) on the x axis: ``loss.png`` (every key ending in ``loss``: ``train/loss``,
``train/epoch_loss``, ``val/loss``, ``val_ema/loss``... on one axis),
``learning_rate.png`` (``train/lr`` and ``train/lr/<group>``), ``grad_norm.png``,
``throughput.png`` (samples/s, tokens/s, MFU, seconds per update), ``metrics.png`` (one
axis per other metric name, every prefix on it: ``train/accuracy`` beside
``val/accuracy``), ``memory.png`` and ``counters.png`` (run totals, non-finite and
overflow counts, epochs). Groups with no key in the file are not drawn.

Needs matplotlib: the ``plot`` extra, ``pip install -e ".[plot]"``. Exit status: 0 when
the plots were written, 1 on an error (a message says which file and what to do).
"""

import argparse
import json
import math
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from toolkit._checks import check

__all__ = ["GROUPS", "group_of", "main", "plot_metrics", "read_series"]

# The PNG files, in the order they are written, with the title of each.
GROUPS = {
    "loss": "loss", "learning_rate": "learning rate",
    "grad_norm": "gradient norm (before clipping)", "throughput": "throughput",
    "metrics": "metrics", "memory": "memory", "counters": "counters",
}  # fmt: skip

_THROUGHPUT = {
    "train/samples_per_s": "samples/s", "train/tokens_per_s": "tokens/s", "train/mfu": "MFU"
}  # fmt: skip
_COUNTERS = {"train/nonfinite", "train/overflow", "train/epoch"}
_MEMORY = {"peak_gib": "CUDA peak allocated (GiB)", "rss_peak_gib": "process peak RSS, CPU (GiB)"}

_EXAMPLE = 'a JSON object such as {"step": 10, "train/loss": 0.5}'
Series = dict[str, tuple[list[int], list[float]]]


def group_of(key: str) -> tuple[str, str]:
    """The PNG (a key of :data:`GROUPS`) and the axis that a metric key is drawn on.

    Keys that share an axis are drawn on it together, so a training metric and its
    validation counterpart can be compared at a glance.

    Args:
        key: a key of a metrics.jsonl line, e.g. ``"val/accuracy"``.

    Returns:
        ``(group, axis title)``.

    Raises:
        Nothing: every key has a group (``metrics`` for those no rule names).

    Example:
        >>> from toolkit.plot import group_of
        >>> group_of("train/loss"), group_of("val/loss"), group_of("train/lr/head")
        (('loss', 'loss'), ('loss', 'loss'), ('learning_rate', 'learning rate'))
        >>> group_of("train/accuracy"), group_of("val_ema/accuracy")
        (('metrics', 'accuracy'), ('metrics', 'accuracy'))
    """
    if key == "train/lr" or key.startswith("train/lr/"):
        return "learning_rate", "learning rate"
    if key == "train/grad_norm":
        return "grad_norm", "gradient norm"
    if key in _THROUGHPUT or key.startswith("time/"):
        return "throughput", _THROUGHPUT.get(key, "seconds per update")
    if key in _COUNTERS or key.startswith("train/total/"):
        return "counters", key
    if key.startswith("memory/"):  # what peak_memory measured, by the name it gave
        return "memory", _MEMORY.get(key.removeprefix("memory/"), key)
    if key.endswith("loss"):  # its last part does
        return "loss", "loss"
    # "val/accuracy" -> "accuracy"; nested records keep their path ("train/f1/macro").
    return "metrics", key.split("/", 1)[-1]


def read_series(path: str | os.PathLike[str]) -> tuple[Series, list[str]]:
    """The numeric series of a metrics.jsonl file: ``{key: (steps, values)}``, and notes.

    Every line is a JSON object with a ``"step"`` (what the ``jsonl`` sink writes). A value
    that is not a number (a string, a list, ``null``, a bool) is not a series and is left
    out; non-finite numbers (``NaN``, ``Infinity``) are kept as NaN, a gap in the line.

    A file that holds several runs (``jsonl`` appends by default) is read as a log: a line
    whose step is lower than the line before starts over from that step, and the earlier
    lines at that step or later are dropped. A rerun in the same folder thus replaces the
    old run, and a run resumed from an earlier checkpoint replaces what the killed run
    published after it. Each such restart adds a note. A key given again at the same
    step (a resume from the checkpoint of the last publish) keeps the later value.

    Args:
        path: the metrics.jsonl file.

    Returns:
        ``(series, notes)``: the series by key in first-seen order, and human-readable
        notes about what was dropped.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        IsADirectoryError: ``path`` is a folder (the message names the file it may mean).
        ValueError: the file is empty, a line is not JSON, not an object or has no integer
            ``"step"``, or no line holds a numeric value.

    Example:
        >>> import json, pathlib, tempfile
        >>> from toolkit.plot import read_series
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = pathlib.Path(tmp) / "metrics.jsonl"
        ...     lines = [{"step": 1, "train/loss": 2.0}, {"step": 2, "train/loss": 1.5},
        ...              {"step": 1, "train/loss": 1.9}]  # a rerun appended to the file
        ...     _ = path.write_text("".join(json.dumps(line) + "\\n" for line in lines))
        ...     series, notes = read_series(path)
        >>> series
        {'train/loss': ([1], [1.9])}
        >>> notes
        ['line 3: step 1 after step 2 (a rerun or a resume): 2 earlier line(s) dropped']
    """
    file = pathlib.Path(path)
    who, name = "toolkit.plot", repr(str(file))
    fix = f"Did you mean {str(file / 'metrics.jsonl')!r}?"
    check(not file.is_dir(), who, "path", "a metrics.jsonl file", str(file), fix, IsADirectoryError)
    records: list[tuple[int, dict[str, Any]]] = []  # (step, record)
    notes: list[str] = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = line.strip()[:80]
        where = f"{name} line {number}"
        check(isinstance(record, dict), who, where, _EXAMPLE, record)
        step = record.get("step")
        check(type(step) is int, who, where, 'an object with an integer "step"', step)
        if records and step < records[-1][0]:
            kept = [r for r in records if r[0] < step]
            said = f"line {number}: step {step} after step {records[-1][0]} (a rerun or a resume)"
            notes.append(f"{said}: {len(records) - len(kept)} earlier line(s) dropped")
            records = kept
        records.append((step, record))
    by_step: dict[str, dict[int, float]] = {}  # a key published again at a step: the later
    for step, record in records:
        for key, v in record.items():
            if key != "step" and type(v) in (int, float):  # not a str, list, null or bool
                by_step.setdefault(key, {})[step] = float(v) if math.isfinite(v) else math.nan
    series: Series = {key: (list(got), list(got.values())) for key, got in by_step.items()}
    check(bool(records), who, name, "a file of published lines", "an empty file")
    keys = sorted({key for _, record in records for key in record} - {"step"})
    check(bool(series), who, name, "a file of numbers besides the steps", keys)
    return series, notes


def plot_metrics(
    path: str | os.PathLike[str], out: str | os.PathLike[str] | None = None
) -> list[pathlib.Path]:
    """Write one PNG per group of metrics found in a metrics.jsonl (see :func:`group_of`).

    Each PNG has one axis per metric name, every series of that name drawn on it against
    the update number, with a legend when there are several. An axis whose values are all
    positive and span more than a factor of 10 (a loss falling over decades) has a log
    scale; memory axes start at 0 and name what was measured (the CUDA peak allocated, or
    the process's peak RSS on the CPU). Files of groups absent
    from the metrics are not written (nor removed when an earlier call wrote them).

    Args:
        path: the metrics.jsonl file (read with :func:`read_series`).
        out: the folder for the PNGs, created if needed; default: ``plots`` beside
            ``path``.

    Returns:
        The paths of the PNGs written, in the order of :data:`GROUPS`.

    Raises:
        ImportError: matplotlib is not installed (``pip install -e ".[plot]"``).
        FileNotFoundError, IsADirectoryError, ValueError: as :func:`read_series`.

    Example:
        >>> import json, pathlib, tempfile
        >>> from toolkit.plot import plot_metrics
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = pathlib.Path(tmp) / "metrics.jsonl"
        ...     lines = [{"step": s, "train/loss": 1 / s, "train/lr": 0.1} for s in (1, 2, 3)]
        ...     _ = path.write_text("".join(json.dumps(line) + "\\n" for line in lines))
        ...     [p.name for p in plot_metrics(path)]
        ['loss.png', 'learning_rate.png']
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        extra = 'pip install -e ".[plot]" (or pip install matplotlib)'
        raise ImportError(f"toolkit.plot needs matplotlib: {extra}.") from error
    series, _ = read_series(path)
    folder = pathlib.Path(path).parent / "plots" if out is None else pathlib.Path(out)
    axes: dict[str, dict[str, list[str]]] = {group: {} for group in GROUPS}
    # Rates before the seconds they come from; otherwise the order the keys first appear in.
    for key in sorted(series, key=lambda k: k.startswith("time/")):
        group, axis = group_of(key)
        axes[group].setdefault(axis, []).append(key)
    written = []
    for group, by_axis in ((g, a) for g, a in axes.items() if a):
        # A Figure without pyplot: no global state, no display backend needed.
        figure = Figure(figsize=(8, 1 + 2.6 * len(by_axis)), dpi=100, layout="constrained")
        figure.suptitle(f"{GROUPS[group]}: {path}", fontsize=10)
        subplots = figure.subplots(len(by_axis), 1, squeeze=False)[:, 0]
        for ax, (axis, keys) in zip(subplots, by_axis.items()):
            for key in keys:  # sparse series (per epoch, validation) show their points
                steps, values = series[key]
                ax.plot(steps, values, label=key, marker="o" if len(steps) <= 30 else None, ms=3)
            ax.set(ylabel=axis)
            ax.grid(True, alpha=0.3)
            ax.ticklabel_format(axis="y", useOffset=False)  # no "+4.687e-1" over a flat line
            finite = [v for key in keys for v in series[key][1] if math.isfinite(v)]
            if group == "memory":  # from 0: a flat high-water mark is not zoomed into noise
                ax.set_ylim(0, max(finite, default=0) * 1.1 or 1)
            elif finite and min(finite) > 0 and max(finite) > 10 * min(finite):
                ax.set_yscale("log")  # a loss falling over decades stays readable after step 100
            if len(keys) > 1 or keys[0] != axis:
                ax.legend(fontsize=8)
        ax.set(xlabel="update (step)")
        folder.mkdir(parents=True, exist_ok=True)
        written.append(folder / f"{group}.png")
        figure.savefig(written[-1])
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """The shell tool: ``python -m toolkit.plot METRICS.jsonl [--out DIR]``.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        0 when the plots were written; 1 after printing an error to stderr.

    Raises:
        SystemExit: from argparse, on bad arguments (status 2).

    Example:
        >>> from toolkit.plot import main
        >>> main(["/nonexistent/metrics.jsonl"])
        1
    """
    parser = argparse.ArgumentParser("python -m toolkit.plot", description=__doc__.split("\n")[0])
    parser.add_argument("metrics", help="a metrics.jsonl written by log_metrics's jsonl sink")
    parser.add_argument("--out", help="folder for the PNGs (default: plots/ beside the metrics)")
    args = parser.parse_args(argv)
    try:
        _, notes = read_series(args.metrics)
        written = plot_metrics(args.metrics, args.out)
    except (ImportError, OSError, ValueError) as error:
        print(error, file=sys.stderr)
        return 1
    print("".join(f"note: {note}\n" for note in notes) + "\n".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
