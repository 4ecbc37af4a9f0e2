"""amp_wrap: autocast forward passes, and a GradScaler for fp16."""

from __future__ import annotations

from typing import overload

import torch

from toolkit.step._decorating import Decorator, check_step, decorate
from toolkit.step._phases import AmpConfig
from toolkit.step._step import Step

__all__ = ["amp_wrap"]

_Scaler = torch.amp.GradScaler | None


@overload
def amp_wrap(
    step: Step, /, *, dtype: str | torch.dtype, scaler: _Scaler = ..., min_scale: float = ...,
    device_type: str | None = ...,
) -> Step: ...  # fmt: skip
@overload
def amp_wrap(
    *, dtype: str | torch.dtype, scaler: _Scaler = ..., min_scale: float = ...,
    device_type: str | None = ...,
) -> Decorator: ...  # fmt: skip
def amp_wrap(
    step: Step | None = None, /, *, dtype: str | torch.dtype | None = None,
    scaler: _Scaler = None, min_scale: float = 1e-4, device_type: str | None = None,
) -> Step | Decorator:  # fmt: skip
    """Run forward passes under ``torch.autocast`` (phase 1); fp16 adds a GradScaler.

    bf16 needs no scaler. fp16 uses ``state.scaler``, else ``scaler``, else a new
    ``torch.amp.GradScaler(device_type)``, kept in the returned state. Gradients are
    unscaled once per update (phase 4). An update the scaler skips for overflow is not
    applied: no scheduler step, ``state.step`` unchanged, ``state.guard.total_overflow``
    counts it. fp16 needs one host sync per update (did the scaler skip?), shared with
    :func:`guard_nonfinite`. Backward runs outside autocast, as PyTorch recommends.

    Args:
        step: the step to wrap; omit it to get a decorator.
        dtype: ``"bf16"``, ``"fp16"``, ``torch.bfloat16`` or ``torch.float16``.
        scaler: fp16 only: the GradScaler to use when the state holds none.
        min_scale: fp16 only: an overflow taking the scale below this raises
            :class:`LossScaleError`.
        device_type: autocast device (``"cpu"``, ``"cuda"``); default: the device of the
            optimizer's first parameter.

    Returns:
        The wrapped :class:`Step`, or a decorator when ``step`` is omitted.

    Raises:
        ValueError: an unknown dtype, a scaler with bf16, a disabled scaler,
            ``min_scale <= 0``, a device type without autocast or without a device here,
            or amp_wrap applied twice.
        TypeError: ``step`` not a Step, ``scaler`` not a GradScaler.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, amp_wrap, make_step
        >>> model = torch.nn.Linear(4, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> step = amp_wrap(make_step(lambda m, b: m(b).float().square().mean()), dtype="bf16")
        >>> state, out = step(state, torch.randn(8, 4))
        >>> out.updated, state.scaler is None
        (True, True)
    """
    check_step("amp_wrap", step)
    config = AmpConfig(dtype, scaler, min_scale, device_type)  # type: ignore[arg-type]
    return decorate(step, "amp_wrap", "amp", config)
