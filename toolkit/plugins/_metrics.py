"""log_metrics: count-weighted interval means of the step's outputs, published to sinks."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from toolkit._checks import check_count
from toolkit._distributed import is_rank_zero
from toolkit._loop import Event, plugin_factory
from toolkit._state import TrainState
from toolkit._step import StepOutput
from toolkit._weighted import sum_over_ranks
from toolkit.plugins._interval import Interval, read
from toolkit.plugins._shared import due, metric_entry
from toolkit.plugins._sinks import Sink

__all__ = ["log_metrics"]

# Past this many updates in one interval, the pending outputs are read back and folded into
# python sums, so memory stays bounded whatever `every` is (one extra host read each).
_FOLD = 4096

# Keys that log_metrics itself publishes under "train/"; a record may not reuse them.
_RESERVED = frozenset(
    {"loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "nonfinite", "overflow"}
)


def _flatten(tree: Mapping[str, Any], prefix: str, where: str, into: dict[str, Any]) -> None:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            _flatten(value, f"{name}/", where, into)
        elif isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"log_metrics: {where} {name!r} is a tensor of shape {tuple(value.shape)}; "
                    "expected a number or a 0-d tensor; reduce it first (.mean(), .sum())."
                )
            into[name] = value.detach().reshape(()) if value.ndim else value.detach()
        elif isinstance(value, (int, float)):
            into[name] = value
        else:
            raise TypeError(
                f"log_metrics: {where} {name!r} is a {type(value).__name__}; expected a "
                "number, a 0-d tensor or a nested mapping of them."
            )


def _flat_records(records: Mapping[str, Any]) -> dict[str, Any]:
    """A micro-batch's records flattened with "/"."""
    flat: dict[str, Any] = {}
    _flatten(records, "", "record", flat)
    clash = _RESERVED.intersection(flat)
    if clash:
        raise ValueError(
            f"log_metrics: record(s) {sorted(clash)} would overwrite the published "
            f"train/{sorted(clash)[0]}; rename them in loss_fn's records."
        )
    return flat


def _new_extras(extras: Mapping[str, Any], seen: dict[str, Any], out: dict[str, float]) -> None:
    """Add to ``out`` the plugin metrics entries whose "step" changed since ``seen``."""
    for name, entry in extras.items():
        parsed = metric_entry(entry)
        if parsed is None or seen.get(name, _NEVER) == parsed[0]:
            continue
        seen[name] = parsed[0]
        flat: dict[str, Any] = {}
        _flatten(parsed[1], f"{name}/", "state.extras metric", flat)
        for key, value in flat.items():
            if isinstance(value, torch.Tensor):
                raise TypeError(
                    f"log_metrics: state.extras metric {key!r} is a tensor; a plugin stores "
                    "python floats in extras[NAME]['metrics'] (read once when produced), so "
                    "that publishing costs no host sync."
                )
            out[key] = value


_NEVER = object()


def _check(every: Any, sinks: Any) -> list[Sink]:
    check_count("log_metrics", "every", every, 1, "updates per published interval")
    if isinstance(sinks, Sink):
        sinks = [sinks]
    if not isinstance(sinks, Sequence) or isinstance(sinks, str):
        raise TypeError(
            f"log_metrics: sinks must be a list of sinks, e.g. [jsonl(path)]; got "
            f"{type(sinks).__name__}."
        )
    for sink in sinks:
        if not (callable(getattr(sink, "write", None)) and callable(getattr(sink, "close", None))):
            raise TypeError(
                f"log_metrics: each sink needs write(step, metrics) and close(); got "
                f"{type(sink).__name__}; build one with jsonl, tensorboard, wandb or Sink."
            )
    return list(sinks)


@dataclasses.dataclass(slots=True)
class _Memory:
    """log_metrics's memory: the open interval."""

    # Each update's window outputs, read at the publish (or a fold). Not the events: their
    # states may hold large extras.
    windows: list[tuple[StepOutput, ...]] = dataclasses.field(default_factory=list)
    interval: Interval = dataclasses.field(default_factory=Interval)  # what was read so far
    data_time: float = 0.0
    step_time: float = 0.0
    started: float = 0.0  # clock() when the interval started
    seen: dict[str, Any] = dataclasses.field(default_factory=dict)  # entry -> step published
    extras: Any = None  # the state.extras last scanned for new entries


