"""validate and early_stop: periodic evaluation with best-score tracking, and stopping on it."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from toolkit._checks import check_count, check_key
from toolkit._distributed import all_reduce_
from toolkit._loop import Event, Plugin
from toolkit._state import TrainState
from toolkit._step import _leading_dim
from toolkit.plugins._entries import metric_entry

__all__ = ["early_stop", "validate"]

_MODES = ("min", "max")


def _check_mode(who: str, mode: Any) -> None:
    if mode not in _MODES:
        raise ValueError(
            f"{who}: mode must be 'min' (lower is better, e.g. a loss) or 'max' (higher is "
            f"better, e.g. an accuracy); got {mode!r}."
        )


def _better(value: float, best: float | None, mode: str, margin: float = 0.0) -> bool:
    if best is None or math.isnan(best):
        return not math.isnan(value)
    return value < best - margin if mode == "min" else value > best + margin


def _bad_result(result: Any, why: str) -> TypeError:
    return TypeError(
        f"validate: eval_fn returned {type(result).__name__}: {why}. Expected a mapping of "
        "metric name -> number or 0-d tensor, e.g. {'loss': loss, 'acc': acc}, or (mapping, "
        "count) where count weights this batch in the mean."
    )


def _parse(result: Any, batch: Any) -> tuple[Mapping[str, Any], Any]:
    if isinstance(result, Mapping):
        metrics, count = result, None
    elif isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], Mapping):
        metrics, count = result
        if count is None:
            raise _bad_result(result, "its count is None; give a number or a 0-d tensor")
    else:
        raise _bad_result(result, "not a mapping of metrics")
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise _bad_result(
                    result, f"metric {name!r} is a tensor of shape {tuple(value.shape)}"
                )
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad_result(result, f"metric {name!r} is a {type(value).__name__}")
    if count is None:
        samples = _leading_dim(batch)
        count = 1 if samples is None else samples
    return metrics, count


def _float64(value: Any) -> Any:
    """A tensor as a 0-d float64 tensor (sums stay on its device); a number as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(torch.float64)
    return value


