"""make_step and Step: one training step as a value, run in the canonical update order."""

import contextlib
import dataclasses
import inspect
import math
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import optree
import torch

import toolkit.step._phases as phases
from toolkit._checks import check, warn
from toolkit._tree import check_weight
from toolkit.distributed._collectives import (
    BucketFlags,
    all_reduce_,
    bucket_flags,
    groups_of,
    suppress_grad_sync,
    sync_kind,
    value_range,
)
from toolkit.distributed._layout import current_layout
from toolkit.step._multi import PerEpoch
from toolkit.step._state import GuardState, TrainState, WindowState


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
            :func:`guard_nonfinite`, fp16 or data parallelism makes one (else unchecked).
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


# Schedulers the step leaves alone: a ReduceLROnPlateau needs a metric (validate steps it),
# a per_epoch one is run()'s to step at each epoch's end.
_NOT_PER_UPDATE = (torch.optim.lr_scheduler.ReduceLROnPlateau, PerEpoch)
Scaler = torch.amp.GradScaler | None
_NO_RECORDS: Mapping[str, Any] = types.MappingProxyType({})  # shared, so read-only
_NO_WINDOW = WindowState()
_TWICE = (  # scheduler.step() outside the step: the schedule runs ahead (a fixed text: once)
    "the LR scheduler was stepped outside the train step (its last_epoch moved between the "
    "step's own steps). Remove your scheduler.step(), or mark it toolkit.per_epoch(scheduler)."
)
_SKIPPED = StepOutput(None, _NO_RECORDS, None, None, updated=False, closed=False, skipped=True)


def _leading_dim(batch: Any) -> int | None:
    """The leading dimension of the first tensor found depth-first in common containers."""
    while True:
        if isinstance(batch, torch.Tensor):
            return int(batch.shape[0]) if batch.ndim else None
        if isinstance(batch, (list, tuple)) and batch:
            batch = batch[0]
        elif isinstance(batch, Mapping) and batch:
            batch = next(iter(batch.values()))
        elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
            batch = [getattr(batch, field.name) for field in dataclasses.fields(batch)]
        else:
            return None


def _parse(result: Any) -> tuple[torch.Tensor, torch.Tensor | float | None, Mapping[str, Any]]:
    """A loss function's result as (loss, count or None, records), checked."""
    if isinstance(result, LossSum):
        loss, count, records = result.total, _checked_count(result.count), result.records
    elif isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping):
        (loss, records), count = result, None
    else:
        loss, count, records = result, None, _NO_RECORDS
    if not isinstance(loss, torch.Tensor):
        got = type(result).__name__
        if isinstance(result, tuple):  # its elements' kinds: (loss, records) gone wrong
            got += f"({', '.join(type(element).__name__ for element in result)})"
        fix = hasattr(result, "loss") * " Return out.loss, which the model computes given labels."
        raise TypeError(
            f"loss_fn returned {got}; expected a scalar tensor, (loss, records), "
            f"LossSum(total, count[, records]), or None to skip the batch.{fix}"
        )
    if "loss" in records:
        fix = "The step reports the loss itself: return out.loss alone, or rename the record."
        check(False, "loss_fn", "records", "without a 'loss' key", type(records), fix)
    if loss.ndim != 0:
        raise ValueError(
            f"loss_fn must return a scalar loss (a 0-d tensor); got a tensor of shape "
            f"{tuple(loss.shape)}. Reduce it first: loss.mean(), or LossSum(loss.sum(), count)."
        )
    if not loss.requires_grad:
        raise ValueError(
            "loss_fn returned a loss that does not require grad; compute it from the model's "
            "output inside loss_fn, outside torch.no_grad()."
        )
    if not records:  # a LossSum's default {}: no tree walk, per micro-batch
        return loss, count, _NO_RECORDS
    detach = lambda leaf: leaf.detach() if isinstance(leaf, torch.Tensor) else leaf  # noqa: E731
    return loss, count, optree.tree_map(detach, records, none_is_leaf=True)  # type: ignore[arg-type,return-value]


def _checked_count(count: Any) -> torch.Tensor | float:
    """A LossSum count as a number >= 0 or a one-element real tensor (checked at the close)."""
    count = check_weight("LossSum", "count", count)
    if isinstance(count, torch.Tensor):
        return count.detach()
    fix = "A negative count would turn the update into gradient ascent."
    check(0 <= count < math.inf, "LossSum", "count", "a finite number >= 0", count, fix)
    return count  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True)
