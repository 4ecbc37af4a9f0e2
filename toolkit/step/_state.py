"""TrainState: everything that changes between training steps, in one explicit value."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any, ClassVar, NamedTuple, TypedDict

import optree
import torch

from toolkit._checks import check
from toolkit.step._multi import NEW_OPTIMIZER, MultiOptimizer, MultiScheduler, check_scheduler_kind


class WindowState(NamedTuple):
    """The open accumulation window.

    Attributes:
        micro_step: accepted micro-batches in the window so far (``0 <= micro_step < k``).
        count: summed target count of the window: a python number while every count was
            one, else a float64 tensor; ``None`` when the loss function reports no counts.
        loss: summed detached loss of the window, or ``None`` when no decorator needs it
            (the guard checks it for finiteness once per window).
        length: micro-batches per update of the step that opened the window (``k``), so
            that a step of another length refuses it instead of never closing it.
        skipped: micro-batches of the window that the loss function skipped (returned
            ``None`` for), counted under data parallelism only: at the window's close the
            ranks compare them, so that a skip on some ranks only raises instead of hanging.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, accumulate, make_step
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> step = accumulate(make_step(lambda m, b: m(b).mean()), micro_batches=3)
        >>> state, _ = step(state, torch.ones(4, 2))
        >>> state.window.micro_step, state.window.length
        (1, 3)
    """

    micro_step: int = 0
    count: torch.Tensor | float | None = None  # type: ignore[assignment]  # shadows tuple.count
    loss: torch.Tensor | None = None
    length: int = 1
    skipped: int = 0


class GuardState(NamedTuple):
    """Counters of :func:`toolkit.guard_nonfinite` and of the fp16 loss scaler.

    Attributes:
        notfinite_count: consecutive non-finite windows (reset by a finite window).
        total_notfinite: rejected windows over the whole run.
        total_overflow: windows the fp16 ``GradScaler`` skipped because of an overflow
            (these are not failures; the scaler lowers its scale and training goes on).

    Example:
        >>> import torch
        >>> from toolkit import TrainState, guard_nonfinite, make_step
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> step = guard_nonfinite(make_step(lambda m, b: m(b).mean()), on_exhaust="skip")
        >>> state, _ = step(state, torch.full((1, 2), float("inf")))
        >>> state.guard
        GuardState(notfinite_count=1, total_notfinite=1, total_overflow=0)
    """

    notfinite_count: int = 0
    total_notfinite: int = 0
    total_overflow: int = 0


class Metrics(TypedDict):
    """What a plugin published at one update: an entry of ``TrainState.metrics``.

    A plain dict, so checkpoints save it as it is.

    Attributes:
        step: the ``state.step`` it was measured at.
        values: each metric's number, by name.

    Example:
        >>> import torch
        >>> from toolkit import Metrics, TrainState
        >>> state = TrainState(model=torch.nn.Linear(1, 1))
        >>> state = state.replace(metrics={"val": Metrics(step=0, values={"loss": 0.5})})
        >>> state.metrics["val"]["values"]["loss"]
        0.5
    """

    step: int
    values: dict[str, float]


@optree.dataclasses.dataclass(frozen=True, namespace="toolkit")  # type: ignore[call-overload]
class TrainState:
    """The explicit state a train step threads through: handles plus immutable bookkeeping.

    ``model``, ``optimizer``, ``scheduler`` and ``scaler`` are *handles*: a step updates them
    in place and the returned state refers to the same objects. Everything else is immutable
    and replaced by each step, so treat a state you passed to a step as consumed and keep
    using the one it returned.

    The state is a pytree in the ``toolkit`` optree namespace (``optree.tree_leaves(state,
    namespace="toolkit")``).

    Args:
        model: the ``torch.nn.Module`` being trained (possibly wrapped by DDP, FSDP2 or
            ``torch.compile``).
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters (it may hold more,
            such as a learnable loss temperature, but not only others); required by every
            train step. A list of optimizers over disjoint parameters becomes a
            :class:`toolkit.MultiOptimizer`: one backward, every one stepped (e.g. Muon for
            the matrices and AdamW for the rest).
        scheduler: an optional LR scheduler over ``optimizer`` (or over one of several),
            stepped once per *applied* update; a list becomes a
            :class:`toolkit.MultiScheduler`. One marked :func:`toolkit.per_epoch` is
            stepped by :func:`toolkit.run` at each epoch's end instead. A
            ``ReduceLROnPlateau`` needs a metric, so the step leaves it alone and
            :func:`toolkit.plugins.validate` steps it with the metric it monitors.
        scaler: an optional ``torch.amp.GradScaler``; ``amp_wrap(dtype="fp16")`` creates one
            on the first step when this is ``None``.
        step: optimizer updates applied so far.
        window: the open accumulation window (:class:`WindowState`).
        guard: non-finite and overflow counters (:class:`GuardState`).
        epoch: passes over the data completed by :func:`toolkit.run`.
        batches_seen: batches drawn in the current epoch (data position for resume).
        stop: a reason string once a plugin has asked the loop to stop, else ``None``.
        metrics: what plugins published for the others, name -> :class:`Metrics` (e.g.
            ``validate``'s under ``"val"``, read by ``log_metrics``, ``early_stop``,
            ``checkpoints``); replace it, do not mutate it.
        extras: the plugins' own memory, which checkpoints persist (EMA weights, best
            score, counters); replace it, do not mutate it.
        data_state: where the current pass over the data started, recorded by
            :func:`toolkit.run` so that a resumed pass draws the same batches (the RNG
            states the pass drew its order from; a stateful loader's own position).

    Returns:
        A frozen dataclass; use :meth:`replace` to derive a changed copy.

    Raises:
        TypeError: a field of the wrong type: ``model`` not a ``torch.nn.Module``,
            ``optimizer`` not a ``torch.optim.Optimizer`` (or a list with another element),
            ``scheduler`` not an LR scheduler (or a list with another element),
            ``scaler`` not a ``torch.amp.GradScaler``, a counter not an int, ``stop`` not a
            str, ``extras`` not a mapping, ``metrics`` not a mapping of :class:`Metrics`.
        ValueError: a negative counter; an optimizer that shares no parameter with the
            model; a scheduler over another optimizer, or without one; a parameter held
            by two optimizers of a list.

    Example:
        >>> import torch
        >>> from toolkit import TrainState
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> state.step, state.window.micro_step
        (0, 0)
        >>> state.replace(step=3).step
        3
    """

    model: torch.nn.Module
    # A torch.optim.Optimizer, a MultiOptimizer or None; typed Any for now because the
    # checkpoint modules' signatures take a torch.optim.Optimizer only.
    optimizer: Any = None
    scheduler: Any = None
    scaler: torch.amp.GradScaler | None = None
    step: int = 0
    window: WindowState = WindowState()
    guard: GuardState = GuardState()
    epoch: int = 0
    batches_seen: int = 0
    stop: str | None = None
    metrics: Mapping[str, Metrics] = dataclasses.field(default_factory=dict)
    extras: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    data_state: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    # Set on a state once a train step has returned its successor (see Step.__call__).
    _consumed: ClassVar[bool] = False
    # Set by a train step: the last micro-batch's loss. Its graph (its saved tensors freed by
    # backward) lives on into the next forward, as a hand-written loop's `loss` does: the
    # AccumulateGrad nodes are reused, and as they hold the parameters, torch need not incref
    # a parameter's Python object in each op on it (a fifth of a tiny model's step overhead).
    _graph: ClassVar[torch.Tensor | None] = None
    # Set by a train step: the scheduler it stepped and that one's last_epoch just after.
    _scheduled: ClassVar[tuple[Any, int]] = (None, 0)

    def __getstate__(self) -> dict[str, Any]:  # copy and pickle: no graph (it cannot be)
        return {name: v for name, v in self.__dict__.items() if name != "_graph"}

    def __post_init__(self) -> None:
        for name, value in _several(vars(self)).items():
            object.__setattr__(self, name, value)
        _check(self, _FIELD_NAMES)

    def replace(self, **changes: Any) -> TrainState:
        """Return a copy with ``changes`` applied; the changed fields are checked as at build.

        Args:
            **changes: field names and their new values.

        Returns:
            A new :class:`TrainState` sharing the unchanged fields and handles.

        Raises:
            TypeError: when a name is not a field of TrainState, or a value has the wrong type.
            ValueError: when a value is out of range (see :class:`TrainState`).

        Example:
            >>> import torch
            >>> from toolkit import TrainState
            >>> TrainState(model=torch.nn.Linear(1, 1)).replace(epoch=2).epoch
            2
        """
        unknown = sorted(changes.keys() - _FIELD_NAMES)
        check(not unknown, "TrainState.replace", "the names", "fields", unknown, error=TypeError)
        new = self._evolve({**changes, **_several(changes)})
        _check(new, changes.keys())
        return new

    def _evolve(self, changes: dict[str, Any], consume: bool = False) -> TrainState:
        # Hot path (field names known to be right): the field dict copied, not
        # dataclasses.replace, which re-runs __init__ and every check: with replace the
        # plain-SGD step row reads 4,282.0K instructions per update, not 3,678.8K (+16.4%;
        # benchmarks/README.md, "2026-11-29, later").
        fields = self.__dict__.copy()
        fields.update(changes)
        new = object.__new__(TrainState)
        object.__setattr__(new, "__dict__", fields)
        if consume:  # a train step's successor: mark this state used, past the frozen setattr
            self.__dict__["_consumed"] = True
        return new


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(TrainState))


def _check(state: TrainState, changed: Collection[str]) -> None:
    """Run the checks that read a field of ``changed`` (all of them at build time)."""
    for run_check, fields in _FIELD_CHECKS.items():
        if not fields.isdisjoint(changed):
            run_check(state)


def _several(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A list or tuple given as ``optimizer``/``scheduler``, made a Multi* (else nothing)."""
    out: dict[str, Any] = {}
    for name, kind in (("optimizer", MultiOptimizer), ("scheduler", MultiScheduler)):
        value = fields.get(name)
        if isinstance(value, (list, tuple)):
            try:
                out[name] = kind(*value)
            except (TypeError, ValueError) as error:
                raise type(error)(f"TrainState.{name}: {error}") from None
    return out


def _optimizer(state: TrainState) -> None:
    # Once per state built by hand (steps copy states without this check). No shared
    # parameter means the optimizer steps another model: training would change nothing.
    optimizer, own = state.optimizer, {id(p) for p in state.model.parameters()}
    several = isinstance(optimizer, MultiOptimizer)
    members = optimizer.optimizers if several else () if optimizer is None else (optimizer,)
    for i, one in enumerate(members):
        params = [p for group in one.param_groups for p in group["params"]]
        if not any(id(p) in own for p in params):
            which = f"optimizer[{i}]" if several else "optimizer"
            raise ValueError(
                f"TrainState.{which}: none of its {len(params)} parameters belongs to the "
                "model, so training would never change the model. Build it over this model's "
                "parameters (after any copy or fully_shard): AdamW(model.parameters())."
            )


def _scheduler(state: TrainState) -> None:
    scheduler, optimizer = state.scheduler, state.optimizer
    if scheduler is None:
        return
    several = isinstance(scheduler, MultiScheduler)
    if not several:  # a MultiScheduler checked its members itself
        check_scheduler_kind(scheduler, "TrainState.scheduler", " (or a list of them)")
    # A scheduler may drive the state's optimizer or, with several, any one of them.
    allowed = [optimizer, *getattr(optimizer, "optimizers", ())]
    for i, member in enumerate(scheduler.schedulers if several else (scheduler,)):
        if optimizer is None or not any(member.optimizer is o for o in allowed):
            which = f"scheduler[{i}]" if several else "scheduler"
            raise ValueError(
                f"TrainState.{which}: expected a scheduler over the state's optimizer; this "
                f"{type(member).__name__} steps "
                f"{'no optimizer of the state' if optimizer is None else 'another one'}. Build "
                "it over the one given as TrainState(optimizer=...) (or one of several)."
            )


def _counters(state: TrainState) -> None:
    for name in ("step", "epoch", "batches_seen"):
        value = getattr(state, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"TrainState.{name}: expected an int >= 0; got {value!r}.")
        if value < 0:
            raise ValueError(f"TrainState.{name}: expected an int >= 0; got {value!r}.")


# The other fields' kinds, and how a message names them.
_KINDS: dict[str, tuple[Any, str]] = {
    "model": (torch.nn.Module, "a torch.nn.Module"),
    "optimizer": (
        (torch.optim.Optimizer, MultiOptimizer, type(None)),
        "a torch.optim.Optimizer or a list of them",
    ),
    "scaler": ((torch.amp.GradScaler, type(None)), "a torch.amp.GradScaler or None"),
    "window": (WindowState, "a WindowState"),
    "guard": (GuardState, "a GuardState"),
    "stop": ((str, type(None)), "None or a reason string"),
    "metrics": (Mapping, "a mapping"),
    "extras": (Mapping, "a mapping"),
    "data_state": (Mapping, "a mapping"),
}


def _kinds(state: TrainState) -> None:
    for name, (kind, expected) in _KINDS.items():
        if not isinstance(getattr(state, name), kind):
            got = type(getattr(state, name)).__name__
            fix = f" {NEW_OPTIMIZER}" if name == "optimizer" else ""
            raise TypeError(f"TrainState.{name}: expected {expected}; got {got}.{fix}")


def _metrics(state: TrainState) -> None:
    for name, entry in state.metrics.items():
        ok = isinstance(entry, Mapping) and type(entry.get("step")) is int
        ok = ok and isinstance(entry.get("values"), Mapping)
        shape = "a Metrics, {'step': int, 'values': {name: float}}"
        check(ok, "TrainState", f"metrics[{name!r}]", shape, entry, error=TypeError)


# Each check and the fields it reads: replace() runs it when one of them changes (in order:
# the kinds first, which the other checks rely on).
_FIELD_CHECKS = {
    _kinds: set(_KINDS),
    _optimizer: {"model", "optimizer"},
    _scheduler: {"optimizer", "scheduler"},
    _counters: {"step", "epoch", "batches_seen"},
    _metrics: {"metrics"},
}
