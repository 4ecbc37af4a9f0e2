"""checkpoints: save, keep, resume and stop on a signal, as a plugin of run()."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from toolkit._checks import check, check_count, check_one_of, check_path
from toolkit.checkpoints._folder import (
    clean_temporaries,
    list_checkpoints,
    load_latest,
    prune_checkpoints,
    write_pointer,
)
from toolkit.checkpoints._load import full_model, load_checkpoint, verified_manifest
from toolkit.checkpoints._model_state import parameter_names, put_model
from toolkit.checkpoints._retention import Retention, retain
from toolkit.checkpoints._save import save_checkpoint, save_in_background
from toolkit.distributed._collectives import Group, agree, group_of, max_over_ranks, rank_of
from toolkit.loop._data import position
from toolkit.loop._run import Event, Plugin, plugin_factory
from toolkit.plugins._shared import metric_entry
from toolkit.step._state import TrainState

__all__ = ["SIGNAL_EVERY", "checkpoints"]

_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_FLAGS = ("per_epoch", "at_end", "restore_best", "background")
SIGNAL_EVERY = 10  # data-parallel ranks agree on a received signal every this many updates


@dataclasses.dataclass(frozen=True)
class _Config:
    """The plugin's arguments (see :func:`checkpoints`), checked when made."""

    folder: str | os.PathLike[str]
    every: int | None
    per_epoch: bool
    at_end: bool
    keep_last: int
    keep_every: int | None
    keep_steps: Sequence[int]
    keep_best: Any
    resume: Any
    signals: Sequence[int]
    exit_code: int | None
    restore_best: bool
    objects: Mapping[str, Any] | None
    background: bool
    on_error: str
    rules: Retention = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        who, resume, code = "checkpoints", self.resume, self.exit_code
        check_path(who, "folder", self.folder)
        if self.every is not None:
            check_count(who, "every", self.every, 1, "applied updates between saves, or None")
        check_one_of(who, "on_error", self.on_error, ("raise", "warn"))
        ok = resume is None or isinstance(resume, (str, os.PathLike))
        check(ok, who, "resume", "'latest', a checkpoint folder or None", resume, "", TypeError)
        ok = all(isinstance(s, int) and not isinstance(s, bool) for s in self.signals)
        example = "a sequence of signal numbers, e.g. (signal.SIGTERM, signal.SIGUSR1)"
        check(ok, who, "signals", example, self.signals, "", TypeError)
        ok = code is None or type(code) is int
        check(ok, who, "exit_code", "an int or None", code, "", TypeError)
        for name in _FLAGS:
            value = getattr(self, name)
            check(type(value) is bool, who, name, "True or False", value, "", TypeError)
        best, triple = self.keep_best, isinstance(self.keep_best, (tuple, list))
        if best is not None or self.restore_best:
            example = "(metric, mode, count), e.g. ('val/loss', 'min', 3)"
            fix = "restore_best=True picks the best checkpoint by it." if self.restore_best else ""
            check(triple and len(best) == 3, who, "keep_best", example, best, fix, TypeError)
        metric, mode, count = best or (None, "min", 0)
        rules = Retention(
            self.keep_last, self.keep_every, tuple(self.keep_steps), count, metric, mode
        )
        object.__setattr__(self, "rules", rules)  # derived once; Retention checks its rules

    @property
    def root(self) -> Path:
        return Path(self.folder)


@dataclasses.dataclass(slots=True)
class _Run:
    """What the plugin remembers during one run."""

    group: Group | None  # the data-parallel group that saves together, if any
    saved_step: int | None = None  # the step of the newest checkpoint written or loaded
    signum: int | None = None  # set by the signal handler: only a flag, nothing else
    handlers: dict[int, Any] = dataclasses.field(default_factory=dict)
    writing: Future[Path] | Path | None = None  # a save whose pointer and pruning are due
    epoch_due: bool = False  # per_epoch: an epoch ended inside an accumulation window
    steps: int = 0  # "step" events seen: the ranks agree on signals every SIGNAL_EVERY


def _share_signal(config: _Config, run_: _Run) -> None:
    """Give every rank of the group the highest signal any rank received."""
    if run_.group is not None and config.signals:
        run_.signum = max_over_ranks(run_.signum or 0, run_.group) or None


def _fresh_metrics(state: TrainState) -> dict[str, float]:
    """The plugins' metrics made at this very step (a checkpoint's score for keep_best)."""
    metrics: dict[str, float] = {}
    for name, entry in state.extras.items():
        parsed = metric_entry(entry)
        if parsed is not None and parsed[0] == state.step:
            for key, value in parsed[1].items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    metrics[f"{name}/{key}"] = float(value)
    return metrics


