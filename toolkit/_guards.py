"""guard_nonfinite: throw away updates whose loss or gradients are NaN or inf."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

from toolkit._decorating import Decorator, attach
from toolkit._state import GuardState
from toolkit._step import Step

__all__ = ["GuardConfig", "NonFiniteError", "guard_nonfinite"]

OnExhaust = Literal["raise", "skip", "accept"]


class NonFiniteError(RuntimeError):
    """Too many consecutive accumulation windows had a non-finite loss or gradient.

    Example:
        >>> import torch
        >>> from toolkit import NonFiniteError, TrainState, guard_nonfinite, make_step
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> step = guard_nonfinite(make_step(lambda m, b: m(b).mean()), max_retries=0)
        >>> try:
        ...     step(state, torch.full((1, 2), float("nan")))
        ... except NonFiniteError as error:
        ...     print(str(error)[:60])
        guard_nonfinite: 1 consecutive accumulation windows had a no
    """


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    """Configuration of :func:`guard_nonfinite`.

    Attributes:
        max_retries: rejected windows in a row that are retried before ``on_exhaust``.
        on_exhaust: ``"raise"``, ``"skip"`` or ``"accept"``.
    """

    max_retries: int
    on_exhaust: OnExhaust = "raise"

    def judge(
        self,
        counters: GuardState,
        nonfinite: bool,
        overflow: bool,
        applied_updates: int,
        window_loss: torch.Tensor | None,
        grad_norm: torch.Tensor | None,
    ) -> tuple[GuardState, bool, NonFiniteError | None]:
        """Update the counters for one closed window.

        Returns them, whether to apply the window, and the error to raise once the step has
        thrown the window away (``on_exhaust="raise"`` with the retries used up), or None.
        """
        if not nonfinite:
            if overflow:  # the scaler's business: neither a failure nor a success
                return counters, False, None
            return counters._replace(notfinite_count=0), True, None
        counters = counters._replace(
            notfinite_count=counters.notfinite_count + 1,
            total_notfinite=counters.total_notfinite + 1,
        )
        if counters.notfinite_count <= self.max_retries or self.on_exhaust == "skip":
            return counters, False, None
        if self.on_exhaust == "accept":
            return counters, True, None
        return (
            counters,
            False,
            NonFiniteError(
                f"guard_nonfinite: {counters.notfinite_count} consecutive accumulation windows had "
                f"a non-finite loss or gradient (max_retries={self.max_retries}; "
                f"{counters.total_notfinite} rejected in total). The last one: summed loss "
                f"{_show(window_loss)}, gradient norm {_show(grad_norm)}, after "
                f"{applied_updates} applied updates. Check the data for NaN/inf and the learning "
                "rate, or pass on_exhaust='skip' to keep skipping such windows."
            ),
        )

    def __str__(self) -> str:
        return f"guard_nonfinite(max_retries={self.max_retries}, on_exhaust={self.on_exhaust!r})"


def _show(value: torch.Tensor | None) -> str:
    return "not computed" if value is None else f"{value.item():g}"


def guard_nonfinite(
    step: Step | None = None,
    /,
    *,
    max_retries: int = 3,
    on_exhaust: OnExhaust = "raise",
) -> Any:
    """Reject an update when the window's loss or gradients are not finite.

    Checked once per accumulation window, after unscaling, on the window's summed loss and
    the total gradient norm, with one host sync (shared with the fp16 scaler's) and a MAX
    all-reduce so that every data-parallel rank decides alike. A rejected window is thrown
    away: gradients cleared, no optimizer step, no scheduler step, ``state.step``
    unchanged; the next window is the retry.

    Counters live in ``state.guard`` (:class:`GuardState`): ``notfinite_count`` (rejected
    windows in a row, reset by a finite window) and ``total_notfinite``. When a window
    fails with ``notfinite_count`` already at ``max_retries`` (``max_retries=0``: the first
    failure), ``on_exhaust`` decides: ``"raise"`` a :class:`NonFiniteError` (default),
    ``"skip"`` it and keep skipping, or ``"accept"`` it and apply the update anyway (optax
    ``apply_if_finite`` semantics).

    Under fp16 non-finite *gradients* are the GradScaler's overflow: the scaler skips the
    update and lowers its scale, the guard does not count it (``state.guard.total_overflow``
    does), and only a non-finite loss is a failure. A scale collapsing below
    ``amp_wrap(min_scale=...)`` raises :class:`toolkit.LossScaleError`.

    Args:
        step: the step to wrap; omit it to get a decorator.
        max_retries: consecutive rejected windows to retry, an int >= 0.
        on_exhaust: ``"raise"``, ``"skip"`` or ``"accept"``.

    Returns:
        The wrapped :class:`Step`, or a decorator when ``step`` is omitted.

    Raises:
        ValueError: ``max_retries`` < 0, an unknown ``on_exhaust``, ``"accept"`` together
            with fp16, or guard_nonfinite applied twice.
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
    if isinstance(max_retries, bool) or not isinstance(max_retries, int):
        raise TypeError(
            f"guard_nonfinite: max_retries must be an int >= 0; got "
            f"{type(max_retries).__name__} {max_retries!r}. For unlimited retries use "
            "on_exhaust='skip'."
        )
    if max_retries < 0:
        raise ValueError(f"guard_nonfinite: max_retries must be >= 0; got {max_retries}.")
    if on_exhaust not in ("raise", "skip", "accept"):
        raise ValueError(
            f"guard_nonfinite: on_exhaust must be 'raise', 'skip' or 'accept'; got {on_exhaust!r}."
        )
    config = GuardConfig(max_retries, on_exhaust)
    if step is None:
        return Decorator("guard_nonfinite", "guard", config)
    return attach(step, "guard_nonfinite", "guard", config)
