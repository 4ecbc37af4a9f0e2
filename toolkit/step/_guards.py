"""guard_nonfinite: throw away updates whose loss or gradients are NaN or inf."""

from __future__ import annotations

from typing import overload

from toolkit.step._decorating import Decorator, check_int, check_step, decorate
from toolkit.step._phases import GuardConfig, OnExhaust
from toolkit.step._step import Step

__all__ = ["guard_nonfinite"]


@overload
def guard_nonfinite(
    step: Step, /, *, max_retries: int = ..., on_exhaust: OnExhaust = ...
) -> Step: ...
@overload
def guard_nonfinite(*, max_retries: int = ..., on_exhaust: OnExhaust = ...) -> Decorator: ...
def guard_nonfinite(
    step: Step | None = None, /, *, max_retries: int = 3, on_exhaust: OnExhaust = "raise"
) -> Step | Decorator:
    """Reject an update whose window had a non-finite loss or gradient (phase 6).

    Checked once per window, after unscaling, on the summed loss and the total gradient
    norm, with one host sync (shared with fp16's) and a MAX all-reduce so that every rank
    decides alike. A rejected window is thrown away: gradients cleared, no optimizer or
    scheduler step, ``state.step`` unchanged; the next window is the retry. Counters are in
    ``state.guard`` (:class:`GuardState`). When a window fails with ``notfinite_count``
    already at ``max_retries``, ``on_exhaust`` decides: ``"raise"`` :class:`NonFiniteError`,
    ``"skip"`` it and keep skipping, or ``"accept"`` it (optax ``apply_if_finite``). Under
    fp16 non-finite *gradients* are the GradScaler's overflow (counted in
    ``state.guard.total_overflow``), and only a non-finite loss is a failure.

    Args:
        step: the step to wrap; omit it to get a decorator.
        max_retries: consecutive rejected windows to retry, an int >= 0.
        on_exhaust: ``"raise"``, ``"skip"`` or ``"accept"``.

    Returns:
        The wrapped :class:`Step`, or a decorator when ``step`` is omitted.

    Raises:
        ValueError: ``max_retries`` < 0, an unknown ``on_exhaust``, ``"accept"`` with fp16,
            or guard_nonfinite applied twice.
        TypeError: ``max_retries`` not an int, or ``step`` not a Step.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, guard_nonfinite, make_step
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> step = guard_nonfinite(make_step(lambda m, b: m(b).mean() * b.sum()), max_retries=1)
        >>> state, out = step(state, torch.tensor([[float("nan"), 1.0]]))
        >>> out.updated, out.nonfinite, state.guard.notfinite_count
        (False, True, 1)
    """
    check_step("guard_nonfinite", step)
    check_int("guard_nonfinite", "max_retries", max_retries, 0)
    if on_exhaust not in ("raise", "skip", "accept"):
        raise ValueError(
            f"guard_nonfinite: on_exhaust must be 'raise', 'skip' or 'accept'; got {on_exhaust!r}."
        )
    return decorate(step, "guard_nonfinite", "guard", GuardConfig(max_retries, on_exhaust))