class Step:
    """A train step: ``step(state, batch) -> (state, StepOutput)``. Build it with make_step.

    Each decorator (:func:`amp_wrap`, :func:`accumulate`, :func:`transform_grads`,
    :func:`clip`, :func:`guard_nonfinite`) fills one field with its configuration;
    ``__call__`` runs the phases in one fixed order (docs/architecture.md, numbered in
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
    amp: phases.AmpConfig | None = None
    accumulation: phases.AccumulateConfig | None = None
    grad_transforms: phases.GradTransformConfig | None = None
    clipping: phases.ClipConfig | None = None
    guard: phases.GuardConfig | None = None
    # Read once: whether loss_fn takes the update number (its signature); the window length.
    _with_step: bool = dataclasses.field(init=False, repr=False, compare=False)
    _k: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:  # a parameter named step (not *args or **kwargs) receives the update number
            param = inspect.signature(self.loss_fn).parameters.get("step")
        except (TypeError, ValueError):  # a builtin or C callable without a signature
            param = None
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        object.__setattr__(self, "_with_step", param is not None and param.kind in kinds)
        object.__setattr__(self, "_k", self.accumulation.micro_batches if self.accumulation else 1)

    def __call__(
        self, state: TrainState, batch: Any, *, close: bool = False
    ) -> tuple[TrainState, StepOutput]:
        """Run one micro-batch; ``close=True`` closes the window after it, however short.

        ``close`` is for the end of the data (:func:`run`'s ``partial_window``): the window
        is applied with the micro-batches it holds, its mean normalised by their number
        instead of ``micro_batches`` (exactly, by the total count, for :class:`LossSum`).
        Under data parallelism give it on every rank alike.
        """
        _check_state(state, self._k)
        scaler = None  # under fp16: ours, made on the first step (not one left by someone else)
        if self.amp is not None and self.amp.fp16:
            if state.scaler is None:
                made = self.amp.scaler or torch.amp.GradScaler(self.amp.device(state.optimizer))
                state = state.replace(scaler=made)
            scaler = state.scaler
        sync = sync_kind(state.model)  # "none", "ddp" or "fsdp2"
        closes = close or state.window.micro_step + 1 == self._k
        if closes or sync == "none":
            window, out, loss = self._micro_batch(state, batch, closes, scaler, sync)
        else:  # 3. gradients are synced on the window's closing micro-batch only
            with suppress_grad_sync(state.model, sync):
                window, out, loss = self._micro_batch(state, batch, closes, scaler, sync)
        if window is None:  # skipped: the window does not advance
            if sync == "none":
                return state, out
            # Data parallel: counted, for the ranks to compare when the window closes.
            window = state.window._replace(skipped=state.window.skipped + 1)
            if sync == "ddp" and window.skipped >= self._k:  # a rank skipping on: it closes
                return self._close_skipped(state, window, scaler)  # the window, or others hang
        if out.skipped or not closes:
            return state._evolve({"window": window, "_graph": loss}, consume=True), out
        return self._close(state, window, out, loss, scaler, sync)

    def _micro_batch(
        self, state: TrainState, batch: Any, closes: bool, scaler: Scaler, sync: str
    ) -> tuple[WindowState | None, StepOutput, torch.Tensor | None]:
        """Phases 1-3: the advanced window (None when skipped), the output and the loss."""
        # 1. forward, under autocast; loss_fn(model, batch, step=...) reads the update number
        keywords = {"step": state.step} if self._with_step else {}
        amp, plain = self.amp, contextlib.nullcontext()
        with plain if amp is None else torch.autocast(amp.device(state.optimizer), amp.dtype):
            result = self.loss_fn(state.model, batch, **keywords)
        if result is None:
            return None, _SKIPPED, None
        loss, count, records = _parse(result)
        # 2. loss normalisation: 1/k, or a sum whose gradients phase 5 divides
        window = _added(state.window, loss, count, self._k, self.guard is not None)
        objective = loss / self._k if count is None and self._k > 1 else loss
        # 3. backward, through the GradScaler under fp16 (DDP, closing: with the flags)
        flags = self._carrier(state.model) if closes and sync == "ddp" else None
        if flags is not None:
            flags.send(window.loss, window.skipped, state.optimizer.param_groups[0]["params"][0])
        (scaler.scale(objective) if scaler is not None else objective).backward()
        shown = loss.detach() if count is None else loss.detach() / count
        return window, StepOutput(shown, records, count, _leading_dim(batch), False, False), loss

    def _close(
        self, state: TrainState, window: WindowState, out: StepOutput, loss: Any, scaler: Scaler,
        sync: str,
    ) -> tuple[TrainState, StepOutput]:  # fmt: skip
        """Phases 4-11 (docs/architecture.md), once per window, whose gradients are complete
        (and synced)."""
        optimizer, clipping, guard = state.optimizer, self.clipping, self.guard
        # The ranks over which counts are summed, and those that agree on the verdict
        # (docs/distributed.md, "Meshes"); None and None for one process.
        tokens = everyone = None
        if sync != "none" or current_layout() is not None:
            _, tokens, everyone = groups_of(state.model)
        # Phases 5-7 read the gradients; a plain update leaves them to the optimizer.
        short = window.micro_step != window.length  # closed early: close=True
        reads = window.count is not None or short or self.grad_transforms or clipping or guard
        params, grads = _with_grads(optimizer) if reads else ([], [])
        if scaler is not None:  # 4. unscale, exactly once
            scaler.unscale_(optimizer)
        total, empty = _normalise(grads, window, tokens)  # 5. by the count, or a short window
        if self.grad_transforms is not None and grads:  # 5b. your gradient transforms
            grads = self.grad_transforms.apply(params, grads)
        norm, found = None, phases.APPLY  # 6. finite check: one host sync, alike on every rank
        if clipping is not None or guard is not None:
            norm = phases.total_norm(grads, clipping.norm_type if clipping else 2.0)
        if guard is not None or scaler is not None or everyone is not None:
            flags = self._carrier(state.model) if sync == "ddp" else None  # DDP: rode along
            found = phases.verdict_of_window(
                window, norm, total, guard=guard, scaler=scaler, amp=self.amp,
                optimizer=optimizer, group=everyone,
                carried=flags.receive() if flags is not None else None,
                replicated=tokens is not everyone,
            )  # fmt: skip
        apply, verdict, counters, failure = self._outcome(
            state, window, found, empty, norm, everyone, total
        )
        lr = optimizer.param_groups[0]["lr"]
        if apply:
            if clipping is not None:  # 7. clip, by the norm of phase 6 and/or by value
                clipping.apply(params, norm)
            # 8. optimizer step; a fused one takes found_inf from the scaler (no host sync),
            # an unfused one needs no scaler.step: we know there was no overflow. On an
            # overflow no optimizer is called (fused SGD would make unfilled momentum).
            if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
                scaler.step(optimizer)
            else:
                optimizer.step()
        if scaler is not None:  # 9. scaler update, zero_grad
            scaler.update()
            if found.collapsed and not found.nonfinite:
                raise self.amp.collapsed(scaler)  # type: ignore[union-attr]
        optimizer.zero_grad(set_to_none=True)
        if failure is not None:
            raise failure  # the window is thrown away (scaler updated, grads cleared)
        scheduled = _step_scheduler(state) if apply else state._scheduled  # 10.
        new = state._evolve(  # 11. counters
            {"step": state.step + 1 if apply else state.step, "window": _NO_WINDOW,
             "guard": counters, "_graph": loss, "_scheduled": scheduled},
            consume=True,
        )  # fmt: skip
        return new, StepOutput(out.loss, out.records, out.count, out.samples, apply, True, False,
                               verdict.nonfinite, verdict.overflow, verdict.empty,
                               norm, lr)  # fmt: skip

    def _close_skipped(
        self, state: TrainState, window: WindowState, scaler: Scaler
    ) -> tuple[TrainState, StepOutput]:
        """DDP: k skips in one window. The other ranks may be in their closing backward's
        gradient all-reduce: this rank takes part with zeros (and its skips), then closes."""
        first = state.optimizer.param_groups[0]["params"][0]
        if self.guard is not None and window.loss is None:  # the guard checks a loss
            window = window._replace(loss=torch.zeros((), device=first.device))
        flags = self._carrier(state.model)
        if flags is not None:
            flags.send(window.loss, window.skipped, first)
        # This rank's part in the gradient all-reduce of the other ranks' backward, without
        # a backward of its own: zeros through the comm hook, bucket by bucket, as DDP's Join
        # does for a rank out of data (the carrier's flags ride along as on a backward).
        state.model._match_all_reduce_for_bwd_pass()  # type: ignore[operator]
        return self._close(state, window, _SKIPPED, None, scaler, "ddp")

    def _carrier(self, model: torch.nn.Module) -> BucketFlags | None:
        """DDP (the callers check): what carries this rank's window loss and skips on the
        gradient all-reduce (:func:`bucket_flags`); None under transform_grads (its functions
        may change the gradients differently per rank): phase 6 then all-reduces the flags
        itself."""
        return bucket_flags(model) if self.grad_transforms is None else None

    def _outcome(
        self, state: TrainState, window: WindowState, verdict: phases.Verdict, empty: bool,
        norm: Any, group: Any, total: torch.Tensor | None,
    ) -> tuple[bool, phases.Verdict, GuardState, Exception | None]:  # fmt: skip
        """Phase 6's outcome: whether to take the optimizer step; the verdict as reported in
        the StepOutput (one reason per window); the guard's counters after this window; an
        error to raise once the window is thrown away, or None."""
        guard, counters = self.guard, state.guard
        if verdict is phases.APPLY and not empty and not counters.notfinite_count:
            return True, verdict, counters, None  # the common case
        empty = empty or verdict.empty
        nonfinite = verdict.nonfinite and not empty  # no targets: 0/0 gradients are no failure
        overflow = verdict.overflow and not nonfinite  # a non-finite loss is the guard's
        verdict = verdict._replace(nonfinite=nonfinite, overflow=overflow, empty=empty)
        apply = not (nonfinite or overflow or empty or verdict.negative)
        failure: Exception | None = None
        if verdict.negative:  # tensor counts only (python ones are checked when returned)
            failure = ValueError(
                "loss_fn reported a negative total target count for the window, which would "
                "turn the update into gradient ascent; the window was thrown away."
            )
        if overflow:  # the scaler's business: neither a failure nor a success
            counters = counters._replace(total_overflow=counters.total_overflow + 1)
        elif nonfinite:  # rejected: retried, skipped, accepted or raised
            assert guard is not None
            n, rejected = counters.notfinite_count + 1, counters.total_notfinite + 1
            counters = counters._replace(notfinite_count=n, total_notfinite=rejected)
            if n > guard.max_retries and guard.on_exhaust != "skip":
                apply = guard.on_exhaust == "accept"
                if not apply:
                    failure = guard.exhausted(counters, window.loss, norm, state.step)
        elif guard is not None and not empty and counters.notfinite_count:
            counters = counters._replace(notfinite_count=0)  # a finite window ends a series
        if verdict.uneven or verdict.replicas:  # a bug in the data, not a numerical accident
            failure = _disagreement(verdict, window, group, total)
            apply = False
        return apply, verdict, counters, failure


def _check_state(state: Any, k: int) -> None:
    """Refuse a state this step cannot run on: no optimizer, consumed, another window."""
    if getattr(state, "optimizer", None) is None:
        given = f"a {type(state).__name__}, not a TrainState"
        given = "None" if isinstance(state, TrainState) else given
        raise TypeError(
            f"a train step needs TrainState.optimizer; got {given}. Build the state with one: "
            "TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()))."
        )
    if state._consumed:
        raise ValueError(
            f"this TrainState (step {state.step}) was already passed to a train step, so "
            "its counters would fork; keep the one it returns: state, out = step(state, batch)."
        )
    opened = state.window
    if opened.micro_step and opened.length != k:
        raise ValueError(
            f"the state's accumulation window was opened by a step of micro_batches="
            f"{opened.length} and holds {opened.micro_step} micro-batch(es); this step has "
            f"micro_batches={k}, so the window would never close as it should."
        )


def _added(
    window: WindowState, loss: torch.Tensor, count: Any, k: int, guarded: bool
) -> WindowState:
    """Phase 2's bookkeeping: the window with one more micro-batch, its count added, and
    (under the guard) its loss, so that one finite check covers the window."""
    if window.micro_step and (count is None) != (window.count is None):
        detail = "this one reported none" if count is None else "earlier ones reported none"
        raise ValueError(
            "loss_fn reported a target count for some micro-batches of the window but not "
            f"for others ({detail}). Return LossSum(total, count) from every call, or none."
        )
    summed = window.loss
    if guarded:  # in float32 at least, so that a large fp16 sum cannot overflow
        detached = loss.detach()
        detached = detached.float() if detached.dtype is torch.float16 else detached
        summed = detached if summed is None else summed + detached
    # python counts stay python numbers: exact, checked sync-free
    counted = (
        count if window.count is None else window.count if count is None else window.count + count
    )
    return WindowState(window.micro_step + 1, counted, summed, k, window.skipped)


def _normalise(
    grads: list[torch.Tensor], window: WindowState, tokens: Any
) -> tuple[torch.Tensor | None, bool]:
    """Phase 5: gradients divided by the window's total count over the token ranks, or, for
    a short window of mean losses, the sum of m losses / k made their mean. Returns the
    total as a tensor (for phase 6 to check) or None, and whether the window is empty."""
    if window.count is None or not grads:
        if window.micro_step != window.length and grads:
            for part in phases.by_mesh(grads):
                torch._foreach_mul_(part, window.length / window.micro_step)
        return None, not window.micro_step  # a window of skips: nothing to learn
    count = window.count
    if tokens is None and not isinstance(count, torch.Tensor):
        if count:  # else nothing to learn from: the window is skipped (empty)
            torch._foreach_mul_(grads, 1.0 / count)
        return None, count == 0
    # A tensor, for phase 6 to check within its host sync.
    total = torch.as_tensor(count, dtype=torch.float64, device=grads[0].device)
    world = 1 if tokens is None else tokens.size()
    if tokens is not None:
        total = all_reduce_(total.clone(), torch.distributed.ReduceOp.SUM, tokens)
    # DDP and FSDP average gradients over ranks; the world factor turns that mean back into
    # the sum that the global count divides.
    factor = (world / total).to(grads[0].dtype)
    for part in phases.by_mesh(grads):
        torch._foreach_mul_(part, factor)
    return total, False


def _step_scheduler(state: TrainState) -> tuple[Any, int]:
    """Phase 10, after an applied update: the scheduler (and its last_epoch) it stepped."""
    scheduler = state.scheduler
    if scheduler is None or isinstance(scheduler, _NOT_PER_UPDATE):
        return state._scheduled
    done = state._scheduled  # (scheduler, its last_epoch after the step stepped it)
    if done[0] is scheduler and getattr(scheduler, "last_epoch", 0) > done[1]:
        warn(_TWICE, UserWarning)
    scheduler.step()
    return scheduler, getattr(scheduler, "last_epoch", 0)


def _disagreement(
    verdict: phases.Verdict, window: WindowState, group: Any, total: Any
) -> ValueError:
    """The error when ranks that must agree do not (one more small all-reduce, for the
    message, on the error path only)."""
    if verdict.uneven:
        fewest, most = value_range(window.skipped, group)
        return ValueError(
            "loss_fn returned None on some ranks of the data-parallel group but not on "
            f"others within one accumulation window (from {fewest} to {most} skipped "
            f"micro-batches; this rank skipped {window.skipped}); the window was thrown "
            "away. Skip a batch on every rank alike, or return a zero loss instead of None "
            "(loss * 0, or LossSum(total * 0, 0))."
        )
    mine = float(total) if total is not None else 0.0
    fewest, most = value_range(mine, group)
    return ValueError(
        "the ranks of one data replica (tensor- or expert-parallel ranks, which hold the same "
        f"samples) reported different target counts: from {fewest} to {most} summed over the data "
        f"ranks (this rank: {mine:g}); the window was thrown away. Give every rank of a replica "
        "the same batch: a DistributedSampler(dataset, **layout.sampler_options())."
    )


def _with_grads(optimizer: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The optimizer's parameters that have a gradient, and their gradients."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return params, [p.grad for p in params]


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
    if not callable(loss_fn) or isinstance(loss_fn, Step):
        raise TypeError(
            f"make_step: expected a callable loss_fn(model, batch); got a "
            f"{type(loss_fn).__name__} (a Step is decorated directly, not wrapped again)."
        )
    return Step(loss_fn)
