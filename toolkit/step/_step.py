"""make_step and Step: one training step as a value, run in the canonical update order."""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from toolkit.distributed._collectives import (
    SYNC_KIND,
    Carrier,
    all_reduce_,
    carrier_of,
    data_parallel_group,
    skips_differ_carried,
    suppress_grad_sync,
    sync_kind,
)
from toolkit.step._multi import PerEpoch
from toolkit.step._phases import (
    AccumulateConfig,
    AmpConfig,
    ClipConfig,
    GradTransformConfig,
    GuardConfig,
    decide,
    skip_range,
    skips_differ,
)
from toolkit.step._state import TrainState, WindowState

__all__ = ["LossSum", "Step", "StepOutput", "make_step"]


class LossSum(NamedTuple):
    """A summed loss with its target count, for exact count-weighted accumulation.

    Return it from a loss function when the loss is a *sum* over targets (tokens, pixels,
    samples). The step backpropagates the sum and, when the accumulation window closes,
    divides the gradients by the window's total count (summed over data-parallel ranks), so
    micro-batches of any sizes give exactly the big-batch gradient of the mean loss.

    Attributes:
        total: scalar tensor, the loss summed over the micro-batch's targets.
        count: number of targets (>= 0): a python number, checked when returned (a window
            whose total is 0 has nothing to learn from and is skipped, ``out.empty``), or a
            one-element tensor, checked within the update's host sync when
            :func:`guard_nonfinite` or fp16 makes one (without either, nothing checks it).
        records: optional nested mapping of numbers or 0-d tensors to report.

    Example:
        >>> import torch
        >>> from toolkit import LossSum
        >>> logits, target = torch.randn(5, 3), torch.tensor([0, 1, 2, 0, 1])
        >>> out = LossSum(torch.nn.functional.cross_entropy(logits, target, reduction="sum"), 5)
        >>> out.count
        5
    """

    total: torch.Tensor
    count: torch.Tensor | float  # type: ignore[assignment]  # shadows tuple.count on purpose
    records: Mapping[str, Any] = {}


class StepOutput(NamedTuple):
    """What one call of a train step reports. Tensors are detached; nothing was synced.

    Attributes:
        loss: this micro-batch's mean loss (``total / count`` for a :class:`LossSum`: not
            finite for a count of 0), or ``None`` when the loss function skipped the batch.
        records: the records the loss function returned (``{}`` when none).
        count: the micro-batch's target count, or ``None`` when not reported.
        samples: leading dimension of the batch's first tensor, or ``None`` when it has none.
        updated: the optimizer applied an update in this call.
        closed: an accumulation window closed in this call (applied, rejected or overflowed).
        skipped: the loss function returned ``None``; nothing else happened.
        nonfinite: the window's loss or gradients were not finite under
            :func:`guard_nonfinite` (rejected, unless ``on_exhaust="accept"`` applied it).
        overflow: the fp16 ``GradScaler`` skipped the update (gradient overflow).
        empty: the window's total target count was 0, so it had nothing to learn from and
            was skipped (no optimizer or scheduler step; not a failure of the guard).
        grad_norm: total gradient norm before clipping, when a window closed under
            :func:`clip` or :func:`guard_nonfinite`; else ``None``.
        lr: learning rate of the first parameter group that the update used (read before
            the scheduler steps), when a window closed; else ``None``.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, make_step
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> step = make_step(lambda m, b: (m(b).square().mean(), {"mean_out": m(b).mean()}))
        >>> state, out = step(state, torch.ones(4, 2))
        >>> out.updated, out.samples, out.lr, sorted(out.records)
        (True, 4, 0.1, ['mean_out'])
    """

    loss: torch.Tensor | None
    records: Mapping[str, Any]
    count: torch.Tensor | float | None  # type: ignore[assignment]  # shadows tuple.count on purpose
    samples: int | None
    updated: bool
    closed: bool
    skipped: bool = False
    nonfinite: bool = False
    overflow: bool = False
    empty: bool = False
    grad_norm: torch.Tensor | None = None
    lr: Any = None