def _device(model: torch.nn.Module, found: torch.device | None) -> torch.device:
    if found is not None:
        return found
    # The collective backend (NCCL) needs tensors on the model's device.
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _modes(model: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    # Per submodule: a model in train mode may hold frozen parts in eval mode on purpose.
    return [(m, m.training) for m in model.modules()]


def _evaluate(
    eval_fn: Callable[[torch.nn.Module, Any], Any], model: torch.nn.Module, data: Iterable[Any]
) -> dict[str, float]:
    """Count-weighted means of ``eval_fn``'s metrics over ``data`` (see :func:`validate`)."""
    modes = _modes(model)
    sums: dict[str, Any] = {}
    weights: dict[str, Any] = {}
    device: torch.device | None = None
    batches = 0
    model.eval()
    try:
        with torch.no_grad():
            for batch in data:
                batches += 1
                metrics, count = _parse(eval_fn(model, batch), batch)
                weight = _float64(count)
                for name, value in metrics.items():
                    if device is None and isinstance(value, torch.Tensor):
                        device = value.device
                    sums[name] = sums.get(name, 0.0) + _float64(value) * weight
                    weights[name] = weights.get(name, 0.0) + weight
    finally:
        for module, training in modes:
            module.training = training
    if not batches:
        raise ValueError(
            "validate: the validation data yielded no batches. Pass a non-empty, re-iterable "
            "source (a DataLoader or a list of batches)."
        )
    names = sorted(sums)
    if not names:
        return {}
    dev = _device(model, device)
    packed = torch.stack(
        [torch.as_tensor(x, dtype=torch.float64, device=dev).reshape(()) for x in sums.values()]
        + [
            torch.as_tensor(x, dtype=torch.float64, device=dev).reshape(())
            for x in weights.values()
        ]
    )
    packed = all_reduce_(packed, dist.ReduceOp.SUM)  # a no-op in one process
    values = packed.tolist()  # the one host sync of the evaluation
    k = len(sums)
    by_name = dict(zip(sums, zip(values[:k], values[k:])))
    # A metric whose weights sum to 0 (e.g. batches without tokens) has no mean: NaN.
    return {name: _ratio(*by_name[name]) for name in names}


def _ratio(total: float, weight: float) -> float:
    return total / weight if weight else math.nan


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
    it, so unequal batch sizes give the exact mean over samples (NaN when its weights sum to
    0). Sums stay tensors until the
    end of the evaluation (one host sync); with ``torch.distributed`` initialised, the sums
    and weights are all-reduced over ranks first, so each rank should evaluate its own shard
    and every rank must return the same metric names.

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
            validation data without batches.
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
            "validate: give every=N (evaluate every N applied updates), per_epoch=True "
            "(after each epoch) and/or at_end=True (once at the end); with none it would "
            "never run."
        )
    _check_mode("validate", mode)
    if isinstance(data, Iterator):
        raise ValueError(
            f"validate: data must be re-iterable (a DataLoader, a list of batches) because it "
            f"is read at every evaluation; got a one-shot iterator ({type(data).__name__})."
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
                f"validate: eval_fn returned no {monitor!r} metric to monitor; it returned "
                f"{sorted(metrics)}. Pass monitor=<one of them>, or return {monitor!r}."
            )
        previous = state.extras.get(key)
        best = previous.get("best") if isinstance(previous, Mapping) else None
        best_step = previous.get("best_step") if isinstance(previous, Mapping) else None
        value = metrics[monitor]
        if _better(value, best, mode):
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
            out = event.out
            due = every is not None and out is not None and out.updated and state.step % every == 0
        elif event.kind == "end":
            due = at_end and event.error is None
        else:
            due = per_epoch and event.kind == "epoch_end"
        if not due:
            return None
        previous = state.extras.get(key)
        if isinstance(previous, Mapping) and previous.get("step") == state.step:
            return None
        return run_eval(state)

    return plugin


