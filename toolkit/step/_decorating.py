"""The step decorators (amp_wrap, accumulate, transform_grads, clip, guard_nonfinite) and compose.

Each is a thin validated factory: it checks its arguments, builds its phase's configuration
(``_phases.py``) and puts it into its own field of a :class:`Step`, which runs the phases in
the canonical order. Every one is callable as ``name(step, ...)`` or ``name(...)``, the
latter returning a :class:`Decorator` for :func:`compose`.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, overload

import torch

import toolkit.step._phases as phases
from toolkit._checks import check, check_one_of, check_positive
from toolkit.step._step import Scaler, Step

_Bound = float | None
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "half": torch.float16}  # fmt: skip
# What ``amp_wrap(dtype="bf16")`` and the other decorators return without a step.
Decorator = Callable[[Step], Step]


def _decorate(step: Any, name: str, field: str, config: Any) -> Any:  # Step | Decorator
    """``step`` with ``config`` in ``field``, or without a step (``name(...)``) a decorator
    doing so; raises on a step decorated twice or an impossible combination."""
    if step is None:
        return lambda step: _decorate(step, name, field, config)
    _check_step(name, step)
    if getattr(step, field) is not None:
        raise ValueError(
            f"{name}: expected a step without {name}; got one with it ({name} applied twice to "
            f"the same step). Apply it once: for other options, to the step it decorated."
        )
    new: Step = dataclasses.replace(step, **{field: config})
    if new.amp is not None and new.amp.fp16 and new.guard and new.guard.on_exhaust == "accept":
        raise ValueError(
            "guard_nonfinite(on_exhaust='accept') cannot be combined with amp_wrap(dtype='fp16'): "
            "the GradScaler always skips an update whose gradients are not finite, so the window "
            "could never be accepted. Use on_exhaust='raise' or 'skip', or bf16."
        )
    return new


def _check_step(name: str, step: Any) -> None:
    if step is not None and not isinstance(step, Step):
        raise TypeError(
            f"{name}: expected a Step from make_step(loss_fn) as the first argument; got "
            f"{type(step).__name__} {step!r:.40}. Pass options by keyword."
        )


def _check_device_type(device_type: Any) -> None:
    try:  # a str torch knows, with autocast and (torch.cuda, torch.mps...) a device here
        available = getattr(getattr(torch, device_type, None), "is_available", lambda: True)
        ok = torch.amp.is_autocast_available(device_type) and available()
    except (RuntimeError, TypeError):
        ok = False
    expected = "a device type with autocast and a device here, such as 'cpu' or 'cuda'"
    fix = "Leave it out to use the parameters' device."
    check(ok, "amp_wrap", "device_type", expected, device_type, fix)


def _number(name: str, option: str, value: Any, least: int | None = None) -> Any:
    """``value``, a number > 0 (as a float) or, given ``least``, an int >= ``least``.

    The wrong kind (a bool is neither) raises TypeError, the wrong size ValueError.
    """
    kind = "a number > 0" if least is None else f"an int >= {least}"
    ok = isinstance(value, int if least is not None else (int, float))
    check(ok and not isinstance(value, bool), name, option, kind, value, error=TypeError)
    check(value > 0 if least is None else value >= least, name, option, kind, value)
    return float(value) if least is None else value


@overload
def amp_wrap(
    step: Step, /, *, dtype: str | torch.dtype, scaler: Scaler = ..., min_scale: float = ...,
    device_type: str | None = ...,
) -> Step: ...  # fmt: skip
@overload
def amp_wrap(
    dtype: str | torch.dtype, *, scaler: Scaler = ..., min_scale: float = ...,
    device_type: str | None = ...,
) -> Decorator: ...  # fmt: skip
def amp_wrap(
    step: Step | str | torch.dtype | None = None, /, *, dtype: str | torch.dtype | None = None,
    scaler: Scaler = None, min_scale: float = 1e-4, device_type: str | None = None,
) -> Step | Decorator:  # fmt: skip
    """Run forward passes under ``torch.autocast`` (phase 1); fp16 adds a GradScaler.

    bf16 needs no scaler. fp16 uses ``state.scaler``, else ``scaler``, else a new
    ``torch.amp.GradScaler(device_type)``, kept in the returned state. Gradients are
    unscaled once per update (phase 4). An update the scaler skips for overflow is not
    applied: no scheduler step, ``state.step`` unchanged, ``state.guard.total_overflow``
    counts it. fp16 needs one host sync per update (did the scaler skip?), shared with
    :func:`guard_nonfinite`. Backward runs outside autocast, as PyTorch recommends.

    Args:
        step: the step to wrap; omit it to get a decorator (or give the dtype in its place:
            ``amp_wrap("bf16")``).
        dtype: ``"bf16"``, ``"fp16"``, ``torch.bfloat16`` or ``torch.float16`` (also
            ``"bfloat16"``, ``"float16"``, ``"half"``, in any case).
        scaler: fp16 only: the GradScaler to use when the state holds none.
        min_scale: fp16 only: an overflow taking the scale below this raises
            :class:`LossScaleError`.
        device_type: autocast device (``"cpu"``, ``"cuda"``); default: the device of the
            optimizer's first parameter.

    Returns:
        The wrapped :class:`Step`, or a decorator when ``step`` is omitted.

    Raises:
        ValueError: an unknown dtype, a scaler with bf16, a disabled scaler, ``min_scale``
            not a finite number > 0, a device type without autocast or without a device
            here, or amp_wrap applied twice.
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
    if isinstance(step, (str, torch.dtype)) and dtype is None:  # amp_wrap("bf16")
        step, dtype = None, step
    _check_step("amp_wrap", step)
    resolved = _DTYPES.get(str(dtype).lower(), dtype if dtype in _DTYPES.values() else None)
    check(resolved is not None, "amp_wrap", "dtype", "'bf16', 'fp16', torch.bfloat16 or "
          "torch.float16", dtype, "For float32 training leave amp_wrap out.")  # fmt: skip
    ok = scaler is None or isinstance(scaler, torch.amp.GradScaler)
    check(ok, "amp_wrap", "scaler", "a torch.amp.GradScaler or None", scaler, error=TypeError)
    if scaler is not None:
        check(resolved == torch.float16, "amp_wrap", "dtype", "'fp16' with a GradScaler", dtype)
        check(scaler.is_enabled(), "amp_wrap", "scaler.is_enabled()", "True", False)
    min_scale = check_positive("amp_wrap", "min_scale", min_scale, "1e-4")
    if device_type is not None:
        _check_device_type(device_type)
    config = phases.AmpConfig(resolved, scaler, min_scale, device_type)  # type: ignore[arg-type]
    return _decorate(step, "amp_wrap", "amp", config)  # type: ignore[arg-type]  # checked


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
    _check_step("accumulate", step)
    k = _number("accumulate", "micro_batches", micro_batches, least=1)
    return _decorate(step, "accumulate", "accumulation", phases.AccumulateConfig(k))