_NO_RECORDS: Mapping[str, Any] = types.MappingProxyType({})
_FP16 = torch.float16
# The fields after samples of an output whose window stays open: updated, closed, skipped,
# nonfinite, overflow, empty, grad_norm, lr (see StepOutput).
_OPEN_FLAGS = (False, False, False, False, False, False, None, None)
# Schedulers the step leaves alone: a ReduceLROnPlateau needs a metric (validate steps it),
# a per_epoch one is run()'s to step at each epoch's end.
_NOT_PER_UPDATE = (torch.optim.lr_scheduler.ReduceLROnPlateau, PerEpoch)
_tuple_new = tuple.__new__
_object_new = object.__new__
_object_setattr = object.__setattr__  # past the frozen dataclass's __setattr__
_SKIPPED = StepOutput(None, _NO_RECORDS, None, None, updated=False, closed=False, skipped=True)


def _leading_dim(batch: Any) -> int | None:
    # Cheap, no tree flattening: the first tensor found depth-first in common containers.
    while True:
        if isinstance(batch, torch.Tensor):
            return int(batch.shape[0]) if batch.ndim else None
        if isinstance(batch, (list, tuple)) and batch:
            batch = batch[0]
        elif isinstance(batch, Mapping) and batch:
            batch = next(iter(batch.values()))
        elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
            fields = dataclasses.fields(batch)
            if not fields:
                return None
            batch = getattr(batch, fields[0].name)
        else:
            return None


def _bad_return(result: Any, why: str) -> TypeError:
    return TypeError(
        f"loss_fn returned {type(result).__name__}: {why}. Expected a scalar tensor, "
        "(loss, records) with records a mapping, LossSum(total, count[, records]), or None to "
        "skip the batch."
    )


def _parse(result: Any) -> tuple[torch.Tensor, torch.Tensor | float | None, Mapping[str, Any]]:
    records: Mapping[str, Any]
    if isinstance(result, torch.Tensor):
        loss, count, records = result, None, _NO_RECORDS
    elif isinstance(result, LossSum):
        loss, count, records = result.total, result.count, result.records
    elif isinstance(result, tuple) and len(result) == 2:
        loss, count, records = result[0], None, result[1]
        if not isinstance(records, Mapping):
            raise _bad_return(
                result,
                f"its second element is a {type(records).__name__}, not a mapping of records",
            )
    elif isinstance(result, tuple):
        raise _bad_return(result, f"a tuple of length {len(result)}, not (loss, records)")
    else:
        raise _bad_return(result, "not a loss")
    if not isinstance(loss, torch.Tensor):
        raise _bad_return(result, f"the loss is a {type(loss).__name__}, not a tensor")
    if loss.ndim != 0:
        raise ValueError(
            f"loss_fn must return a scalar loss (a 0-d tensor); got a tensor of shape "
            f"{tuple(loss.shape)}. Reduce it first: loss.mean(), or "
            "LossSum(loss.sum(), count) for count-weighted accumulation."
        )
    if not loss.requires_grad:
        raise ValueError(
            "loss_fn returned a loss that does not require grad, so backward cannot run. "
            "Compute it from the model's output inside loss_fn, outside torch.no_grad()."
        )
    if count is not None:
        count = _checked_count(count)
    return loss, count, records


def _checked_count(count: Any) -> torch.Tensor | float:
    """A LossSum count as a number >= 0 or a one-element real tensor (checked later)."""
    if isinstance(count, torch.Tensor):
        if count.numel() != 1 or count.is_complex() or count.dtype is torch.bool:
            raise TypeError(
                f"LossSum.count: expected a number or a one-element real tensor; got a "
                f"{count.dtype} tensor of shape {tuple(count.shape)}. Count the targets: "
                "(targets != ignore_index).sum()."
            )
        return count.detach().reshape(()) if count.ndim else count.detach()
    if isinstance(count, bool) or not isinstance(count, (int, float)):
        raise TypeError(
            f"LossSum.count: expected a number >= 0 or a one-element tensor; got "
            f"{type(count).__name__} {count!r:.40}."
        )
    if not (count >= 0 and count != float("inf")):
        raise ValueError(
            f"LossSum.count: expected a finite number >= 0 (the micro-batch's targets); got "
            f"{count!r}. A negative count would turn the update into gradient ascent."
        )
    return count