def _failed(config: _Config, error: BaseException) -> None:
    if config.on_error == "raise":
        raise error
    message = f"checkpoints: a save failed and training goes on (on_error='warn'): {error}"
    warnings.warn(message, RuntimeWarning, stacklevel=5)


def _finish(config: _Config, run_: _Run) -> None:
    """Wait for the save in flight; then rank 0 moves the pointer and prunes (after success)."""
    writing, run_.writing = run_.writing, None
    if writing is None:
        return
    try:
        path = writing.result() if isinstance(writing, Future) else writing
        problem = None
        try:
            if rank_of(run_.group)[0] == 0:
                write_pointer(config.root, path)
                prune_checkpoints(config.root, config.rules)
        except Exception as caught:
            problem = caught
        agree(problem, run_.group, "checkpoints")  # the other ranks wait for rank 0
    except Exception as error:
        _failed(config, error)


def _save(config: _Config, run_: _Run, state: TrainState, data: Any) -> None:
    if run_.saved_step == state.step:
        return
    _finish(config, run_)
    path = config.root / f"step_{state.step:06d}"
    state = state.replace(data_state=position(data, state.data_state))
    save = save_in_background if config.background else save_checkpoint
    try:
        run_.writing = save(
            state, path, objects=config.objects, metrics=_fresh_metrics(state), rules=config.rules
        )
    except Exception as error:
        _failed(config, error)
        return
    run_.saved_step = state.step
    if not config.background:
        _finish(config, run_)


def _install(config: _Config, run_: _Run) -> None:
    def handler(signum: int, frame: Any) -> None:
        run_.signum = signum  # only a flag: the loop acts on it between updates

    if threading.current_thread() is not threading.main_thread():  # Python allows no other
        if config.signals:
            names = [signal.Signals(s).name for s in config.signals]
            warnings.warn(
                f"checkpoints: run() is not on the main thread, where Python delivers signals; "
                f"{names} keep their handlers.",
                RuntimeWarning,
                stacklevel=5,
            )
        return
    for signum in config.signals:
        run_.handlers[signum] = signal.signal(signum, handler)


def _resumed(config: _Config, run_: _Run, state: TrainState) -> TrainState:
    root = config.root
    if config.resume == "latest":
        loaded = load_latest(root, like=state, objects=config.objects)
        if loaded is not None:
            state = loaded[0]
            run_.saved_step = state.step
    elif config.resume is not None:
        state = load_checkpoint(config.resume, like=state, objects=config.objects)
    elif found := list_checkpoints(root):
        raise ValueError(
            f"checkpoints: {str(root)!r} already holds checkpoints "
            f"({', '.join(i.path.name for i in found[-3:])}) and resume=None; "
            "pass resume='latest' to continue from them, or use an empty folder."
        )
    return state


def _start(config: _Config, event: Event) -> tuple[_Run, TrainState]:
    if event.state.optimizer is not None:  # refuse what no save could name, before training
        parameter_names(event.state.model, event.state.optimizer)
    run_ = _Run(group_of(event.state.model))
    expected = "False with a data-parallel model (DDP or FSDP2), whose ranks save together"
    check(run_.group is None or not config.background, "checkpoints", "background", expected, True)
    _install(config, run_)
    error = None
    try:
        if rank_of(run_.group)[0] == 0:  # one rank cleans; the others wait for it in agree()
            config.root.mkdir(parents=True, exist_ok=True)
            clean_temporaries(config.root)
    except Exception as caught:
        error = caught
    agree(error, run_.group, "checkpoints")
    state = _resumed(config, run_, event.state)
    _share_signal(config, run_)
    if run_.signum is not None:  # a signal while starting: stop before any update
        state = _stop(config, run_, state, event.loop.data)
    return run_, state


def _stop(config: _Config, run_: _Run, state: TrainState, data: Any) -> TrainState:
    assert run_.signum is not None
    _save(config, run_, state, data)
    name = signal.Signals(run_.signum).name
    return state.replace(
        stop=f"checkpoints: {name} received; saved step {state.step} in {str(config.root)!r}"
    )


