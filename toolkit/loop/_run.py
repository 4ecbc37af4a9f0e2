"""run(): thread a TrainState through a train step over data, calling plugins."""

import dataclasses
import functools
import inspect
import itertools
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple, TypeVar

from torch.optim.lr_scheduler import ReduceLROnPlateau

from toolkit._checks import check_count, check_one_of, check_type, warn
from toolkit._unwrap import unwrap
from toolkit.distributed._collectives import check_even, groups_of
from toolkit.loop._data import batches_per_epoch, is_stateful, snapshot, split_at, unseen
from toolkit.step._multi import epoch_schedulers
from toolkit.step._state import TrainState
from toolkit.step._step import StepOutput

EventKind = Literal["restore", "start", "epoch_start", "step", "epoch_end", "end"]
PartialWindow = Literal["carry", "epoch", "end"]


@dataclasses.dataclass(frozen=True)
class LoopInfo:
    """Facts about the run that plugins may need (for ETA, totals, cadence).

    Attributes:
        max_steps: the update budget given to :func:`run`, or ``None``.
        epochs: the epoch budget given to :func:`run`, or ``None``.
        batches_per_epoch: ``len(data)`` when the data has a length, else ``None``.
        micro_batches: micro-batches per update of the step (1 without accumulation).
        start_step: ``state.step`` when this run started (> 0 after a resume).
        total_steps: the number of updates the run will reach, when it can be known.
        data: the data source given to :func:`run` (a checkpoint plugin records a stateful
            loader's position from it).

    Example:
        >>> import torch
        >>> from toolkit import TrainState, accumulate, make_step, run
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> step = accumulate(make_step(lambda m, b: m(b).mean()), micro_batches=2)
        >>> infos = []
        >>> _ = run(step, state, [torch.ones(1, 2)] * 4, epochs=3,
        ...         plugins=[lambda e: infos.append(e.loop) if e.kind == "start" else None])
        >>> infos[0].batches_per_epoch, infos[0].micro_batches, infos[0].total_steps
        (4, 2, 6)
    """

    max_steps: int | None
    epochs: int | None
    batches_per_epoch: int | None
    micro_batches: int
    start_step: int
    total_steps: int | None
    data: Any = dataclasses.field(default=None, repr=False, compare=False)


class Event(NamedTuple):
    """What :func:`run` passes to every plugin.

    Attributes:
        kind: ``"restore"`` (first: a plugin that loads a checkpoint returns the restored
            state; the others ignore it), ``"start"`` (before the first batch),
            ``"epoch_start"`` (before each pass over the data, a resumed pass included:
            then ``state.batches_seen > 0``, unless a changed batch size split its first batch),
            ``"step"`` (once per optimizer update:
            after the micro-batch that closes an accumulation window, whether the update
            was applied, rejected by the guard or skipped by the fp16 scaler),
            ``"epoch_end"`` (after a full pass over the data, ``state.epoch`` already
            advanced) or ``"end"`` (always last, also when training raised).
        state: the current state.
        loop: the run's :class:`LoopInfo`.
        out: the output of the closing micro-batch, which carries ``updated``, ``lr``,
            ``grad_norm`` (``"step"`` events only; ``outs[-1]``).
        data_time: seconds spent waiting for the window's batches (``"step"`` events only).
        step_time: seconds the window's step calls took on the host (``"step"`` events only;
            on an accelerator this is launch time unless the step synchronised).
        error: the exception that ended training (``"end"`` events only), else ``None``.
        outs: the outputs of every micro-batch of the window, in order, skipped ones
            included (``"step"`` events); at ``"end"``, those of a window left open.
        batches: the window's batches as the data gave them, in the order of ``outs``
            (the same objects, not copies; ``"step"`` events, and at ``"end"`` those of a
            window left open): a plugin sees each micro-batch's inputs next to what the
            loss function returned for it (put model outputs in its records).

    Example:
        >>> import torch
        >>> from toolkit import TrainState, accumulate, make_step, run
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> step = accumulate(make_step(lambda m, b: m(b).mean()), micro_batches=2)
        >>> seen = []
        >>> _ = run(step, state, [torch.ones(1, 2)] * 4, epochs=1,
        ...         plugins=[lambda event: seen.append((event.kind, len(event.outs)))])
        >>> seen  # doctest: +NORMALIZE_WHITESPACE
        [('restore', 0), ('start', 0), ('epoch_start', 0), ('step', 2), ('step', 2),
         ('epoch_end', 0), ('end', 0)]
    """

    kind: EventKind
    state: TrainState
    loop: LoopInfo
    out: StepOutput | None = None
    data_time: float = 0.0
    step_time: float = 0.0
    error: BaseException | None = None
    outs: tuple[StepOutput, ...] = ()
    batches: tuple[Any, ...] = ()


