"""log_metrics: count-weighted interval means of the step's outputs, published to sinks."""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from toolkit._checks import check_count
from toolkit.distributed._collectives import (
    data_parallel_group,
    is_distributed,
    is_rank_zero,
    sum_over_ranks,
)
from toolkit.loop._run import Event, plugin_factory
from toolkit.plugins._interval import KINDS, Interval, combine, flat_scalars, merge, read
from toolkit.plugins._shared import claim, due, metric_entry
from toolkit.plugins._sinks import Sink, check_listed_once, close_all
from toolkit.step._state import TrainState
from toolkit.step._step import StepOutput

__all__ = ["log_metrics"]

# Past this many updates in one interval, the pending outputs are read back and folded into
# python sums, so memory stays bounded whatever `every` is (one extra host read each).
_FOLD = 4096

# Keys that log_metrics itself publishes under "train/"; a record may not reuse them (nor
# those of the options in use: "mfu", "epoch_loss", "epoch").
_RESERVED = frozenset(
    {"loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "nonfinite", "overflow"}
)

# The state.extras key of the run totals: {"totals": {record: number}, "through": step}.
KEY = "log_metrics"


def _flat_records(
    records: Mapping[str, Any], chosen: frozenset[str] | None, reserved: frozenset[str]
) -> dict[str, Any]:
    """A micro-batch's scalar records flattened with "/"."""
    flat = flat_scalars(records, chosen)
    clash = reserved.intersection(flat)
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
        _flatten_entry(parsed[1], f"{name}/", flat)
        out.update(flat)


def _flatten_entry(tree: Mapping[str, Any], prefix: str, into: dict[str, Any]) -> None:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            _flatten_entry(value, f"{name}/", into)
        elif isinstance(value, torch.Tensor):
            raise TypeError(
                f"log_metrics: state.extras metric {name!r} is a tensor; a plugin stores "
                "python floats in extras[NAME]['metrics'] (read once when produced), so "
                "that publishing costs no host sync."
            )
        elif isinstance(value, (int, float)):
            into[name] = value
        else:
            raise TypeError(
                f"log_metrics: state.extras metric {name!r} is a {type(value).__name__}; "
                "expected a number or a nested mapping of numbers."
            )


_NEVER = object()


def _positive(who: str, name: str, value: Any, example: str) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value > 0):
        raise ValueError(f"{who}: {name} must be a number > 0, e.g. {example}; got {value!r}.")


@dataclasses.dataclass(frozen=True, slots=True)
class _Options:
    """log_metrics's checked options."""

    every: int
    sinks: list[Sink]
    kinds: dict[str, str]  # record (or "grad_norm") -> "sum" | "max" | "min"
    totals: tuple[str, ...]
    records: frozenset[str] | None
    per_epoch: bool
    flops: tuple[str, float] | None  # ("samples" | "targets", FLOPs per one), with peak
    peak_flops: float | None
    reserved: frozenset[str]  # names a record may not have


