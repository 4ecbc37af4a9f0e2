"""accumulate: one optimizer update per k accepted micro-batches."""

from __future__ import annotations

from typing import overload

from toolkit.step._decorating import Decorator, check_int, check_step, decorate
from toolkit.step._phases import AccumulateConfig
from toolkit.step._step import Step

__all__ = ["accumulate"]


@overload
def accumulate(step: Step, /, *, micro_batches: int) -> Step: ...
@overload
def accumulate(*, micro_batches: int) -> Decorator: ...
def accumulate(
    step: Step | None = None, /, *, micro_batches: int | None = None
) -> Step | Decorator:
    """Accumulate gradients over ``micro_batches`` calls, then apply one update.

    Like optax ``MultiSteps``: each call consumes one micro-batch and the update happens on
    the k-th *accepted* call (``out.updated``); a batch whose loss function returns ``None``
    does not advance the window (``state.window.micro_step``). A plain loss is divided by k;
    a :class:`LossSum` is summed and the gradients divided by the window's total count
    (over all data-parallel ranks), which is exact for micro-batches of any sizes. Under
    DDP/FSDP2 gradients are synchronised on the closing micro-batch only.

    Args:
        step: the step to wrap; omit it to get a decorator.
        micro_batches: micro-batches per update, an int >= 1.

    Returns:
        The wrapped :class:`Step`, or a decorator when ``step`` is omitted.

    Raises:
        ValueError: ``micro_batches`` < 1, or accumulate applied twice.
        TypeError: ``micro_batches`` missing or not an int, or ``step`` not a Step.

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
    check_step("accumulate", step)
    k = check_int("accumulate", "micro_batches", micro_batches, 1)
    return decorate(step, "accumulate", "accumulation", AccumulateConfig(k))
