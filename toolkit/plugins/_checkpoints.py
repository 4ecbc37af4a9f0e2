"""checkpoints: save, keep, resume and stop on a signal, as a plugin of run()."""

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from toolkit._checks import check, check_bool, check_count, check_one_of, check_path, warn
from toolkit.checkpoints._folder import (
    clean_temporaries,
    list_checkpoints,
    load_latest,
    prune_checkpoints,
    write_pointer,
)
from toolkit.checkpoints._load import full_model, load_checkpoint, verified_manifest
from toolkit.checkpoints._manifest import read_manifest
from toolkit.checkpoints._model_state import parameter_names, put_model
from toolkit.checkpoints._retention import Retention, retain
from toolkit.checkpoints._save import on_rank0, save_checkpoint, save_in_background
from toolkit.distributed._collectives import groups_of, max_over_ranks, rank_of
from toolkit.distributed._layout import current_layout
from toolkit.loop._data import pass_settings, position, restore_generators, seen_after_change
from toolkit.loop._run import Event, LoopInfo, Plugin, plugin_factory
from toolkit.step._state import TrainState

_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# In state dicts, not settings: parameters, their lr (compared as the optimizer's), what moves.
_NOT_SETTINGS = {"params", "initial_lr", "base_lrs", "verbose", "last_epoch", "_step_count",
                 "_last_lr", "_is_initial", "_get_lr_called_within_step", "best", "T_cur", "T_i",
                 "num_bad_epochs", "cooldown_counter"}  # fmt: skip
_LOCKS: list[int] = []  # the lock files this process holds open (see _forget_locks)
SIGNAL_EVERY = 10  # data-parallel ranks agree on a received signal every this many updates


@dataclasses.dataclass(frozen=True)
class _Config:
    """The plugin's arguments (see :func:`checkpoints`), checked when made."""

    folder: Path
    objects: Mapping[str, Any] | None  # saved with the state, loaded into on resume
    every: int | None
    per_epoch: bool
    at_end: bool
    background: bool
    on_error: str
    trainable_only: bool
    keep: Retention
    restore_best: bool
    resume: str | os.PathLike[str] | None
    on_change: str
    signals: tuple[int, ...]
    exit_code: int | None

    def __post_init__(self) -> None:
        if self.every is not None:
            meaning = "applied updates between saves, or None"
            check_count("checkpoints", "every", self.every, 1, meaning)
        for name in ("per_epoch", "at_end", "background", "trainable_only", "restore_best"):
            check_bool("checkpoints", name, getattr(self, name))
        for name, allowed in (("on_error", ("raise", "warn")), ("on_change", ("warn", "error"))):
            check_one_of("checkpoints", name, getattr(self, name), allowed)
        typed = {  # name: (whether its value is of the type expected, what is expected)
            "resume": (self.resume is None or isinstance(self.resume, (str, os.PathLike)),
                       "'latest', a checkpoint folder or None"),
            "signals": (all(isinstance(s, int) and not isinstance(s, bool) for s in self.signals),
                        "a sequence of signal numbers, e.g. (signal.SIGTERM, signal.SIGUSR1)"),
            "exit_code": (self.exit_code is None or type(self.exit_code) is int, "an int or None"),
            "keep": (isinstance(self.keep, Retention),
                     "a toolkit.checkpoints.Retention, e.g. keep=Retention(keep_last=3)"),
        }  # fmt: skip
        for name, (ok, expected) in typed.items():
            check(ok, "checkpoints", name, expected, getattr(self, name), "", TypeError)
        best, fix = self.keep.keep_best, "Pass e.g. keep=Retention(keep_best=1, metric='val/loss')."
        said = ">= 1 with restore_best=True, which picks the best checkpoint by its metric"
        check(best > 0 or not self.restore_best, "checkpoints", "keep.keep_best", said, best, fix)


