"""TrainState: everything that changes between training steps, in one explicit value."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import optree
import torch

__all__ = ["GuardState", "TrainState", "WindowState"]


class WindowState(NamedTuple):
    """The open accumulation window.

    Attributes:
        micro_step: accepted micro-batches in the window so far (``0 <= micro_step < k``).
        count: summed target count of the window (float64 tensor), or ``None`` when the
            loss function reports no counts.
        loss: summed detached loss of the window, or ``None`` when no decorator needs it
            (the guard checks it for finiteness once per window).

    Example:
        >>> import torch
        >>> from toolkit import TrainState, accumulate, make_step
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> step = accumulate(make_step(lambda m, b: m(b).mean()), micro_batches=3)
        >>> state, _ = step(state, torch.ones(4, 2))
        >>> state.window.micro_step
        1
    """

    micro_step: int = 0
    count: torch.Tensor | None = None  # type: ignore[assignment]  # shadows tuple.count on purpose
    loss: torch.Tensor | None = None


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
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters; required by every
            train step.
        scheduler: an optional LR scheduler, stepped once per *applied* update.
        scaler: an optional ``torch.amp.GradScaler``; ``amp_wrap(dtype="fp16")`` creates one
            on the first step when this is ``None``.
        step: optimizer updates applied so far.
        window: the open accumulation window (:class:`WindowState`).
        guard: non-finite and overflow counters (:class:`GuardState`).
        epoch: passes over the data completed by :func:`toolkit.run`.
        batches_seen: batches drawn in the current epoch (data position for resume).
        stop: a reason string once a plugin has asked the loop to stop, else ``None``.
        extras: plugin state (EMA weights, best score, ...); replace it, do not mutate it.

    Returns:
        A frozen dataclass; use :meth:`replace` to derive a changed copy.

    Raises:
        TypeError: when ``model`` is not a ``torch.nn.Module``, or ``optimizer`` is given
            and is not a ``torch.optim.Optimizer``.

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
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    scaler: torch.amp.GradScaler | None = None
    step: int = 0
    window: WindowState = WindowState()
    guard: GuardState = GuardState()
    epoch: int = 0
    batches_seen: int = 0
    stop: str | None = None
    extras: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise TypeError(
                f"TrainState.model: expected a torch.nn.Module, got {type(self.model).__name__}. "
                "Pass the module you train, e.g. TrainState(model=net, optimizer=opt)."
            )
        if self.optimizer is not None and not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                "TrainState.optimizer: expected a torch.optim.Optimizer, got "
                f"{type(self.optimizer).__name__}. Build it over the model's parameters, "
                "e.g. torch.optim.AdamW(model.parameters(), lr=1e-3)."
            )

    def replace(self, **changes: Any) -> TrainState:
        """Return a copy with ``changes`` applied (fields are not re-validated).

        Args:
            **changes: field names and their new values.

        Returns:
            A new :class:`TrainState` sharing the unchanged fields and handles.

        Raises:
            TypeError: when a name is not a field of TrainState.

        Example:
            >>> import torch
            >>> from toolkit import TrainState
            >>> TrainState(model=torch.nn.Linear(1, 1)).replace(epoch=2).epoch
            2
        """
        unknown = changes.keys() - _FIELD_NAMES
        if unknown:
            raise TypeError(
                f"TrainState.replace: unknown field(s) {sorted(unknown)}; "
                f"expected some of {sorted(_FIELD_NAMES)}."
            )
        return self._evolve(changes)

    def _evolve(self, changes: dict[str, Any]) -> TrainState:
        # Hot path (field names known to be right): copying the field dict is several times
        # faster than dataclasses.replace, which re-runs __init__ and its checks.
        fields = self.__dict__.copy()
        fields.update(changes)
        new = object.__new__(TrainState)
        object.__setattr__(new, "__dict__", fields)
        return new

    def _with_window(self, window: WindowState) -> TrainState:
        # Once per micro-batch that does not close a window: _evolve for one field.
        fields = self.__dict__.copy()
        fields["window"] = window
        new = object.__new__(TrainState)
        object.__setattr__(new, "__dict__", fields)
        return new


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(TrainState))
