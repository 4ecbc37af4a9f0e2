"""validate: periodic evaluation with count-weighted means and best-score tracking."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from toolkit._checks import check_count, check_key
from toolkit._loop import Event, Plugin, plugin_factory
from toolkit._state import TrainState
from toolkit._step import _leading_dim
from toolkit._weighted import columns, sum_over_ranks, weighted_sums
from toolkit.plugins._shared import better, check_mode, due

__all__ = ["validate"]


def _bad_result(result: Any, why: str) -> TypeError:
    return TypeError(
        f"validate: eval_fn returned {type(result).__name__}: {why}; expected a mapping of "
        "metric name -> number or 0-d tensor, or (mapping, count)."
    )


def _parse(result: Any, batch: Any) -> tuple[Mapping[str, Any], Any]:
    """``eval_fn``'s metrics (tensors made 0-d, views copied) and the batch's weight."""
    if isinstance(result, Mapping):
        metrics, count = result, None
    elif isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], Mapping):
        metrics, count = result
        if count is None:
            raise _bad_result(result, "its count is None; give a number or a 0-d tensor")
    else:
        raise _bad_result(result, "not a mapping of metrics")
    flat = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise _bad_result(
                    result, f"metric {name!r} is a tensor of shape {tuple(value.shape)}"
                )
            value = value.reshape(()) if value.ndim else value
            if value._base is not None:  # kept till the end: not the tensor it is a view of
                value = value.clone()
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad_result(result, f"metric {name!r} is a {type(value).__name__}")
        flat[name] = value
    if count is None:
        samples = _leading_dim(batch)
        count = 1 if samples is None else samples
    elif isinstance(count, torch.Tensor) and count.ndim:
        count = count.reshape(())
    return flat, count


def _evaluate(
    eval_fn: Callable[[torch.nn.Module, Any], Any], model: torch.nn.Module, data: Iterable[Any]
) -> dict[str, float]:
    """Count-weighted means of ``eval_fn``'s metrics over ``data`` (see :func:`validate`)."""
    # Per submodule: a model in train mode may hold frozen parts in eval mode on purpose.
    modes = [(module, module.training) for module in model.modules()]
    records, weights = [], []
    model.eval()
    try:
        with torch.no_grad():
            for batch in data:
                metrics, count = _parse(eval_fn(model, batch), batch)
                records.append(metrics)
                weights.append(count)
            # The batches' tensors are read back once, at the end: one host sync.
            reduced = weighted_sums(columns(records), weights)
    finally:
        for module, training in modes:
            module.training = training
    if not records:
        raise ValueError(
            "validate: the validation data yielded no batches; pass a non-empty, re-iterable "
            "source (a DataLoader, a list of batches)."
        )
    sums, _ = sum_over_ranks("validate", reduced.sums)  # type: ignore[arg-type]
    # A metric whose weights sum to 0 (e.g. batches without tokens) has no mean: NaN.
    return {
        name: total / weight if weight else math.nan
        for name, (total, weight) in sorted(sums.items())
    }


