"""A hand-written PyTorch training loop in the nanoGPT ``train.py`` order.

This is the reference the composed toolkit step is tested against (tests/step/test_equivalence.py).
It is written the way a careful user writes the loop by hand, with plain PyTorch calls only
and nothing from toolkit: per micro-batch, forward under autocast, ``loss / k``, backward
through the GradScaler; when the window closes, unscale, clip by norm (reporting the pre-clip
norm), reject a non-finite window, clip by value, optimizer step (through the scaler under
fp16), scaler update, ``zero_grad(set_to_none=True)``, and a scheduler step only when the
optimizer really stepped. A user's gradient function, when given, runs right after unscaling.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch


@dataclasses.dataclass
class Trace:
    """What the hand-written loop observed, to compare with the step's outputs.

    Attributes:
        updated: per micro-batch call, whether an optimizer update was applied.
        lrs: per closed window, the learning rate the (possibly skipped) update would use.
        grad_norms: per closed window, the pre-clip total norm (``None`` when not computed).
        steps: optimizer updates applied.
        overflows: windows the GradScaler skipped (gradient overflow, finite loss).
        rejected: windows thrown away because the loss or the gradients were not finite.
        clipped: applied updates whose pre-clip norm exceeded ``max_norm``.
        value_clipped: applied updates with a gradient element beyond ``max_value``.
    """

    updated: list[bool] = dataclasses.field(default_factory=list)
    lrs: list[float] = dataclasses.field(default_factory=list)
    grad_norms: list[torch.Tensor | None] = dataclasses.field(default_factory=list)
    steps: int = 0
    overflows: int = 0
    rejected: int = 0
    clipped: int = 0
    value_clipped: int = 0


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batches: Sequence[Any],
    *,
    dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    micro_batches: int = 1,
    max_norm: float | None = None,
    max_value: float | None = None,
    guard: bool = False,
    grad_fn: Callable[[list[torch.Tensor]], Any] | None = None,
) -> Trace:
    """Train on ``batches`` (a whole number of windows of ``micro_batches``) by hand.

    Args:
        model, optimizer, scheduler: updated in place.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        batches: the micro-batches, in order.
        dtype: autocast dtype on CPU, or ``None`` for float32.
        scaler: a GradScaler (fp16), or ``None``.
        micro_batches: gradient accumulation steps per update.
        max_norm, max_value: clipping bounds, or ``None``.
        guard: skip a window whose summed loss (or, without a scaler, gradient norm) is not
            finite.
        grad_fn: ``grad_fn(grads)`` changes the gradients in place (returning None) or returns
            new ones, which become the ``.grad``; called once per window after unscaling.

    Returns:
        The :class:`Trace` of what happened.
    """
    k = micro_batches
    assert len(batches) % k == 0, "the reference trains on whole windows only"
    ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
    trace = Trace()
    for start in range(0, len(batches), k):
        window_loss = torch.zeros(())
        for batch in batches[start : start + k]:
            with ctx:
                loss = loss_fn(model, batch)
            window_loss += loss.detach().float()
            if k > 1:
                loss = loss / k  # scale the loss to account for gradient accumulation
            if scaler is not None:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            trace.updated.append(False)

        # The window closes: unscale once, then clip, then step.
        if scaler is not None:
            scaler.unscale_(optimizer)
        params = [p for p in model.parameters() if p.grad is not None]
        if grad_fn is not None:
            new = grad_fn([p.grad for p in params])
            if new is not None:
                for p, g in zip(params, new):
                    p.grad = g
        norm = None
        norm_clipped = value_clipped = False
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            norm_clipped = bool(norm > max_norm)
        elif guard:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        trace.grad_norms.append(None if norm is None else norm.detach().clone())

        finite = True
        if guard:
            # Under fp16, non-finite gradients are the scaler's business (it skips the step).
            finite = bool(torch.isfinite(window_loss)) and (
                scaler is not None or bool(torch.isfinite(norm))
            )
        trace.rejected += not finite
        trace.lrs.append(optimizer.param_groups[0]["lr"])
        stepped = finite
        if finite:
            if max_value is not None:
                value_clipped = any(bool((p.grad.abs() > max_value).any()) for p in params)
                torch.nn.utils.clip_grad_value_(params, max_value)
            if scaler is not None:
                scaler.step(optimizer)
            else:
                optimizer.step()
        if scaler is not None:
            # update() is due even for a rejected window: unscale_ ran, and the next unscale_
            # would raise otherwise. A lower scale afterwards means the scaler skipped.
            scale = scaler.get_scale()
            scaler.update()
            if scaler.get_scale() < scale:
                trace.overflows += finite
                stepped = False
        optimizer.zero_grad(set_to_none=True)
        if stepped:
            scheduler.step()
            trace.steps += 1
            trace.clipped += norm_clipped
            trace.value_clipped += value_clipped
            trace.updated[-1] = True
    return trace
