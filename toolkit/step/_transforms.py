"""transform_grads: the user's functions over the gradients, once per update."""

from __future__ import annotations

from typing import overload

from toolkit.step._decorating import Decorator, decorate
from toolkit.step._phases import GradFn, GradTransformConfig
from toolkit.step._step import Step

__all__ = ["transform_grads"]


@overload
def transform_grads(step: Step, /, *fns: GradFn) -> Step: ...
@overload
def transform_grads(*fns: GradFn) -> Decorator: ...
def transform_grads(*args: Step | GradFn) -> Step | Decorator:
    """Run your functions over the gradients once per update, between phases 5 and 6.

    Each ``fn(grads)`` gets the gradients of the optimizer's parameters that have one, in
    ``param_groups`` order, after unscaling (4) and the division by the target count (5),
    before the finite check (6) and clipping (7): scale by world size, add noise,
    centralise, clip per layer. It changes them in place and returns ``None``, or returns
    as many new tensors, which become the parameters' ``.grad``. The functions run in the
    given order on every closed window, also one that phase 6 then rejects.

    Args:
        *args: optionally the step to wrap first, then one or more functions
            ``fn(grads: list[Tensor]) -> list[Tensor] | None``.

    Returns:
        The wrapped :class:`Step`, or a decorator when no step is given.

    Raises:
        TypeError: no function, or one that is not callable; at run time, a function that
            returns something else than None or a list of as many tensors.
        ValueError: transform_grads applied twice to one step (give all functions at once).

    Example:
        >>> import torch
        >>> from toolkit import TrainState, make_step, transform_grads
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> torch.nn.init.zeros_(model.weight)
        Parameter containing:
        tensor([[0., 0.]], requires_grad=True)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        >>> def halve(grads):
        ...     torch._foreach_mul_(grads, 0.5)
        >>> step = transform_grads(make_step(lambda m, b: m(b).sum()), halve)
        >>> state, out = step(state, torch.tensor([[2.0, 4.0]]))
        >>> model.weight.tolist()  # the gradient [2, 4], halved
        [[-1.0, -2.0]]
    """
    step = args[0] if args and isinstance(args[0], Step) else None
    fns = args[1:] if step is not None else args
    if not fns or not all(callable(fn) and not isinstance(fn, Step) for fn in fns):
        raise TypeError(
            "transform_grads: expected one or more functions fn(grads) after the optional "
            f"step; got {[type(fn).__name__ for fn in fns]}."
        )
    return decorate(step, "transform_grads", "grad_transforms", GradTransformConfig(fns))  # type: ignore[arg-type]
