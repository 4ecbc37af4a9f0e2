"""clip: gradient clipping by total norm and/or by value, once per update."""

from __future__ import annotations

from typing import overload

from toolkit.step._decorating import Decorator, check_positive, check_step, decorate
from toolkit.step._phases import ClipConfig
from toolkit.step._step import Step

__all__ = ["clip"]

_Bound = float | None


@overload
def clip(
    step: Step, /, *, max_norm: _Bound = ..., max_value: _Bound = ..., norm_type: float = ...
) -> Step: ...
@overload
def clip(
    *, max_norm: _Bound = ..., max_value: _Bound = ..., norm_type: float = ...
) -> Decorator: ...
def clip(
    step: Step | None = None,
    /,
    *,
    max_norm: _Bound = None,
    max_value: _Bound = None,
    norm_type: float = 2.0,
) -> Step | Decorator:
    """Clip gradients once per update (phase 7), after unscaling and count normalisation.

    By norm with ``torch.nn.utils.clip_grad_norm_`` semantics; by value, clamping each
    element to ``[-max_value, max_value]``; with both, the norm clip first. ``out.grad_norm``
    is the total norm before clipping. No host sync.

    Args:
        step: the step to wrap; omit it to get a decorator.
        max_norm: the total-norm bound, > 0.
        max_value: the element-wise bound, > 0.
        norm_type: the norm's p, > 0 or ``math.inf``.

    Returns:
        The wrapped :class:`Step`, or a decorator when ``step`` is omitted.

    Raises:
        ValueError: neither bound, a bound or ``norm_type`` not > 0, or clip applied twice.
        TypeError: a bound or ``norm_type`` that is not a number, or ``step`` not a Step.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, clip, make_step
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> step = clip(make_step(lambda m, b: 100 * m(b).square().mean()), max_norm=1.0)
        >>> state, out = step(state, torch.ones(4, 2))
        >>> bool(out.grad_norm > 1.0)
        True
    """
    check_step("clip", step)
    if max_norm is None and max_value is None:
        raise ValueError("clip: expected max_norm and/or max_value; got neither.")
    norm = None if max_norm is None else check_positive("clip", "max_norm", max_norm)
    value = None if max_value is None else check_positive("clip", "max_value", max_value)
    config = ClipConfig(norm, value, check_positive("clip", "norm_type", norm_type))
    return decorate(step, "clip", "clipping", config)