@dataclasses.dataclass(slots=True)
class _Run:
    """What the plugin remembers during one run."""

    group: Any  # the data-parallel group that saves together (None: this process alone)
    saved_step: int | None = None  # the step of the newest checkpoint written or loaded
    received: int | None = None  # the first signal this process received (the handler's flag)
    signum: int | None = None  # the signal the run stops for: the ranks' highest received
    handlers: dict[int, Any] = dataclasses.field(default_factory=dict)
    writing: Future[Path] | Path | None = None  # a save whose pointer and pruning are due
    epoch_due: bool = False  # per_epoch: an epoch ended inside an accumulation window
    steps: int = 0  # "step" events seen: the ranks agree on signals every SIGNAL_EVERY
    lock: int | None = None  # rank 0's open lock file: the folder is this run's
    readonly: bool = False  # the folder cannot be written: nothing is saved
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)  # what saves record


def _share_signal(config: _Config, run_: _Run) -> None:
    """Give every rank of the group the highest signal any rank received. ``received`` is
    read once and never written here: a signal that arrives while the ranks exchange (the
    handler runs when the collective returns) is agreed on at the next exchange, not lost."""
    received = run_.received or 0
    if run_.group is not None and config.signals:
        received = max_over_ranks(received, run_.group)
    run_.signum = received or None


def _metrics(state: TrainState, metric: str | None) -> dict[str, float]:
    """The numbers the plugins published at this very step (a checkpoint's scores for
    keep_best); a keep_best ``metric`` missing from what its prefix's plugin published (a
    typo) is refused."""
    published = {n: (e["step"], e["values"]) for n, e in state.metrics.items()}
    known = {f"{n}/{k}": (at, v) for n, (at, m) in published.items() for k, v in m.items()}
    if metric and metric not in known and any(metric.startswith(f"{n}/") for n in published):
        raise ValueError(
            f"checkpoints: keep_best ranks by {metric!r}, which no plugin publishes (known: "
            f"{list(known)}); name one of them, e.g. 'val/loss' for validate(key='val')."
        )
    fresh = {k: v for k, (at, v) in known.items() if at == state.step and type(v) is not bool}
    return {k: float(v) for k, v in fresh.items() if isinstance(v, (int, float))}


@contextlib.contextmanager
def _saving(config: _Config) -> Iterator[None]:
    """Raise a save's error (``on_error="raise"``), or warn and let training go on."""
    try:
        yield
    except Exception as error:
        if config.on_error == "raise":
            raise
        warn(f"checkpoints: a save failed and training goes on (on_error='warn'): {error}")


def _publish(config: _Config, path: Path) -> None:
    """Rank 0's, after a save succeeded: point ``latest`` at it, then prune."""
    write_pointer(config.folder, path)
    prune_checkpoints(config.folder, config.keep)


def _finish(config: _Config, run_: _Run) -> None:
    """Wait for the save in flight; then rank 0 publishes it while the other ranks wait."""
    writing, run_.writing = run_.writing, None
    with _saving(config):
        path = writing.result() if isinstance(writing, Future) else writing
        if path is not None:
            on_rank0(run_.group, "checkpoints", _publish, config, path)


def _save(config: _Config, run_: _Run, state: TrainState, loop: LoopInfo) -> None:
    if run_.saved_step == state.step or run_.readonly:
        return
    metrics = _metrics(state, config.keep.metric)  # a keep_best typo raises before a write
    _finish(config, run_)
    state = state.replace(data_state=position(loop.data, state.data_state, not state.batches_seen))
    save = save_in_background if config.background else save_checkpoint
    options: dict[str, Any] = {"objects": config.objects, "rules": config.keep}
    options.update(metrics=metrics, settings=run_.settings, trainable_only=config.trainable_only)
    with _saving(config):
        run_.writing = save(state, config.folder / f"step_{state.step:06d}", **options)
        run_.saved_step = state.step
    if not config.background:
        _finish(config, run_)


def _install(signals: Sequence[int], run_: _Run) -> None:
    def handler(signum: int, frame: Any) -> None:
        run_.received = run_.received or signum  # a flag the loop acts on; the first one stops

    if threading.current_thread() is threading.main_thread():  # Python allows no other
        run_.handlers = {signum: signal.signal(signum, handler) for signum in signals}
    elif names := [signal.Signals(s).name for s in signals]:
        message = "checkpoints: run() is not on the main thread, where Python delivers signals"
        warn(f"{message}; {names} keep their handlers.")


