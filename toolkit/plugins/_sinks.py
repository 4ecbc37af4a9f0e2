"""Sinks for :func:`toolkit.plugins.log_metrics` and :func:`toolkit.plugins.log_images`:
JSON lines, TensorBoard, W&B, PNG files; each follows a resumed run's step."""

import contextlib
import dataclasses
import functools
import importlib
import inspect
import itertools
import json
import os
import pathlib
import re
import sys
import tempfile
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from toolkit._checks import check, check_count, check_one_of, check_path
from toolkit.checkpoints._files import replace_file, write_bytes

_LOGGERS = 'pip install -e ".[loggers]" from a checkout of toolkit'
_EXISTING = ("refuse", "replace", "append")  # what a fresh run does with logs already there


def _nothing(*args: Any) -> None:
    """The default ``Sink.start`` and ``Sink.images``: nothing to check, nothing recorded."""


class Sink(NamedTuple):
    """Where :func:`toolkit.plugins.log_metrics` (and :func:`toolkit.plugins.log_images`)
    send what they publish: two to four functions.

    Any ``write`` and ``close`` make a sink; :func:`jsonl`, :func:`tensorboard`,
    :func:`wandb` and :func:`png_dir` build the usual ones. The built-in sinks open their
    file or run at ``start`` (or at the first ``write`` when nothing started them), so a
    sink used only on ranks other than 0 creates nothing, and they may be written again
    after ``close`` (they reopen and continue).

    Attributes:
        write: ``write(step, metrics)`` records ``metrics`` (flat ``{"train/loss": 0.5}``,
            python floats) at update ``step``.
        close: ``close()`` flushes and releases the file or run; calling it twice is harmless.
            A built-in sink started by two plugins (one sink shared by ``log_metrics`` and
            ``log_images``) is released at the second ``close``.
        start: ``start(step)``, optional (default: does nothing): called by
            :func:`toolkit.plugins.log_metrics` and :func:`toolkit.plugins.log_images` on rank 0 at
            ``"start"`` (after the ``"restore"`` event, at which a ``checkpoints`` plugin restored
            the state) with ``state.step`` (0 for a fresh run, N after a resume); checks what can be
            checked before training (folder writable, parent not a file) and aligns the logs with
            the resumed step. (The wandb arguments are checked earlier, when ``wandb(...)`` is
            called.)
        images: ``images(step, {name: image})``, optional (default: records nothing):
            records images at ``step``; an image is a tensor (uint8 pixels, or float
            intensities in [0, 1]; ``(H, W)``, CHW when the first dimension is 1, 3 or 4,
            else HWC) or a matplotlib figure.

    Example:
        >>> from toolkit.plugins import Sink
        >>> seen = []
        >>> sink = Sink(write=lambda step, m: seen.append((step, m)), close=lambda: None)
        >>> sink.start(0)  # the default: nothing to do
        >>> sink.write(10, {"train/loss": 0.5})
        >>> seen
        [(10, {'train/loss': 0.5})]
    """

    write: Callable[[int, dict[str, float]], None]
    close: Callable[[], None]
    start: Callable[[int], None] = _nothing
    images: Callable[[int, dict[str, Any]], None] = _nothing


def check_sinks(who: str, sinks: Any, images: bool = False) -> list[Sink]:
    """``sinks`` (a list, or one sink) as a list, each with the members ``who`` calls, once."""
    sinks = [sinks] if isinstance(sinks, Sink) else sinks
    listed = isinstance(sinks, Sequence) and not isinstance(sinks, str)
    listed = listed and (bool(sinks) or not images)  # images with no sink: a forgotten sink
    check(listed, who, "sinks", "a list of sinks, e.g. [jsonl(path)]", sinks, "", TypeError)
    members = ("images", "close", "start") if images else ("write", "close", "start")
    for i, sink in enumerate(sinks):
        ok = all(callable(getattr(sink, name, None)) for name in members)
        ok = ok and not (images and sink.images is _nothing)
        fix = "Use png_dir, tensorboard or wandb (jsonl records metrics only), or a Sink."
        check(ok, who, f"sinks[{i}]", f"a sink with {', '.join(members)}", sink, fix, TypeError)
        once = not any(sink is other for other in sinks[:i])
        check(once, who, f"sinks[{i}]", "listed once", "the same sink as an earlier one")
    return list(sinks)


