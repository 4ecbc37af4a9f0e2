"""Metric sinks for :func:`toolkit.plugins.log_metrics`: JSON lines, TensorBoard, W&B."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["Sink", "jsonl", "tensorboard", "wandb"]


class Sink(NamedTuple):
    """Where :func:`toolkit.plugins.log_metrics` sends what it publishes: two functions.

    Any pair of functions works as a sink; :func:`jsonl`, :func:`tensorboard` and
    :func:`wandb` build the usual ones. The built-in sinks open their file or run lazily at
    the first ``write``, so a sink that is never written (on ranks other than 0) creates
    nothing, and they may be written again after ``close`` (they reopen).

    Attributes:
        write: ``write(step, metrics)`` records ``metrics`` (flat ``{"train/loss": 0.5}``,
            python floats) at update ``step``.
        close: ``close()`` flushes and releases the file or run; calling it twice is harmless.
        start: ``start(step)``, optional (default: does nothing): called by
            :func:`toolkit.plugins.log_metrics` at the run's ``"start"`` event on rank 0 with
            ``state.step`` (0 for a fresh run, N after a resume); checks what can be checked
            before training (folder writable, parent not a file, wandb arguments valid) and
            aligns the logs with the resumed step.

    Example:
        >>> from toolkit.plugins import Sink
        >>> seen = []
        >>> sink = Sink(write=lambda step, m: seen.append((step, m)), close=lambda: None)
        >>> sink.write(10, {"train/loss": 0.5})
        >>> seen
        [(10, {'train/loss': 0.5})]
    """

    write: Callable[[int, dict[str, float]], None]
    close: Callable[[], None]
    start: Callable[[int], None] = lambda step: None  # a sink with nothing to check


def _check_path(fn: str, name: str, value: Any) -> pathlib.Path:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"{fn}: {name} must be a path (str or os.PathLike); got {type(value).__name__}."
        )
    return pathlib.Path(value)


@dataclasses.dataclass(slots=True)
class _Lazy:
    """A sink's target (file, writer, run), opened at the first write and after a close."""

    open: Callable[[int], Any]  # called with the number of earlier opens
    put: Callable[[Any, int, dict[str, float]], None]
    shut: Callable[[Any], None]
    target: Any = None
    opens: int = 0

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.target is None:
            self.target = self.open(self.opens)
            self.opens += 1
        self.put(self.target, step, metrics)

    def close(self) -> None:
        target, self.target = self.target, None
        if target is not None:
            self.shut(target)

    def sink(self) -> Sink:
        return Sink(self.write, self.close)


def jsonl(path: str | os.PathLike[str], *, mode: str = "a") -> Sink:
    """A sink appending one JSON object per publish to ``path``: ``{"step": s, **metrics}``.

    Needs no extra package. Parent directories are created at the first write; every line
    goes to the operating system in one unbuffered write as soon as it is published, so a
    crashed run loses no published line. By default the file is opened in append mode, so
    a resumed run continues the same file; ``mode="w"`` starts it afresh at this sink's
    first write (later writes append, also after a close and reopen), for a new run in a
    reused folder. Non-finite values are written as ``NaN`` / ``Infinity`` (what Python's
    ``json`` writes and reads back).

    Args:
        path: the file to append to, e.g. ``"runs/exp1/metrics.jsonl"``.
        mode: ``"a"`` to append to an existing file, ``"w"`` to replace it.

    Returns:
        A :class:`Sink`.

    Raises:
        TypeError: when ``path`` is not a str or path-like.
        ValueError: when ``mode`` is not ``"a"`` or ``"w"``.
        IsADirectoryError: when ``path`` is an existing directory.

    Example:
        >>> import json, pathlib, tempfile
        >>> from toolkit.plugins import jsonl
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     sink = jsonl(pathlib.Path(tmp) / "run" / "metrics.jsonl")
        ...     sink.write(1, {"train/loss": 0.5})
        ...     sink.write(2, {"train/loss": 0.25})
        ...     sink.close()
        ...     lines = (pathlib.Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
        >>> [json.loads(line) for line in lines]
        [{'step': 1, 'train/loss': 0.5}, {'step': 2, 'train/loss': 0.25}]
    """
    file_path = _check_path("jsonl", "path", path)
    if file_path.is_dir():
        raise IsADirectoryError(
            f"jsonl: path must be a file, e.g. {str(file_path / 'metrics.jsonl')!r}; got the "
            f"directory {str(file_path)!r}."
        )
    if mode not in ("a", "w"):
        raise ValueError(f"jsonl: mode must be 'a' (append) or 'w' (replace); got {mode!r}.")

    def open_file(opens: int) -> Any:
        file_path.parent.mkdir(parents=True, exist_ok=True)
        # Replaced at the first open only: this sink's own lines are kept from then on.
        # Unbuffered bytes: each line reaches the operating system in one write call.
        return open(file_path, ("a" if opens else mode) + "b", buffering=0)

    def put(handle: Any, step: int, metrics: dict[str, float]) -> None:
        data = (json.dumps({"step": step, **metrics}) + "\n").encode()
        while data:  # a regular file takes it all at once; a short write is retried
            data = data[handle.write(data) :]

    return _Lazy(open_file, put, lambda handle: handle.close()).sink()


