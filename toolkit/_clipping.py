"""clip: gradient clipping by total norm and/or by value, once per update."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from toolkit._decorating import Decorator, attach
from toolkit._step import Step

__all__ = ["ClipConfig", "clip"]


@dataclasses.dataclass(frozen=True)
class ClipConfig:
    """Configuration of :func:`clip`.

    Attributes:
        max_norm: clip the total gradient norm to this, or ``None``.
        max_value: clamp every gradient element to ``[-max_value, max_value]``, or ``None``.
        norm_type: the p of the p-norm (``2.0``; ``math.inf`` for the max norm).
    """

    max_norm: float | None
    max_value: float | None
    norm_type: float = 2.0

    def apply(self, params: list[torch.Tensor], total_norm: torch.Tensor | None) -> None:
        """Clip ``params``' gradients in place; ``total_norm`` is their pre-clip norm."""
        if self.max_norm is not None:
            assert total_norm is not None  # the step computes it whenever clip is on
            # Same arithmetic as torch.nn.utils.clip_grad_norm_, reusing the norm the step
            # already computed for reporting and the finite check (no host sync).
            torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, total_norm)
        if self.max_value is not None:
            torch.nn.utils.clip_grad_value_(params, self.max_value)

    def __str__(self) -> str:
        return f"clip(max_norm={self.max_norm}, max_value={self.max_value})"


def _positive(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"clip: {name} must be a positive number; got {type(value).__name__}.")
    if not value > 0:
        raise ValueError(
            f"clip: {name} must be > 0; got {value}. Leave it out (None) to not clip that way."
        )
    return float(value)


def clip(
    step: Step | None = None,
    /,
    *,
    max_norm: float | None = None,
    max_value: float | None = None,
    norm_type: float = 2.0,
) -> Any:
    """Clip gradients once per update, after unscaling and count normalisation.

    By norm: scale all gradients so that their total ``norm_type``-norm is at most
    ``max_norm`` (``torch.nn.utils.clip_grad_norm_`` semantics). By value: clamp each
    element to ``[-max_value, max_value]``. With both, the norm clip runs first; the result
    satisfies both bounds. ``out.grad_norm`` reports the total norm *before* clipping.
    Clipping happens only when a window closes, never per micro-batch, and adds no host
    sync.

    Args:
        step: the step to wrap; omit it to get a decorator.
        max_norm: the total-norm bound, > 0.
        max_value: the element-wise bound, > 0.
        norm_type: the norm's p (> 0, or ``math.inf``).

    Returns:
        The wrapped :class:`Step`, or a decorator when ``step`` is omitted.

    Raises:
        ValueError: neither bound given, a bound <= 0, ``norm_type`` <= 0, or clip applied
            twice.
        TypeError: a bound that is not a number, or ``step`` not a Step.

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
    norm = _positive("max_norm", max_norm)
    value = _positive("max_value", max_value)
    if norm is None and value is None:
        raise ValueError(
            "clip: give max_norm and/or max_value; got neither, so there is nothing to clip. "
            "Example: clip(step, max_norm=1.0)."
        )
    if not norm_type > 0:  # math.inf passes; -inf and NaN do not
        raise ValueError(f"clip: norm_type must be > 0 or math.inf; got {norm_type}.")
    config = ClipConfig(norm, value, float(norm_type))
    if step is None:
        return Decorator("clip", "clipping", config)
    return attach(step, "clip", "clipping", config)
