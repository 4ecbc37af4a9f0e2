"""validate: periodic evaluation with count-weighted means and best-score tracking."""

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau

from toolkit._checks import check, check_count, check_key, check_one_of
from toolkit.loop._evaluate import _evaluate, check_eval_fn
from toolkit.loop._run import Event, Plugin, declare, plugin_factory
from toolkit.plugins._shared import ValidationEntry, better, due
from toolkit.step._state import Metrics, TrainState


def _check_plateau(event: Event, plateau_metric: str, monitor: str, mode: str) -> None:
    """At ``"start"``: plateau_metric steps a ReduceLROnPlateau of ``mode`` (when monitored)."""
    scheduler = event.state.scheduler
    kind, name = type(scheduler).__name__, "state.scheduler"
    fix = "Put one in the state, or drop plateau_metric (the train step steps other schedulers)."
    steps = f"a ReduceLROnPlateau for plateau_metric={plateau_metric!r}"
    check(isinstance(scheduler, ReduceLROnPlateau), "validate", name, steps, kind, fix)
    same = plateau_metric != monitor or scheduler.mode == mode
    fix = f"plateau_metric={plateau_metric!r} is also the monitored metric: give both one mode."
    check(same, "validate", f"{name}.mode", f"{mode!r} like validate's", scheduler.mode, fix)


