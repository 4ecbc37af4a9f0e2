"""evaluate: an evaluation-only entry point, the evaluation of the validate plugin as a function."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from toolkit._state import TrainState

__all__ = ["evaluate"]


def evaluate(
    eval_fn: Callable[[torch.nn.Module, Any], Any],
    model: torch.nn.Module | TrainState,
    data: Iterable[Any],
) -> dict[str, float]:
    """Evaluate ``model`` over ``data`` once: count-weighted means of ``eval_fn``'s metrics.

    The same evaluation as :func:`toolkit.plugins.validate` runs, without a training run:
    ``eval_fn(model, batch)`` for every batch, the model in ``eval()`` mode under
    ``torch.no_grad()`` (every submodule's train/eval flag restored afterwards, also when
    ``eval_fn`` raises). ``eval_fn`` returns a mapping of metric name -> number or 0-d
    tensor, or ``(mapping, count)``; each metric is the mean weighted by ``count`` (by
    default the batch's leading dimension). One host sync at the end; under
    ``torch.distributed`` the sums are all-reduced over the ranks (each rank evaluates its
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
    # Imported here: the plugins package imports the loop, which imports toolkit's core.
    from toolkit.plugins._validation import _evaluate

    if not callable(eval_fn):
        raise TypeError(
            f"evaluate: eval_fn must be callable as eval_fn(model, batch); got "
            f"{type(eval_fn).__name__}."
        )
    module = model.model if isinstance(model, TrainState) else model
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"evaluate: model must be a torch.nn.Module or a TrainState; got "
            f"{type(model).__name__}."
        )
    if not isinstance(data, Iterable) or isinstance(data, (str, bytes)):
        raise TypeError(
            f"evaluate: data must be an iterable of batches (a DataLoader, a list); got "
            f"{type(data).__name__}."
        )
    return _evaluate(eval_fn, module, data, who="evaluate")
