"""accumulate: one optimizer update per k accepted micro-batches."""

from __future__ import annotations

import dataclasses
from typing import Any

from toolkit._decorating import Decorator, attach
from toolkit._step import Step

__all__ = ["AccumulateConfig", "accumulate"]


@dataclasses.dataclass(frozen=True)
class AccumulateConfig:
    """Configuration of :func:`accumulate`.

    Attributes:
        micro_batches: accepted micro-batches per optimizer update.
    """

    micro_batches: int

    def __str__(self) -> str:
        return f"accumulate(micro_batches={self.micro_batches})"


def accumulate(step: Step | None = None, /, *, micro_batches: int) -> Any:
    """Accumulate gradients over ``micro_batches`` calls, then apply one update.

    Like optax ``MultiSteps``: each call consumes one micro-batch and the update happens on
    the k-th *accepted* call (``out.updated`` says whether it did). A micro-batch whose loss
    function returns ``None`` never happened: it does not advance the window. The position
    lives in ``state.window.micro_step``.

    Normalisation: a plain loss is divided by ``micro_batches`` (each window holds exactly
    that many micro-batches, so this is the mean over them). A :class:`LossSum` is
    backpropagated as a sum and the gradients are divided by the window's total count
    (summed over data-parallel ranks) when the window closes: micro-batches of unequal
    sizes then give exactly the big-batch gradient. Under DDP/FSDP2 the gradient sync is
    suppressed on all but the closing micro-batch.

    Args:
        step: the step to wrap; omit it to get a decorator.
        micro_batches: micro-batches per update, an int >= 1.

    Returns:
        The wrapped :class:`Step`, or a decorator when ``step`` is omitted.

    Raises:
        ValueError: ``micro_batches`` < 1, or accumulate applied twice.
        TypeError: ``micro_batches`` not an int, or ``step`` not a Step.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, accumulate, make_step
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> step = accumulate(make_step(lambda m, b: m(b).square().mean()), micro_batches=2)
        >>> state, out = step(state, torch.randn(4, 2))
        >>> out.updated, state.window.micro_step
        (False, 1)
        >>> state, out = step(state, torch.randn(4, 2))
        >>> out.updated, state.step
        (True, 1)
    """
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int):
        raise TypeError(
            f"accumulate: micro_batches must be an int >= 1; got "
            f"{type(micro_batches).__name__} {micro_batches!r}."
        )
    if micro_batches < 1:
        raise ValueError(
            f"accumulate: micro_batches must be >= 1; got {micro_batches}. Use 1 (or leave "
            "accumulate out) for one update per batch."
        )
    config = AccumulateConfig(micro_batches)
    if step is None:
        return Decorator("accumulate", "accumulation", config)
    return attach(step, "accumulate", "accumulation", config)
