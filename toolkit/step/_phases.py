"""The phases of one optimizer update: their configurations, behaviour and errors.

This module sits beneath :class:`toolkit.Step` (as optax's ``base.py`` sits beneath its
transforms): ``_step.py`` runs these phases in the canonical order, and the public decorator
modules (``amp_wrap``, ``accumulate``, ``clip``, ``guard_nonfinite``, ``transform_grads``)
only check their arguments and build one of these configurations.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch

from toolkit.distributed._collectives import all_reduce_
from toolkit.step._state import GuardState, WindowState

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

    @property
    def fp16(self) -> bool:
        return self.dtype == torch.float16

    def device(self, optimizer: torch.optim.Optimizer) -> str:
        """The device type to autocast on and to make a GradScaler for."""
        return self.device_type or optimizer.param_groups[0]["params"][0].device.type

    def collapsed(self, scaler: torch.amp.GradScaler) -> LossScaleError:
        """The error for an overflow that took the scale below ``min_scale``."""
        return LossScaleError(
            f"the fp16 loss scale fell to {scaler.get_scale():g}, below min_scale="
            f"{self.min_scale:g}: the gradients are likely NaN or inf at any scale; check the "
            "data and the learning rate, or train in bf16, or lower min_scale."
        )


@dataclasses.dataclass(frozen=True)
class AccumulateConfig:
    """Phase 2 (loss normalisation) and the window length.

    Attributes:
        micro_batches: accepted micro-batches per optimizer update.
    """

    micro_batches: int


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
                got = f"list of {len(result)}" if isinstance(result, Sequence) else type(result)
                raise TypeError(
                    f"transform_grads: {getattr(fn, '__qualname__', fn)} returned a "
                    f"{getattr(got, '__name__', got)}; "
                    f"expected None (changed in place) or a list of {len(grads)} tensors."
                )
            grads = list(result)
            for param, grad in zip(params, grads):
                param.grad = grad
        return grads


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
        for part in by_mesh(params):  # DTensor refuses one kernel over two meshes
            if self.max_norm is not None:
                assert total_norm is not None  # the step computes it whenever clip is on
                # clip_grad_norm_'s arithmetic, reusing the norm the step already computed
                # for reporting and the finite check (no host sync).
                torch.nn.utils.clip_grads_with_norm_(part, self.max_norm, total_norm)
            if self.max_value is not None:
                torch.nn.utils.clip_grad_value_(part, self.max_value)


def by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in lists that one foreach kernel takes: plain tensors together, DTensors
    by device mesh (a model tensor-parallel in part holds both, on several meshes)."""
    if {type(tensor) for tensor in tensors} <= {torch.Tensor}:  # no DTensor (or none)
        return [tensors]
    lists: dict[Any, list[torch.Tensor]] = {}
    for tensor in tensors:
        lists.setdefault(getattr(tensor, "device_mesh", None), []).append(tensor)
    return list(lists.values())