def _own(root: Path, run_: _Run) -> bool:
    """Rank 0's, at the start: make ``root``, hold its lock file open and locked in
    ``run_.lock`` (the kernel frees it when the process ends), remove what killed saves left;
    on storage that cannot be written, only return True (read-only)."""
    path = root / ".lock"  # never followed elsewhere (O_NOFOLLOW), nor waited on (a FIFO)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise RuntimeError(
            f"checkpoints: {str(path)!r} is not a regular file; it only names the run that "
            "holds the folder, and is written to. Remove it."
        )
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as error:  # read-only storage: fine for a run with nothing to write
        if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return True
        raise
    _LOCKS.append(fd)
    holder = os.pread(fd, 200, 0).decode(errors="replace").strip()  # emptied when let go
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(_LOCKS.pop())
        raise RuntimeError(
            f"checkpoints: {str(root)!r} is in use by {holder or 'a run'}; two runs in one folder "
            "would delete each other's checkpoints. Wait for it to end, or use another folder."
        ) from None
    run_.lock = fd  # from now on, _release frees it
    if holder:  # said as the resume line is, not warned: a relaunch after a kill is routine
        said = f"checkpoints: {holder} ended without letting {str(root)!r} go (killed?); taken over"
        print(said, file=sys.stderr, flush=True)
    os.pwrite(fd, f"the run of pid {os.getpid()} on {os.uname().nodename}".ljust(200).encode(), 0)
    clean_temporaries(root)
    return False


def _settings(state: TrainState, loop: LoopInfo) -> dict[str, Any]:
    """What the run is made with: each parameter group's hyperparameters (its starting lr),
    the scheduler's class and fresh state dict flattened (its arguments, and those of the
    schedulers inside it), micro-batches, the data's pass and data ranks, the mesh's sizes."""
    groups = getattr(state.optimizer, "param_groups", [])
    optimizer = [_setting_values({**g, "lr": g.get("initial_lr", g.get("lr"))}) for g in groups]
    sched = state.scheduler
    fresh = _flat(sched.state_dict()) if callable(getattr(sched, "state_dict", None)) else {}
    kind = None if sched is None else {"class": type(sched).__name__, **_setting_values(fresh)}
    data = {**pass_settings(loop.data), "world_size": rank_of(groups_of(state.model).data)[1]}
    made = dict(optimizer=optimizer, scheduler=kind, micro_batches=loop.micro_batches, data=data)
    layout = current_layout()
    return made if layout is None else {**made, "mesh": layout.sizes()}