def tensorboard(log_dir: str | os.PathLike[str]) -> Sink:
    """A sink writing each metric as a TensorBoard scalar (``SummaryWriter.add_scalar``).

    Needs the ``tensorboard`` package. The event file is created in ``log_dir`` at the first
    write and flushed after every write; view it with ``tensorboard --logdir <log_dir>``.

    Args:
        log_dir: the directory for the event files, e.g. ``"runs/exp1/tb"``.

    Returns:
        A :class:`Sink`.

    Raises:
        TypeError: when ``log_dir`` is not a str or path-like.
        ImportError: when tensorboard is not installed (the message says how to install it).

    Example:
        >>> import tempfile
        >>> from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        >>> from toolkit.plugins import tensorboard
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     sink = tensorboard(tmp)
        ...     sink.write(3, {"train/loss": 0.5})
        ...     sink.close()
        ...     events = EventAccumulator(tmp)
        ...     _ = events.Reload()
        ...     [(e.step, e.value) for e in events.Scalars("train/loss")]
        [(3, 0.5)]
    """
    directory = _check_path("tensorboard", "log_dir", log_dir)
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            "tensorboard(): needs the tensorboard package: pip install tensorboard (or pip "
            'install "toolkit[loggers]"), or log with jsonl(path), which needs nothing.'
        ) from exc

    def put(writer: Any, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            writer.add_scalar(key, value, step)
        writer.flush()

    opened = _Lazy(lambda _: SummaryWriter(log_dir=str(directory)), put, lambda w: w.close())
    return opened.sink()


def wandb(**init_kwargs: Any) -> Sink:
    """A sink logging to Weights & Biases: ``wandb.init(**init_kwargs)`` at the first write.

    Needs the ``wandb`` package. Each publish is ``run.log(metrics, step=step)`` with the
    update count as the W&B step, so steps keep increasing across a resume; to continue the
    same W&B run after a restart, pass its id: ``wandb(project="p", id=run_id,
    resume="allow")``. ``close`` calls ``run.finish()``; a write after that starts a new run
    with the same arguments. Offline runs (``WANDB_MODE=offline`` or ``mode="offline"``)
    need no account.

    Args:
        **init_kwargs: passed to ``wandb.init`` unchanged (``project``, ``name``, ``config``,
            ``dir``, ``mode``, ``id``, ``resume``...).

    Returns:
        A :class:`Sink`.

    Raises:
        ImportError: when wandb is not installed (the message says how to install it).

    Example:
        >>> import pathlib, tempfile
        >>> from toolkit.plugins import wandb
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     sink = wandb(project="demo", dir=tmp, mode="disabled")
        ...     sink.write(1, {"train/loss": 0.5})
        ...     sink.close()
    """
    try:
        import wandb as wandb_module
    except ImportError as exc:
        raise ImportError(
            'wandb(): needs the wandb package: pip install wandb (or pip install "toolkit[loggers]'
            '"), or log with jsonl(path), which needs nothing.'
        ) from exc
    return _Lazy(
        lambda _: wandb_module.init(**init_kwargs),
        lambda run, step, metrics: run.log(metrics, step=step),
        lambda run: run.finish(),
    ).sink()