def total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of all ``grads`` as one plain tensor, over any meshes.

    One norm per mesh (a DTensor's made whole over its mesh: one all-reduce), then the norm
    of those norms, which is the total norm exactly (``max`` for ``inf``), as
    ``clip_grad_norm_`` combines its per-device norms.
    """
    norms = [torch.nn.utils.get_total_norm(part, norm_type) for part in by_mesh(grads)]
    norms = [n if type(n) is torch.Tensor else n.full_tensor() for n in norms]  # type: ignore[attr-defined]
    if len(norms) == 1:  # one mesh, or none: the norm as clip_grad_norm_ computes it
        return norms[0]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    """Phase 6: the finite check's verdict and the retry counters.

    Attributes:
        max_retries: rejected windows in a row that are retried before ``on_exhaust``.
        on_exhaust: ``"raise"``, ``"skip"`` or ``"accept"``.
    """

    max_retries: int
    on_exhaust: OnExhaust = "raise"

    def exhausted(
        self, counters: GuardState, loss: torch.Tensor | None, norm: torch.Tensor | None, step: int
    ) -> NonFiniteError:
        """The error once ``on_exhaust="raise"`` has no retry left."""
        n, total = counters.notfinite_count, counters.total_notfinite
        return NonFiniteError(
            f"guard_nonfinite: {n} consecutive accumulation windows had a non-finite loss or "
            f"gradient (max_retries={self.max_retries}; {total} rejected in total); the last: "
            f"summed loss {_show(loss)}, gradient norm {_show(norm)}, after {step} updates. "
            "Check the data and the learning rate, or pass on_exhaust='skip'."
        )


class Verdict(NamedTuple):
    """What phase 6 found about a closed window (all False: apply it)."""

    nonfinite: bool = False  # the loss (or, without a scaler, the gradient norm) is not finite
    overflow: bool = False  # the GradScaler found inf/NaN gradients
    collapsed: bool = False  # ... and its scale fell below min_scale
    empty: bool = False  # the window's total target count is 0: nothing to learn from
    negative: bool = False  # ... or negative: the loss function reported a bad count
    uneven: bool = False  # data-parallel ranks skipped different numbers of micro-batches
    replicas: bool = False  # ranks of one replica (tensor parallel) counted different targets


APPLY = Verdict()  # nothing against applying the window, as one object


def verdict_of_window(
    window: WindowState, grad_norm: torch.Tensor | None, total: torch.Tensor | None, *,
    guard: GuardConfig | None, scaler: torch.amp.GradScaler | None, amp: AmpConfig | None,
    optimizer: torch.optim.Optimizer, group: Any, carried: torch.Tensor | None,
    replicated: bool,
) -> Verdict:  # fmt: skip
    """Phase 6: every decision about the closed window in one host sync, alike on all ranks.

    Each flag is a 0-d tensor; one read of them all is the update's host sync. ``total``
    is the window's count as a tensor (checked here since this sync exists anyway), or
    None. Over ``group`` (every rank of the job) one MAX all-reduce agrees the flags, with
    each rank's skipped micro-batches and their negation (``uneven`` when the most and the
    fewest differ), unless DDP has ``carried`` the ranks' summed window loss and skip sums
    with the gradients (see :class:`BucketFlags`): then every flag agrees without one.
    ``replicated``: ``group`` holds replicas of the token ranks (tensor parallelism), whose
    summed counts ride along as ``[total, -total]`` (``replicas`` when they differ).
    """
    loss, flags = window.loss, {}
    if scaler is None and total is None and group is None and guard is not None:
        # The guard alone: as few kernels as a hand-written loop needs, and one read.
        assert loss is not None and grad_norm is not None
        finite = bool((torch.isfinite(loss) & torch.isfinite(grad_norm)).item())  # the sync
        return APPLY if finite else Verdict(nonfinite=True)
    if carried is not None:
        loss = carried[0]  # the ranks' summed losses: finite when every rank's is
        # Equal counts exactly when sum**2 == world * sum of squares (Cauchy-Schwarz).
        flags["uneven"] = carried[1] * carried[1] != group.size() * carried[2]
    if scaler is None and guard is not None:
        assert loss is not None and grad_norm is not None
        flags["nonfinite"] = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
    elif scaler is not None:
        if guard is not None and loss is not None:  # under fp16 only the loss counts
            flags["nonfinite"] = ~torch.isfinite(loss)
        # The GradScaler keeps found_inf per optimizer and device: combined on the scale's
        # device (no .item()), the whole decision stays to this single sync.
        found_per_device = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        scale = scaler._get_scale_async()
        assert scale is not None  # unscale_ has run, so the scale exists
        found: Any = sum(f.to(scale.device) for f in found_per_device.values())
        flags["overflow"] = found > 0
        floor = amp.min_scale if amp is not None else 0.0
        flags["collapsed"] = (found > 0) & (scale * scaler.get_backoff_factor() < floor)
    if total is not None:
        flags["empty"], flags["negative"] = total == 0, total < 0
    if group is not None and carried is None:
        pairs = [_pair(window.skipped, optimizer)]  # on the parameters' device
        if replicated and total is not None:
            pairs.append(torch.stack([total, -total]).to(pairs[0]))
        values = [flag.to(pairs[0].device, torch.float32) for flag in flags.values()]
        packed = torch.cat([torch.stack(values), *pairs]) if values else torch.cat(pairs)
        packed = all_reduce_(packed, torch.distributed.ReduceOp.MAX, group)
        flags = dict(zip(flags, packed[: len(values)] > 0))
        flags["uneven"] = packed[len(values)] + packed[len(values) + 1] > 0
        if len(pairs) == 2:
            flags["replicas"] = packed[-2] + packed[-1] > 0
    device = next(iter(flags.values())).device
    bits = torch.stack([flag.to(device, torch.float32) for flag in flags.values()])
    code = int((bits * _flag_weights(device)[: len(bits)]).sum().item())  # the sync
    return Verdict(**{name: bool(code >> i & 1) for i, name in enumerate(flags)})


def _pair(value: float, optimizer: Any) -> torch.Tensor:
    """``[value, -value]``: MAX over the ranks gives the most and minus the fewest."""
    device = optimizer.param_groups[0]["params"][0].device
    return torch.tensor([value, -value], dtype=torch.float32, device=device)


@functools.cache
def _flag_weights(device: torch.device) -> torch.Tensor:
    """The weights that pack the seven flags into one number, made once per device."""
    return torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0], device=device)


def _show(value: torch.Tensor | None) -> str:
    return "not computed" if value is None else f"{value.item():g}"
