"""The phases of one optimizer update: their configurations, behaviour and errors.

This module sits beneath :class:`toolkit.Step` (as optax's ``base.py`` sits beneath its
transforms): ``_step.py`` runs these phases in the canonical order, and the public decorator
modules (``amp_wrap``, ``accumulate``, ``clip``, ``guard_nonfinite``, ``transform_grads``)
only check their arguments and build one of these configurations.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch

from toolkit.distributed._collectives import all_reduce_, skips_differ_carried
from toolkit.step._state import GuardState

__all__ = [
    "AccumulateConfig",
    "AmpConfig",
    "ClipConfig",
    "GradTransformConfig",
    "GuardConfig",
    "LossScaleError",
    "NonFiniteError",
    "Verdict",
    "decide",
    "skip_range",
    "skips_differ",
]

OnExhaust = Literal["raise", "skip", "accept"]
GradFn = Callable[[list[torch.Tensor]], "Sequence[torch.Tensor] | None"]


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
class AmpConfig:
    """Phase 1 (forward under autocast) and 3-4, 8-9 under fp16 (the GradScaler).

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

    def __post_init__(self) -> None:
        # amp_wrap's argument checks: a dtype string becomes the torch dtype.
        object.__setattr__(self, "dtype", _resolve_dtype(self.dtype))
        scaler = self.scaler
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(
                f"amp_wrap: scaler must be a torch.amp.GradScaler or None; got {scaler!r}."
            )
        if scaler is not None and self.dtype != torch.float16:
            raise ValueError(f"amp_wrap: a GradScaler needs dtype='fp16'; got dtype={self.dtype}.")
        if scaler is not None and not scaler.is_enabled():
            raise ValueError(
                "amp_wrap: expected an enabled GradScaler; got one with enabled=False."
            )
        m = self.min_scale
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not m > 0:
            raise ValueError(f"amp_wrap: min_scale must be a number > 0; got {m!r}.")
        object.__setattr__(self, "min_scale", float(m))
        if self.device_type is not None:
            _check_device_type(self.device_type)

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

    def collapsed(self, scaler: torch.amp.GradScaler) -> LossScaleError:
        """The error for an overflow that took the scale below ``min_scale``."""
        return LossScaleError(
            f"the fp16 loss scale fell to {scaler.get_scale():g}, below "
            f"min_scale={self.min_scale:g}: gradients overflow even at a tiny scale, so they "
            "are likely NaN or inf whatever the scale. Check the data and the learning rate, "
            "or train in bf16 (amp_wrap(dtype='bf16')), or lower min_scale."
        )

    def __str__(self) -> str:
        return f"amp_wrap(dtype={self.dtype})"


@dataclasses.dataclass(frozen=True)
class AccumulateConfig:
    """Phase 2 (loss normalisation) and the window length.

    Attributes:
        micro_batches: accepted micro-batches per optimizer update.
    """

    micro_batches: int

    def __str__(self) -> str:
        return f"accumulate(micro_batches={self.micro_batches})"