def _no_optimizer(state: Any) -> TypeError:
    given = (
        "None" if isinstance(state, TrainState) else f"a {type(state).__name__}, not a TrainState"
    )
    return TypeError(
        f"a train step needs TrainState.optimizer; got {given}. Build the state with one: "
        "TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()))."
    )


@dataclasses.dataclass(frozen=True)
class Step:
    """A train step: ``step(state, batch) -> (state, StepOutput)``. Build it with make_step.

    Each decorator (:func:`amp_wrap`, :func:`accumulate`, :func:`transform_grads`,
    :func:`clip`, :func:`guard_nonfinite`) fills one field with its configuration;
    ``__call__`` runs the phases in one fixed order (``DESIGN.md`` section 2, numbered in
    the code), so the order in which decorators are applied never matters.

    The model, optimizer, scheduler and scaler are updated in place; the returned state
    refers to the same objects. Do not reuse the state you passed in.

    Attributes:
        loss_fn: ``loss_fn(model, batch)``, see :func:`make_step`.
        amp: set by :func:`amp_wrap`.
        accumulation: set by :func:`accumulate`.
        grad_transforms: set by :func:`transform_grads`.
        clipping: set by :func:`clip`.
        guard: set by :func:`guard_nonfinite`.

    Example:
        >>> import torch
        >>> from toolkit import clip, make_step
        >>> step = clip(make_step(lambda m, b: m(b).mean()), max_norm=1.0)
        >>> step.clipping.max_norm, step.accumulation is None
        (1.0, True)
    """

    loss_fn: Callable[..., Any]  # (model, batch) or (model, batch, step=)
    amp: AmpConfig | None = None
    accumulation: AccumulateConfig | None = None
    grad_transforms: GradTransformConfig | None = None
    clipping: ClipConfig | None = None
    guard: GuardConfig | None = None
    _k: int = dataclasses.field(init=False, repr=False, compare=False)
    _with_step: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The window length, read on every call: derived from accumulation, not given.
        k = self.accumulation.micro_batches if self.accumulation is not None else 1
        object.__setattr__(self, "_k", k)
        object.__setattr__(self, "_with_step", _takes_step(self.loss_fn))

    def _forward_with_step(self, state: TrainState, batch: Any, optimizer: Any) -> Any:
        # Off the common path: only loss functions with a `step` parameter come here.
        if self.amp is not None:
            with self.amp.autocast(optimizer):
                return self.loss_fn(state.model, batch, step=state.step)
        return self.loss_fn(state.model, batch, step=state.step)

    def _send_flags(
        self, model: torch.nn.Module, state: TrainState, loss: torch.Tensor, optimizer: Any
    ) -> Carrier | None:
        # DDP, before the closing backward: this rank's loss flag and skip count go with the
        # gradients (phase 6 reads them back), when the model takes toolkit's hook.
        carrier = carrier_of(model)
        if carrier is None:
            return None
        total = None
        if self.guard is not None:
            # The window's summed loss, as phase 6 checks it (float32 at least).
            current = loss.detach()
            current = current.float() if current.dtype is _FP16 else current
            window_loss = state.window.loss
            total = current if window_loss is None else window_loss + current
        carrier.send(total, state.window.skipped, optimizer.param_groups[0]["params"][0])
        return carrier

    def __call__(
        self, state: TrainState, batch: Any, *, close: bool = False
    ) -> tuple[TrainState, StepOutput]:
        """Run one micro-batch; ``close=True`` closes the window after it, however short.

        ``close`` is for the end of the data (:func:`run`'s ``partial_window``): the window
        is applied with the micro-batches it holds, its mean normalised by their number
        instead of ``micro_batches`` (exactly, by the total count, for :class:`LossSum`).
        Under data parallelism give it on every rank alike.
        """
        optimizer = getattr(state, "optimizer", None)
        if optimizer is None:
            raise _no_optimizer(state)
        if state._consumed:
            raise _reused(state)
        model, window, amp, k = state.model, state.window, self.amp, self._k
        if window.micro_step and window.length != k:
            raise _other_window(window, k)
        closes = close or window.micro_step + 1 == k
        sync = SYNC_KIND.get(type(model)) or sync_kind(model)  # "none", "ddp" or "fsdp2"
        scaler = None  # a scaler left in the state by someone else is not ours to use
        if amp is not None and amp.fp16:
            scaler = state.scaler
            if scaler is None:
                scaler = amp.make_scaler(optimizer)
                state = state.replace(scaler=scaler)

        # Per micro-batch, phases 1-3. Every Python line and call here shows in the overhead
        # on small models: one frame, a zero-cost try instead of a with, a plain-loss path.
        no_sync = None if closes or sync == "none" else suppress_grad_sync(model, sync)
        if no_sync is not None:  # (3) gradients are synced on the closing micro-batch only
            no_sync.__enter__()
        carrier = None  # DDP: the window's flags ride on its gradient all-reduce
        try:
            # 1. forward, under autocast
            if self._with_step:  # loss_fn(model, batch, step=...) reads the update number
                result = self._forward_with_step(state, batch, optimizer)
            elif amp is not None:
                with amp.autocast(optimizer):
                    result = self.loss_fn(model, batch)
            else:
                result = self.loss_fn(model, batch)
            if result is None:
                if sync == "none":
                    return state, _SKIPPED
                # Data parallel: the window does not advance, but the skip is counted for
                # the ranks to compare at the window's close (phase 6).
                return _skipped_in_lockstep(state, window), _SKIPPED
            if type(result) is torch.Tensor and result.ndim == 0 and result.requires_grad:
                loss, count, records = result, None, _NO_RECORDS
            else:
                loss, count, records = _parse(result)
            # 2. loss normalisation: 1/k, or a sum whose gradients phase 5 divides
            if count is None:
                if window.count is not None:
                    raise _mixed_counts("this one reported none")
                objective = loss / k if k > 1 else loss
            else:
                if window.micro_step and window.count is None:
                    raise _mixed_counts("earlier ones reported none")
                objective = loss
            # 3. backward, through the GradScaler under fp16
            if scaler is not None:
                objective = scaler.scale(objective)
            if closes and sync == "ddp" and self.grad_transforms is None:
                carrier = self._send_flags(model, state, loss, optimizer)
            objective.backward()
        finally:
            if no_sync is not None:
                no_sync.__exit__(None, None, None)

        detached = loss.detach()
        window_loss = window.loss
        if self.guard is not None:
            # Summed over the window so that one isfinite check covers every micro-batch;
            # in float32 at least, so that a large fp16 sum cannot overflow into a false alarm.
            lf = detached.float() if detached.dtype is _FP16 else detached
            window_loss = lf if window_loss is None else window_loss + lf
        window_count = window.count
        if count is not None:
            # Python counts stay python numbers (exact, checkable without a sync).
            window_count = count if window_count is None else window_count + count
            detached = detached / count
        first = batch[0] if type(batch) is tuple and batch else None  # (inputs, targets)
        samples = first.shape[0] if type(first) is torch.Tensor and first.ndim else None
        if samples is None:
            samples = _leading_dim(batch)
        if not closes:
            # tuple.__new__: namedtuple's generated __new__ costs more, on every micro-batch.
            new_window = _tuple_new(
                WindowState, (window.micro_step + 1, window_count, window_loss, k, window.skipped)
            )
            out = _tuple_new(StepOutput, (detached, records, count, samples, *_OPEN_FLAGS))
            # TrainState._evolve, inlined (a call costs more than its lines here): a copy of
            # the fields with the new window.
            fields = state.__dict__.copy()
            fields["window"] = new_window
            new = _object_new(TrainState)
            _object_setattr(new, "__dict__", fields)
            state.__dict__["_consumed"] = True  # a mark, past the frozen __setattr__
            return new, out

        # When the window closes, phases 4-11, once per window.
        transforms, clipping, guard = self.grad_transforms, self.clipping, self.guard
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        # A window closed early (close=True) holds m < k micro-batches of loss / k.
        short = close and window.micro_step + 1 != k
        if (
            window_count is not None
            or short
            or transforms is not None
            or clipping is not None
            or guard is not None
        ):
            # The optimizer's parameters, not model.parameters(): the tensors the update
            # touches, and no module-tree walk. A loop, not comprehensions: each of those is
            # a function call of its own in Python 3.11.
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is not None:
                        params.append(param)
                        grads.append(grad)

        # 4. unscale, exactly once
        if scaler is not None:
            scaler.unscale_(optimizer)

        # 5. divide by the window's total target count, summed over ranks (or, for a short
        # window of mean losses, turn the sum of m losses / k into their mean)
        if short and window_count is None and grads:
            torch._foreach_mul_(grads, k / (window.micro_step + 1))
        empty = False  # a total count of 0: nothing to learn from, the window is skipped
        total = None  # the total as a tensor, for phase 6 to check within its host sync
        # The data-parallel group (None in one process, or for a model no wrapper syncs):
        # counts are summed and verdicts agreed over it, not over the world.
        group = None if sync == "none" else data_parallel_group(model)
        if window_count is not None and grads:
            if group is None and not isinstance(window_count, torch.Tensor):
                empty = window_count == 0  # python counts were checked >= 0 when returned
                if not empty:
                    torch._foreach_mul_(grads, 1.0 / window_count)
            else:
                total = torch.as_tensor(window_count, dtype=torch.float64, device=grads[0].device)
                world = 1
                if group is not None:
                    total = all_reduce_(total.clone(), torch.distributed.ReduceOp.SUM, group)
                    world = group.size()
                # DDP and FSDP average gradients over ranks; the world factor turns that mean
                # back into the sum that the global count divides.
                torch._foreach_mul_(grads, (world / total).to(grads[0].dtype))

        # 5b. the user's gradient transforms (transform_grads)
        if transforms is not None and grads:
            grads = transforms.apply(params, grads)

        # 6. finite check: one host sync (shared with the scaler's), the same on every rank
        grad_norm = clip_norm = None
        if clipping is not None or guard is not None:
            norm_type = clipping.norm_type if clipping is not None else 2.0
            grad_norm = clip_norm = torch.nn.utils.get_total_norm(grads, norm_type)
            if type(grad_norm) is not torch.Tensor and hasattr(grad_norm, "full_tensor"):
                # FSDP2: a DTensor over the shards. Clipping takes it as it is (as
                # clip_grad_norm_ does); the decision and the report need its value.
                grad_norm = grad_norm.full_tensor()
        # The flags that rode on DDP's gradient all-reduce (None: they travel on their own).
        carried = carrier.receive() if carrier is not None else None
        nonfinite = overflow = collapsed = negative = uneven = False
        if guard is not None or scaler is not None:
            min_scale = amp.min_scale if amp is not None else 0.0
            verdict = decide(
                guard,
                scaler,
                min_scale,
                optimizer,
                window_loss,
                grad_norm,
                total,
                group,
                window.skipped,
                carried,
            )
            nonfinite, overflow, collapsed, zero, negative, uneven = verdict
            empty = empty or zero
        elif carried is not None:  # the host sync of the skip check
            uneven = skips_differ_carried(carried.tolist(), group.size())
        elif group is not None:
            # No verdict to carry the ranks' skip counts: one small all-reduce of their own.
            uneven = skips_differ(window.skipped, group, optimizer)
        nonfinite = nonfinite and not empty  # the gradients of no target are 0/0: not a failure
        overflow = overflow and not nonfinite  # a non-finite loss is the guard's to report
        apply = not (nonfinite or overflow or empty or negative)
        counters = state.guard
        if overflow:
            counters = counters._replace(total_overflow=counters.total_overflow + 1)
        failure: Exception | None = _negative_total(window_count) if negative else None
        if guard is not None and (nonfinite or counters.notfinite_count):
            counters, apply, failure = guard.judge(
                counters, nonfinite, overflow or empty, state.step, window_loss, grad_norm
            )
        if uneven:  # a bug in the loss function or the data, not a numerical accident
            # The error path only: one more small all-reduce, on every rank alike, for the
            # message.
            fewest, most = skip_range(window.skipped, group, optimizer)
            apply, failure = False, _uneven_skips(window.skipped, fewest, most)

        lr = optimizer.param_groups[0]["lr"]
        if apply:
            # 7. clip, by norm (with the norm of phase 6) and/or by value
            if clipping is not None:
                clipping.apply(params, clip_norm)
            # 8. optimizer step
            if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
                scaler.step(optimizer)  # found_inf goes into the kernel: no host sync
            else:
                # Unfused under a scaler: we already know there was no overflow, which is all
                # scaler.step would find out (with one more .item()) before calling step().
                optimizer.step()
        # On an overflow the optimizer is not called at all, not even a fused one through
        # scaler.step (whose kernel would skip on found_inf): fused SGD would create momentum
        # buffers with empty_like and leave them unfilled, poisoning the next update.

        # 9. scaler update, zero_grad
        if scaler is not None:
            scaler.update()
            if collapsed and not nonfinite:
                assert amp is not None
                raise amp.collapsed(scaler)
        optimizer.zero_grad(set_to_none=True)
        if failure is not None:
            raise failure  # the window is thrown away (scaler updated, grads cleared) first

        # 10. scheduler step, only after an applied update (a ReduceLROnPlateau needs a
        # metric: validate() steps it; a per_epoch one is stepped by run())
        scheduler = state.scheduler
        if apply and scheduler is not None and not isinstance(scheduler, _NOT_PER_UPDATE):
            scheduler.step()

        # 11. counters
        fields = state.__dict__.copy()  # TrainState._evolve, inlined as above
        fields.update(step=state.step + 1 if apply else state.step, window=_EMPTY_WINDOW)
        fields["guard"] = counters
        new = _object_new(TrainState)
        _object_setattr(new, "__dict__", fields)
        state.__dict__["_consumed"] = True
        out = StepOutput(
            loss=detached,
            records=records,
            count=count,
            samples=samples,
            updated=apply,
            closed=True,
            nonfinite=nonfinite,
            overflow=overflow,
            empty=empty,
            grad_norm=grad_norm,
            lr=lr,
        )
        return new, out


