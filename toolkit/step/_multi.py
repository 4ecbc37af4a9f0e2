"""Several optimizers (and schedulers) stepped from one backward, and per-epoch schedulers.

``MultiOptimizer`` and ``MultiScheduler`` present a few real optimizers (schedulers) as the
one object a train step, the GradScaler, the checkpoint code and the plugins expect: the
parameter groups concatenated, ``step``/``zero_grad`` over every one, and the standard
state-dict format numbered across all of them. ``per_epoch`` marks a scheduler that
:func:`toolkit.run` steps once per pass over the data instead of once per update.
"""

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau

from toolkit._checks import check, check_type

# The fix of an optimizer of the wrong kind (here and in TrainState's checks), of a scheduler.
NEW_OPTIMIZER = "Build one over the parameters: torch.optim.AdamW(model.parameters(), lr=1e-3)."
NEW_SCHEDULER = "Build one over the optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, fn)."


class MultiOptimizer:
    """Several optimizers over disjoint parameters, used as one: VeOmni's Muon + AdamW.

    One backward fills every gradient; the train step then treats the optimizers as one:
    the GradScaler unscales them together and skips them together on an overflow, the
    guard rejects a non-finite window for all of them, clipping takes the norm over all
    their parameters, and each is stepped once per applied update. Passing a list to
    ``TrainState(optimizer=[muon, adamw])`` builds one.

    ``param_groups`` is the concatenation of the optimizers' groups, in order (the
    group dicts themselves, so changing a group's ``lr`` changes that optimizer's);
    ``state_dict()`` is in ``torch.optim.Optimizer``'s format with the parameters numbered
    across the optimizers in that order, which ``load_state_dict`` splits back. Build a
    scheduler over each real optimizer (``.optimizers``), not over this object.

    Args:
        *optimizers: one or more ``torch.optim.Optimizer``, no parameter held by two.

    Raises:
        TypeError: no optimizer, or an element that is not a ``torch.optim.Optimizer``.
        ValueError: the same optimizer twice, or a parameter held by two of them (it would
            be updated twice per step).

    Example:
        >>> import torch
        >>> from toolkit import MultiOptimizer
        >>> model = torch.nn.Linear(3, 2)
        >>> muon_like = torch.optim.SGD([model.weight], lr=0.1, momentum=0.9)
        >>> adamw = torch.optim.AdamW([model.bias], lr=1e-3)
        >>> both = MultiOptimizer(muon_like, adamw)
        >>> model(torch.ones(4, 3)).sum().backward()
        >>> both.step(); both.zero_grad()
        >>> [group["lr"] for group in both.param_groups], model.bias.grad is None
        ([0.1, 0.001], True)
    """

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        _check_optimizers(optimizers)
        self.optimizers = tuple(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every optimizer's parameter groups, in order (a new list of the same dicts)."""
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        # torch.distributed.checkpoint's get_state_dict takes an iterable of optimizers.
        return iter(self.optimizers)

    def step(self, closure: Any = None) -> None:
        """Step every optimizer, in order."""
        if closure is not None:
            raise TypeError("MultiOptimizer.step: a closure would be evaluated once per optimizer.")
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every optimizer's parameters."""
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """``{"state", "param_groups"}`` as one optimizer's, numbered across all of them."""
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for optimizer in self.optimizers:
            inner = optimizer.state_dict()
            state.update({offset + i: value for i, value in inner["state"].items()})
            for group in inner["param_groups"]:
                groups.append({**group, "params": [offset + i for i in group["params"]]})
            offset += sum(len(group["params"]) for group in inner["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Split a :meth:`state_dict` back over the optimizers and load each one.

        Raises:
            ValueError: the state dict has another number of parameter groups, or a group
                with options its optimizer does not know (it was saved from other
                optimizers); each optimizer's own check reports groups of other sizes.
        """
        groups = list(state_dict["param_groups"])
        counts = [len(optimizer.param_groups) for optimizer in self.optimizers]
        if len(groups) != sum(counts):
            raise ValueError(
                f"MultiOptimizer.load_state_dict: the state dict has {len(groups)} parameter "
                f"group(s); these optimizers have {sum(counts)} ({counts})."
            )
        pieces, offset = [], 0  # every optimizer's part is checked before any is loaded
        saved = state_dict["state"]
        for i, (optimizer, count) in enumerate(zip(self.optimizers, counts, strict=True)):
            own, groups = groups[:count], groups[count:]
            # The numbering says nothing of the kind: SGD's state loaded into an AdamW would
            # only fail at its first step. Their options tell them apart.
            live = {key for group in optimizer.param_groups for key in group}
            foreign = sorted({key for group in own for key in group} - live)
            if foreign:
                raise ValueError(
                    f"MultiOptimizer.load_state_dict: the state for optimizers[{i}] "
                    f"({type(optimizer).__name__}) has options {foreign} it does not know; it "
                    "was saved from another kind of optimizer."
                )
            indices = [j for group in own for j in group["params"]]
            state = {j - offset: saved[j] for j in indices if j in saved}
            own = [{**group, "params": [j - offset for j in group["params"]]} for group in own]
            pieces.append({"state": state, "param_groups": own})
            offset += len(indices)
        for optimizer, piece in zip(self.optimizers, pieces, strict=True):
            optimizer.load_state_dict(piece)

    def __repr__(self) -> str:
        return f"MultiOptimizer({', '.join(type(o).__name__ for o in self.optimizers)})"


def _check_optimizers(optimizers: tuple[Any, ...]) -> None:
    if not optimizers:
        raise TypeError("MultiOptimizer: expected one or more torch.optim.Optimizer; got none.")
    owner: dict[int, int] = {}
    for i, optimizer in enumerate(optimizers):
        ok, name = isinstance(optimizer, torch.optim.Optimizer), f"optimizers[{i}]"
        check_type(ok, "MultiOptimizer", name, "a torch.optim.Optimizer", optimizer, NEW_OPTIMIZER)
        for param in (p for group in optimizer.param_groups for p in group["params"]):
            first = owner.setdefault(id(param), i)
            if first != i:
                raise ValueError(
                    f"MultiOptimizer: a parameter of shape {list(param.shape)} is held by "
                    f"optimizers[{first}] ({type(optimizers[first]).__name__}) and optimizers[{i}] "
                    f"({type(optimizer).__name__}); it would be updated twice per step."
                )


@dataclasses.dataclass(frozen=True)
class PerEpoch:
    """A scheduler that :func:`toolkit.run` steps once per pass over the data.

    Build it with :func:`per_epoch`. The train step leaves it alone; ``run()`` calls its
    ``step()`` at every ``"epoch_end"``, before the plugins (so a checkpoint taken there
    holds the stepped scheduler). Every other attribute (``optimizer``, ``state_dict``,
    ``load_state_dict``, ``get_last_lr``, ...) is the wrapped scheduler's.

    Attributes:
        scheduler: the wrapped LR scheduler.

    Example:
        >>> import torch
        >>> from toolkit import per_epoch
        >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
        >>> every_epoch = per_epoch(torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5))
        >>> optimizer.step(); every_epoch.step(); every_epoch.get_last_lr()
        [0.5]
    """

    scheduler: Any

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # not set yet (copy, pickle): no endless recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)


def per_epoch(scheduler: Any) -> PerEpoch:
    """Mark ``scheduler`` to be stepped once per epoch (accel_hydra's ``EPOCH`` interval).

    Put the result in ``TrainState(scheduler=...)`` (alone, or in a list with per-update
    schedulers). The train step never steps it; :func:`toolkit.run` steps it at every
    ``"epoch_end"`` (every completed pass over the data, whether or not the pass applied
    an update, as a hand-written ``for epoch: ...; scheduler.step()`` loop does), before
    calling the plugins. A run stopped by ``max_steps`` in the middle of a pass does not
    step it for that pass. In a loop of your own, call its ``step()`` after each epoch.

    Args:
        scheduler: an LR scheduler from ``torch.optim.lr_scheduler`` (not a
            ``ReduceLROnPlateau``).

    Returns:
        A :class:`PerEpoch` wrapping it.

    Raises:
        TypeError: ``scheduler`` is a ``ReduceLROnPlateau`` (it needs a metric: let
            ``validate(plateau_metric=...)`` step it), already per-epoch, several
            schedulers, or not a scheduler.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, make_step, per_epoch, run
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        >>> decay = per_epoch(torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5))
        >>> state = TrainState(model=model, optimizer=optimizer, scheduler=decay)
        >>> state = run(make_step(lambda m, b: m(b).mean()), state, [torch.ones(1, 2)] * 3,
        ...             epochs=2)
        >>> state.step, optimizer.param_groups[0]["lr"]
        (6, 0.25)
    """
    _check_scheduler(scheduler, "per_epoch: scheduler")
    return PerEpoch(scheduler)


class MultiScheduler:
    """Several LR schedulers used as one (a scheduler per optimizer of a MultiOptimizer).

    ``step()`` steps the per-update schedulers (a :func:`per_epoch` one is left to
    :func:`toolkit.run`'s ``"epoch_end"``); ``get_last_lr()`` concatenates theirs, in
    the order given (give them in the optimizers' order to match ``param_groups``);
    ``state_dict()`` holds one state per scheduler, in order. Passing a list to
    ``TrainState(scheduler=[...])`` builds one.

    Args:
        *schedulers: LR schedulers, possibly :func:`per_epoch`-marked.

    Raises:
        TypeError: no scheduler, or an element that is not an LR scheduler, or a
            ``ReduceLROnPlateau`` (the validate plugin steps one only alone in
            ``TrainState.scheduler``), or a nested MultiScheduler.

    Example:
        >>> import torch
        >>> from toolkit import MultiScheduler
        >>> a = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
        >>> b = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=2.0)
        >>> lr = torch.optim.lr_scheduler
        >>> both = MultiScheduler(lr.StepLR(a, 1, gamma=0.5), lr.StepLR(b, 1, gamma=0.1))
        >>> a.step(); b.step(); both.step(); both.get_last_lr()
        [0.5, 0.2]
    """

    def __init__(self, *schedulers: Any) -> None:
        ok = bool(schedulers)
        check(ok, "MultiScheduler", "schedulers", "one or more LR schedulers", (), error=TypeError)
        for i, scheduler in enumerate(schedulers):
            alone = scheduler.scheduler if isinstance(scheduler, PerEpoch) else scheduler
            _check_scheduler(alone, f"MultiScheduler: schedulers[{i}]")
        self.schedulers = tuple(schedulers)

    def step(self) -> None:
        """Step the per-update schedulers (not the :func:`per_epoch` ones)."""
        for scheduler in self.schedulers:
            if not isinstance(scheduler, PerEpoch):
                scheduler.step()

    def get_last_lr(self) -> list[Any]:
        return [lr for s in self.schedulers for lr in s.get_last_lr()]

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [dict(s.state_dict()) for s in self.schedulers]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        # load_checkpoint compares the saved states with these schedulers first.
        for scheduler, state in zip(self.schedulers, state_dict["schedulers"], strict=True):
            scheduler.load_state_dict(state)

    def __repr__(self) -> str:
        return f"MultiScheduler({', '.join(type(s).__name__ for s in self.schedulers)})"


def _check_scheduler(scheduler: Any, who: str) -> None:
    if isinstance(scheduler, (ReduceLROnPlateau, PerEpoch, MultiScheduler)):
        raise TypeError(
            f"{who}: got a {type(scheduler).__name__}; expected one LR scheduler by count "
            "(validate(plateau_metric=...) steps a ReduceLROnPlateau alone)."
        )
    check_scheduler_kind(scheduler, who)


def check_scheduler_kind(scheduler: Any, who: str, alternative: str = "") -> None:
    """TypeError unless ``scheduler`` has an LR scheduler's ``step``, ``state_dict`` and
    ``optimizer`` (here and in TrainState's checks)."""
    methods = [getattr(scheduler, name, None) for name in ("step", "state_dict")]
    if not (all(map(callable, methods)) and hasattr(scheduler, "optimizer")):
        raise TypeError(
            f"{who}: expected an LR scheduler from torch.optim.lr_scheduler{alternative}; got "
            f"{type(scheduler).__name__} {getattr(scheduler, '__name__', repr(scheduler)):.40}. "
            + NEW_SCHEDULER
        )


def epoch_schedulers(scheduler: Any) -> tuple[PerEpoch, ...]:
    """The :func:`per_epoch` schedulers in ``TrainState.scheduler``, for run()'s epoch end."""
    members = getattr(scheduler, "schedulers", (scheduler,))
    return tuple(s for s in members if isinstance(s, PerEpoch))