def _on_step(config: _Config, run_: _Run, event: Event) -> TrainState | None:
    state, out = event.state, event.out
    due = run_.epoch_due or (config.every is not None and state.step % config.every == 0)
    if out is not None and out.updated and due:
        run_.epoch_due = False
        _save(config, run_, state, event.loop.data)
    run_.steps += 1
    if run_.steps % SIGNAL_EVERY == 0:
        _share_signal(config, run_)
    if run_.signum is not None and (run_.group is None or run_.steps % SIGNAL_EVERY == 0):
        return _stop(config, run_, state, event.loop.data)
    return None


def _end(config: _Config, run_: _Run, event: Event) -> None:
    try:
        if event.error is None:
            _share_signal(config, run_)  # a signal after the last update: all save, or none
            if event.state.window.micro_step:
                # Its gradients are in no state dict, and its batches are counted as seen.
                warnings.warn(
                    f"checkpoints: the run ended with an open accumulation window "
                    f"({event.state.window.micro_step} micro-batches), which no checkpoint "
                    f"can hold; the newest checkpoint stays step {run_.saved_step}.",
                    RuntimeWarning,
                    stacklevel=4,
                )
            elif run_.signum is not None or config.at_end:
                _save(config, run_, event.state, event.loop.data)
        _finish(config, run_)
        if event.error is None and config.restore_best and run_.signum is None:
            _restore_best(config.root, config.rules, event.state.model)
    finally:
        for signum, old in run_.handlers.items():
            signal.signal(signum, old)
    if run_.signum is not None:
        raise SystemExit(128 + run_.signum if config.exit_code is None else config.exit_code)