def _setting_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """The settings among ``values`` (by name or path ``a.0.b``): numbers, strings and tuples
    of them (0-d tensors too)."""
    found = {}
    for key, value in values.items():
        value = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        value = tuple(value) if isinstance(value, list) else value
        items = value if isinstance(value, tuple) else (value,)
        plain = all(isinstance(v, (int, float, str, type(None))) for v in items)
        name = [part for part in key.split(".") if not part.isdigit()][-1]  # base_lrs.0
        if plain and name not in _NOT_SETTINGS:
            found[key] = value
    return found


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``tree``'s leaves by their paths: ``{"a": [{"b": 1}]}`` gives ``{"a.0.b": 1}``; a
    mapping with other keys than str (MultiStepLR's Counter of milestones) is one leaf, its
    sorted items in a row: ``{4: 1, 2: 1}`` gives ``(2, 1, 4, 1)``."""
    if isinstance(tree, Mapping) and not all(isinstance(key, str) for key in tree):
        tree = tuple(x for item in sorted(tree.items(), key=str) for x in item)
    if not isinstance(tree, (Mapping, list)):
        return {prefix.rstrip("."): tree}
    pairs = tree.items() if isinstance(tree, Mapping) else enumerate(tree)
    return {k: v for key, value in pairs for k, v in _flat(value, f"{prefix}{key}.").items()}


def _report(
    config: _Config, run_: _Run, state: TrainState, loop: LoopInfo, path: Path
) -> tuple[int, int]:
    """Say what the resume from ``path`` did, on rank 0 alone (only its settings reach a
    manifest): every difference of the current settings ``run_.settings`` from the saved
    ones in one warning (``run_.settings`` then takes the saved optimizer and scheduler: what
    the resumed run goes on with, and what its saves record), then one line naming the
    checkpoint and the position. Returns the pass position in the current batches: those seen
    whole, and the samples seen of the next one."""
    seen, saved = state.batches_seen, read_manifest(path).settings
    was, now = _flat(saved), _flat(run_.settings)
    pairs = {k: (was.get(k, "-"), now.get(k, "-")) for k in sorted(was.keys() | now.keys())}
    changes = "; ".join(f"{k} {old} -> {new}" for k, (old, new) in pairs.items() if old != new)
    changed = f"checkpoints: the run in {str(config.folder)!r} started with other settings "
    changed += f"(saved -> now): {changes}"
    if saved and changes and config.on_change == "error":
        raise ValueError(
            f"{changed}, and on_change='error' refuses a change. Resume with the saved "
            "settings, or start afresh in another folder."
        )
    data = (loop.data, seen, saved.get("data", {}), run_.settings["data"], state.data_state)
    seen, part, where = seen_after_change(*data) if saved else (seen, 0, "")
    if saved and changes:
        run_.settings.update(optimizer=saved.get("optimizer"), scheduler=saved.get("scheduler"))
        warn(
            f"{changed}. The checkpoint's optimizer and scheduler values are used, the current "
            f"data and micro_batches (this pass goes on {where}). To start afresh, use another "
            "folder; on_change='error' refuses a change."
        )
    at = f"update {state.step}, epoch {state.epoch}, batch {seen}"
    if _ended(state, loop):
        at += "; the run had already reached its end (raise max_steps or epochs to go on)"
    print(f"checkpoints: resumed from {path} at {at}", file=sys.stderr, flush=True)
    return seen, part


def _ended(state: TrainState, loop: LoopInfo) -> bool:
    limits = ((loop.max_steps, state.step), (loop.epochs, state.epoch))
    return any(limit is not None and done >= limit for limit, done in limits)


def _resumed(config: _Config, run_: _Run, event: Event) -> TrainState:
    root, state, resume = config.folder, event.state, config.resume
    run_.settings = _settings(state, event.loop)  # the user's, before any load
    if resume is None and (found := list_checkpoints(root)):
        raise ValueError(
            f"checkpoints: {str(root)!r} already holds checkpoints "
            f"({', '.join(i.path.name for i in found[-3:])}) and resume=None; "
            "pass resume='latest' to continue from them, or use an empty folder."
        )
    path = None if resume in (None, "latest") else Path(resume)  # type: ignore[arg-type]
    if resume == "latest":
        state, path = load_latest(root, like=state, objects=config.objects) or (state, None)
        run_.saved_step = None if path is None else state.step
    elif path is not None:
        state = load_checkpoint(path, like=state, objects=config.objects)
    if path is None:
        return state
    where = on_rank0(run_.group, "checkpoints", _report, config, run_, state, event.loop, path)
    seen, part = (max_over_ranks(n, run_.group) for n in where or (0, 0))  # rank 0's
    split = {**state.data_state, "split": [seen, part]}  # unseen() leaves out `part` samples
    state = state._evolve({"batches_seen": seen, "data_state": split})
    if not state.batches_seen:  # between passes: the next one draws from the saved generators
        restore_generators(event.loop.data, state.data_state)
    return state


def _start(config: _Config, event: Event) -> tuple[_Run, TrainState]:
    if event.state.optimizer is not None:  # refuse what no save could name, before training
        parameter_names(event.state.model, event.state.optimizer)
    run_ = _Run(groups_of(event.state.model).everyone)
    expected = "False with a data-parallel model (DDP or FSDP2), whose ranks save together"
    check(run_.group is None or not config.background, "checkpoints", "background", expected, True)
    _install(config.signals, run_)
    try:
        readonly = on_rank0(run_.group, "checkpoints", _own, config.folder, run_)  # the others wait
        run_.readonly = bool(max_over_ranks(readonly or 0, run_.group))  # rank 0's
        state = _resumed(config, run_, event)
        if run_.readonly and not (_ended(state, event.loop) and run_.saved_step == state.step):
            fix = "copy it to writable storage and pass that, or pass another folder"
            ok, got = config.on_error == "warn", str(config.folder)
            expected, said = "writable storage, as this run saves checkpoints", "It is read-only"
            check(ok, "checkpoints", "folder", expected, got, f"{said}: {fix}.", PermissionError)
            said = f"checkpoints: {got!r} is read-only: nothing will be saved in this run"
            warn(f"{said} (on_error='warn'); to save, {fix}.")
    except BaseException:
        _release(run_)
        raise
    return run_, _stop(config, run_, state, event.loop) or state  # a signal while starting


def _release(run_: _Run, stopped: bool = False) -> None:
    """Unlock the folder (closing the lock file frees it); put the old handlers back (when
    ``stopped``, SIGINT's only, the others ignored at exit: see _end)."""
    if run_.lock is not None:
        _LOCKS.remove(run_.lock)
        os.ftruncate(run_.lock, 0)  # no holder named: the next run knows this one let it go
        os.close(run_.lock)
        run_.lock = None
    for signum, old in run_.handlers.items():
        if not stopped or signum == signal.SIGINT:
            signal.signal(signum, old)
        if stopped:  # at exit, Python puts SIG_DFL back: torchrun's SIGTERM would give -15
            atexit.register(signal.signal, signum, signal.SIG_IGN)


def _forget_locks() -> None:
    """In a forked child (a DataLoader worker): close the parent's lock files, whose locks
    the child would otherwise hold after the parent let them go, or died."""
    while _LOCKS:
        os.close(_LOCKS.pop())


os.register_at_fork(after_in_child=_forget_locks)


def _stop(config: _Config, run_: _Run, state: TrainState, loop: LoopInfo) -> TrainState | None:
    """At the start, and after every update (under data parallelism every SIGNAL_EVERY-th,
    where the ranks agree on the signals received): after a signal, save and stop."""
    if run_.group is not None and run_.steps % SIGNAL_EVERY:
        return None
    _share_signal(config, run_)
    if run_.signum is None:
        return None
    _save(config, run_, state, loop)
    name, where = signal.Signals(run_.signum).name, str(config.folder)
    return state.replace(stop=f"checkpoints: {name} received; saved step {state.step} in {where!r}")


def _end(config: _Config, run_: _Run, event: Event) -> None:
    error = event.error
    if error is not None:  # no exchange after an error: this rank's own signal is said
        run_.signum = run_.signum or run_.received
    try:
        if error is None:
            _share_signal(config, run_)  # a signal after the last update: all save, or none
            if open_ := event.state.window.micro_step:  # its gradients are in no state dict
                said = f"checkpoints: the run ended with an open accumulation window ({open_} "
                said += "micro-batches), which no checkpoint can hold; the newest checkpoint stays"
                warn(f"{said} step {run_.saved_step}.")
            elif run_.signum is not None or config.at_end:
                _save(config, run_, event.state, event.loop)
        _finish(config, run_)
        if error is None and run_.signum is None and config.keep.metric is not None:
            _best(config, event.state.model)
    except Exception as caught:
        if run_.signum is None or error is not None:
            raise
        error = caught  # the stop's save failed: said at the exit below
    finally:
        # After a signal, or any end of a data-parallel run, the process is on its way out
        # (torchrun sends SIGTERM to the ranks still tearing down when one exits): SIGTERM and
        # SIGUSR1 stay flag-only until it exits, so that none cuts short the "end" of the
        # plugins after this one, nor the exit; SIGINT's handler goes back, for a process
        # that goes on (a notebook catches the SystemExit).
        _release(run_, stopped=run_.signum is not None or run_.group is not None)
    if run_.signum is None:
        return
    said = f"checkpoints: {signal.Signals(run_.signum).name} was received"
    code = 128 + run_.signum if config.exit_code is None else config.exit_code
    if event.error is None:
        raise SystemExit(code if error is None else f"{said}; then the save failed: {error!r}")
    event.error.add_note(f"{said} too; this error replaces the exit with {code}")  # it goes on


@plugin_factory(order=80)
def checkpoints(
    folder: str | os.PathLike[str],
    *,
    every: int | None = None,
    per_epoch: bool = False,
    at_end: bool = True,
    keep: Retention = Retention(),  # noqa: B008 (frozen: one shared default is safe)
    resume: str | os.PathLike[str] | None = "latest",
    signals: Sequence[int] = _SIGNALS,
    exit_code: int | None = None,
    restore_best: bool = False,
    objects: Mapping[str, Any] | None = None,
    background: bool = False,
    on_error: str = "raise",
    on_change: str = "warn",
    trainable_only: bool = False,
) -> Plugin:
    """A plugin that saves checkpoints, keeps some, resumes from the newest, stops on a signal.

    docs/checkpoints.md tells the whole behaviour; the arguments come in four groups.

    **Saving** (:func:`toolkit.save_checkpoint` to ``folder/step_NNNNNN``, then the pointer
    ``folder/latest``, then pruning): after every ``every``-th applied update, at every
    ``"epoch_end"`` (``per_epoch``; inside an accumulation window, at the update that
    closes it), at the steps retention keeps, and at the end of a run that did not raise
    (``at_end``). Each save records the metrics other plugins made at that step, the data
    position and the run's settings. ``background=True`` writes in a thread (not under
    data parallelism); ``on_error="warn"`` lets training go on after a failed save;
    ``trainable_only`` saves the trainable parameters only (a LoRA adapter).

    **Retention** (``keep``, a :class:`toolkit.checkpoints.Retention`), decided from the
    manifests on disk: the union of its ``keep_last``, ``keep_every``, ``keep_steps`` and
    ``keep_best`` (by ``metric``, ``mode``) rules; the newest is never deleted; ``keep_full=N``
    reduces older kept checkpoints to the model. ``restore_best=True`` loads the best one's
    weights (by ``keep``'s metric) into the model at the end.

    **Resume** at ``"restore"``, before any plugin's ``"start"``: the folder is locked for
    this run (``folder/.lock``; a second run is refused; on read-only storage only a run
    with nothing to save goes on), leftovers of killed saves are removed, and
    ``resume="latest"`` loads the newest intact checkpoint (damaged ones are skipped with a
    warning) into the state and ``objects``; a checkpoint folder may be given;
    ``resume=None`` refuses a folder that holds checkpoints. Settings that differ
    from the saved ones are listed in one warning (``on_change="error"`` raises).

    **Preemption**: each of ``signals`` (SIGTERM, SIGUSR1, SIGINT) only sets a flag; the
    update finishes, the state is saved, every plugin's ``"end"`` runs and the process
    exits with ``exit_code`` (``None``: 128 + the signal). Under data parallelism the
    ranks agree on a signal every ``SIGNAL_EVERY`` (10) updates.

    Args:
        folder: the folder of checkpoints, e.g. ``"runs/a/ckpt"``.
        every, per_epoch, at_end, background, on_error, trainable_only: saving (above);
            ``every``: applied updates between saves (>= 1) or ``None``; ``on_error``:
            ``"raise"`` or ``"warn"``.
        keep, restore_best: retention (above), e.g.
            ``keep=Retention(keep_last=3, keep_best=2, metric="val/loss")``; the default
            keeps the newest checkpoint only; ``restore_best`` needs ``keep.keep_best >= 1``.
        resume, on_change, objects: resuming; ``resume``: ``"latest"``, a checkpoint
            folder or ``None``; ``on_change``: ``"warn"`` or ``"error"``; ``objects``:
            extra stateful objects (``state_dict``/``load_state_dict``) saved and loaded.
        signals, exit_code: preemption.

    Returns:
        The plugin, ``plugin(event) -> TrainState | None``.

    Raises:
        TypeError, ValueError: bad arguments; at ``"restore"``, a checkpoint that does not
            fit the state, ``resume=None`` with checkpoints in ``folder``, changed settings
            with ``on_change="error"``; a failing save with ``on_error="raise"``; a
            ``keep_best`` metric its plugin does not publish.
        RuntimeError: ``folder`` locked by another run, or its ``.lock`` not a regular file.
        PermissionError: ``folder`` is read-only and the run would save there (with
            ``on_error="warn"``: one warning, and nothing is saved).
        SystemExit: at ``"end"`` after a signal, with ``exit_code``.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, make_step, run
        >>> from toolkit.plugins import checkpoints
        >>> def fresh():
        ...     torch.manual_seed(0)
        ...     model = torch.nn.Linear(2, 1)
        ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ...     return TrainState(model=model, optimizer=optimizer)
        >>> step = make_step(lambda m, b: m(b).square().mean())
        >>> data = [torch.ones(4, 2)] * 4
        >>> state = run(step, fresh(), data, max_steps=6, plugins=[checkpoints("ckpt", every=2)])
        >>> sorted(p.name for p in __import__("pathlib").Path("ckpt").iterdir())
        ['.lock', 'latest', 'step_000006']
        >>> again = run(step, fresh(), data, max_steps=8, plugins=[checkpoints("ckpt", every=2)])
        >>> again.step  # resumed at 6, trained 2 more
        8
    """
    folder_ = check_path("checkpoints", "folder", folder)
    saving = (every, per_epoch, at_end, background, on_error, trainable_only)
    stopping = (signals if isinstance(signals, str) else tuple(signals), exit_code)
    config = _Config(folder_, objects, *saving, keep, restore_best, resume, on_change, *stopping)  # type: ignore[arg-type]
    live: dict[str, _Run] = {}  # one run at a time

    def plugin(event: Event) -> TrainState | None:
        if event.kind == "restore":
            live["run"], state = _start(config, event)
            return state
        if (run_ := live.get("run")) is None:
            return None
        if event.kind == "step":  # a save due after an update; a signal stops the run
            state, out, rules = event.state, event.out, config.keep
            due = run_.epoch_due or state.step in rules.keep_steps
            due = due or any(n and state.step % n == 0 for n in (config.every, rules.keep_every))
            if out is not None and out.updated and due:
                run_.epoch_due = False
                _save(config, run_, state, event.loop)
            run_.steps += 1
            return _stop(config, run_, state, event.loop)
        if event.kind == "epoch_end" and config.per_epoch:
            # Inside an accumulation window (its gradients fit in no checkpoint): saved at
            # the update that closes it.
            run_.epoch_due = bool(event.state.window.micro_step)
            if not run_.epoch_due:
                _save(config, run_, event.state, event.loop)
        elif event.kind == "end":
            _end(config, live.pop("run"), event)
        return None

    return plugin


def _best(config: _Config, model: torch.nn.Module) -> None:
    """``restore_best``: load the best checkpoint's weights into ``model``; and warn when no
    checkpoint holds the ``keep_best`` metric (a typo that no save could tell)."""
    infos = {i.name: i for i in list_checkpoints(config.folder) if i.intact and i.step is not None}
    rules = dataclasses.replace(config.keep, keep_best=1)  # the best one only
    kept = retain(((i.name, i.step, i.metrics) for i in infos.values()), rules)  # type: ignore[misc]
    best = [infos[name].path for name, why in kept.items() if "keep_best" in why]
    if best and config.restore_best:
        manifest = verified_manifest(best[0])
        put_model(model, full_model(manifest, partial=True), strict=manifest.frozen is None)
    elif not best:
        then = "; the model keeps its final weights." if config.restore_best else "."
        said = f"checkpoints: no checkpoint in {str(config.folder)!r} holds keep_best's "
        warn(f"{said}{config.keep.metric!r}: no plugin published it at a save (a typo?){then}")