_EMPTY_WINDOW = WindowState()


def _takes_step(loss_fn: Callable[..., Any]) -> bool:
    """Whether ``loss_fn`` has a parameter named ``step`` to receive the update number."""
    try:
        parameters = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
    param = parameters.get("step")
    return param is not None and param.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )


def _skipped_in_lockstep(state: TrainState, window: WindowState) -> TrainState:
    new = state._evolve({"window": window._replace(skipped=window.skipped + 1)})
    state.__dict__["_consumed"] = True
    return new


def _uneven_skips(skipped: int, fewest: int, most: int) -> ValueError:
    return ValueError(
        "loss_fn returned None on some ranks of the data-parallel group but not on others "
        f"within one accumulation window (from {fewest} to {most} skipped micro-batches; "
        f"this rank skipped {skipped}), so the ranks' windows no longer hold the same "
        "micro-batches and their gradient all-reduces would pair up wrongly. The window was "
        "thrown away. Skip a batch on every rank alike (decide from data all ranks share), "
        "or return a zero loss instead of None (loss * 0, or LossSum(total * 0, 0) from a "
        "loss function that reports counts)."
    )


def _reused(state: TrainState) -> ValueError:
    return ValueError(
        f"this TrainState (step {state.step}) was already passed to a train step, which "
        "returned its successor: the model has moved on since, so its counters would fork. "
        "Keep the state the step returns: state, out = step(state, batch)."
    )