def _check(
    every: Any,
    sinks: Any,
    reduce: Any,
    totals: Any,
    records: Any,
    per_epoch: Any,
    flops_per_sample: Any,
    flops_per_token: Any,
    peak_flops: Any,
) -> _Options:
    check_count("log_metrics", "every", every, 1, "updates per published interval")
    if isinstance(sinks, Sink):
        sinks = [sinks]
    if not isinstance(sinks, Sequence) or isinstance(sinks, str):
        raise TypeError(
            f"log_metrics: sinks must be a list of sinks, e.g. [jsonl(path)]; got "
            f"{type(sinks).__name__}."
        )
    for sink in sinks:
        if not all(callable(getattr(sink, name, None)) for name in ("write", "close", "start")):
            raise TypeError(
                f"log_metrics: each sink needs write(step, metrics), close() and start(step); "
                f"got {type(sink).__name__}; build one with jsonl, tensorboard, wandb or "
                "Sink(write, close)."
            )
    check_listed_once("log_metrics", sinks)
    if not isinstance(reduce, Mapping):
        raise TypeError(
            f"log_metrics: reduce must map record names to a kind, e.g. {{'ntokens': 'sum'}}; "
            f"got {type(reduce).__name__}."
        )
    for name, kind in reduce.items():
        if not isinstance(name, str) or kind not in KINDS:
            raise ValueError(
                f"log_metrics: reduce[{name!r}] must be one of {list(KINDS)}; got {kind!r}."
            )
        if name in _RESERVED - {"grad_norm"}:
            raise ValueError(
                f"log_metrics: reduce[{name!r}]: only records and 'grad_norm' can be reduced "
                f"otherwise than by the mean; train/{name} is always what it is documented as."
            )
    names = _names("totals", totals)
    for name in names:
        if reduce.get(name) != "sum":
            raise ValueError(
                f"log_metrics: totals names {name!r}, which is not reduced by 'sum'; a run "
                f"total adds up interval sums: pass reduce={{{name!r}: 'sum'}} as well."
            )
    chosen = None if records is None else frozenset(_names("records", records))
    if not isinstance(per_epoch, bool):
        raise TypeError(f"log_metrics: per_epoch must be True or False; got {per_epoch!r}.")
    flops = None
    if flops_per_sample is not None and flops_per_token is not None:
        raise ValueError(
            "log_metrics: give flops_per_sample or flops_per_token, not both; got both."
        )
    for name, value, unit in (
        ("flops_per_sample", flops_per_sample, "samples"),
        ("flops_per_token", flops_per_token, "targets"),
    ):
        if value is not None:
            _positive("log_metrics", name, value, "6 * n_params * tokens_per_sample")
            flops = (unit, float(value))
    if (flops is None) != (peak_flops is None):
        raise ValueError(
            "log_metrics: train/mfu needs both the FLOPs of one sample (flops_per_sample) or "
            "target (flops_per_token) and the peak FLOP/s of one device (peak_flops); got "
            + ("only peak_flops." if flops is None else "no peak_flops.")
        )
    if peak_flops is not None:
        _positive("log_metrics", "peak_flops", peak_flops, "989e12 (an H100's bf16 peak)")
    kinds = {name: kind for name, kind in reduce.items() if kind != "mean"}
    reserved = _RESERVED | {"mfu"} if flops else _RESERVED
    reserved = reserved | {"epoch_loss", "epoch"} if per_epoch else reserved
    return _Options(
        every, list(sinks), kinds, tuple(names), chosen, per_epoch, flops, peak_flops, reserved
    )


def _names(what: str, value: Any) -> list[str]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise TypeError(
            f"log_metrics: {what} must be a list of record names, e.g. ['ntokens']; got {value!r}."
        )
    names = list(value)
    if not all(isinstance(name, str) for name in names):
        raise TypeError(f"log_metrics: {what} must be a list of record names; got {names!r}.")
    return names


def _groups(optimizer: Any) -> list[dict[str, Any]]:
    """The parameter groups of the state's optimizer (a MultiOptimizer's: all of them)."""
    return list(getattr(optimizer, "param_groups", None) or ())


def _group_names(groups: Sequence[Mapping[str, Any]]) -> list[str]:
    names = [
        str(g["name"]) if isinstance(g.get("name"), str) else str(i) for i, g in enumerate(groups)
    ]
    return names if len(set(names)) == len(names) else [str(i) for i in range(len(groups))]


def _lrs(groups: Sequence[Mapping[str, Any]]) -> list[Any]:
    # A tensor learning rate is changed in place by schedulers: keep a copy.
    return [
        g["lr"].detach().clone() if isinstance(g["lr"], torch.Tensor) else g["lr"] for g in groups
    ]