@plugin_factory(order=20)
def validate(
    eval_fn: Callable[[torch.nn.Module, Any], Any], data: Iterable[Any], *,
    every: int | None = None, per_epoch: bool = False, at_end: bool = False, key: str = "val",
    monitor: str = "loss", mode: str = "min",
    model: Callable[[TrainState], torch.nn.Module] | None = None, plateau_metric: str | None = None,
) -> Plugin:  # fmt: skip
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

    The metrics are published as ``state.metrics[key] = {"step": state.step, "values": {name:
    float}}`` (a :class:`toolkit.Metrics`), and ``state.extras[key] = {"epoch": state.epoch,
    "best": float, "best_step": int}`` keeps ``best``, the best ``monitor`` value so far
    (lowest for ``mode="min"``, highest for ``"max"``; a NaN never becomes best, so both are
    None until an evaluation gives a number) and ``best_step``, the update at which it was
    reached; a resumed entry keeps its best. The evaluation is not repeated for a
    ``state.step`` that already has one (the weights have not changed), e.g. when an epoch
    ends on a multiple of ``every``. Another plugin of the run under the same ``key`` (a
    second ``validate``, ``ema()`` under ``key="ema"``) is refused before training.

    Weights: a count must be a real number or a one-element real tensor (a bool is
    refused), finite and >= 0; a python number is checked when returned, a tensor count
    after the evaluation's one read, before anything is recorded. A pass whose weights sum
    to 0 over every batch (and rank) gives NaN for every metric with a ``RuntimeWarning``
    rather than an error: a bookkeeping mistake should not end a long run, and NaN is never
    taken as a best value.

    ``ReduceLROnPlateau``: the train step leaves a ``ReduceLROnPlateau`` in
    ``state.scheduler`` alone (it needs a metric). ``plateau_metric="loss"`` makes this
    ``validate`` step it once per evaluation with that metric's value,
    ``scheduler.step(metrics["loss"])``, exactly as a hand-written loop calling
    ``scheduler.step(val_loss)`` after each validation. It is explicit on purpose: with a
    ``ReduceLROnPlateau`` in the state and no ``validate`` of the run given
    ``plateau_metric``, :func:`toolkit.run` raises before training rather than leave the
    learning rate silently unreduced; a second ``validate`` with ``plateau_metric`` would
    step it twice per evaluation and is refused too.

    Args:
        eval_fn: ``eval_fn(model, batch) -> mapping | (mapping, count)``.
        data: a re-iterable source of validation batches (a DataLoader, a list).
        every: evaluate after every this many applied updates (``state.step % every == 0``).
        per_epoch: evaluate at every ``"epoch_end"``.
        at_end: evaluate once more at ``"end"`` (when training did not raise) unless the
            final weights were already evaluated, so the last result is always current.
        key: the name of the result in ``state.metrics`` and ``state.extras``.
        monitor: the metric whose best value is tracked.
        mode: ``"min"`` or ``"max"``: which direction is better for ``monitor``.
        model: a function ``state -> module`` choosing what to evaluate instead of
            ``state.model``, e.g. :func:`toolkit.plugins.ema_model` to evaluate the average
            (ema runs before validate, so it is the average of this very update).
        plateau_metric: the metric to step the ``ReduceLROnPlateau`` in ``state.scheduler``
            with after each evaluation, or None (see above). The scheduler's own ``mode``
            applies; when ``plateau_metric == monitor`` it must equal ``mode``.

    Returns:
        The plugin, ``plugin(event) -> TrainState | None``.

    Raises:
        ValueError: none of ``every``, ``per_epoch`` and ``at_end``, ``every < 1``, a bad
            ``mode``, an empty ``key`` or ``plateau_metric``, a one-shot iterator as
            ``data``; before training (see :func:`toolkit.run`), ``key`` kept by another
            plugin of the run, ``plateau_metric`` without a ``ReduceLROnPlateau`` in
            ``state.scheduler``, or with one whose ``mode`` contradicts ``mode``, or given
            to two ``validate``, or a ``ReduceLROnPlateau`` that no ``validate`` steps;
            during the run, validation data without batches, a negative or non-finite
            count, or ranks returning different metric names.
        TypeError: ``eval_fn`` not callable; during the run, an ``eval_fn`` result that is
            not a mapping of scalars, or a count that is not a real number or one-element
            real tensor.
        KeyError: during the run, ``eval_fn`` never returned ``monitor`` or
            ``plateau_metric`` (the message lists the metrics it did return).

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
        >>> published, best = state.metrics["val"], state.extras["val"]["best"]
        >>> published["step"], best <= published["values"]["loss"], model.training
        (4, True, True)

        Stepping a ``ReduceLROnPlateau`` with the validation loss:

        >>> plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(state.optimizer, patience=0)
        >>> state = state.replace(scheduler=plateau, metrics={}, extras={})
        >>> frozen = lambda m, b: {"loss": 1.0}  # never improves after the first evaluation
        >>> plugins = [validate(frozen, val, every=2, plateau_metric="loss")]
        >>> state = run(step, state, train, max_steps=8, plugins=plugins)
        >>> round(state.optimizer.param_groups[0]["lr"], 6)  # reduced once: 0.1 -> 0.01
        0.01
    """
    check_eval_fn("validate", eval_fn)
    if every is not None:
        check_count("validate", "every", every, 1, "applied updates between evaluations, or None")
    if every is None and not per_epoch and not at_end:
        raise ValueError("validate: expected every=N, per_epoch=True and/or at_end=True; got none.")
    check_key("validate", key)
    check_one_of("validate", "mode", mode, ("min", "max"), " (is lower or higher better)")
    once = isinstance(data, Iterator)
    check(not once, "validate", "data", "re-iterable (a list), not a one-shot iterator", data)
    ok = model is None or callable(model)
    check(ok, "validate", "model", "a function state -> module or None", model, "", TypeError)
    named = plateau_metric is None or (isinstance(plateau_metric, str) and bool(plateau_metric))
    metric = "the name of a metric eval_fn returns, e.g. 'loss', or None"
    check(named, "validate", "plateau_metric", metric, plateau_metric)

    def plugin(event: Event) -> TrainState | None:
        kind, state = event.kind, event.state
        if kind == "start" and plateau_metric is not None:
            _check_plateau(event, plateau_metric, monitor, mode)
        due_now = (
            (kind == "step" and every is not None and due(event, every))
            or (kind == "epoch_end" and per_epoch)
            or (kind == "end" and at_end and event.error is None)
        )
        last = state.metrics.get(key)
        # Not twice for one step: the weights have not changed (an epoch ending on `every`).
        if not due_now or (last is not None and last["step"] == state.step):
            return None
        module = model(state) if model is not None else state.model
        metrics = _evaluate(eval_fn, module, data, f" at step {state.step}")
        for wanted, option in ((monitor, "monitor"), (plateau_metric, "plateau_metric")):
            returned = f"a metric eval_fn returns, one of {sorted(metrics)}"
            fix = f"Pass {option}=<one of them>, or return {wanted!r}."
            ok = wanted is None or wanted in metrics
            check(ok, "validate", option, returned, wanted, fix, KeyError)
        if plateau_metric is not None:
            state.scheduler.step(metrics[plateau_metric])  # a ReduceLROnPlateau: see start
        previous: ValidationEntry | None = state.extras.get(key)
        best, best_step = (previous["best"], previous["best_step"]) if previous else (None, None)
        if better(metrics[monitor], best, mode):
            best, best_step = metrics[monitor], state.step
        entry = ValidationEntry(epoch=state.epoch, best=best, best_step=best_step)
        published = {**state.metrics, key: Metrics(step=state.step, values=metrics)}
        return state.replace(metrics=published, extras={**state.extras, key: entry})

    return declare(plugin, key, steps_plateau=plateau_metric is not None)
