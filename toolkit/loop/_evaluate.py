"""evaluate: an evaluation-only entry point, the evaluation of the validate plugin as a function."""

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from toolkit._checks import check_type, warn
from toolkit._tree import check_weight, check_weight_values
from toolkit._weighted import columns, weighted_sums
from toolkit.distributed._collectives import groups_of, sum_over_ranks, sync_kind
from toolkit.step._state import TrainState
from toolkit.step._step import _leading_dim


def evaluate(
    eval_fn: Callable[[torch.nn.Module, Any], Any], model: torch.nn.Module | TrainState,
    data: Iterable[Any],
) -> dict[str, float]:  # fmt: skip
    """Evaluate ``model`` over ``data`` once: count-weighted means of ``eval_fn``'s metrics.

    The same evaluation as :func:`toolkit.plugins.validate` runs, without a training run:
    ``eval_fn(model, batch)`` for every batch, the model in ``eval()`` mode under
    ``torch.no_grad()`` (every submodule's train/eval flag restored afterwards, also when
    ``eval_fn`` raises). ``eval_fn`` returns a mapping of metric name -> number or 0-d
    tensor, or ``(mapping, count)``; each metric is the mean weighted by ``count`` (by
    default the batch's leading dimension). One host sync at the end; under
    ``torch.distributed`` the sums are all-reduced over the model's data-parallel ranks
    (the default group for a model that is not DDP or FSDP2; each rank evaluates its
    own shard; all must return the same metric names).

    Args:
        eval_fn: ``eval_fn(model, batch) -> mapping | (mapping, count)``.
        model: the module to evaluate, or a :class:`TrainState` (its ``model``).
        data: a source of evaluation batches (any iterable, read once).

    Returns:
        ``{name: float}``, sorted by name; NaN for a metric whose weights sum to 0.

    Raises:
        TypeError: ``eval_fn`` is not callable, ``model`` is neither a module nor a
            TrainState, ``data`` is not an iterable; an ``eval_fn`` result that is not a
            mapping of scalars.
        ValueError: ``data`` yields no batches.

    Example:
        >>> import torch
        >>> from toolkit import evaluate
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.ones(3, 2), torch.zeros(3, 1)), (torch.ones(1, 2), torch.zeros(1, 1))]
        >>> def eval_fn(m, batch):
        ...     x, y = batch
        ...     return {"mse": torch.nn.functional.mse_loss(m(x), y)}
        >>> sorted(evaluate(eval_fn, model, data)), model.training
        (['mse'], True)
    """
    who, module = "evaluate", model.model if isinstance(model, TrainState) else model
    check_eval_fn(who, eval_fn)
    ok = isinstance(module, torch.nn.Module)
    check_type(ok, who, "model", "a torch.nn.Module or a TrainState", model)
    ok = isinstance(data, Iterable) and not isinstance(data, (str, bytes))
    check_type(ok, who, "data", "an iterable of batches (a list)", data)
    return _evaluate(eval_fn, module, data, who="evaluate")


def check_eval_fn(who: str, eval_fn: Any) -> None:
    """Raise TypeError unless ``eval_fn`` is callable."""
    check_type(callable(eval_fn), who, "eval_fn", "callable as eval_fn(model, batch)", eval_fn)


def _bad_result(result: Any, why: str, who: str) -> TypeError:
    return TypeError(
        f"{who}: eval_fn returned {type(result).__name__}: {why}; expected a mapping of "
        "metric name -> number or 0-d tensor, or (mapping, count)."
    )


def _parse(result: Any, batch: Any, index: int, who: str) -> tuple[Mapping[str, Any], Any]:
    """``eval_fn``'s metrics (tensors made 0-d, views copied) and the batch's weight."""
    metrics, count = result if isinstance(result, tuple) and len(result) == 2 else (result, 1)
    if not isinstance(metrics, Mapping):
        raise _bad_result(result, "not a mapping of metrics", who)
    if count is None:
        raise _bad_result(result, "its count is None; give a number or a 0-d tensor", who)
    flat = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            # Kept till the end: a copy, not the (maybe large) tensor it is a view of.
            value = value.reshape(()).clone() if value._base is not None else value.reshape(())
        elif isinstance(value, (torch.Tensor, bool)) or not isinstance(value, (int, float)):
            shape = isinstance(value, torch.Tensor) and f"tensor of shape {tuple(value.shape)}"
            raise _bad_result(result, f"metric {name!r} is a {shape or type(value).__name__}", who)
        flat[name] = value
    if result is metrics:
        samples = _leading_dim(batch)
        return flat, 1 if samples is None else samples
    fix = ", e.g. (metrics, mask.sum())"
    count = check_weight(who, f"the count eval_fn returned for batch {index}", count, fix)
    if not isinstance(count, torch.Tensor):  # refused now, before the next batch
        check_weight_values(who, _count_name(who), [count], index)
    return flat, count


def _count_name(who: str) -> str:
    data = "validation data" if who == "validate" else "data"
    return "the count eval_fn returned for batch {} of the " + data


def _evaluate(
    eval_fn: Callable[[torch.nn.Module, Any], Any], model: torch.nn.Module, data: Iterable[Any],
    where: str = "", who: str = "validate",
) -> dict[str, float]:  # fmt: skip
    """Count-weighted means of ``eval_fn``'s metrics over ``data`` (see :func:`validate`).

    ``where`` (e.g. ``" at step 40"``) completes the warning about a pass of weight 0;
    ``who`` names the caller in errors and warnings (``"evaluate"`` for the function).
    """
    # Per submodule: a model in train mode may hold frozen parts in eval mode on purpose.
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            parsed = [_parse(eval_fn(model, b), b, i, who) for i, b in enumerate(data)]
            records = [metrics for metrics, _ in parsed]
            # The batches' tensors are read back once, at the end: one host sync.
            reduced = weighted_sums(columns(records), [count for _, count in parsed])
    finally:
        for module, training in modes:
            module.training = training
            # FSDP2 keeps the root's parameters gathered after a forward without backward (it
            # expects one); training found them sharded, so it gets them back sharded.
            if sync_kind(module) == "fsdp2":  # a module that fully_shard gave an FSDPModule class
                module.reshard()  # type: ignore[operator]
    if not records:
        raise ValueError(
            f"{who}: the {'validation ' if who == 'validate' else ''}data yielded no batches; "
            "pass a non-empty, re-iterable source (a DataLoader, a list of batches)."
        )
    check_weight_values(who, _count_name(who), reduced.weights)
    sums, _ = sum_over_ranks(who, reduced.sums, group=groups_of(model).tokens)  # type: ignore[arg-type]
    if sums and not any(weight for _, weight in sums.values()):
        why = "had weight 0 (the counts eval_fn returned sum to 0 over all ranks)"
        message = f"{who}: every batch of the pass{where} {why}, so every metric is NaN"
        warn(f"{message}; check the counts eval_fn returns.")
    # A metric whose weights sum to 0 (e.g. batches without tokens) has no mean: NaN.
    means = {name: total / weight if weight else math.nan for name, (total, weight) in sums.items()}
    return dict(sorted(means.items()))
