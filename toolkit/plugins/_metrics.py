"""log_metrics: count-weighted interval means of the step's outputs, published to sinks."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from toolkit._checks import check, check_bool, check_count, check_names, check_positive, warn
from toolkit.distributed._collectives import groups_of, is_distributed, is_rank_zero, sum_over_ranks
from toolkit.loop._run import Event, declare, plugin_factory
from toolkit.plugins._interval import KINDS, Interval, combine, flat_scalars, read
from toolkit.plugins._shared import due
from toolkit.plugins._sinks import Sink, check_sinks, close_all
from toolkit.step._state import TrainState
from toolkit.step._step import StepOutput

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


@dataclasses.dataclass(frozen=True)
class _Options:
    """log_metrics's checked arguments."""

    every: int
    sinks: list[Sink]
    kinds: dict[str, str]  # record (or "grad_norm") -> "sum" | "max" | "min"
    totals: list[str]
    records: frozenset[str] | None
    per_epoch: bool
    flops: tuple[str, float, float] | None  # ("sample" | "token", FLOPs per one, peak)
    reserved: frozenset[str]  # names a record may not have
    clock: Callable[[], float]


@dataclasses.dataclass(slots=True)
class _Memory:
    """The open interval, and what the run's other plugins published."""

    # Each update's window outputs, read at the publish (or a fold); not the events, whose
    # states may hold large extras.
    windows: list[tuple[StepOutput, ...]] = dataclasses.field(default_factory=list)
    interval: Interval = dataclasses.field(default_factory=Interval)  # read so far
    times: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0])  # data, step
    started: float = 0.0  # clock() when the interval started
    seen: dict[str, int] = dataclasses.field(default_factory=dict)  # entry -> step published
    metrics: Any = None  # the state.metrics last scanned for new entries
    # With several parameter groups: their LRs for the next update, and the last applied one's.
    lrs: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
    epoch_loss: tuple[float, float] = (0.0, 0.0)  # (weighted sum, weight) this epoch
    read_once: bool = False  # records left out were reported (at the run's first read)
    nonfinite: bool = False  # a non-finite loss was reported in this run


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
    another plugin, a string) are left out, named in a ``RuntimeWarning`` at the run's first
    publish; ``records=[...]`` logs only those named, without the warning (``records=[]``:
    none). Micro-batches of a window that :func:`toolkit.guard_nonfinite` rejected are left
    out (and counted in ``train/nonfinite``).

    **Other kinds.** ``reduce`` names records (or ``"grad_norm"``) to publish otherwise
    than by their weighted mean: ``"sum"`` (over the interval's micro-batches and ranks,
    unweighted: a count of target elements), ``"max"`` or ``"min"`` (a NaN wins, as in
    torch). ``totals`` names summed records whose run total is published too, as
    ``train/total/<name>``: it is never reset, and it lives in ``state.extras["log_metrics"]``
    (``{"totals": {...}, "through": step}``), so a checkpoint carries it and a resume
    continues it. The totals in the state count the updates up to the last publish: save at
    multiples of ``every`` (``checkpoints`` runs after ``log_metrics``, so the final save
    follows the final publish), and a resumed run's totals
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
    * ``NAME/<metric>`` for each ``state.metrics[NAME] = {"step": s, "values": {...}}``
      that another plugin published, as soon as its ``"step"`` changes (entries from
      before this run's first update, e.g. restored by a resume, are not republished).
      ``validate`` and ``peak_memory`` run before ``log_metrics``, so their metrics appear
      at their step.

    At ``"start"`` (after the ``"restore"`` event, at which a ``checkpoints`` plugin has
    restored the state), rank 0 calls each sink's ``start(step)`` with the step the run
    resumes from. At ``"end"`` the sinks are closed (they reopen
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
            that is not a number, or a plugin metric in ``state.metrics`` that is a tensor.

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
    who, reduce = "log_metrics", {} if reduce is None else reduce
    check_count(who, "every", every, 1, "updates per published interval")
    example = "a mapping of record names to a kind, e.g. {'ntokens': 'sum'}"
    check(isinstance(reduce, Mapping), who, "reduce", example, reduce, error=TypeError)
    for name, kind in reduce.items():
        check(kind in KINDS, who, f"reduce[{name!r}]", f"one of {list(KINDS)}", kind)
        builtin = name in _RESERVED - {"grad_norm"}
        check(not builtin, who, f"reduce[{name!r}]", "a record or 'grad_norm'", name)
    totals = check_names(who, "totals", totals)
    for name in totals:
        summed, fix = reduce.get(name) == "sum", f"Pass reduce={{{name!r}: 'sum'}} as well."
        check(summed, who, f"totals[{name!r}]", "a record reduced by 'sum'", name, fix)
    chosen = None if records is None else frozenset(check_names(who, "records", records))
    check_bool(who, "per_epoch", per_epoch)
    flops = _flops(flops_per_sample, flops_per_token, peak_flops)
    kinds = {name: kind for name, kind in reduce.items() if kind != "mean"}
    reserved = _RESERVED | ({"mfu"} if flops else set())
    reserved |= {"epoch_loss", "epoch"} if per_epoch else set()
    sinks = check_sinks(who, sinks)
    options = _Options(every, sinks, kinds, totals, chosen, per_epoch, flops, reserved, clock)
    memory = _Memory()  # a fresh one per run, made at "start"

    def plugin(event: Event) -> TrainState | None:
        nonlocal memory
        kind, state = event.kind, event.state
        if kind == "step":  # first: the one event of every update
            return _on_step(options, memory, event)
        if kind == "start":
            memory = _start(options, event)
        if kind not in ("epoch_end", "end"):
            return None
        try:
            extra = _scan(memory, state)
            if kind == "epoch_end" and options.per_epoch:
                extra = {**_epoch_metrics(options, memory, state), **extra}
            elif kind == "end" and (memory.windows or event.outs or memory.interval.sums):
                # Micro-batches of a window the run left open count too. After an error: no
                # collective (the other ranks may be gone), and only updates applied since
                # the last publish, since a resume trains the open window again at a step
                # (the checkpoint's) whose line the resumed log keeps.
                ok = event.error is None
                if ok or memory.windows or memory.interval.updates:
                    return _publish(options, memory, state, extra, ok, event.outs if ok else ())
            _write(options, state.step, extra)
        finally:
            if kind == "end":
                close_all(options.sinks)
        return None

    return declare(plugin, KEY if totals else None)


def _flops(per_sample: Any, per_token: Any, peak: Any) -> tuple[str, float, float] | None:
    """``("sample" | "token", FLOPs per one, peak FLOP/s)`` for train/mfu, or None."""
    who, both = "log_metrics", per_sample is not None and per_token is not None
    check(not both, who, "flops_per_sample or flops_per_token", "given alone", "both")
    unit, per = ("sample", per_sample) if per_token is None else ("token", per_token)
    got = "only peak_flops" if per is None else "no peak_flops"
    expected = "given flops_per_sample or flops_per_token and peak_flops"
    check((per is None) == (peak is None), who, "train/mfu", expected, got)
    if per is None:
        return None
    per = check_positive(who, f"flops_per_{unit}", per, "6 * n_params * tokens_per_sample")
    return unit, per, check_positive(who, "peak_flops", peak, "989e12 (an H100's bf16 peak)")


def _start(options: _Options, event: Event) -> _Memory:
    """A new run, from the (restored) state: its step is the one the sinks start at."""
    state = event.state
    # Entries from before this run's first update were published by an earlier run.
    seen = {name: m["step"] for name, m in state.metrics.items() if m["step"] <= state.step}
    if is_rank_zero():
        for sink in options.sinks:
            sink.start(state.step)
        entry = state.extras.get(KEY)
        through = entry.get("through") if isinstance(entry, Mapping) else None
        if options.totals and isinstance(through, int) and through < state.step:
            n, fix = state.step - through, "Save checkpoints at multiples of log_metrics's every."
            said = f"the run totals in the state count the updates up to step {through}, and the"
            said += f" run resumes from step {state.step}: no total counts the {n} update"
            warn(f"log_metrics: {said}{'s' * (n != 1)} between. {fix}")
    return _Memory(started=options.clock(), seen=seen, lrs=(_lrs(state.optimizer), {}))


def _on_step(options: _Options, memory: _Memory, event: Event) -> TrainState | None:
    state = event.state
    if memory.lrs[0]:  # several parameter groups: the LRs the next update will use
        used = memory.lrs[0] if event.out is not None and event.out.updated else memory.lrs[1]
        memory.lrs = (_lrs(state.optimizer), used)
    memory.windows.append(event.outs)
    memory.times = [memory.times[0] + event.data_time, memory.times[1] + event.step_time]
    extra = _scan(memory, state)
    if due(event, options.every):
        return _publish(options, memory, state, extra, True)
    if len(memory.windows) >= _FOLD:
        _take(options, memory)
    _write(options, state.step, extra)
    return None


def _take(
    options: _Options, memory: _Memory, open_window: Any = (), also: Sequence[Any] = ()
) -> list[Any]:
    """Read the pending windows into the interval (and the epoch's loss): one host read."""
    interval = memory.interval
    before = interval.sums.get("loss", (0.0, 0.0))

    def flatten(record: Mapping[str, Any]) -> dict[str, Any]:
        flat = flat_scalars(record, options.records, left_out=left_out)
        clash = sorted(options.reserved.intersection(flat))
        fix = "Rename them in loss_fn's records."
        check(not clash, "log_metrics", "records", "named unlike published keys", clash, fix)
        return flat

    # Records that are not scalars are named at the run's first read (with records=None).
    left_out: set[str] | None = set() if not memory.read_once and options.records is None else None
    got = read(interval, memory.windows, open_window, flatten, options.kinds, also)
    memory.windows.clear()
    if left_out:  # said at the first publish, not found missing from the logs at the end
        why = f"records {sorted(left_out)} are not numbers or one-element tensors: not logged"
        fix = "reduce them in loss_fn (.mean()), or choose the records to log: records=[...]"
        warn(f"log_metrics: {why}; {fix}.")
    memory.read_once = True
    if options.per_epoch:
        after = interval.sums.get("loss", (0.0, 0.0))
        total, weight = memory.epoch_loss
        memory.epoch_loss = (total + after[0] - before[0], weight + after[1] - before[1])
    return got


def _publish(
    options: _Options, memory: _Memory, state: TrainState, extra: dict[str, float],
    collective: bool, open_window: Any = (),
) -> TrainState | None:  # fmt: skip
    interval, lrs = memory.interval, memory.lrs[1]
    group_lrs = _take(options, memory, open_window, list(lrs.values()))
    elapsed, memory.started = (now := options.clock()) - memory.started, now
    # The 1.0 adds up to the number of ranks: times are per rank, their mean is shown.
    counts = [interval.samples or 0, interval.targets or 0.0, *memory.times, 1.0]
    means, reduced, counts = _over_ranks(interval, options.kinds, counts, collective, state.model)
    samples, targets, data_time, step_time, ranks = counts
    metrics = {f"train/{k}": total / weight for k, (total, weight) in means if weight}
    metrics.update({f"train/{key}": value for key, value in reduced.items()})
    if interval.lr is not None:
        metrics["train/lr"] = float(interval.lr)
    for name, lr in zip(lrs, group_lrs):
        _put(metrics, f"train/lr/{name}", float(lr))
    if interval.norms and "grad_norm" not in reduced:
        metrics["train/grad_norm"] = interval.norm_total / interval.norms
    if interval.updates:
        metrics["time/data"] = data_time / ranks / interval.updates
        metrics["time/step"] = step_time / ranks / interval.updates
    if elapsed > 0 and interval.samples is not None:
        metrics["train/samples_per_s"] = samples / elapsed
    if elapsed > 0 and interval.targets is not None:
        metrics["train/tokens_per_s"] = targets / elapsed
    if elapsed > 0 and options.flops is not None:
        unit, per, peak = options.flops
        devices = dist.get_world_size() if is_distributed() else 1
        done = samples if unit == "sample" else targets
        metrics["train/mfu"] = per * done / elapsed / peak / devices
    counted = {key: getattr(interval, key) for key in ("nonfinite", "overflow")}
    metrics.update({f"train/{key}": float(n) for key, n in counted.items() if n})
    new_state = None
    if options.totals:
        entry = state.extras.get(KEY)
        before = entry.get("totals", {}) if isinstance(entry, Mapping) else {}
        run_totals = {name: before.get(name, 0) + reduced.get(name, 0) for name in options.totals}
        extras = {**state.extras, KEY: {"totals": run_totals, "through": state.step}}
        new_state = state.replace(extras=extras)
        for name, value in run_totals.items():
            _put(metrics, f"train/total/{name}", value)
    metrics.update(extra)
    memory.interval, memory.times = Interval(), [0.0, 0.0]
    _write(options, state.step, metrics)
    loss = metrics.get("train/loss")  # said once written, so a warning turned error loses none
    memory.nonfinite = memory.nonfinite or warn_nonfinite("log_metrics", loss, state.step)
    return new_state


def warn_nonfinite(who: str, loss: float | None, step: int) -> bool:
    """Warn (and return True) when the mean loss ``who`` shows at update ``step`` is not
    finite: without :func:`toolkit.guard_nonfinite` it went into the weights."""
    if loss is None or math.isfinite(loss):
        return False
    fix = "training goes on. Wrap the step in guard_nonfinite(...) to leave such windows out."
    warn(f"{who}: the mean loss of the updates up to update {step} is {loss}; {fix}")
    return True


def _write(options: _Options, step: int, metrics: dict[str, float]) -> None:
    if metrics and is_rank_zero():
        for sink in options.sinks:
            sink.write(step, metrics)


def _epoch_metrics(options: _Options, memory: _Memory, state: TrainState) -> dict[str, float]:
    if memory.windows:
        _take(options, memory)  # the interval continues; what it read is kept
    group = groups_of(state.model).tokens
    sums, _ = sum_over_ranks("log_metrics", {"loss": memory.epoch_loss}, group=group)
    (total, weight), memory.epoch_loss = sums["loss"], (0.0, 0.0)
    loss = {"train/epoch_loss": total / weight} if weight else {}
    return {"train/epoch": float(state.epoch), **loss}


def _scan(memory: _Memory, state: TrainState) -> dict[str, float]:
    """The values of the ``state.metrics`` entries whose "step" changed."""
    if state.metrics is memory.metrics:  # metrics are replaced, never mutated
        return {}
    memory.metrics, out = state.metrics, {}
    for name, entry in state.metrics.items():
        if memory.seen.get(name) != entry["step"]:
            memory.seen[name] = entry["step"]
            out.update({f"{name}/{key}": v for key, v in flat_scalars(entry["values"]).items()})
    tensors = ", ".join(key for key, value in out.items() if isinstance(value, torch.Tensor))
    fix = "Publish python floats in state.metrics[NAME]['values'] (no host sync)."
    check(not tensors, "log_metrics", f"metric {tensors}", "a float", "a tensor", fix, TypeError)
    return out


def _lrs(optimizer: Any) -> dict[str, Any]:
    """With several parameter groups (a MultiOptimizer's: all of them), each one's LR by name."""
    groups = list(getattr(optimizer, "param_groups", None) or ())
    names = [str(g.get("name", i)) for i, g in enumerate(groups)]
    names = names if len(set(names)) == len(names) else [str(i) for i in range(len(groups))]
    # A tensor learning rate is changed in place by schedulers: keep a copy.
    lrs = [lr.detach().clone() if isinstance(lr := g["lr"], torch.Tensor) else lr for g in groups]
    return dict(zip(names, lrs)) if len(groups) > 1 else {}


def _put(metrics: dict[str, float], key: str, value: float) -> None:
    fix = "Rename the record in loss_fn's records."
    check(key not in metrics, "log_metrics", "a record", f"named unlike its own {key!r}", key, fix)
    metrics[key] = value


def _over_ranks(
    interval: Interval, kinds: Mapping[str, str], counts: list[float], collective: bool,
    model: torch.nn.Module,
) -> tuple[list[tuple[str, tuple[float, float]]], dict[str, Any], list[float]]:  # fmt: skip
    """The interval's means, other kinds and ``counts`` summed over the ranks that hold
    different targets (a tensor-parallel replica counted once): one collective."""
    reduced, group = interval.reduced, groups_of(model).tokens if collective else None
    if group is None:
        return sorted(interval.sums.items()), dict(reduced), counts
    world, mine = dist.get_world_size(group), (-1, dist.get_rank(group))
    # The other kinds travel as (value, 0) pairs beside the means: a sum in one slot that
    # every rank adds to, a max or min in one slot per rank (another rank's slot adds 0).
    slots = {key: [-1] if kinds[key] == "sum" else range(world) for key in reduced}
    sums = dict(interval.sums)
    for key, keys in slots.items():
        sums.update({f"{key}\0{s}": (float(reduced[key]) if s in mine else 0.0, 0.0) for s in keys})
    sums, counts = sum_over_ranks("log_metrics", sums, counts, group)
    ranks = {key: [sums[f"{key}\0{s}"][0] for s in keys] for key, keys in slots.items()}
    out = {k: functools.reduce(functools.partial(combine, kinds[k]), v) for k, v in ranks.items()}
    return sorted((k, pair) for k, pair in sums.items() if "\0" not in k), out, counts
