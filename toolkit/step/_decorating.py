"""How step decorators attach their configuration to a Step, and compose()."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from toolkit.step._step import Step

__all__ = [
    "Decorator",
    "attach",
    "check_int",
    "check_positive",
    "check_step",
    "compose",
    "decorate",
]


@dataclasses.dataclass(frozen=True)
class Decorator:
    """A configured decorator waiting for its step: ``amp_wrap(dtype="bf16")`` returns one.

    Attributes:
        name: the public name (``"amp_wrap"``), used in error messages.
        field: the :class:`Step` field the configuration goes into.
        config: the validated configuration.
    """

    name: str
    field: str
    config: Any

    def __call__(self, step: Step) -> Step:
        return attach(step, self.name, self.field, self.config)


def decorate(step: Step | None, name: str, field: str, config: Any) -> Step | Decorator:
    """The two calling forms of every decorator: ``name(step, ...)`` or ``name(...)``."""
    if step is None:
        return Decorator(name, field, config)
    return attach(step, name, field, config)


def check_positive(name: str, option: str, value: Any) -> float:
    """``value`` as a float, or a one-sentence error unless it is a number > 0 (or ``inf``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: {option} must be a number > 0; got {value!r}.")
    if not value > 0:  # math.inf passes; -inf and NaN do not
        raise ValueError(f"{name}: {option} must be > 0; got {value!r}.")
    return float(value)


def check_int(name: str, option: str, value: Any, least: int, fix: str = "") -> int:
    """``value``, or a one-sentence error unless it is an int (not a bool) >= ``least``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: {option} must be an int >= {least}; got {value!r}.{fix}")
    if value < least:
        raise ValueError(f"{name}: {option} must be an int >= {least}; got {value!r}.{fix}")
    return value


def check_step(name: str, step: Any) -> None:
    """A one-sentence error unless ``step`` (the optional first argument) is a Step or None."""
    if step is not None and not isinstance(step, Step):
        raise TypeError(
            f"{name}: expected a Step from make_step(loss_fn) as the first argument; got "
            f"{type(step).__name__} {step!r:.40}. Pass options by keyword: "
            f"{name}(make_step(loss_fn), ...)."
        )


def attach(step: Any, name: str, field: str, config: Any) -> Step:
    """Return ``step`` with ``config`` in ``field``; raise on reuse or impossible combinations."""
    check_step(name, step)
    present = getattr(step, field)
    if present is not None:
        raise ValueError(
            f"{name} was applied twice to the same step (already {present}, now {config}). "
            "Apply each decorator once; to change its settings, decorate the undecorated "
            "step again."
        )
    new = dataclasses.replace(step, **{field: config})
    _check_combination(new)
    return new


def _check_combination(step: Step) -> None:
    if (
        step.amp is not None
        and step.amp.fp16
        and step.guard is not None
        and step.guard.on_exhaust == "accept"
    ):
        raise ValueError(
            "guard_nonfinite(on_exhaust='accept') cannot be combined with "
            "amp_wrap(dtype='fp16'): the GradScaler always skips an update whose gradients "
            "are not finite, so the window could never be accepted. Use on_exhaust='raise' "
            "or 'skip', or bf16."
        )


def compose(*decorators: Callable[[Step], Step]) -> Callable[[Step], Step]:
    """Chain step decorators into one function ``Step -> Step``.

    Any function from a Step to a Step is a decorator: the configured built-ins
    (``clip(max_norm=1.0)``) and your own (``lambda s: clip(s, max_norm=1.0)``). The
    built-ins each fill their own phase of the canonical order, so their order here never
    changes the result.

    Args:
        *decorators: functions ``Step -> Step``, applied left to right.

    Returns:
        A function ``Step -> Step`` applying every decorator.

    Raises:
        TypeError: an argument is not callable or is a Step (which takes a state and a
            batch, not a step); when applied, a decorator returning something else than a
            Step.
        ValueError: when applied, the same built-in decorator twice (or one already on the
            step), or two that cannot be combined.

    Example:
        >>> import torch
        >>> from toolkit import accumulate, clip, compose, make_step
        >>> loss_fn = lambda m, b: m(b).square().mean()
        >>> step = compose(accumulate(micro_batches=2), clip(max_norm=1.0))(make_step(loss_fn))
        >>> step.accumulation.micro_batches, step.clipping.max_norm
        (2, 1.0)
    """
    for d in decorators:
        if isinstance(d, Step) or not callable(d):
            raise TypeError(
                f"compose: expected functions Step -> Step such as clip(max_norm=1.0); got "
                f"{type(d).__name__} {d!r:.40}."
            )

    def composed(step: Step) -> Step:
        for d in decorators:
            new = d(step)
            if not isinstance(new, Step):
                raise TypeError(
                    f"compose: {getattr(d, '__qualname__', d)!r} returned "
                    f"{type(new).__name__}; expected the Step it was given, decorated."
                )
            step = new
        return step

    return composed