@dataclasses.dataclass(frozen=True)
class GradTransformConfig:
    """Phase 5b: user functions over the gradient list, once per closed window.

    Attributes:
        fns: the functions, applied in this order.
    """

    fns: tuple[GradFn, ...]

    def apply(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run every function; return the gradients (new ones are set as the ``.grad``)."""
        for fn in self.fns:
            result = fn(grads)
            if result is None:
                continue
            if not isinstance(result, Sequence) or len(result) != len(grads):
                raise TypeError(
                    f"transform_grads: {_name(fn)} returned {_describe(result)}; expected None "
                    f"(gradients changed in place) or a list of {len(grads)} tensors."
                )
            grads = list(result)
            for param, grad in zip(params, grads):
                param.grad = grad
        return grads

    def __str__(self) -> str:
        return f"transform_grads({', '.join(_name(fn) for fn in self.fns)})"


@dataclasses.dataclass(frozen=True)
class ClipConfig:
    """Phase 7: clipping by total norm and/or by value.

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
            # clip_grad_norm_'s arithmetic, reusing the norm the step already computed for
            # reporting and the finite check (no host sync).
            torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, total_norm)
        if self.max_value is not None:
            torch.nn.utils.clip_grad_value_(params, self.max_value)

    def __str__(self) -> str:
        return f"clip(max_norm={self.max_norm}, max_value={self.max_value})"


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    """Phase 6: the finite check's verdict and the retry counters.

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


class Verdict(NamedTuple):
    """What phase 6 found about a closed window (all False: apply it)."""

    nonfinite: bool  # the loss (or, without a scaler, the gradient norm) is not finite
    overflow: bool  # the GradScaler found inf/NaN gradients
    collapsed: bool  # ... and its scale fell below min_scale
    empty: bool  # the window's total target count is 0: nothing to learn from
    negative: bool  # ... or negative: the loss function reported a bad count
    uneven: bool = False  # data-parallel ranks skipped different numbers of micro-batches


_FINE = Verdict(False, False, False, False, False, False)


def decide(
    guard: GuardConfig | None,
    scaler: torch.amp.GradScaler | None,
    min_scale: float,
    optimizer: torch.optim.Optimizer,
    window_loss: torch.Tensor | None,
    grad_norm: torch.Tensor | None,
    total: torch.Tensor | None = None,
    group: Any = None,
    skipped: int = 0,
    carried: torch.Tensor | None = None,
) -> Verdict:
    """Phase 6: every decision of the window in one host sync.

    ``total`` is the window's target count as a tensor (checked here because this sync
    exists anyway), or None. ``group`` is the model's data-parallel process group (see
    :func:`toolkit.data_parallel_group`), or None: the flags are all-reduced over it with
    MAX so that every data-parallel rank decides alike, together with this rank's count of
    ``skipped`` micro-batches and its negation (their maximum and minimum over the ranks:
    ``uneven`` when they differ). ``carried`` (DDP, see :class:`Carrier`): the
    ranks' summed window loss and skip sums, already exchanged with the gradients, which
    DDP has made the same on every rank; then nothing more is all-reduced.
    """
    if carried is not None:
        world = group.size() if group is not None else 1
        return _decide_carried(
            guard, scaler, min_scale, optimizer, grad_norm, total, carried, world
        )
    if scaler is None and total is None:
        # The common case, kept to as few tiny kernels as a hand-written loop needs.
        assert window_loss is not None and grad_norm is not None
        finite = torch.isfinite(window_loss) & torch.isfinite(grad_norm)
        if group is None:
            nonfinite = not finite.item()  # the one host sync of the update
            return _FINE._replace(nonfinite=nonfinite) if nonfinite else _FINE
        packed = torch.cat([(~finite).to(torch.float32).reshape(1), _pair(skipped, finite)])
        packed = all_reduce_(packed, torch.distributed.ReduceOp.MAX, group)
        # bit 0: not finite on some rank; bit 1: the skip counts differ (max + -min > 0)
        code = int(((packed[0] > 0) + 2 * (packed[1] + packed[2] > 0)).item())  # the sync
        return _FINE._replace(nonfinite=bool(code & 1), uneven=bool(code & 2))
    flags = []  # bit i of the code below
    if scaler is not None:
        found, scale = _overflows(scaler, optimizer)
        device = scale.device
        found = found > 0
        if guard is not None and window_loss is not None:
            # Under fp16 only the loss counts: non-finite gradients are the scaler's overflow.
            flags.append(~torch.isfinite(window_loss).to(device))
        else:
            flags.append(torch.zeros((), dtype=torch.bool, device=device))
        flags += [found, found & (scale * scaler.get_backoff_factor() < min_scale)]
    else:
        assert window_loss is not None and grad_norm is not None and total is not None
        device = total.device
        finite = torch.isfinite(window_loss) & torch.isfinite(grad_norm)
        flags += [~finite.to(device), *torch.zeros(2, dtype=torch.bool, device=device)]
    if total is not None:
        flags += [total.to(device) == 0, total.to(device) < 0]
    packed = torch.stack(flags).to(torch.float32)
    if group is not None:
        if total is None:  # keep the skip flag at bit 5
            packed = torch.cat([packed, packed.new_zeros(2)])
        packed = torch.cat([packed, _pair(skipped, packed)])
        packed = all_reduce_(packed, torch.distributed.ReduceOp.MAX, group)
        packed = torch.cat([packed[:5], (packed[5:6] + packed[6:7] > 0).to(torch.float32)])
    code = int((packed * _flag_bits(packed.device)[: len(packed)]).sum().item())  # the sync
    return Verdict(*(bool(code & (1 << i)) for i in range(6)))


def _decide_carried(
    guard: GuardConfig | None,
    scaler: torch.amp.GradScaler | None,
    min_scale: float,
    optimizer: torch.optim.Optimizer,
    grad_norm: torch.Tensor | None,
    total: torch.Tensor | None,
    carried: torch.Tensor,
    world: int,
) -> Verdict:
    """:func:`decide` under DDP with the flags carried (see :class:`Carrier`).

    The gradients (so their norm and the scaler's overflow) are the same on every rank
    after DDP's all-reduce, and the count total was summed over the ranks: every flag here
    agrees across ranks without an exchange of its own. One host sync, one read of a few
    numbers, decided in Python.
    """
    parts = [carried]
    if scaler is None:
        assert grad_norm is not None
        parts.append(grad_norm.reshape(1))
    else:
        found, scale = _overflows(scaler, optimizer)
        parts += [found.reshape(1), scale.reshape(1)]
    if total is not None:
        parts.append(total.reshape(1))
    # the sync
    values = torch.cat([part.to(carried.device, torch.float64) for part in parts]).tolist()
    uneven = skips_differ_carried(values[:3], world)
    loss = values[0]
    # Under fp16 only the loss counts: non-finite gradients are the scaler's overflow.
    nonfinite = guard is not None and not math.isfinite(loss)
    overflow = collapsed = False
    if scaler is None:
        nonfinite = nonfinite or not math.isfinite(values[3])
    else:
        overflow = values[3] > 0
        collapsed = overflow and values[4] * scaler.get_backoff_factor() < min_scale
    zero = negative = False
    if total is not None:
        zero, negative = values[-1] == 0, values[-1] < 0
    return Verdict(nonfinite, overflow, collapsed, zero, negative, uneven)


def _overflows(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer
) -> tuple[torch.Tensor, torch.Tensor]:
    """The GradScaler's count of devices with inf/NaN gradients after unscale_, and its scale.

    It keeps found_inf per optimizer and device; combining the tensors on device (no
    .item()) keeps the whole decision to phase 6's single sync. On the scale's device.
    """
    found_per_device = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    scale = scaler._get_scale_async()
    assert scale is not None  # unscale_ has run, so the scale exists
    found = sum(f.to(scale.device) for f in found_per_device.values())
    assert isinstance(found, torch.Tensor)
    return found, scale


def _pair(skipped: int, like: torch.Tensor) -> torch.Tensor:
    """``[skipped, -skipped]``: MAX over the ranks gives the most and minus the fewest."""
    return torch.tensor([skipped, -skipped], dtype=torch.float32, device=like.device)


def skips_differ(skipped: int, group: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether the ranks of ``group`` skipped different numbers of micro-batches.

    For an update without a verdict to carry the counts (no guard, no fp16): one
    2-element all-reduce and one host sync.
    """
    packed = all_reduce_(
        _pair(skipped, _first_param(optimizer)), torch.distributed.ReduceOp.MAX, group
    )
    return bool((packed.sum() > 0).item())


def skip_range(skipped: int, group: Any, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """The fewest and the most micro-batches of the window that a rank of ``group`` skipped.

    For the error message, on every rank of the group once they know the counts differ.
    """
    packed = all_reduce_(
        _pair(skipped, _first_param(optimizer)), torch.distributed.ReduceOp.MAX, group
    )
    wide = packed.to(torch.float64)
    code = int((wide[0] * 65536 - wide[1]).item())
    most, fewest = divmod(code, 65536)
    return fewest, most


def _first_param(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    return optimizer.param_groups[0]["params"][0]


@functools.cache
def _flag_bits(device: torch.device) -> torch.Tensor:
    """The weights that pack the six flags into one number, made once per device."""
    return torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0, 32.0], device=device)


_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16}
_DTYPES.update({"float16": torch.float16, "half": torch.float16})