def early_stop(
    metric: str = "val/loss",
    *,
    patience: int = 5,
    min_delta: float = 0.0,
    mode: str = "min",
) -> Plugin:
    """A plugin that asks the loop to stop when a metric has stopped improving.

    ``metric="NAME/m"`` reads ``state.extras[NAME]["metrics"][m]`` (the entry that
    :func:`validate` with ``key=NAME`` writes) each time ``state.extras[NAME]["step"]``
    changes, so each evaluation counts once. An evaluation improves when it beats the best
    so far by more than ``min_delta`` (below ``best - min_delta`` for ``mode="min"``, above
    ``best + min_delta`` for ``"max"``; a NaN never improves); the first one always does.
    After ``patience`` evaluations in a row without improvement the plugin returns the
    state with ``stop`` set to the reason, e.g. ``"early_stop: val/loss did not improve by
    more than 0 for 5 evaluations (best 0.1234 at step 400)"``. Its counters live in
    ``state.extras["early_stop"]`` (``{"metric", "seen_step", "best", "best_step",
    "bad"}``), so a resumed run keeps them; use one ``early_stop`` per run. Put it after
    ``validate`` in the plugin list.

    When a run that did not raise ends and ``state.extras`` never got a ``NAME`` entry, the
    plugin raises a ``KeyError`` at ``"end"`` naming the keys that exist: a misspelt
    metric or a missing/late ``validate`` would otherwise fail silently. (A run too short to
    reach the first evaluation therefore raises too; validate once at the end of such a run,
    e.g. ``per_epoch=True``, or leave ``early_stop`` out of it.)

    Args:
        metric: ``"NAME/metric"``, e.g. ``"val/loss"`` or ``"val/acc"``.
        patience: evaluations without improvement before stopping (>= 1).
        min_delta: the margin an evaluation must beat the best by to count as an
            improvement (>= 0).
        mode: ``"min"`` (lower is better) or ``"max"`` (higher is better).

    Returns:
        The plugin, ``plugin(event) -> TrainState | None``.

    Raises:
        ValueError: ``metric`` without ``"/"``, ``patience < 1``, a negative ``min_delta``,
            a bad ``mode``.
        KeyError: during the run, an entry ``NAME`` that holds no metrics or no metric
            ``m``; at the end of a run, no ``NAME`` entry at all.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, make_step, run
        >>> from toolkit.plugins import early_stop, validate
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
        >>> train, val = [torch.ones(4, 2)] * 100, [torch.ones(4, 2)]
        >>> def eval_fn(m, b):
        ...     return {"loss": m(b).square().mean()}
        >>> plugins = [validate(eval_fn, val, every=10), early_stop("val/loss", patience=2)]
        >>> step = make_step(lambda m, b: m(b).square().mean())
        >>> state = run(step, state, train, max_steps=100, plugins=plugins)
        >>> state.step  # lr=0: no improvement after the first evaluation at step 10
        30
        >>> state.stop.startswith("early_stop: val/loss did not improve by more than 0 for 2")
        True
    """
    if not isinstance(metric, str) or "/" not in metric:
        raise ValueError(
            f"early_stop: metric must be 'NAME/metric', the state.extras entry and the metric "
            f"in it, e.g. 'val/loss' for validate(key='val') returning 'loss'; got {metric!r}."
        )
    name, _, sub = metric.partition("/")
    check_count(
        "early_stop", "patience", patience, 1, "evaluations without improvement before stopping"
    )
    if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or not min_delta >= 0:
        raise ValueError(f"early_stop: min_delta must be a number >= 0; got {min_delta!r}.")
    _check_mode("early_stop", mode)
    margin = float(min_delta)

    def plugin(event: Event) -> TrainState | None:
        state = event.state
        if event.kind == "end":
            if event.error is None and name not in state.extras:
                raise KeyError(
                    f"early_stop: state.extras never got a {name!r} entry to read {metric!r} "
                    f"from during this run (entries: {sorted(state.extras)}). Check the name, "
                    f"and that validate(..., key={name!r}) comes before early_stop in plugins "
                    "and evaluates at least once within the run."
                )
            return None
        if event.kind == "start":
            return None
        entry = state.extras.get(name)
        if entry is None:
            return None
        parsed = metric_entry(entry)
        if parsed is None:
            raise KeyError(
                f"early_stop: state.extras[{name!r}] holds no metrics (an entry of the form "
                "{'step': ..., 'metrics': {...}} that validate or peak_memory write). Give "
                "the key of such a plugin, e.g. early_stop('val/loss')."
            )
        step, metrics = parsed
        counters = state.extras.get("early_stop")
        if counters is None or counters.get("metric") != metric:
            counters = dict(metric=metric, seen_step=None, best=None, best_step=None, bad=0)
        if step == counters["seen_step"]:
            return None
        if sub not in metrics:
            raise KeyError(
                f"early_stop: state.extras[{name!r}]['metrics'] has no {sub!r} (it has "
                f"{sorted(metrics)}). Use early_stop('{name}/<one of them>')."
            )
        value = float(metrics[sub])
        if _better(value, counters["best"], mode, margin):
            counters = {**counters, "best": value, "best_step": step, "bad": 0}
        else:
            counters = {**counters, "bad": counters["bad"] + 1}
        counters["seen_step"] = step
        state = state.replace(extras={**state.extras, "early_stop": counters})
        if counters["bad"] >= patience:
            best = counters["best"]
            best_text = f"{best:.4g}" if best is not None else "none"
            reason = (
                f"early_stop: {metric} did not improve by more than {margin:g} for "
                f"{counters['bad']} evaluations (best {best_text} at step "
                f"{counters['best_step']})"
            )
            state = state.replace(stop=reason)
        return state

    return plugin