@plugin_factory
def validate(
    eval_fn: Callable[[torch.nn.Module, Any], Any],
    data: Iterable[Any],
    *,
    every: int | None = None,
    per_epoch: bool = False,
    at_end: bool = False,
    key: str = "val",
    monitor: str = "loss",
    mode: str = "min",
    model: Callable[[TrainState], torch.nn.Module] | None = None,
) -> Plugin:
    """A plugin that evaluates the model every ``every`` updates, after every epoch, at the end.

    Each evaluation calls ``eval_fn(model, batch)`` for every batch of ``data`` with the model
    in ``eval()`` mode under ``torch.no_grad()``; afterwards every submodule gets back its
    previous train/eval flag, also when ``eval_fn`` raises. ``eval_fn`` returns a mapping of
    metric name -> number or 0-d tensor, or ``(mapping, count)`` where ``count`` weights the
    batch; by default the weight is the leading dimension of the batch's first tensor (1
    when it has none). Each metric is the count-weighted mean over the batches that reported
    it, so unequal batch sizes give the exact mean over samples (a batch of weight 0 counts
    for nothing; NaN when a metric's weights sum to 0). The batches' values are read back
    at the end of the evaluation, at once, as :func:`toolkit.key_average` does (one host
    sync); with ``torch.distributed`` initialised, the sums and weights are then all-reduced
    over the ranks in one collective, so each rank should evaluate its own shard and every
    rank must return the same metric names.

    The result goes to ``state.extras[key] = {"step": state.step, "epoch": state.epoch,
    "metrics": {name: float}, "best": float, "best_step": int}``, where ``best`` is the best
    ``monitor`` value so far (lowest for ``mode="min"``, highest for ``"max"``; a NaN never
    becomes best, so both are None until an evaluation gives a number) and ``best_step`` the
    update at which it was reached; a resumed entry keeps its best. The evaluation is not
    repeated for a ``state.step`` that already has one (the weights have not changed), e.g.
    when an epoch ends on a multiple of ``every``. Put ``validate`` before ``early_stop``
    and ``log_metrics`` in the plugin list.

    Args:
        eval_fn: ``eval_fn(model, batch) -> mapping | (mapping, count)``.
        data: a re-iterable source of validation batches (a DataLoader, a list).
        every: evaluate after every this many applied updates (``state.step % every == 0``).
        per_epoch: evaluate at every ``"epoch_end"``.
        at_end: evaluate once more at ``"end"`` (when training did not raise) unless the
            final weights were already evaluated, so the last result is always current.
        key: the ``state.extras`` key of the result.
        monitor: the metric whose best value is tracked.
        mode: ``"min"`` or ``"max"``: which direction is better for ``monitor``.
        model: a function ``state -> module`` choosing what to evaluate instead of
            ``state.model``, e.g. :func:`toolkit.plugins.ema_model` to evaluate the average
            (then put ``ema`` before ``validate``).

    Returns:
        The plugin, ``plugin(event) -> TrainState | None``.

    Raises:
        ValueError: none of ``every``, ``per_epoch`` and ``at_end``, ``every < 1``, a bad
            ``mode``, an empty ``key``, a one-shot iterator as ``data``; during the run,
            validation data without batches, or ranks returning different metric names.
        TypeError: ``eval_fn`` not callable; during the run, an ``eval_fn`` result that is
            not a mapping of scalars.
        KeyError: during the run, ``eval_fn`` never returned ``monitor`` (the message lists
            the metrics it did return).

    Example:
        >>> import torch
        >>> from toolkit import TrainState, make_step, run
        >>> from toolkit.plugins import validate
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> train = [torch.ones(4, 2)] * 4
        >>> val = [torch.ones(3, 2), torch.ones(1, 2)]
        >>> def eval_fn(m, b):
        ...     return {"loss": m(b).square().mean()}
        >>> step = make_step(lambda m, b: m(b).square().mean())
        >>> state = run(step, state, train, max_steps=4, plugins=[validate(eval_fn, val, every=2)])
        >>> entry = state.extras["val"]
        >>> entry["step"], entry["best"] <= entry["metrics"]["loss"], model.training
        (4, True, True)
    """
    if not callable(eval_fn):
        raise TypeError(
            f"validate: eval_fn must be callable as eval_fn(model, batch); got "
            f"{type(eval_fn).__name__}."
        )
    if every is not None:
        check_count("validate", "every", every, 1, "applied updates between evaluations, or None")
    check_key("validate", key)
    if every is None and not per_epoch and not at_end:
        raise ValueError(
            "validate: expected every=N, per_epoch=True and/or at_end=True; got none of "
            "them, so it would never run."
        )
    check_mode("validate", mode)
    if isinstance(data, Iterator):
        raise ValueError(
            f"validate: data must be re-iterable (a DataLoader, a list), read at every "
            f"evaluation; got a one-shot iterator ({type(data).__name__})."
        )
    if model is not None and not callable(model):
        raise TypeError(
            f"validate: model must be a function state -> module (e.g. ema_model) or None; "
            f"got {type(model).__name__}."
        )
    pick = model

    def run_eval(state: TrainState) -> TrainState:
        metrics = _evaluate(eval_fn, pick(state) if pick is not None else state.model, data)
        if monitor not in metrics:
            raise KeyError(
                f"validate: eval_fn returned no {monitor!r} metric to monitor, only "
                f"{sorted(metrics)}; pass monitor=<one of them>, or return {monitor!r}."
            )
        previous = state.extras.get(key)
        best = previous.get("best") if isinstance(previous, Mapping) else None
        best_step = previous.get("best_step") if isinstance(previous, Mapping) else None
        value = metrics[monitor]
        if better(value, best, mode):
            best, best_step = value, state.step
        entry = {
            "step": state.step,
            "epoch": state.epoch,
            "metrics": metrics,
            "best": best,
            "best_step": best_step,
        }
        return state.replace(extras={**state.extras, key: entry})

    def plugin(event: Event) -> TrainState | None:
        state = event.state
        if event.kind == "step":
            evaluate = every is not None and due(event, every)
        elif event.kind == "end":
            evaluate = at_end and event.error is None
        else:
            evaluate = per_epoch and event.kind == "epoch_end"
        if not evaluate:
            return None
        previous = state.extras.get(key)
        if isinstance(previous, Mapping) and previous.get("step") == state.step:
            return None
        return run_eval(state)

    return plugin