@dataclasses.dataclass(slots=True)
class _Memory:
    """log_metrics's memory: the open interval, and what the run started from."""

    # Each update's window outputs, read at the publish (or a fold). Not the events: their
    # states may hold large extras.
    windows: list[tuple[StepOutput, ...]] = dataclasses.field(default_factory=list)
    interval: Interval = dataclasses.field(default_factory=Interval)  # what was read so far
    data_time: float = 0.0
    step_time: float = 0.0
    started: float = 0.0  # clock() when the interval started
    seen: dict[str, Any] = dataclasses.field(default_factory=dict)  # entry -> step published
    extras: Any = None  # the state.extras last scanned for new entries
    # Work on the "step" path that most runs do not need: the first event after "start"
    # (see begin) and, with several parameter groups, their learning rates.
    slow: bool = False
    begun: bool = False
    group_names: list[str] = dataclasses.field(default_factory=list)
    next_lrs: list[Any] = dataclasses.field(default_factory=list)  # for the next update
    used_lrs: list[Any] = dataclasses.field(default_factory=list)  # by the last applied one
    epoch_loss: tuple[float, float] = (0.0, 0.0)  # (weighted sum, weight) this epoch
    group: Any = None  # the model's data-parallel group; None: the world


@plugin_factory(order=60)
def log_metrics(
    every: int = 100,
    *,
    sinks: Sequence[Sink] | Sink,
    reduce: Mapping[str, str] | None = None,
    totals: Sequence[str] = (),
    records: Sequence[str] | None = None,
    per_epoch: bool = False,
    flops_per_sample: float | None = None,
    flops_per_token: float | None = None,
    peak_flops: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Callable[[Event], TrainState | None]:
    """A plugin publishing count-weighted means of each interval of ``every`` updates.

    Every micro-batch's loss (``StepOutput.loss``) is weighted by its target count when the
    loss function reports one (:class:`toolkit.LossSum`), else by its number of samples,
    else by 1, so the mean over micro-batches of different sizes is the exact mean over
    targets (or samples); a micro-batch of weight 0 counts for nothing. Records (nested
    mappings of numbers or one-element tensors) are weighted alike, key by key (a key
    missing from some micro-batches is averaged over those that have it), and flattened
    with "/" under ``train/``. Records that are not scalars (a tensor of logits kept for
    another plugin, a string) are left out, unless named in ``records``. Micro-batches of
    a window that :func:`toolkit.guard_nonfinite` rejected are left out (and counted in
    ``train/nonfinite``).

    **Other kinds.** ``reduce`` names records (or ``"grad_norm"``) to publish otherwise
    than by their weighted mean: ``"sum"`` (over the interval's micro-batches and ranks,
    unweighted: a count of target elements), ``"max"`` or ``"min"`` (a NaN wins, as in
    torch). ``totals`` names summed records whose run total is published too, as
    ``train/total/<name>``: it is never reset, and it lives in ``state.extras["log_metrics"]``
    (``{"totals": {...}, "through": step}``), so a checkpoint carries it and a resume
    continues it. The totals in the state count the updates up to the last publish: put
    ``log_metrics`` *before* ``checkpoints`` in the plugin list and save at multiples of
    ``every`` (the final save then follows the final publish), and a resumed run's totals
    equal an uninterrupted run's. A checkpoint taken between publishes (a signal, another
    cadence) holds the totals up to the publish before it: the updates after it are in no
    total after a resume, and a warning says how many. The open interval (means of the
    updates after the last publish) is never part of a checkpoint: a resume starts a new
    interval.

    **Per epoch.** With ``per_epoch=True``, each ``"epoch_end"`` publishes
    ``train/epoch_loss``, the count-weighted mean loss over the micro-batches of the
    updates made in that epoch (all ranks), and ``train/epoch`` (epochs completed). An
    accumulation window that straddles the boundary counts for the epoch in which it
    closes (its update happens there); micro-batches of a window still open at the last
    ``"epoch_end"`` count for none. After a resume mid-epoch, the epoch's loss covers the
    updates of this run.

    **Throughput as MFU.** Given the FLOPs of one sample (``flops_per_sample``) or of one
    target of the loss's counts (``flops_per_token``; e.g. ``6 * n_params`` for a
    transformer's forward and backward per token) and one device's peak FLOP/s
    (``peak_flops``), ``train/mfu`` is ``flops_per_sample * samples / seconds /
    (peak_flops * devices)`` over the interval: samples of all data-parallel ranks over
    the interval's wall-clock time, ``devices`` the world size (1 without
    torch.distributed).

    Nothing is synchronised per micro-batch: each publish reads the interval's tensors back
    at once, as :func:`toolkit.key_average` does (one host sync), and an interval longer
    than 4096 updates is read every 4096 updates, so memory stays bounded. Under data
    parallelism the sums, weights, maxima and times are reduced over the ranks in one
    all-reduce per publish (none per update), so the published loss is the mean over all
    ranks' targets; every rank must then report the same record keys. Only rank 0 writes
    to the sinks (and starts them); every rank does the same work.

    A publish happens after the update that makes ``state.step`` a multiple of ``every``,
    and at ``"end"`` for a partial interval; the step given to the sinks is ``state.step``,
    so steps keep increasing after a resume. Published keys:

    * ``train/loss``; ``train/<record>`` for each record (its mean, or its ``reduce``);
    * ``train/lr``: the learning rate the interval's last applied update used (of the
      first parameter group); with several groups also ``train/lr/<group>`` for each,
      named by the group's ``"name"`` entry when every group has a distinct one, else by
      its index (``train/lr/0``, ``train/lr/1``...), read from the optimizer between
      updates;
    * ``train/grad_norm``: mean pre-clip norm over the interval's updates (when computed,
      i.e. under :func:`toolkit.clip` or :func:`toolkit.guard_nonfinite`);
    * ``time/data``, ``time/step``: seconds per update waiting for data and in the step;
    * ``train/samples_per_s`` and, when counts are reported, ``train/tokens_per_s``: over
      the interval's wall-clock time (everything included, validation too), all ranks;
      ``train/mfu`` when asked for;
    * ``train/total/<name>`` for each of ``totals``;
    * ``train/nonfinite``, ``train/overflow``: rejected and fp16-overflowed windows in the
      interval, when not zero;
    * ``NAME/<metric>`` for each ``state.extras[NAME] = {"step": s, "metrics": {...}}``
      entry of another plugin, as soon as its ``"step"`` changes (entries from before this
      run's first update, e.g. restored by a resume, are not republished). Put such
      plugins (``validate``, ``peak_memory``) before ``log_metrics`` so they appear at
      their step.

    At the run's first event after ``"start"`` (so that a ``checkpoints`` plugin placed
    after it has restored the state), rank 0 calls each sink's ``start(step)`` with the
    step the run resumes from. At ``"end"`` the sinks are closed (they reopen
    if written again, e.g. by a second run). When training raised, the partial interval is
    still published, from this rank's data only (no collective: the other ranks may be
    gone).

    Args:
        every: updates per interval (>= 1).
        sinks: the sinks to write to (a list, or a single :class:`Sink`).
        reduce: record name (flattened, e.g. ``"acc/top1"``) or ``"grad_norm"`` to its kind:
            ``"mean"`` (the default), ``"sum"``, ``"max"`` or ``"min"``.
        totals: records, reduced by ``"sum"``, whose run totals are published.
        records: publish only these records (flattened names); a named record that is not
            a scalar raises. ``None``: every scalar record.
        per_epoch: publish ``train/epoch_loss`` at each ``"epoch_end"``.
        flops_per_sample: FLOPs of one sample's forward and backward, for ``train/mfu``.
        flops_per_token: FLOPs per target of the loss's counts instead, for ``train/mfu``.
        peak_flops: peak FLOP/s of one device, for ``train/mfu``.
        clock: a function returning seconds, for the throughput; tests pass a fake one.

    Returns:
        The plugin, a function ``plugin(event) -> TrainState | None`` (a new state when it
        updated the run totals).

    Raises:
        ValueError: ``every`` is not an int >= 1; a sink listed twice; a ``reduce`` kind
            that is not one of the four, or a built-in key in it; a total not reduced by ``"sum"``;
            ``flops_per_*`` without ``peak_flops`` (or the reverse), both ``flops_per_*``,
            or one that is not a number > 0; (while training) a record named like a
            published key (``loss``, ``lr``...), a record in ``records`` that is a tensor
            of several elements, or ranks reporting different record keys.
        TypeError: ``sinks`` is not a list of sinks, ``reduce`` not a mapping, ``totals``
            or ``records`` not a list of names; (while training) a record in ``records``
            that is not a number, or a plugin metric in ``state.extras`` that is a tensor.

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

        Sums and run totals, over intervals of one update; the run totals continue in a
        second run of the returned state (as they would after a resume):

        >>> logged.clear()
        >>> plugin = log_metrics(every=1, sinks=[sink], reduce={"tokens": "sum"},
        ...                      totals=["tokens"])
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
        >>> state = run(make_step(loss_fn), state, data, epochs=1, plugins=[plugin])
        >>> state = run(make_step(loss_fn), state, data[:1], epochs=2, plugins=[plugin])
        >>> [(s, m["train/tokens"], m["train/total/tokens"]) for s, m in logged]
        [(1, 3, 3), (2, 1, 4), (3, 3, 7)]
        >>> state.extras["log_metrics"]
        {'totals': {'tokens': 7}, 'through': 3}
    """
    options = _check(
        every,
        sinks,
        {} if reduce is None else reduce,
        totals,
        records,
        per_epoch,
        flops_per_sample,
        flops_per_token,
        peak_flops,
    )
    sink_list, kinds, chosen = options.sinks, options.kinds, options.records
    memory = _Memory()

    reserved = options.reserved

    def flatten(record: Mapping[str, Any]) -> dict[str, Any]:
        return _flat_records(record, chosen, reserved)

    def take(
        windows: Sequence[tuple[StepOutput, ...]],
        open_window: Any = (),
        also: Sequence[torch.Tensor] = (),
    ) -> list[Any]:
        """Read ``windows`` into the interval (and the epoch's loss): one host read."""
        if not options.per_epoch:
            return read(memory.interval, windows, open_window, flatten, kinds, also)
        part = Interval()
        got = read(part, windows, open_window, flatten, kinds, also)
        merge(memory.interval, part, kinds)
        total, weight = part.sums.get("loss", (0.0, 0.0))
        memory.epoch_loss = (memory.epoch_loss[0] + total, memory.epoch_loss[1] + weight)
        return got

    def publish(
        state: TrainState, extra: dict[str, float], collective: bool, open_window: Any = ()
    ) -> TrainState | None:
        interval = memory.interval
        lrs = memory.used_lrs
        tensor_lrs = [lr for lr in lrs if isinstance(lr, torch.Tensor)]
        host_lrs = iter(take(memory.windows, open_window, tensor_lrs))  # one host read
        if tensor_lrs:
            lrs = [next(host_lrs) if isinstance(lr, torch.Tensor) else lr for lr in lrs]
        now = clock()
        elapsed, memory.started = now - memory.started, now
        # The 1.0 adds up to the number of ranks: times are per rank, their mean is shown.
        times = [memory.data_time, memory.step_time, 1.0]
        counts = [interval.samples or 0, interval.targets or 0.0, *times]
        means, reduced, counts = _over_ranks(interval, kinds, counts, collective, memory.group)
        samples, targets, data_time, step_time, ranks = counts
        metrics = {f"train/{k}": total / weight for k, (total, weight) in means if weight}
        for key, value in reduced.items():
            metrics[f"train/{key}"] = value
        if interval.lr is not None:
            metrics["train/lr"] = float(interval.lr)
        if len(lrs) > 1:
            for name, lr in zip(memory.group_names, lrs):
                _put(metrics, f"train/lr/{name}", float(lr))
        if interval.norms and "grad_norm" not in reduced:
            metrics["train/grad_norm"] = interval.norm_total / interval.norms
        if interval.updates:
            metrics["time/data"] = data_time / ranks / interval.updates
            metrics["time/step"] = step_time / ranks / interval.updates
        if elapsed > 0:
            if interval.samples is not None:
                metrics["train/samples_per_s"] = samples / elapsed
            if interval.targets is not None:
                metrics["train/tokens_per_s"] = targets / elapsed
            if options.flops is not None and options.peak_flops is not None:
                unit, flops = options.flops
                done = samples if unit == "samples" else targets
                devices = dist.get_world_size() if is_distributed() else 1
                metrics["train/mfu"] = flops * done / elapsed / (options.peak_flops * devices)
        if interval.nonfinite:
            metrics["train/nonfinite"] = float(interval.nonfinite)
        if interval.overflow:
            metrics["train/overflow"] = float(interval.overflow)
        new_state = None
        if options.totals:
            new_state, run_totals = _add_totals(state, options.totals, reduced)
            for name, value in run_totals.items():
                _put(metrics, f"train/total/{name}", value)
        metrics.update(extra)
        reset()
        write(state.step, metrics)
        return new_state

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

    def begin(event: Event) -> None:
        """What needs the state the run really starts from: done at the first event after
        "start", once a plugin placed later (checkpoints) has had the chance to restore it."""
        state = event.state
        memory.begun = True
        resumed = state.step - (
            event.kind == "step" and event.out is not None and event.out.updated
        )
        # Entries from before this run's first update were published by an earlier run.
        memory.seen = {}
        for name, entry in state.extras.items():
            parsed = metric_entry(entry)
            if parsed is not None and not (isinstance(parsed[0], int) and parsed[0] > resumed):
                memory.seen[name] = parsed[0]
        memory.extras = None  # scan everything at this event
        if is_rank_zero():
            for sink in sink_list:
                sink.start(resumed)
            _check_totals(state, options.totals, resumed)
        memory.slow = len(memory.next_lrs) > 1

    def lrs_at_step(event: Event) -> None:
        if event.out is not None and event.out.updated:
            memory.used_lrs = memory.next_lrs
        memory.next_lrs = _lrs(_groups(event.state.optimizer))

    def plugin(event: Event) -> TrainState | None:
        kind, state = event.kind, event.state
        if kind == "step":
            if memory.slow:
                if not memory.begun:
                    begin(event)
                if len(memory.next_lrs) > 1:
                    lrs_at_step(event)
            memory.windows.append(event.outs)
            memory.data_time += event.data_time
            memory.step_time += event.step_time
            extra = scan(state)
            if due(event, options.every):
                return publish(state, extra, collective=True)
            if len(memory.windows) >= _FOLD:
                take(memory.windows)
                memory.windows.clear()
            if extra:
                write(state.step, extra)
        elif kind == "start":
            reset()
            memory.started = clock()
            memory.begun, memory.slow = False, True
            memory.epoch_loss = (0.0, 0.0)
            groups = _groups(state.optimizer)
            memory.group_names = _group_names(groups)
            memory.next_lrs = _lrs(groups) if len(groups) > 1 else []
            memory.used_lrs = []
            memory.group = data_parallel_group(state.model)
            if options.totals:
                claim(event, KEY, "log_metrics")
        elif kind == "epoch_end":
            if not memory.begun:
                begin(event)
            extra = scan(state)
            if options.per_epoch:
                extra = {**epoch_metrics(state), **extra}
            write(state.step, extra)
        elif kind == "end":
            try:
                if not memory.begun:
                    begin(event)
                extra = scan(state)
                if memory.windows or event.outs or memory.interval.sums:
                    # Micro-batches of a window the run left open count too.
                    return publish(
                        state, extra, collective=event.error is None, open_window=event.outs
                    )
                write(state.step, extra)
            finally:
                close_all(sink_list)
        return None

    def epoch_metrics(state: TrainState) -> dict[str, float]:
        if memory.windows:
            take(memory.windows)  # the interval continues; what it read is kept
            memory.windows.clear()
        sums, _ = sum_over_ranks("log_metrics", {"loss": memory.epoch_loss}, group=memory.group)
        total, weight = sums["loss"]
        memory.epoch_loss = (0.0, 0.0)
        metrics = {"train/epoch": float(state.epoch)}
        if weight:
            metrics["train/epoch_loss"] = total / weight
        return metrics

    return plugin


def _put(metrics: dict[str, float], key: str, value: float) -> None:
    if key in metrics:
        raise ValueError(
            f"log_metrics: a record published as {key!r} clashes with log_metrics' own "
            f"{key!r}; rename the record in loss_fn's records."
        )
    metrics[key] = value


def _over_ranks(
    interval: Interval,
    kinds: Mapping[str, str],
    counts: list[float],
    collective: bool,
    group: Any,
) -> tuple[list[tuple[str, tuple[float, float]]], dict[str, Any], list[float]]:
    """The interval's means, other kinds and ``counts`` summed over ranks: one collective.

    Sums travel as ``(value, 0)`` pairs beside the means; a maximum or minimum travels as
    one slot per rank (the others add 0), and each rank takes the extreme of the slots. A
    marker pair per key makes a key missing on some rank fail the layout check.
    """
    reduced = interval.reduced
    if not (collective and is_distributed()):
        return sorted(interval.sums.items()), dict(reduced), counts
    sums = dict(interval.sums)
    extremes = sorted(key for key in reduced if kinds[key] != "sum")
    for key, value in reduced.items():
        kind = kinds[key]
        sums[f"{key}\0{kind}"] = (float(value), 0.0) if kind == "sum" else (0.0, 0.0)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    slots = [0.0] * (world * len(extremes))
    for i, key in enumerate(extremes):
        slots[i * world + rank] = float(reduced[key])
    sums, values = sum_over_ranks("log_metrics", sums, [*counts, *slots], group)
    out: dict[str, Any] = {}
    means = []
    for key, pair in sorted(sums.items()):
        name, _, kind = key.partition("\0")
        if kind == "sum":
            out[name] = pair[0]
        elif not kind:
            means.append((key, pair))
    counts, slots = values[: len(counts)], values[len(counts) :]
    for i, key in enumerate(extremes):
        extreme = slots[i * world]
        for value in slots[i * world + 1 : (i + 1) * world]:
            extreme = combine(kinds[key], extreme, value)
        out[key] = extreme
    return means, out, counts


def _add_totals(
    state: TrainState, names: Sequence[str], reduced: Mapping[str, Any]
) -> tuple[TrainState, dict[str, Any]]:
    """The state with the interval's sums added to its run totals, and those totals."""
    entry = state.extras.get(KEY)
    before = entry.get("totals", {}) if isinstance(entry, Mapping) else {}
    run_totals = {name: before.get(name, 0) + reduced.get(name, 0) for name in names}
    extras = {**state.extras, KEY: {"totals": run_totals, "through": state.step}}
    return state.replace(extras=extras), run_totals


def _check_totals(state: TrainState, names: Sequence[str], resumed: int) -> None:
    entry = state.extras.get(KEY)
    if not names or not isinstance(entry, Mapping):
        return
    through = entry.get("through")
    if isinstance(through, int) and through < resumed:
        warnings.warn(
            f"log_metrics: the run totals in the state count the updates up to step "
            f"{through}, and the run resumes from step {resumed}: the {resumed - through} "
            "updates between are in no total. Put log_metrics before checkpoints in the "
            "plugin list and save at multiples of its every.",
            RuntimeWarning,
            stacklevel=4,
        )