def close_all(sinks: Sequence[Sink]) -> None:
    """Close every sink, even when one fails; then raise the failure."""
    with contextlib.ExitStack() as stack:  # runs every callback, last in first out
        for sink in reversed(sinks):
            stack.callback(sink.close)


def _need(who: str, pip: str, *modules: str) -> Any:
    """The last of ``modules``, imported (with those before it), or how to install them."""
    try:
        return [importlib.import_module(module) for module in modules][-1]
    except ImportError as exc:
        what = " and ".join(pip.split())
        raise ImportError(f"{who}() needs {what}: pip install {pip} (or {_LOGGERS}).") from exc


def _replace(who: str, arg: str, where: pathlib.Path, old: str, files: Any, policy: str) -> None:
    """What a fresh run does with ``old`` (what another run left in ``where``; "": none): raise
    FileExistsError when ``policy`` refuses, delete ``files`` when it replaces."""
    if old and policy == "refuse":
        said = f"{who}: {str(where)!r} already holds {old} of another run, and this run starts"
        fix = f"Pass {who}({arg}, existing='replace') to start afresh, existing='append' to add"
        fix += f" this run after them, or choose another {arg}."
        raise FileExistsError(f"{said} fresh (step 0). {fix}")
    for file in files if old and policy == "replace" else ():
        file.unlink()


