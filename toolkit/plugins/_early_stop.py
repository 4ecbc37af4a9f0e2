"""early_stop: ask the loop to stop when a validation metric has stopped improving."""

from toolkit._checks import check, check_count, check_key, check_one_of, warn
from toolkit.loop._run import Event, Plugin, declare, plugin_factory
from toolkit.plugins._shared import EarlyStopEntry, better
from toolkit.step._state import TrainState


@plugin_factory(order=30)
def early_stop(
    metric: str = "val/loss", *, patience: int = 5, min_delta: float = 0.0, mode: str = "min",
    key: str = "early_stop",
) -> Plugin:  # fmt: skip
    """A plugin that asks the loop to stop when a metric has stopped improving.

    ``metric="NAME/m"`` reads ``state.metrics[NAME]["values"][m]`` (what :func:`validate`
    with ``key=NAME`` publishes) each time ``state.metrics[NAME]["step"]`` changes, so each
    evaluation counts once. An evaluation improves when it beats the best
    so far by more than ``min_delta`` (below ``best - min_delta`` for ``mode="min"``, above
    ``best + min_delta`` for ``"max"``; a NaN never improves); the first one always does.
    After ``patience`` evaluations in a row without improvement the plugin returns the
    state with ``stop`` set to the reason, e.g. ``"early_stop: val/loss did not improve by
    more than 0 for 5 evaluations (best 0.1234 at step 400)"``. Its counters live in
    ``state.extras[key]`` (``{"metric", "seen_step", "best", "best_step", "bad"}``), so a
    resumed run keeps them. A second ``early_stop`` (say on another metric) needs its own
    ``key=``, or the run is refused before training.

    When a run that did not raise ends and ``state.metrics`` never got a ``NAME`` entry, the
    plugin warns once at ``"end"`` (a ``RuntimeWarning`` naming the entries that exist) and
    does nothing else: a misspelt metric or a missing or late ``validate`` would otherwise
    go unnoticed, while a run too short to reach its first evaluation is not an error (the
    trained state is returned as usual). Validate once at the end of such a run
    (``validate(..., at_end=True)``) to have a score.

    Args:
        metric: ``"NAME/metric"``, e.g. ``"val/loss"`` or ``"val/acc"``.
        patience: evaluations without improvement before stopping (>= 1).
        min_delta: the margin an evaluation must beat the best by to count as an
            improvement (>= 0).
        mode: ``"min"`` (lower is better) or ``"max"`` (higher is better).
        key: the ``state.extras`` key of the counters.

    Returns:
        The plugin, ``plugin(event) -> TrainState | None``.

    Raises:
        ValueError: ``metric`` without ``"/"``, ``patience < 1``, a negative ``min_delta``,
            a bad ``mode``, an empty ``key``; before training, ``key`` kept by another
            plugin of the run.
        KeyError: during the run, an entry ``NAME`` without a metric ``m``.

    Warns:
        RuntimeWarning: at the end of a run that did not raise, no ``NAME`` entry at all.

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
    ok = isinstance(metric, str) and "/" in metric
    check(ok, "early_stop", "metric", "'NAME/metric' (a state.metrics entry / its value)", metric)
    name, _, sub = metric.partition("/")
    check_count("early_stop", "patience", patience, 1, "evaluations without improvement")
    ok = isinstance(min_delta, (int, float)) and not isinstance(min_delta, bool)
    check(ok and min_delta >= 0, "early_stop", "min_delta", "a number >= 0", min_delta)
    check_one_of("early_stop", "mode", mode, ("min", "max"), " (is lower or higher better)")
    check_key("early_stop", key)
    fresh = EarlyStopEntry(metric=metric, seen_step=None, best=None, best_step=None, bad=0)

    def plugin(event: Event) -> TrainState | None:
        state = event.state
        if event.kind == "end" and event.error is None and name not in state.metrics:
            said = f"early_stop: state.metrics never got a {name!r} entry to read {metric!r} from"
            fix = f"Check the name, and that validate(..., key={name!r}) runs (e.g. at_end=True)"
            warn(f"{said} (entries: {sorted(state.metrics)}), so no score was judged. {fix}.")
        if event.kind in ("restore", "start", "end") or name not in state.metrics:
            return None
        step, metrics = state.metrics[name]["step"], state.metrics[name]["values"]
        counters: EarlyStopEntry = state.extras.get(key) or fresh
        counters = counters if counters["metric"] == metric else fresh
        if step == counters["seen_step"]:
            return None
        known = f"a metric of state.metrics[{name!r}], one of {sorted(metrics)}"
        fix = f"Use early_stop('{name}/<one of them>')."
        check(sub in metrics, "early_stop", repr(metric), known, sub, fix, KeyError)
        counters = {**counters, "seen_step": step, "bad": counters["bad"] + 1}
        if better(value := float(metrics[sub]), counters["best"], mode, min_delta):
            counters.update({"best": value, "best_step": step, "bad": 0})
        state = state.replace(extras={**state.extras, key: counters})
        if counters["bad"] < patience:
            return state
        said = f"did not improve by more than {min_delta:g} for {counters['bad']} evaluations"
        best = f"{counters['best']:.4g}" if counters["best"] is not None else "none"
        best += f" at step {counters['best_step']}"
        return state.replace(stop=f"early_stop: {metric} {said} (best {best})")

    return declare(plugin, key)