@plugin_factory
def log_metrics(
    every: int = 100,
    *,
    sinks: Sequence[Sink] | Sink,
    clock: Callable[[], float] = time.perf_counter,
) -> Callable[[Event], TrainState | None]:
    """A plugin publishing count-weighted means of each interval of ``every`` updates.

    Every micro-batch's loss (``StepOutput.loss``) is weighted by its target count when the
    loss function reports one (:class:`toolkit.LossSum`), else by its number of samples,
    else by 1, so the mean over micro-batches of different sizes is the exact mean over
    targets (or samples); a micro-batch of weight 0 counts for nothing. Records (nested
    mappings of numbers or 0-d tensors) are weighted alike, key by key (a key missing from
    some micro-batches is averaged over those that have it), and flattened with "/" under
    ``train/``. Micro-batches of a window that :func:`toolkit.guard_nonfinite` rejected are
    left out (and counted in ``train/nonfinite``).

    Nothing is synchronised per micro-batch: each publish reads the interval's tensors back
    at once, as :func:`toolkit.key_average` does (one host sync), and an interval longer
    than 4096 updates is read every 4096 updates, so memory stays bounded. Under data
    parallelism the sums and weights are all-reduced over the ranks in one collective, so
    the published loss is the mean over all ranks' targets; every rank must then report the
    same record keys. Only rank 0 writes to the sinks; every rank does the same work.

    A publish happens after the update that makes ``state.step`` a multiple of ``every``,
    and at ``"end"`` for a partial interval; the step given to the sinks is ``state.step``,
    so steps keep increasing after a resume. Published keys:

    * ``train/loss``; ``train/<record>`` for each record;
    * ``train/lr``: the learning rate the interval's last applied update used;
    * ``train/grad_norm``: mean pre-clip norm over the interval's updates (when computed,
      i.e. under :func:`toolkit.clip` or :func:`toolkit.guard_nonfinite`);
    * ``time/data``, ``time/step``: seconds per update waiting for data and in the step;
    * ``train/samples_per_s`` and, when counts are reported, ``train/tokens_per_s``: over
      the interval's wall-clock time (everything included, validation too), all ranks;
    * ``train/nonfinite``, ``train/overflow``: rejected and fp16-overflowed windows in the
      interval, when not zero;
    * ``NAME/<metric>`` for each ``state.extras[NAME] = {"step": s, "metrics": {...}}``
      entry of another plugin, as soon as its ``"step"`` changes (entries present when the
      run starts, from an earlier run of the state, are not republished). Put such plugins
      (``validate``, ``peak_memory``) before ``log_metrics`` so they appear at their step.

    At ``"end"`` the sinks are closed (they reopen if written again, e.g. by a second run).
    When training raised, the partial interval is still published, from this rank's data
    only (no collective: the other ranks may be gone).

    Args:
        every: updates per interval (>= 1).
        sinks: the sinks to write to (a list, or a single :class:`Sink`).
        clock: a function returning seconds, for the throughput; tests pass a fake one.

    Returns:
        The plugin, a function ``plugin(event) -> None``.

    Raises:
        ValueError: ``every`` is not an int >= 1; (while training) a record tensor with more
            than one element, a record named like a published key (``loss``, ``lr``...), or
            ranks reporting different record keys.
        TypeError: ``sinks`` is not a list of sinks; (while training) a record that is not
            a number or tensor, or a plugin metric in ``state.extras`` that is a tensor.

    Example:
        >>> import torch
        >>> from toolkit import LossSum, TrainState, make_step, run
        >>> from toolkit.plugins import Sink, log_metrics
        >>> model = torch.nn.Linear(1, 1, bias=False)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
        >>> def loss_fn(m, batch):  # per-token losses 1.0 (3 tokens), then 3.0 (1 token)
        ...     total = m(batch).sum() * 0 + batch.sum()
        ...     return LossSum(total, batch.numel(), {"tokens": batch.numel()})
        >>> data = [torch.ones(3, 1), torch.full((1, 1), 3.0)]
        >>> logged = []
        >>> sink = Sink(write=lambda step, m: logged.append((step, m)), close=lambda: None)
        >>> _ = run(make_step(loss_fn), state, data, epochs=1,
        ...         plugins=[log_metrics(every=2, sinks=[sink])])
        >>> step, metrics = logged[0]
        >>> step, metrics["train/loss"], metrics["train/tokens"], metrics["train/lr"]
        (2, 1.5, 2.5, 0.0)
    """
    sink_list = _check(every, sinks)
    memory = _Memory()

    def publish(
        state: TrainState, extra: dict[str, float], collective: bool, open_window: Any = ()
    ) -> None:
        interval = memory.interval
        read(interval, memory.windows, open_window, flatten=_flat_records)  # one host read
        now = clock()
        elapsed, memory.started = now - memory.started, now
        # The 1.0 adds up to the number of ranks: times are per rank, their mean is shown.
        times = [memory.data_time, memory.step_time, 1.0]
        totals = [interval.samples or 0, interval.targets or 0.0, *times]
        sums = interval.sums
        if collective:
            sums, totals = sum_over_ranks("log_metrics", sums, totals)
        samples, targets, data_time, step_time, ranks = totals
        metrics = {
            f"train/{k}": total / weight for k, (total, weight) in sorted(sums.items()) if weight
        }
        if interval.lr is not None:
            metrics["train/lr"] = float(interval.lr)
        if interval.norms:
            metrics["train/grad_norm"] = interval.norm_total / interval.norms
        if interval.updates:
            metrics["time/data"] = data_time / ranks / interval.updates
            metrics["time/step"] = step_time / ranks / interval.updates
        if elapsed > 0:
            if interval.samples is not None:
                metrics["train/samples_per_s"] = samples / elapsed
            if interval.targets is not None:
                metrics["train/tokens_per_s"] = targets / elapsed
        if interval.nonfinite:
            metrics["train/nonfinite"] = float(interval.nonfinite)
        if interval.overflow:
            metrics["train/overflow"] = float(interval.overflow)
        metrics.update(extra)
        reset()
        write(state.step, metrics)

    def reset() -> None:
        memory.windows.clear()
        memory.interval = Interval()
        memory.data_time = memory.step_time = 0.0

    def write(step: int, metrics: dict[str, float]) -> None:
        if metrics and is_rank_zero():
            for sink in sink_list:
                sink.write(step, metrics)

    def scan(state: TrainState) -> dict[str, float]:
        extra: dict[str, float] = {}
        if state.extras is not memory.extras:  # extras are replaced, never mutated
            memory.extras = state.extras
            _new_extras(state.extras, memory.seen, extra)
        return extra

    def plugin(event: Event) -> None:
        kind, state = event.kind, event.state
        if kind == "step":
            memory.windows.append(event.outs)
            memory.data_time += event.data_time
            memory.step_time += event.step_time
            extra = scan(state)
            if due(event, every):
                publish(state, extra, collective=True)
            elif len(memory.windows) >= _FOLD:
                read(memory.interval, memory.windows, flatten=_flat_records)
                memory.windows.clear()
                if extra:
                    write(state.step, extra)
            elif extra:
                write(state.step, extra)
        elif kind == "start":
            reset()
            memory.started = clock()
            # Entries already there (from an earlier run of the state) were published by it.
            memory.extras = state.extras
            memory.seen = {}
            for name, entry in state.extras.items():
                parsed = metric_entry(entry)
                if parsed is not None:
                    memory.seen[name] = parsed[0]
        elif kind == "epoch_end":
            write(state.step, scan(state))
        elif kind == "end":
            try:
                extra = scan(state)
                if memory.windows or event.outs or memory.interval.sums:
                    # Micro-batches of a window the run left open count too.
                    publish(state, extra, collective=event.error is None, open_window=event.outs)
                else:
                    write(state.step, extra)
            finally:
                _close_all(sink_list)
        return None

    return plugin


def _close_all(sinks: Sequence[Sink]) -> None:
    first: BaseException | None = None
    for sink in sinks:
        try:
            sink.close()
        except Exception as exc:
            first = first or exc
    if first is not None:
        raise first