Plugin = Callable[[Event], "TrainState | None"]
F = TypeVar("F", bound=Callable[..., Any])


def _set_epoch(data: Any, epoch: int) -> None:
    # DataLoader(sampler=DistributedSampler) and friends reshuffle per epoch through this.
    sampler, batch_sampler = getattr(data, "sampler", None), getattr(data, "batch_sampler", None)
    for owner in (data, sampler, batch_sampler, getattr(batch_sampler, "sampler", None)):
        if callable(getattr(owner, "set_epoch", None)):
            return owner.set_epoch(epoch)  # type: ignore[union-attr, no-any-return]


def _counted(loop: LoopInfo, state: TrainState, partial: PartialWindow) -> LoopInfo:
    """``loop`` with the run's start step and total number of updates, from ``state``."""
    epochs, batches, k = loop.epochs, loop.batches_per_epoch, loop.micro_batches
    total = loop.max_steps
    if epochs is not None and batches is not None:
        left = 0
        if epochs > state.epoch:
            # Micro-batches of a window left open by the previous run still count toward it.
            this = batches - state.batches_seen + state.window.micro_step
            passes = epochs - state.epoch - 1
            if partial == "epoch":  # every pass ends with a window of its own, however short
                left = -(-this // k) + passes * -(-batches // k)
            else:  # "end" applies the last short window, "carry" never does
                left = (this + passes * batches + (k - 1 if partial == "end" else 0)) // k
        total = state.step + left if total is None else min(total, state.step + left)
    return dataclasses.replace(loop, start_step=state.step, total_steps=total)


def _validate(state: Any, data: Any, max_steps: Any, epochs: Any, plugins: Any) -> None:
    fix = "The order is run(step, state, data, max_steps=...)."
    check_type(isinstance(state, TrainState), "run", "state", "a TrainState", state, fix)
    if max_steps is None and epochs is None:
        raise ValueError("run: give max_steps and/or epochs; got neither, so it would never end.")
    for name, value in (("max_steps", max_steps), ("epochs", epochs)):
        if value is not None:
            check_count("run", name, value, 0)
        if value == 0:  # e.g. a budget read from a config that lost its value
            warn(f"run: {name}=0: no update will run; give {name} >= 1, or evaluate() alone.")
    ok = isinstance(data, Iterable) and not isinstance(data, (Mapping, str, bytes))
    fix = "To train on one batch n times, pass [batch] * n."
    check_type(ok, "run", "data", "an iterable of batches (a DataLoader, a list)", data, fix)
    if epochs is not None and isinstance(data, Iterator):
        raise ValueError(
            f"run: epochs needs data that can be iterated again; got a one-shot "
            f"{type(data).__name__}; pass the DataLoader itself, or use max_steps."
        )
    if callable(plugins) or not isinstance(plugins, Sequence) or isinstance(plugins, str):
        got = "a single plugin" if callable(plugins) else type(plugins).__name__
        raise TypeError(f"run: plugins must be a list of plugins; got {got}; pass [plugin].")
    for i, plugin in enumerate(plugins):
        if plugin in FACTORIES or not callable(plugin):
            got = "an uncalled plugin factory" if plugin in FACTORIES else type(plugin).__name__
            raise TypeError(
                f"run: plugins[{i}] must be a plugin, plugin(event); got {got} ({plugin!r:.40}); "
                "build it first: plugins=[progress()]."
            )


# The plugin factories of toolkit.plugins (added by plugin_factory), so that run() can tell
# `plugins=[progress]` (the factory, not called) from a plugin.
FACTORIES: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
USER_ORDER = 50  # where a plugin without an ``order`` runs among the built-in ones
EVAL_MODE = (  # a warning: dropout off and batch norm frozen for the whole run
    "run: the model is in eval mode (no dropout, batch norm frozen); call model.train() first, "
    "or if meant: warnings.filterwarnings('ignore', 'run: the model is in eval mode')"
)


def plugin_factory(order: int) -> Callable[[F], F]:
    """Mark a function that builds a plugin: run() refuses it uncalled, and calls the plugins
    it builds at ``order`` among the others (lower first; :func:`run` lists the orders),
    named after the factory (in run()'s messages)."""

    def mark(factory: F) -> F:
        @functools.wraps(factory)
        def build(*args: Any, **kwargs: Any) -> Any:
            plugin = factory(*args, **kwargs)
            plugin.order, plugin.__name__ = order, factory.__name__
            return plugin

        FACTORIES.add(build)
        return build  # type: ignore[return-value]

    return mark


def declare(plugin: Plugin, key: str | None, steps_plateau: bool = False) -> Plugin:
    """``plugin`` with what it writes declared, for run()'s check before training: ``key``,
    the ``state.metrics``/``state.extras`` name; ``steps_plateau``, whether it steps a
    ``ReduceLROnPlateau`` in ``state.scheduler``."""
    vars(plugin).update(key=key, steps_plateau=steps_plateau)
    return plugin


def _check_plugins(plugins: Sequence[Plugin], state: TrainState) -> None:
    """One key per plugin; a ReduceLROnPlateau in the state stepped by exactly one."""
    keys: dict[str, str] = {}
    named: list[str] = []  # the plugins stepping a ReduceLROnPlateau
    for plugin in plugins:
        key, name = getattr(plugin, "key", None), getattr(plugin, "__name__", repr(plugin))
        if getattr(plugin, "steps_plateau", False):
            named.append(f"{name}(key={key!r})")
        if key in keys:
            raise ValueError(
                f"{name}: key {key!r} is already kept by {keys[key]} in this run; two plugins "
                f"writing one key would overwrite each other's memory. Give each its own key, "
                f"e.g. {name}(..., key={key + '_2'!r}) (and the same key to whatever reads it, "
                "such as early_stop or ema_model)."
            )
        if key is not None:
            keys[key] = name
    if isinstance(state.scheduler, ReduceLROnPlateau) and not named:
        raise ValueError(
            "run: state.scheduler is a ReduceLROnPlateau, which the train step leaves alone (it "
            "needs a metric), and no plugin of this run steps it, so the learning rate would "
            "never be reduced. Pass the metric to step it with, e.g. "
            "validate(..., plateau_metric='loss')."
        )
    if len(named) > 1:
        raise ValueError(
            f"{named[1]}: state.scheduler, a ReduceLROnPlateau, is already stepped by {named[0]} "
            "in this run; a second one would step it twice per evaluation. Give plateau_metric "
            "to one validate."
        )


def _call(plugins: Sequence[Plugin], event: Event) -> TrainState:
    for plugin in plugins:
        new = plugin(event)
        if new is not None:
            if not isinstance(new, TrainState):
                got = f"{getattr(plugin, '__name__', plugin)!r} returned {type(new).__name__}"
                raise TypeError(f"plugin {got}; expected a TrainState or None.")
            event = event._replace(state=new)
    return event.state


def run(
    step: Callable[[TrainState, Any], tuple[TrainState, StepOutput]],
    state: TrainState,
    data: Iterable[Any],
    *,
    max_steps: int | None = None,
    epochs: int | None = None,
    plugins: Sequence[Plugin] = (),
    partial_window: PartialWindow = "carry",
) -> TrainState:
    """Train: feed batches from ``data`` to ``step``, threading the state, calling plugins.

    Stops at the first of: ``state.step == max_steps`` applied updates; ``state.epoch ==
    epochs`` completed passes over ``data``; a plugin setting ``state.stop`` (a reason
    string); a one-shot iterator running out. A finite re-iterable ``data`` (DataLoader,
    list) is iterated again for each epoch, after calling ``set_epoch(epoch)`` on it or on
    its sampler when they have one. Any source works: map-style and iterable DataLoaders
    (with or without a length), lists, generators, ``iter(loader)``.

    Before each fresh pass, run() records in ``state.data_state`` the RNG states the pass
    draws its order from. A resumed state (``state.batches_seen > 0``, e.g. from a
    checkpoint) continues its pass exactly: the same batches in the same order, the ones
    already seen skipped without being loaded (a DataLoader over a map-style dataset skips
    index batches; a list skips items; torchdata's StatefulDataLoader restores its own
    position). Sources that cannot skip unread (an IterableDataset without state, a
    one-shot iterator) read the seen batches again and drop them, with a warning naming
    the reason and the fix; so does a DataLoader with ``persistent_workers=True``, whose
    order after a resume differs.

    An accumulation window that the data's end leaves short (fewer than ``micro_batches``
    micro-batches) is, by ``partial_window``: ``"carry"`` (the default) continued by the
    next pass, so windows may straddle epochs and a window open when the run ends is not
    applied; ``"epoch"`` applied at every pass's end (a pass of 45 batches with
    ``accumulate(micro_batches=2)`` makes 23 updates, as pytorch_accelerated does); or
    ``"end"`` carried across passes and applied at the end of the last one (or of a
    one-shot iterator). An applied short window is normalised exactly: the mean over its
    micro-batches (by the total count with :class:`LossSum`), through the step's
    ``close=True``. The pass's last batch is known from ``len(data)``, or else by reading
    one batch ahead (a stateful loader's saved position is then one batch ahead too).
    Under data parallelism every rank must have as many batches (``DistributedSampler``
    pads them so).

    A scheduler marked :func:`toolkit.per_epoch` in ``state.scheduler`` (alone or in a
    list) is stepped at every completed pass, right before the ``"epoch_end"`` plugins.

    Plugins are plain functions ``plugin(event) -> TrainState | None`` (see :class:`Event`), called
    (in the order below) at ``"restore"`` and ``"start"``, at ``"epoch_start"`` before each pass,
    once per optimizer update (``"step"``, with the outputs of the window's micro-batches in
    ``event.outs`` and their batches in ``event.batches``), at ``"epoch_end"`` and at ``"end"``. The
    state is the same between updates (only the accumulation window moves), so a plugin sees every
    change of ``state.step``, and a stop request takes effect at the next update. A returned state
    replaces the current one and the next plugin sees it. **Order.** run() calls the plugins by
    their ``order`` attribute, lower first, the list order breaking ties: ema 10, validate and
    peak_memory 20, early_stop 30, yours 50 (a function without ``order``), log_metrics, log_images
    and profile 60, checkpoints 80, progress 90; so each sees what the ones before it made of the
    same update, wherever it stands in the list. To place a plugin of your own elsewhere, set it:
    ``my_plugin.order = 70`` (after the metrics are published, before the checkpoint);
    :func:`plugin_factory` does that for a factory.

    **What plugins publish.** A plugin that measures publishes in ``state.metrics[name]`` (a
    :class:`toolkit.Metrics`: its step and values; ``log_metrics``, ``progress``,
    ``early_stop`` and ``checkpoints`` read it there) and keeps its own memory, which
    checkpoints persist, in ``state.extras[name]``; a stop request is ``state.stop``. A
    plugin's ``key`` attribute names the entry it writes, and ``steps_plateau`` (true) says it
    steps a ``ReduceLROnPlateau`` in ``state.scheduler`` (``validate(plateau_metric=)``). After
    ``"restore"``, run() refuses two plugins with one ``key``, and a ``ReduceLROnPlateau``
    stepped by no plugin (its learning rate would never drop) or by two.

    ``"end"`` reaches every plugin even when training raised (then ``event.error`` is set and the
    exception propagates after all of them ran, their own failures attached as notes); when
    training ended well, a plugin failing at ``"end"`` is reported as a ``RuntimeWarning``
    and the trained state is still returned. The data iterator (and its worker pool) is
    closed on every exit.

    A model in eval mode (``unwrap(state.model).training`` False once the ``"start"``
    plugins ran; ``from_pretrained`` returns models so) would train the whole run with
    dropout off and batch norm frozen: run() warns (``RuntimeWarning``). When eval mode is
    meant, ``warnings.filterwarnings("ignore", "run: the model is in eval mode")``.

    A whole pass over re-iterable data in which no micro-batch was accepted (no batch at
    all, or the loss function skipped every one) would repeat forever: it raises when only
    ``max_steps`` bounds the run, and warns (once) when ``epochs`` does.

    Args:
        step: a train step, usually from :func:`make_step` and its decorators.
        state: the starting :class:`TrainState` (``state.stop`` is cleared).
        data: an iterable of batches.
        max_steps: stop after this many applied updates in total (not per run).
        epochs: stop after this many passes over ``data`` in total. Either at 0 warns
            (``RuntimeWarning``): no update would run.
        plugins: plugin functions, called by their ``order`` (see above).
        partial_window: ``"carry"``, ``"epoch"`` or ``"end"``: what becomes of a window the
            data's end leaves short (see above).

    Returns:
        The final state.

    Raises:
        ValueError: neither ``max_steps`` nor ``epochs``, a negative budget, ``epochs``
            with a one-shot iterator, an unknown ``partial_window``; a pass without an
            accepted micro-batch under ``max_steps`` alone; two plugins with one ``key``,
            a ``ReduceLROnPlateau`` that no plugin steps, or two; under data parallelism (a DDP
            or FSDP2 model), ranks whose ``data`` have different lengths (checked once, at
            the start, with one all-reduce).
        TypeError: ``state`` not a TrainState; ``data`` not an iterable of batches (a
            mapping iterates over its keys); ``plugins`` not a list of plugin functions (or
            holding an uncalled factory); a step not returning ``(TrainState, StepOutput)``;
            a plugin returning something else than a TrainState or None; a
            ``partial_window`` other than ``"carry"`` with a step that takes no ``close=``.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, make_step, run
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> data = [torch.randn(4, 2) for _ in range(3)]
        >>> state = run(make_step(lambda m, b: m(b).square().mean()), state, data, epochs=2)
        >>> state.step, state.epoch
        (6, 2)
    """
    _validate(state, data, max_steps, epochs, plugins)
    plugins = sorted(plugins, key=lambda plugin: getattr(plugin, "order", USER_ORDER))
    _check_partial(step, partial_window)
    k = getattr(getattr(step, "accumulation", None), "micro_batches", 1)
    batches = batches_per_epoch(data)
    # Ranks whose passes differ in length would hang in the step's collectives at the end of
    # the shortest: one all-reduce per run (none without data parallelism) refuses that.
    check_even(batches, groups_of(state.model).everyone)
    state = state.replace(stop=None) if state.stop is not None else state
    loop = _counted(LoopInfo(max_steps, epochs, batches, k, 0, None, data), state, partial_window)
    window = _BetweenPasses()
    error: BaseException | None = None
    try:
        # Restoring comes first, so that every plugin starts from the restored state.
        state = _call(plugins, Event("restore", state, loop))
        _check_plugins(plugins, state)
        loop = _counted(loop, state, partial_window)
        state = _call(plugins, Event("start", state, loop))
        if not unwrap(state.model).training:  # from_pretrained's models come in eval mode
            warn(EVAL_MODE)
        while not _done(state, loop):
            _set_epoch(data, state.epoch)
            state = _call(plugins, Event("epoch_start", state, loop))
            if _done(state, loop):
                break
            state, ran_out = _pass(step, state, loop, plugins, window, partial_window)
            if not ran_out:
                break
            # The next pass is fresh: its batch 0 is not one that a batch size change split.
            kept = {k: v for k, v in state.data_state.items() if k != "split"}
            state = state._evolve({"epoch": state.epoch + 1, "batches_seen": 0, "data_state": kept})
            # Before the plugins: a checkpoint taken at "epoch_end" holds the stepped one.
            for scheduler in epoch_schedulers(state.scheduler):
                scheduler.step()
            state = _call(plugins, Event("epoch_end", state, loop))
            if isinstance(data, Iterator):
                break
    except BaseException as exc:
        error = exc
        raise
    finally:
        outs, batches_ = tuple(window.outs), tuple(window.batches)
        end = Event("end", window.failed or state, loop, None, 0.0, 0.0, error, outs, batches_)
        try:
            state = _end(plugins, end)
        finally:  # error's traceback holds this frame: no cycle may keep the model alive
            del error, end  # (a DDP model's gloo threads at exit: docs/distributed.md)
    return state


@dataclasses.dataclass(slots=True)
class _BetweenPasses:
    """What run() carries from pass to pass: the open accumulation window (a window may span
    the epoch boundary), how far a pass that raised got, and the warnings given once."""

    outs: list[StepOutput] = dataclasses.field(default_factory=list)
    batches: list[Any] = dataclasses.field(default_factory=list)  # references, not copies
    times: tuple[float, float] = (0.0, 0.0)  # the open window's data and step time so far
    failed: TrainState | None = None  # the state when a pass raised, its batches counted
    warned: bool = False  # an inexact resume was reported
    stalled: bool = False  # a pass without progress was reported


def _pass(
    step: Callable[..., tuple[TrainState, StepOutput]], state: TrainState, loop: LoopInfo,
    plugins: Sequence[Plugin], window: _BetweenPasses, partial_window: PartialWindow,
) -> tuple[TrainState, bool]:  # fmt: skip
    """One pass over the data (its rest when resumed); whether the data ran out."""
    one_shot = isinstance(loop.data, Iterator)
    # Close the window on the pass's last batch: at every pass's end, or the last.
    last_pass = one_shot or (loop.epochs is not None and state.epoch + 1 >= loop.epochs)
    flush = partial_window == "epoch" or (partial_window == "end" and last_pass)
    resumed = state.batches_seen > 0  # a partial pass may hold nothing new
    state, iterator = _open(state, loop.data, window)
    pairs = _with_last(iterator, flush, loop.batches_per_epoch, state.batches_seen)
    outs, batches, (data_time, step_time) = window.outs, window.batches, window.times
    pending = accepted = 0  # batches since state.batches_seen was written; not skipped ones
    try:
        t0 = time.perf_counter()
        for batch, last in pairs:
            t1 = time.perf_counter()
            # A step without close= serves partial_window="carry", which never flushes.
            state, out = step(state, batch, close=last) if flush else step(state, batch)
            t2 = time.perf_counter()
            if type(out) is not StepOutput:
                got = f"({type(state).__name__}, {type(out).__name__})"
                raise TypeError(f"run: the step returned {got}; expected (TrainState, StepOutput).")
            outs.append(out)
            batches.append(batch)
            pending, accepted = pending + 1, accepted + (not out.skipped)
            data_time, step_time = data_time + t1 - t0, step_time + t2 - t1
            # Plugins see updates, not micro-batches: nothing they read (state.step, the LR,
            # a stop request) changes in between, and calling them per micro-batch would
            # cost more than the loop itself.
            if out.closed:
                state = state._evolve({"batches_seen": state.batches_seen + pending})
                times = data_time, step_time
                event = Event("step", state, loop, out, *times, None, tuple(outs), tuple(batches))
                outs.clear()
                batches.clear()
                pending, data_time, step_time = 0, 0.0, 0.0
                state = _call(plugins, event)
                if _done(state, loop):
                    return state, False
                t2 = time.perf_counter()  # time in plugins is neither data time nor step time
            t0 = t2
    except BaseException:
        # For the "end" event: how far training got.
        window.failed = state._evolve({"batches_seen": state.batches_seen + pending})
        raise
    finally:
        window.times = (data_time, step_time)
        # Generators have close(); DataLoader iterators with workers have _shutdown_workers().
        close = getattr(iterator, "close", None) or getattr(iterator, "_shutdown_workers", None)
        if callable(close):
            close()
    if not accepted and not one_shot and not resumed and not window.stalled:
        window.stalled = _no_progress(state, pending, loop.epochs)
    return state, True


def _open(state: TrainState, data: Any, window: _BetweenPasses) -> tuple[TrainState, Iterator[Any]]:
    """The pass's iterator (the rest of a resumed pass), and the state recording the pass.

    A pass 0 batches in is fresh, unless a changed batch size split its first batch (then it
    goes on after the samples trained of that batch).
    """
    if state.batches_seen == 0 and not split_at(state.data_state, 0):
        if not isinstance(data, Iterator):  # what the pass draws its order from, for a resume
            state = state._evolve({"data_state": snapshot(data)})
        return state, iter(data)
    if is_stateful(data) and "loader" in state.data_state:
        data.load_state_dict(state.data_state["loader"])  # it restarts where it was
        return state, iter(data)
    iterator, why = unseen(data, state.batches_seen, state.data_state)
    if why is not None and not window.warned:
        warn(f"run: {why}.")
        window.warned = True
    return state, iterator


def _with_last(
    iterator: Iterator[Any], flush: bool, batches: int | None, seen: int
) -> Iterator[tuple[Any, bool]]:
    """``(batch, is_last)``: by ``len(data)``, else one batch read ahead (only to flush)."""
    if not flush:
        return zip(iterator, itertools.repeat(False))
    if batches is not None:
        return ((batch, i >= batches) for i, batch in enumerate(iterator, seen + 1))
    end = object()
    pairs = itertools.pairwise(itertools.chain(iterator, [end]))
    return ((batch, following is end) for batch, following in pairs)


def _check_partial(step: Any, partial_window: Any) -> None:
    check_one_of("run", "partial_window", partial_window, ("carry", "epoch", "end"))
    try:  # "carry" never closes a window early: any step will do
        takes_close = partial_window == "carry" or "close" in inspect.signature(step).parameters
    except (TypeError, ValueError):
        takes_close = False
    if not takes_close:
        raise TypeError(
            f"run: partial_window={partial_window!r} needs step(state, batch, close=...); got a "
            f"{type(step).__name__} without close=; pass a step of make_step."
        )


def _no_progress(state: TrainState, batches: int, epochs: int | None) -> bool:
    """A whole pass with no accepted micro-batch: the next passes would be the same."""
    why = f"the loss function skipped all {batches} batches (returned None)"
    why = f"run: in epoch {state.epoch} {why if batches else 'the data yielded no batch'}"
    if epochs is None:
        raise ValueError(f"{why}, so no update can ever happen; check the data and loss_fn.")
    warn(f"{why}; no update happened in that pass.")
    return True


def _done(state: TrainState, loop: LoopInfo) -> bool:
    return (
        state.stop is not None
        or (loop.max_steps is not None and state.step >= loop.max_steps)
        or (loop.epochs is not None and state.epoch >= loop.epochs)
    )


def _end(plugins: Sequence[Plugin], event: Event) -> TrainState:
    """Call every plugin's end, even if some raise.

    When training raised, that error propagates and a plugin's failure at the end is attached
    to it as a note rather than hiding it. When training ended well, a plugin failing at the
    end (a sink that cannot close, say) must not cost the trained state: the failure is
    reported as a RuntimeWarning and run() returns the state. A plugin that raises
    SystemExit or KeyboardInterrupt (the checkpoints plugin after a signal) is obeyed once
    every other plugin's end has run.
    """
    leave: BaseException | None = None  # SystemExit, KeyboardInterrupt: raised at the end
    for plugin in plugins:
        try:
            event = event._replace(state=_call((plugin,), event))
        except Exception as exc:
            name = getattr(plugin, "__qualname__", repr(plugin))
            if event.error is not None:
                event.error.add_note(f"and then plugin {name} failed at 'end': {exc!r}")
            else:
                message = f"run: plugin {name} failed at 'end' after training ended well: {exc!r}"
                message += "; run() returns the trained state anyway."
                warn(message)
        except BaseException as exc:
            leave = leave or exc
    if leave is not None:
        try:
            raise leave
        finally:
            del leave  # no cycle through this frame (see run())
    return event.state