@overload
def transform_grads(step: Step, /, *fns: phases.GradFn) -> Step: ...
@overload
def transform_grads(*fns: phases.GradFn) -> Decorator: ...
def transform_grads(*args: Step | phases.GradFn) -> Step | Decorator:
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
    ok = bool(fns) and all(callable(fn) and not isinstance(fn, Step) for fn in fns)
    expected, got = "one or more functions fn(grads)", [type(fn).__name__ for fn in fns]
    check(ok, "transform_grads", "the arguments after the step", expected, got, error=TypeError)
    config = phases.GradTransformConfig(fns)  # type: ignore[arg-type]
    return _decorate(step, "transform_grads", "grad_transforms", config)


@overload
def clip(
    step: Step, /, *, max_norm: _Bound = ..., max_value: _Bound = ..., norm_type: float = ...
) -> Step: ...
@overload
def clip(
    *, max_norm: _Bound = ..., max_value: _Bound = ..., norm_type: float = ...
) -> Decorator: ...
def clip(
    step: Step | None = None, /, *, max_norm: _Bound = None, max_value: _Bound = None,
    norm_type: float = 2.0,
) -> Step | Decorator:  # fmt: skip
    """Clip gradients once per update (phase 7), after unscaling and count normalisation.

    By norm with ``torch.nn.utils.clip_grad_norm_`` semantics; by value, clamping each
    element to ``[-max_value, max_value]``; with both, the norm clip first. ``out.grad_norm``
    is the total norm before clipping. No host sync.

    Args:
        step: the step to wrap; omit it to get a decorator.
        max_norm: the total-norm bound, > 0.
        max_value: the element-wise bound, > 0.
        norm_type: the norm's p, > 0 or ``math.inf``.

    Returns:
        The wrapped :class:`Step`, or a decorator when ``step`` is omitted.

    Raises:
        ValueError: neither bound, a bound or ``norm_type`` not > 0, or clip applied twice.
        TypeError: a bound or ``norm_type`` that is not a number, or ``step`` not a Step.

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
    _check_step("clip", step)
    if max_norm is None and max_value is None:
        raise ValueError("clip: expected max_norm and/or max_value; got neither.")
    norm = None if max_norm is None else _number("clip", "max_norm", max_norm)
    value = None if max_value is None else _number("clip", "max_value", max_value)
    config = phases.ClipConfig(norm, value, _number("clip", "norm_type", norm_type))
    return _decorate(step, "clip", "clipping", config)


@overload
def guard_nonfinite(
    step: Step, /, *, max_retries: int = ..., on_exhaust: phases.OnExhaust = ...
) -> Step: ...
@overload
def guard_nonfinite(*, max_retries: int = ..., on_exhaust: phases.OnExhaust = ...) -> Decorator: ...
def guard_nonfinite(
    step: Step | None = None, /, *, max_retries: int = 3, on_exhaust: phases.OnExhaust = "raise"
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
    ``state.guard.total_overflow``), and only a non-finite loss is a failure. What the
    window's forward passes changed stays: BatchNorm running statistics (and any buffer a
    forward updates) keep the rejected batches, possibly NaN; reset them, or load a
    checkpoint, if the model has such buffers.

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
    _check_step("guard_nonfinite", step)
    _number("guard_nonfinite", "max_retries", max_retries, least=0)
    check_one_of("guard_nonfinite", "on_exhaust", on_exhaust, ("raise", "skip", "accept"))
    return _decorate(step, "guard_nonfinite", "guard", phases.GuardConfig(max_retries, on_exhaust))


def compose(*decorators: Callable[[Step], Step]) -> Callable[[Step], Step]:
    """Chain step decorators into one function ``Step -> Step``.

    Any function from a Step to a Step is a decorator: the configured built-ins
    (``clip(max_norm=1.0)``) and your own (``lambda s: clip(s, max_norm=1.0)``). The
    built-ins each fill their own phase of the canonical order, so their order here never
    changes the result.

    Args:
        *decorators: functions ``Step -> Step``, applied left to right.

    Returns:
        A function ``Step -> Step`` applying every decorator.

    Raises:
        TypeError: an argument is not callable or is a Step (which takes a state and a
            batch, not a step); when applied, a decorator returning something else than a
            Step.
        ValueError: when applied, the same built-in decorator twice (or one already on the
            step), or two that cannot be combined.

    Example:
        >>> import torch
        >>> from toolkit import accumulate, clip, compose, make_step
        >>> loss_fn = lambda m, b: m(b).square().mean()
        >>> step = compose(accumulate(micro_batches=2), clip(max_norm=1.0))(make_step(loss_fn))
        >>> step.accumulation.micro_batches, step.clipping.max_norm
        (2, 1.0)
    """
    for d in decorators:
        ok, expected = callable(d) and not isinstance(d, Step), "a function Step -> Step"
        check(ok, "compose", "each", expected + ", e.g. clip(max_norm=1.0)", d, error=TypeError)

    def composed(step: Step) -> Step:
        for d in decorators:
            step = d(step)
            name = f"what {getattr(d, '__qualname__', d)!r} returned"
            check(isinstance(step, Step), "compose", name, "a Step", type(step), error=TypeError)
        return step

    return composed