def _check_device_type(device_type: Any) -> None:
    try:
        known = isinstance(device_type, str) and torch.amp.is_autocast_available(device_type)
    except RuntimeError:  # not a device type torch knows at all
        known = False
    if not known:
        raise ValueError(
            f"amp_wrap: device_type must be a device type with autocast, such as 'cpu' or "
            f"'cuda'; got {device_type!r}. Leave it out to use the parameters' device."
        )
    # torch.cuda, torch.xpu, torch.mps... (a backend torch has no module for is not checked)
    available = getattr(getattr(torch, device_type, None), "is_available", None)
    if device_type != "cpu" and callable(available) and not available():
        raise ValueError(
            f"amp_wrap: device_type={device_type!r}, but no {device_type} device is available "
            "here, so autocast would be off and training would run in float32; leave "
            "device_type out to use the parameters' device."
        )


def _resolve_dtype(dtype: Any) -> torch.dtype:
    key = dtype.lower() if isinstance(dtype, str) else dtype
    if key in (torch.bfloat16, torch.float16):
        return key
    if isinstance(key, str) and key in _DTYPES:
        return _DTYPES[key]
    raise ValueError(
        f"amp_wrap: dtype must be 'bf16', 'fp16', torch.bfloat16 or torch.float16; got "
        f"{dtype!r}. For float32 training leave amp_wrap out."
    )


def _show(value: torch.Tensor | None) -> str:
    return "not computed" if value is None else f"{value.item():g}"


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _describe(value: Any) -> str:
    if isinstance(value, Sequence):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"
