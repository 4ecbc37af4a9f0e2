"""How step decorators attach their configuration to a Step, and compose()."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import reduce
from typing import Any

from toolkit._step import Step

__all__ = ["Decorator", "attach", "compose"]


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


def attach(step: Any, name: str, field: str, config: Any) -> Step:
    """Return ``step`` with ``config`` in ``field``; raise on reuse or impossible combinations."""
    if not isinstance(step, Step):
        raise TypeError(
            f"{name}: expected a Step built by make_step(loss_fn); got "
            f"{type(step).__name__}. Wrap the loss function first: "
            f"{name}(make_step(loss_fn), ...)."
        )
    present = getattr(step, field)
    if present is not None:
        raise ValueError(
            f"{name} was applied twice to the same step (already {present}, now {config}). "
            f"Apply each decorator once; to change its settings, decorate the undecorated "
            f"step again."
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
    """Chain step decorators into one; the order does not change the resulting step.

    Args:
        *decorators: configured decorators such as ``clip(max_norm=1.0)``.

    Returns:
        A function ``Step -> Step`` applying every decorator.

    Raises:
        TypeError: when an argument is not a decorator (for example a bare ``clip`` that
            was never configured, or a Step).
        ValueError: when the returned function is applied to a step: the same decorator
            appears twice (or is already on the step), or two cannot be combined.

    Example:
        >>> import torch
        >>> from toolkit import accumulate, clip, compose, make_step
        >>> loss_fn = lambda m, b: m(b).square().mean()
        >>> step = compose(accumulate(micro_batches=2), clip(max_norm=1.0))(make_step(loss_fn))
        >>> step.accumulation.micro_batches, step.clipping.max_norm
        (2, 1.0)
    """
    for d in decorators:
        if not isinstance(d, Decorator):
            raise TypeError(
                f"compose: expected configured decorators such as clip(max_norm=1.0); got "
                f"{d!r}. Call each decorator with its options (and no step) inside compose."
            )
    return lambda step: reduce(lambda s, d: d(s), decorators, step)