def _check_folder(who: str, name: str, folder: pathlib.Path) -> None:
    """Create ``folder`` and check that a file can be written in it, or say why not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:  # a parent that is a file, a folder that is read-only...
        where, fix = repr(str(folder)), f"choose another {name}, or make it a writable folder"
        raise type(exc)(f"{who}: cannot write in {where} ({exc.strerror or exc}); {fix}.") from exc


@dataclasses.dataclass(slots=True, weakref_slot=True, eq=False)  # hashed by identity
class _Lazy:
    """A sink's target (file, writer, run): prepared and opened at ``start`` (or at the first
    write), reopened by a write after a close."""

    # prepare(step, fresh): checks, and aligns the logs with the step a run starts from;
    # fresh: this sink's first start, at step 0: logs already there are another run's.
    prepare: Callable[[int, bool], None]
    open: Callable[[int | None], Any]  # open(the step of a start, or None when reopened)
    shut: Callable[[Any], None]
    put: Callable[[Any, int, dict[str, float]], None] | None = None
    put_images: Callable[[Any, int, dict[str, Any]], None] | None = None
    target: Any = None
    started: int | None = None  # the step of the last start; None: never started
    users: int = 0  # plugins that started this sink and have not closed it yet

    def start(self, step: int) -> None:
        check_count("Sink.start", "step", step, 0, "the state.step the run starts from")
        if self.target is not None and self.started == step:
            self.users += 1  # a second plugin sharing this sink: nothing to do again
            return
        self.close(self.users)  # what an earlier start opened, for all its users
        self.prepare(step, self.started is None and step == 0)
        self.started, self.users = step, 1
        self.target = self.open(step)

    def opened(self) -> Any:
        if self.started is None:  # written without a start: a fresh run
            self.start(0)
        elif self.target is None:  # written after a close: reopened
            self.target = self.open(None)
        return self.target

    def close(self, users: int = 1) -> None:
        self.users = max(self.users - users, 0)
        if not self.users and self.target is not None:
            target, self.target = self.target, None
            self.shut(target)

    def sink(self) -> Sink:
        put, put_images = self.put, self.put_images
        write = _nothing if put is None else lambda step, m: put(self.opened(), step, m)
        images = _nothing if put_images is None else lambda s, i: put_images(self.opened(), s, i)
        return Sink(write, self.close, self.start, images)


# The jsonl sink holding each file (resolved path) in this process: a second sink on the
# same file would interleave (or truncate) the first one's lines.
_HOLDERS: weakref.WeakValueDictionary[str, _Lazy] = weakref.WeakValueDictionary()


def _kept_lines(data: bytes, step: int) -> bytes:
    """The lines of a metrics file that a run resumed at ``step`` keeps.

    The last run in the file starts after the last line whose step is lower than the line
    before it (a fresh run appended after an older one); of its lines, those past ``step``
    go (the resumed run writes them again), and so does a last line cut short by a crash.
    """
    lines = data.splitlines(keepends=True)
    if lines and not lines[-1].endswith(b"\n"):
        lines.pop()  # a line the crash cut short
    steps = [_step_of(line) for line in lines]
    known = [(i, s) for i, s in enumerate(steps) if s is not None]
    last_run = max((i for (_, a), (i, b) in itertools.pairwise(known) if b < a), default=0)
    tail = zip(lines[last_run:], steps[last_run:])
    return b"".join(lines[:last_run] + [ln for ln, s in tail if s is None or s <= step])


def _step_of(line: bytes) -> int | None:
    with contextlib.suppress(ValueError, AttributeError):
        step = json.loads(line).get("step")
        return step if isinstance(step, int) else None
    return None


def jsonl(path: str | os.PathLike[str], *, existing: str = "refuse") -> Sink:
    """A sink appending one JSON object per publish to ``path``: ``{"step": s, **metrics}``.

    Needs no extra package. Every line goes to the operating system in one unbuffered write
    as soon as it is published, so a crashed run loses no published line. Non-finite
    values are written as ``NaN`` / ``Infinity`` (what Python's ``json`` writes and reads
    back). It records no images.

    At ``start(step)`` (from :func:`toolkit.plugins.log_metrics`, on rank 0) the parent
    folders are created and checked writable, and the file follows the run:

    * **a resumed run** (``step > 0``) continues the file: the lines past ``step``, written
      by the run before the crash after its last checkpoint, are dropped (the file is
      rewritten atomically: a temporary file, fsync, rename), so each step is in the file
      once and in order;
    * **a fresh run** (``step == 0``) into a file that is not empty (at this sink's first
      start; a later one, a second ``run()`` with the same sink, continues its own lines)
      does what ``existing`` says: ``"refuse"`` (the default) raises ``FileExistsError``
      naming the path and the options, before any training; ``"replace"`` empties the
      file; ``"append"`` adds the new run after the old one (a resume later drops only the
      last run's lines past its step).

    A sink written without a start (used by hand) acts as a fresh run at its first write.
    Two jsonl sinks on one file in a process are refused (``ValueError`` naming both) at
    the second one's start. After ``close``, a write reopens the file and appends.

    Args:
        path: the file, e.g. ``"runs/exp1/metrics.jsonl"``.
        existing: ``"refuse"`` (default), ``"replace"`` or ``"append"``: what a fresh run
            does with a non-empty file.

    Returns:
        A :class:`Sink`.

    Raises:
        TypeError: when ``path`` is not a str or path-like.
        ValueError: when ``existing`` is not one of its values.
        IsADirectoryError: when ``path`` is an existing directory.
        FileExistsError: at a fresh start into a non-empty file with ``existing="refuse"``.
        NotADirectoryError, PermissionError: at start, when a parent is a file or the
            folder cannot be written.

    Example:
        >>> import json, pathlib, tempfile
        >>> from toolkit.plugins import jsonl
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = pathlib.Path(tmp) / "run" / "metrics.jsonl"
        ...     sink = jsonl(path)
        ...     sink.start(0)  # a fresh run (log_metrics does this)
        ...     for step in (2, 4, 6):
        ...         sink.write(step, {"train/loss": 1 / step})
        ...     sink.close()
        ...     resumed = jsonl(path)
        ...     resumed.start(4)  # resumed from a checkpoint at step 4: step 6 comes again
        ...     resumed.write(6, {"train/loss": 0.125})
        ...     resumed.close()
        ...     for line in path.read_text().splitlines():
        ...         print(json.loads(line))
        {'step': 2, 'train/loss': 0.5}
        {'step': 4, 'train/loss': 0.25}
        {'step': 6, 'train/loss': 0.125}
    """
    file_path = check_path("jsonl", "path", path)
    file = not file_path.is_dir()
    check(file, "jsonl", "path", "a file, e.g. 'metrics.jsonl'", str(path), "", IsADirectoryError)
    policy = check_one_of("jsonl", "existing", existing, _EXISTING)
    key = str(file_path.resolve())

    def prepare(step: int, fresh: bool) -> None:
        other = _HOLDERS.setdefault(key, lazy)
        fix = "Give each sink its own path, or pass the same sink wherever that file is wanted."
        check(other is lazy, "jsonl", "path", "written by one sink", key, fix)
        _check_folder("jsonl", "path", file_path.parent)
        data = file_path.read_bytes() if file_path.exists() else b""
        old = f"{len(data.splitlines())} lines" if data and fresh else ""
        _replace("jsonl", "path", file_path, old, [file_path], policy)
        if step and (kept := _kept_lines(data, step)) != data:
            replace_file(file_path, functools.partial(write_bytes, data=kept))  # atomically

    def open_file(_: int | None) -> Any:
        _HOLDERS[key] = lazy
        # Unbuffered bytes: each line reaches the operating system in one write call.
        return open(file_path, "ab", buffering=0)

    def put(handle: Any, step: int, metrics: dict[str, float]) -> None:
        data = (json.dumps({"step": step, **metrics}) + "\n").encode()
        while data:  # a regular file takes it all at once; a short write is retried
            data = data[handle.write(data) :]

    def shut(handle: Any) -> None:
        handle.close()
        if _HOLDERS.get(key) is lazy:
            del _HOLDERS[key]

    lazy = _Lazy(prepare, open_file, shut, put)
    return lazy.sink()


# One image (tensor or matplotlib figure) as the uint8 pixels every image sink writes.
_CHANNELS = (1, 3, 4)  # grey, RGB, RGBA


def pixels(who: str, name: str, image: Any) -> torch.Tensor:
    """``image`` as a contiguous CPU ``uint8`` tensor: ``(H, W)`` grey, or ``(H, W, C)``, C in 3, 4.

    A tensor is ``(H, W)`` (grey), or 3-D: **CHW when its first dimension is 1, 3 or 4**
    (torch's convention), else HWC (its last dimension must then be 1, 3 or 4); so an HWC
    image whose height is 1, 3 or 4 must be given as CHW. ``uint8`` values are pixels as
    they are; floating-point values are intensities in [0, 1] (clamped to it, then
    ``round(x * 255)``). A matplotlib figure is drawn (RGBA) with its own canvas when
    that draws with Agg, else with an Agg canvas that replaces it.

    Example:
        >>> import torch
        >>> pixels("log_images", "grid", torch.zeros(3, 2, 5)).shape  # CHW
        torch.Size([2, 5, 3])
        >>> pixels("log_images", "grid", torch.tensor([[0.0, 0.5, 1.0]])).flatten().tolist()
        [0, 128, 255]
    """
    figure = sys.modules.get("matplotlib.figure")  # a figure exists only if this is imported
    if figure is not None and isinstance(image, figure.Figure):
        canvas = image.canvas
        if not hasattr(canvas, "buffer_rgba"):  # a canvas that does not draw with Agg
            from matplotlib.backends.backend_agg import FigureCanvasAgg

            canvas = FigureCanvasAgg(image)
        canvas.draw()
        rgba = canvas.buffer_rgba()  # a (H, W, 4) memoryview of the canvas's own memory: copied
        return torch.frombuffer(bytearray(rgba), dtype=torch.uint8).reshape(rgba.shape)
    what, tensor = f"image {name!r}", isinstance(image, torch.Tensor)
    ok = tensor and (image.dtype == torch.uint8 or image.is_floating_point())
    expected = "a matplotlib figure, or a tensor of uint8 pixels or float intensities in [0, 1]"
    check(ok, who, what, expected, image.dtype if tensor else type(image), "", TypeError)
    image = image.detach().cpu()
    if image.dim() == 3 and image.shape[0] in _CHANNELS:
        image = image.permute(1, 2, 0)
    if image.dim() == 3 and image.shape[-1] == 1:
        image = image[..., 0]  # grey: (H, W), as Pillow and W&B take it
    shaped = image.dim() == 2 or (image.dim() == 3 and image.shape[-1] in _CHANNELS)
    shaped = shaped and image.numel() > 0
    shapes = "(H, W), (C, H, W) or (H, W, C) with C in 1, 3 or 4 and H, W > 0"
    check(shaped, who, f"{what}'s shape", shapes, tuple(image.shape))
    if image.dtype != torch.uint8:
        finite = bool(torch.isfinite(image).all())
        check(finite, who, what, "intensities in [0, 1]", "NaN or infinite values")
        image = image.float().clamp(0, 1).mul(255).round().to(torch.uint8)
    return image.contiguous()


def check_name(who: str, name: Any) -> str:
    """An image name: a non-empty relative path of "/"-separated parts, none "." or ".."."""
    parts = name.split("/") if isinstance(name, str) else [""]
    ok = not any(part in ("", ".", "..") or "\\" in part for part in parts)
    example = "a relative path such as 'val/samples' (no empty, '.' or '..' part, no backslash)"
    check(ok, who, "an image name", example, name)
    return name


def tensorboard(log_dir: str | os.PathLike[str], *, existing: str = "refuse") -> Sink:
    """A sink writing each metric as a TensorBoard scalar and each image as an image.

    Needs the ``tensorboard`` package (``pip install -e ".[loggers]"`` from a checkout).
    Metrics go through ``SummaryWriter.add_scalar``, images (see :class:`Sink`) through
    ``add_image`` as uint8 pixels (a figure as its drawn RGBA pixels); the writer is
    flushed after every write. View with ``tensorboard --logdir <log_dir>``.

    At ``start(step)`` the folder is created and checked writable, and:

    * **a resumed run** (``step > 0``) opens its writer with ``purge_step=step + 1``:
      TensorBoard hides the events past ``step`` that the run before the crash wrote
      (they come again from this run), so each step shows once;
    * **a fresh run** (``step == 0``) into a folder with event files (at this sink's first
      start, as for :func:`jsonl`) does what ``existing`` says: ``"refuse"`` (the
      default) raises ``FileExistsError``; ``"replace"`` deletes the folder's
      ``events.out.tfevents.*`` files; ``"append"`` keeps them (TensorBoard then draws
      both runs on the same steps).

    Args:
        log_dir: the directory for the event files, e.g. ``"runs/exp1/tb"``.
        existing: ``"refuse"`` (default), ``"replace"`` or ``"append"``.

    Returns:
        A :class:`Sink`.

    Raises:
        TypeError: when ``log_dir`` is not a str or path-like.
        ValueError: when ``existing`` is not one of its values.
        ImportError: when tensorboard is not installed (the message says how to install it).
        FileExistsError, NotADirectoryError, PermissionError: at start (see above).

    Example:
        >>> import tempfile
        >>> from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        >>> from toolkit.plugins import tensorboard
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     sink = tensorboard(tmp)
        ...     sink.start(0)
        ...     sink.write(3, {"train/loss": 0.5})
        ...     sink.write(6, {"train/loss": 0.25})
        ...     sink.close()
        ...     resumed = tensorboard(tmp)
        ...     resumed.start(3)  # resumed at step 3: the old step 6 is purged
        ...     resumed.write(6, {"train/loss": 0.125})
        ...     resumed.close()
        ...     events = EventAccumulator(tmp)
        ...     _ = events.Reload()
        ...     [(e.step, e.value) for e in events.Scalars("train/loss")]
        [(3, 0.5), (6, 0.125)]
    """
    directory = check_path("tensorboard", "log_dir", log_dir)
    policy = check_one_of("tensorboard", "existing", existing, _EXISTING)
    board = _need("tensorboard", "tensorboard", "torch.utils.tensorboard")

    def prepare(step: int, fresh: bool) -> None:
        _check_folder("tensorboard", "log_dir", directory)
        events = list(directory.glob("events.out.tfevents.*"))
        old = f"{len(events)} event files" if events and fresh else ""
        _replace("tensorboard", "log_dir", directory, old, events, policy)

    def open_writer(step: int | None) -> Any:  # a resumed start hides the events past its step
        return board.SummaryWriter(str(directory), purge_step=step + 1 if step else None)

    def put(writer: Any, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            writer.add_scalar(key, value, step)
        writer.flush()

    def put_images(writer: Any, step: int, images: dict[str, Any]) -> None:
        for name, image in images.items():
            hwc = pixels("tensorboard", name, image)  # (H, W) when grey
            writer.add_image(name, hwc.numpy(), step, dataformats="HWC"[: hwc.dim()])
        writer.flush()

    return _Lazy(prepare, open_writer, lambda w: w.close(), put, put_images).sink()


_CHOICES = {"mode": ("online", "offline", "disabled", "shared"),
            "resume": ("allow", "never", "must", "auto", True, False)}  # fmt: skip
_TEXTS = ("entity", "project", "id", "name", "notes", "group", "job_type")
RUN_FILE = "toolkit-run.json"  # in <dir>/wandb/: {"id": the run's id, "step": last logged}


def _check_wandb(init: Any, kwargs: dict[str, Any]) -> None:
    """What wandb.init would refuse (or silently work around) later, checked now."""
    params = inspect.signature(init).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(kwargs) - set(params))
        fix = f"It takes {sorted(params)}."
        check(not unknown, "wandb", "each argument", "one of wandb.init", unknown, fix, TypeError)
    for name, value in ((n, v) for n, v in kwargs.items() if v is not None):  # None: default
        if name == "dir":
            check_path("wandb", "dir", value)
        elif name in _CHOICES:
            check_one_of("wandb", name, value, _CHOICES[name])
        elif name == "tags":
            ok = isinstance(value, (list, tuple)) and all(isinstance(t, str) for t in value)
            check(ok, "wandb", "tags", "a list of str, e.g. ['baseline']", value, "", TypeError)
        elif name in _TEXTS:
            check(isinstance(value, str), "wandb", name, "a str", value, "", TypeError)


def wandb(**init_kwargs: Any) -> Sink:
    """A sink logging to Weights & Biases: metrics with ``run.log(metrics, step=step)``,
    images as ``wandb.Image``.

    Needs the ``wandb`` package (``pip install -e ".[loggers]"`` from a checkout). The
    arguments are checked when the sink is made (names that ``wandb.init`` does not take,
    a ``mode`` or ``resume`` it does not know, a non-str ``project``, ``name``, ``id``...,
    ``tags`` not a list of str). At ``start(step)`` the folder ``dir`` (default:
    ``$WANDB_DIR``, else the working directory) is created and checked writable, and
    ``wandb.init(**init_kwargs)`` is called, so a bad argument, a missing login or an
    unreachable server fail before training. The run's id and last logged step are kept
    in ``<dir>/wandb/toolkit-run.json``:

    * **a resumed run** (``step > 0``) continues the same W&B run (``id=`` the stored one,
      ``resume="allow"``), and the steps up to the last one the run before the crash
      logged are not sent again: W&B steps must increase, and it would drop them anyway;
    * **a fresh run** (``step == 0``) starts a new W&B run (its own id); earlier runs stay
      in W&B as they were. Give each experiment its own ``dir``.

    An ``id`` or ``resume`` given here is used as given. The W&B step is the update count,
    so steps keep increasing across a resume. ``close`` calls ``run.finish()``; a write
    after it resumes the same run. Offline runs (``WANDB_MODE=offline`` or
    ``mode="offline"``) need no account.

    Args:
        **init_kwargs: passed to ``wandb.init`` (``project``, ``name``, ``config``,
            ``dir``, ``mode``, ``id``, ``resume``...).

    Returns:
        A :class:`Sink`.

    Raises:
        ImportError: when wandb is not installed (the message says how to install it).
        TypeError, ValueError: when an argument is not what ``wandb.init`` takes.

    Example:
        >>> import pathlib, tempfile
        >>> from toolkit.plugins import wandb
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     sink = wandb(project="demo", dir=tmp, mode="disabled")
        ...     sink.start(0)
        ...     sink.write(1, {"train/loss": 0.5})
        ...     sink.close()
    """
    wandb_module = _need("wandb", "wandb", "wandb")
    _check_wandb(wandb_module.init, init_kwargs)
    folder = init_kwargs.get("dir") or os.environ.get("WANDB_DIR") or os.getcwd()
    run_file = pathlib.Path(folder) / "wandb" / RUN_FILE
    # What the next init continues: {"id": ..., "step": last logged}, and the floor: steps
    # up to it were logged to that run before and are not sent again.
    memory: dict[str, Any] = {"id": None, "step": -1, "floor": -1}

    def prepare(step: int, fresh: bool) -> None:
        _check_folder("wandb", "dir", run_file.parent)
        memory.update(id=None, step=-1, floor=-1)
        if step > 0 and run_file.exists():
            got: Any = None
            with contextlib.suppress(ValueError):  # not JSON: refused below
                got = json.loads(run_file.read_text())
            run_id, last = (got.get("id"), got.get("step")) if isinstance(got, dict) else (0, 0)
            if not (isinstance(run_id, str) and isinstance(last, int)):
                said = f"wandb: cannot read the W&B run to resume from {str(run_file)!r}"
                fix = "expected {'id': str, 'step': int}. Delete it to start a new W&B run."
                raise ValueError(f"{said} (got {got!r}); {fix}")
            if init_kwargs.get("id") in (None, run_id):
                memory.update(id=run_id, step=last, floor=last)

    def open_run(_: int | None) -> Any:
        kwargs = dict(init_kwargs)
        if memory["id"] is not None and "id" not in kwargs:
            kwargs.update(id=memory["id"], resume=kwargs.get("resume", "allow"))
        run = wandb_module.init(**kwargs)
        memory["id"] = run.id
        logged(memory["step"])
        return run

    def put(run: Any, step: int, metrics: dict[str, Any]) -> None:
        if step > memory["floor"]:
            run.log(metrics, step=step)
            if step > memory["step"]:
                logged(step)

    def put_images(run: Any, step: int, images: dict[str, Any]) -> None:
        logs = {k: wandb_module.Image(pixels("wandb", k, v).numpy()) for k, v in images.items()}
        put(run, step, logs)

    def logged(step: int) -> None:  # the run's id and last logged step, for a resume
        memory["step"] = step
        if isinstance(memory["id"], str):
            data = json.dumps({"id": memory["id"], "step": step}).encode()
            replace_file(run_file, functools.partial(write_bytes, data=data))

    def shut(run: Any) -> None:
        run.finish()
        memory["floor"] = memory["step"]  # a reopened run continues after it

    return _Lazy(prepare, open_run, shut, put, put_images).sink()


def png_dir(path: str | os.PathLike[str], *, existing: str = "refuse") -> Sink:
    """A sink writing each image as a PNG file: ``<path>/<name>/step_000100.png``.

    For :func:`toolkit.plugins.log_images`; it records no metrics (``write`` does
    nothing). Needs Pillow and numpy (``pip install pillow numpy``; matplotlib installs
    both). Images are those of :class:`Sink`: uint8 pixels or float intensities in [0, 1]
    (``round(x * 255)``), ``(H, W)`` grey, CHW when the first dimension is 1, 3 or 4, else
    HWC; a matplotlib figure is written as its drawn RGBA pixels. A name with ``/`` makes
    sub-folders (``"val/samples"``). Each file is written to a temporary name and renamed,
    so a crash leaves no half-written PNG.

    At ``start(step)`` the folder is created and checked writable; **a resumed run**
    (``step > 0``) deletes the ``step_*.png`` files past ``step`` (this run writes those
    steps again); **a fresh run** (``step == 0``) into a folder with ``step_*.png`` files
    (at this sink's first start, as for :func:`jsonl`) does what ``existing`` says:
    ``"refuse"`` (default) raises ``FileExistsError``, ``"replace"`` deletes them,
    ``"append"`` keeps them (same steps are overwritten).

    Args:
        path: the folder, e.g. ``"runs/exp1/images"``.
        existing: ``"refuse"`` (default), ``"replace"`` or ``"append"``.

    Returns:
        A :class:`Sink`.

    Raises:
        TypeError: when ``path`` is not a str or path-like.
        ValueError: when ``existing`` is not one of its values.
        ImportError: when Pillow or numpy is not installed.
        FileExistsError, NotADirectoryError, PermissionError: at start (see above).

    Example:
        >>> import pathlib, tempfile, torch
        >>> from PIL import Image
        >>> from toolkit.plugins import png_dir
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     sink = png_dir(tmp)
        ...     sink.start(0)
        ...     sink.images(100, {"samples": torch.full((3, 2, 4), 255, dtype=torch.uint8)})
        ...     sink.close()
        ...     with Image.open(pathlib.Path(tmp) / "samples" / "step_000100.png") as png:
        ...         (png.size, png.mode, png.getpixel((0, 0)))
        ((4, 2), 'RGB', (255, 255, 255))
    """
    directory = check_path("png_dir", "path", path)
    policy = check_one_of("png_dir", "existing", existing, _EXISTING)
    # Pillow reads the pixels through numpy.
    pil = _need("png_dir", "pillow numpy", "numpy", "PIL", "PIL.Image")

    def prepare(step: int, fresh: bool) -> None:
        _check_folder("png_dir", "path", directory)
        found = directory.rglob("step_*.png")
        pngs = {p: int(m[1]) for p in found if (m := re.fullmatch(r"step_(\d+)\.png", p.name))}
        old = f"{len(pngs)} step_*.png files" if pngs and fresh else ""
        _replace("png_dir", "path", directory, old, pngs, policy)
        for png in [p for p, number in pngs.items() if number > step > 0]:  # written again
            png.unlink()

    def put_images(folder: pathlib.Path, step: int, images: dict[str, Any]) -> None:
        for name, image in images.items():
            picture = pil.fromarray(pixels("png_dir", check_name("png_dir", name), image).numpy())
            target = folder / name / f"step_{step:06d}.png"
            target.parent.mkdir(parents=True, exist_ok=True)
            replace_file(target, functools.partial(picture.save, format="PNG"))

    return _Lazy(prepare, lambda _: directory, lambda _: None, None, put_images).sink()