@plugin_factory(order=80)
def checkpoints(
    folder: str | os.PathLike[str],
    *,
    every: int | None = None,
    per_epoch: bool = False,
    at_end: bool = True,
    keep_last: int = 1,
    keep_every: int | None = None,
    keep_steps: Sequence[int] = (),
    keep_best: tuple[str, str, int] | None = None,
    resume: str | os.PathLike[str] | None = "latest",
    signals: Sequence[int] = _SIGNALS,
    exit_code: int | None = None,
    restore_best: bool = False,
    objects: Mapping[str, Any] | None = None,
    background: bool = False,
    on_error: str = "raise",
) -> Plugin:
    """A plugin that saves checkpoints, keeps some, resumes from the newest, stops on a signal.

    **Saving.** After every ``every``-th applied update, at every ``"epoch_end"``
    (``per_epoch``; when the epoch ends inside an accumulation window, at the update that
    closes it), once more at the end of a run that did not raise (``at_end``), and when a
    configured signal arrived, the state is written with :func:`toolkit.save_checkpoint`
    to ``folder/step_NNNNNN`` (atomically), with the
    metrics other plugins made at that very step (``{"val/loss": ...}``, for ``keep_best``)
    and a stateful loader's position; then the pointer ``folder/latest`` is replaced and
    retention prunes the folder. ``background=True`` writes in a thread and blocks the loop
    only for a host copy of the tensors; the next save, the pointer and pruning wait for it.

    **Retention** is decided from what is on disk, so it holds across restarts: a checkpoint
    stays when any rule keeps it: the ``keep_last`` newest, every ``keep_every`` updates,
    ``keep_steps``, and the ``count`` best by ``keep_best=(metric, "min"|"max", count)``. The
    newest is never deleted. ``python -m toolkit.checkpoints FOLDER`` lists them and why.

    **Resume.** At ``"start"``, leftover temporary folders of a killed save are removed, and
    with ``resume="latest"`` the newest intact checkpoint (damaged ones are skipped with a
    warning) is loaded into the state (model, scheduler, optimizer, scaler, RNG states, data
    position, extras), which is returned: the same command starts and resumes a job. A
    checkpoint folder may be given instead; with ``resume=None`` a folder that already holds
    checkpoints is refused rather than mixed with a new run.

    **Signals.** For each of ``signals`` (SIGTERM and SIGUSR1 by default, as SLURM and
    Kubernetes send them before preemption) the handler only sets a flag (Python delivers
    signals to the main thread only: a run() on another thread installs none). The update in
    progress finishes, the state is saved (unless this step already was), the loop stops,
    every plugin's ``"end"`` runs, and the process exits with ``exit_code`` (default
    ``128 + signal``: 143 for SIGTERM; 0 suits setups that requeue on success). A signal
    during a save waits for it; one before the first update stops the run at once.

    **Data parallel (DDP, FSDP2).** Put the plugin on every rank, with the same arguments.
    Saves are collective (see :func:`toolkit.save_checkpoint`: DDP's rank 0 writes, FSDP2's
    ranks write their shards; every rank keeps its own RNG states); the pointer and pruning
    are rank 0's; ``resume="latest"`` loads the checkpoint rank 0 picked, on every rank. A
    signal delivered to one rank only stops every rank after the same update, with one
    checkpoint: every ``SIGNAL_EVERY`` (10) updates the ranks all-reduce the flag (one small
    all-reduce, only when ``signals`` is not empty; every rank checks at the same updates,
    so all stop after the same one), and once more at ``"start"`` and ``"end"``.
    The folder must be on a file system every rank sees. ``background=True`` is refused
    there.

    **Order in the plugin list.** Put ``checkpoints`` after the plugins whose state it
    saves at a step (``ema``, ``validate``, ``early_stop``, and ``log_metrics`` when it
    keeps run ``totals``) and before those that only report (``progress``, a
    ``log_metrics`` without totals). ``log_metrics`` starts its sinks at the first event
    after ``"start"``, so its logs follow the restored step wherever it stands. Plugins
    before it must accept that their ``"start"`` state is replaced (toolkit's do).
    ``restore_best=True`` loads the best checkpoint's weights (by ``keep_best``) into
    the model at the end of a run that did not raise or stop on a signal.

    Args:
        folder: the folder of checkpoints, e.g. ``"runs/a/ckpt"``.
        every: save after every this many applied updates (>= 1), or ``None``.
        per_epoch: save at the end of every pass over the data, after the plugins before
            it in the list (a ``validate(per_epoch=True)`` there gives ``keep_best`` its
            score). A step already saved by ``every`` is not written again.
        at_end: save when the run ends (not when training raised, nor with an accumulation
            window still open: no checkpoint holds its gradients).
        keep_last: keep the newest this many (>= 0; the newest is kept anyway).
        keep_every: keep the checkpoints whose step is a multiple of this.
        keep_steps: keep the checkpoints of these steps.
        keep_best: ``(metric, mode, count)``: keep the best ``count`` by ``metric``.
        resume: ``"latest"``, a checkpoint folder to load, or ``None``.
        signals: the signal numbers that save and stop the run.
        exit_code: the exit status after a signal; ``None`` for ``128 + signal``.
        restore_best: load the best checkpoint's weights into the model at the end.
        objects: extra stateful objects (``state_dict``/``load_state_dict``) saved with the
            state and loaded into on resume.
        background: write in a background thread.
        on_error: ``"raise"`` a failing save (earlier checkpoints stay intact) or ``"warn"``
            and keep training.

    Returns:
        The plugin, ``plugin(event) -> TrainState | None``.

    Raises:
        TypeError, ValueError: bad arguments (named in the message); at ``"start"``, a
            checkpoint that does not fit the state, or ``resume=None`` with checkpoints in
            ``folder``; a failing save with ``on_error="raise"``.
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
        ['latest', 'step_000006']
        >>> again = run(step, fresh(), data, max_steps=8, plugins=[checkpoints("ckpt", every=2)])
        >>> again.step  # resumed at 6, trained 2 more
        8
    """
    config = _Config(**locals())  # the arguments, checked
    live: dict[str, _Run] = {}  # one run at a time

    def plugin(event: Event) -> TrainState | None:
        run_ = live.get("run")
        if event.kind == "restore":
            live["run"], state = _start(config, event)
            return state
        if run_ is None:
            return None
        if event.kind == "step":
            return _on_step(config, run_, event)
        if event.kind == "epoch_end" and config.per_epoch:
            if event.state.window.micro_step:  # its gradients fit in no checkpoint
                run_.epoch_due = True
            else:
                _save(config, run_, event.state, event.loop.data)
        if event.kind == "end":
            _end(config, live.pop("run"), event)
        return None

    return plugin


def _restore_best(root: Path, rules: Retention, model: torch.nn.Module) -> None:
    """Load the best checkpoint's weights into ``model``."""
    infos = {i.name: i for i in list_checkpoints(root) if i.intact and i.step is not None}
    best_only = dataclasses.replace(rules, keep_best=1)
    kept = retain(((i.name, i.step, i.metrics) for i in infos.values()), best_only)  # type: ignore[misc]
    best = [name for name, why in kept.items() if "keep_best" in why]
    if best:
        put_model(model, full_model(verified_manifest(infos[best[0]].path)))
    else:
        warnings.warn(
            f"checkpoints: restore_best found no checkpoint with {rules.metric!r} in "
            f"{str(root)!r}; the model keeps its final weights.",
            RuntimeWarning,
            stacklevel=4,
        )
