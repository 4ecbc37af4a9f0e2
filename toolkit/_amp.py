"""amp_wrap: autocast forward passes, and a GradScaler for fp16."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from toolkit._decorating import Decorator, attach
from toolkit._step import Step

__all__ = ["AmpConfig", "LossScaleError", "amp_wrap"]

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}


class LossScaleError(RuntimeError):
    """The fp16 loss scale fell below its floor: gradients overflow whatever the scale.

    Example:
        >>> import torch
        >>> from toolkit import LossScaleError, TrainState, amp_wrap, make_step
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
        >>> step = amp_wrap(make_step(lambda m, b: m(b).float().mean()), dtype="fp16",
        ...                 scaler=scaler, min_scale=0.75)
        >>> try:
        ...     step(state, torch.full((1, 2), float("inf")))
        ... except LossScaleError as error:
        ...     print(str(error)[:44])
        the fp16 loss scale fell to 0.5, below min_s
    """


@dataclasses.dataclass(frozen=True)
class AmpConfig:
    """Configuration of :func:`amp_wrap`.

    Attributes:
        dtype: the autocast dtype (``torch.bfloat16`` or ``torch.float16``).
        scaler: a GradScaler to use when the state has none (fp16 only), or ``None``.
        min_scale: the loss-scale floor under which an overflow raises LossScaleError.
        device_type: autocast device type; ``None`` takes that of the optimizer's first
            parameter (no walk over the model's modules per micro-batch).
    """

    dtype: torch.dtype
    scaler: torch.amp.GradScaler | None = None
    min_scale: float = 1e-4
    device_type: str | None = None

    @property
    def fp16(self) -> bool:
        return self.dtype == torch.float16

    def _device_type(self, optimizer: torch.optim.Optimizer) -> str:
        if self.device_type is not None:
            return self.device_type
        for group in optimizer.param_groups:
            for param in group["params"]:
                return str(param.device.type)
        return "cpu"

    def autocast(self, optimizer: torch.optim.Optimizer) -> torch.autocast:
        return torch.autocast(self._device_type(optimizer), dtype=self.dtype)

    def make_scaler(self, optimizer: torch.optim.Optimizer) -> torch.amp.GradScaler:
        if self.scaler is not None:
            return self.scaler
        return torch.amp.GradScaler(self._device_type(optimizer))

    def raise_collapsed(self, scaler: torch.amp.GradScaler) -> None:
        """Raise LossScaleError; called after an overflow took the scale below min_scale."""
        raise LossScaleError(
            f"the fp16 loss scale fell to {scaler.get_scale():g}, below "
            f"min_scale={self.min_scale:g}: gradients overflow even at a tiny scale, so they "
            "are likely NaN or inf whatever the scale. Check the data and the learning rate, "
            "or train in bf16 (amp_wrap(dtype='bf16')), or lower min_scale."
        )

    def __str__(self) -> str:
        return f"amp_wrap(dtype={self.dtype})"


def _resolve_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype.lower() in _DTYPES:
            return _DTYPES[dtype.lower()]
        raise ValueError(
            f"amp_wrap: unknown dtype string {dtype!r}; expected 'bf16' or 'fp16' (or "
            "torch.bfloat16 / torch.float16). For float32 training leave amp_wrap out."
        )
    if dtype in (torch.bfloat16, torch.float16):
        return dtype
    raise ValueError(
        f"amp_wrap: dtype must be 'bf16', 'fp16', torch.bfloat16 or torch.float16; got "
        f"{dtype!r}. For float32 training leave amp_wrap out."
    )


def amp_wrap(
    step: Step | None = None,
    /,
    *,
    dtype: str | torch.dtype,
    scaler: torch.amp.GradScaler | None = None,
    min_scale: float = 1e-4,
    device_type: str | None = None,
) -> Any:
    """Run forward passes under ``torch.autocast``; with fp16, scale the loss with a GradScaler.

    bf16 needs no scaler. fp16 uses ``state.scaler`` or, when the state has none, ``scaler``
    or a new ``torch.amp.GradScaler(device_type)``, stored in the returned state (and so in
    every checkpoint). Gradients are unscaled exactly once per update, before the finite
    check and clipping. An update the scaler skips for overflow is not applied: the
    scheduler and ``state.step`` do not advance, and ``state.guard.total_overflow`` counts
    it. Backward runs outside autocast, as PyTorch recommends.

    Under fp16 the step needs one host sync per update (to know whether the scaler
    skipped, so the scheduler does not step); :func:`guard_nonfinite` shares that sync.

    Args:
        step: the step to wrap; omit it to get a decorator (``amp_wrap(dtype="bf16")``).
        dtype: ``"bf16"``, ``"fp16"``, ``torch.bfloat16`` or ``torch.float16``.
        scaler: fp16 only: the GradScaler to use when the state holds none.
        min_scale: fp16 only: an overflow that takes the scale below this raises
            :class:`LossScaleError`.
        device_type: autocast device (``"cpu"``, ``"cuda"``); default: the device of the
            optimizer's first parameter.

    Returns:
        The wrapped :class:`Step`, or a decorator when ``step`` is omitted.

    Raises:
        ValueError: unknown dtype, a scaler with bf16, a disabled scaler, ``min_scale <= 0``,
            or amp_wrap applied twice.
        TypeError: when ``step`` is not a Step.

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
    resolved = _resolve_dtype(dtype)
    if scaler is not None and resolved != torch.float16:
        raise ValueError(
            f"amp_wrap: a GradScaler was given with dtype={resolved}; only fp16 needs loss "
            "scaling. Drop the scaler, or use dtype='fp16'."
        )
    if scaler is not None and not scaler.is_enabled():
        raise ValueError(
            "amp_wrap: the GradScaler given is disabled (enabled=False), so fp16 gradients "
            "would never be unscaled. Pass torch.amp.GradScaler(device) or none at all."
        )
    if not min_scale > 0:
        raise ValueError(f"amp_wrap: min_scale must be > 0; got {min_scale!r}.")
    config = AmpConfig(resolved, scaler, float(min_scale), device_type)
    if step is None:
        return Decorator("amp_wrap", "amp", config)
    return attach(step, "amp_wrap", "amp", config)