def _other_window(window: WindowState, k: int) -> ValueError:
    return ValueError(
        f"the state's accumulation window was opened by a step of micro_batches="
        f"{window.length} and holds {window.micro_step} micro-batch(es); this step has "
        f"micro_batches={k}, so the window would never close as it should. Finish it with "
        "the step that opened it, or change the step at an update boundary "
        "(state.window.micro_step == 0)."
    )


def _negative_total(total: Any) -> ValueError:
    shown = "" if isinstance(total, torch.Tensor) else f" ({total:g})"
    return ValueError(
        f"loss_fn reported a negative total target count{shown} for the window, which would "
        "turn the update into gradient ascent; the window was thrown away. Counts are "
        "numbers of targets (tokens, samples): return LossSum(total, count) with count >= 0."
    )


def _mixed_counts(detail: str) -> ValueError:
    return ValueError(
        "loss_fn reported a target count for some micro-batches of the window but not for "
        f"others ({detail}). Return LossSum(total, count) from every call, or from none."
    )


def make_step(loss_fn: Callable[..., Any]) -> Step:
    """Build a plain train step around ``loss_fn``: forward, backward, optimizer, scheduler.

    ``loss_fn(model, batch)`` returns one of:

    * a scalar loss tensor (mean over the batch);
    * ``(loss, records)`` with ``records`` a nested mapping of numbers or 0-d tensors;
    * :class:`LossSum` ``(total, count[, records])``: a summed loss and its target count,
      for exact count-weighted accumulation;
    * ``None``: skip this batch entirely (no backward; the accumulation window does not
      advance, as if the batch never happened). Under data parallelism (DDP, FSDP2) every
      rank must skip alike. Each rank counts its skips in the window
      (``state.window.skipped``) and the ranks compare the counts when the window closes:
      on the verdict all-reduce of :func:`guard_nonfinite` or fp16 when the update makes
      one (no extra cost), else with one 2-element all-reduce and one host sync per
      update. Counts that differ raise ``ValueError`` on every rank. Under DDP the ranks
      reach that comparison even though their windows drifted apart, since DDP syncs
      gradients only on a window's closing micro-batch; not when the data ends before the
      rank that skipped closes its window (the others wait in the gradient all-reduce:
      torch's collective timeout ends it). FSDP2 gathers parameters in every forward and
      backward, so a skip on one rank mismatches those collectives at once, before the
      comparison: keep skips alike there.

    A loss function with a parameter named ``step`` (``loss_fn(model, batch, step)`` or
    ``loss_fn(model, batch, *, step)``) gets the number of applied updates so far,
    ``state.step``, the same for every micro-batch of a window: for curricula and warm-ups
    of auxiliary losses. The signature is read once, here; loss functions without it are
    called as before, at no cost.

    Without decorators the step applies one update per call: ``loss.backward()``,
    ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``, ``scheduler.step()``.

    Args:
        loss_fn: the user's loss function.

    Returns:
        A :class:`Step`, callable as ``step(state, batch) -> (state, StepOutput)``.

    Raises:
        TypeError: when ``loss_fn`` is not callable (at build time); when the state has no
            optimizer or ``loss_fn`` returns something else than listed above (at call time).
        ValueError: when the loss is not a scalar or does not require grad (at call time).

    Example:
        >>> import torch
        >>> from toolkit import TrainState, make_step
        >>> model = torch.nn.Linear(3, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> step = make_step(lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
        >>> state, out = step(state, (torch.randn(8, 3), torch.randn(8, 1)))
        >>> state.step, out.updated, out.samples
        (1, True, 8)
    """
    if not callable(loss_fn):
        raise TypeError(
            f"make_step: expected a callable loss_fn(model, batch); got {type(loss_fn).__name__}."
        )
    if isinstance(loss_fn, Step):
        raise TypeError(
            "make_step: got a Step, expected a loss function. A Step is already a train step; "
            "decorate it directly instead of wrapping it again."
        )
    return Step(loss_fn)
