"""log_metrics: count-weighted interval means of the step's outputs, published to sinks."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from toolkit._checks import check_count
from toolkit._distributed import is_distributed, is_rank_zero
from toolkit._host import to_host
from toolkit._loop import Event
from toolkit._state import TrainState
from toolkit._step import StepOutput
from toolkit.plugins._entries import metric_entry
from toolkit.plugins._sinks import Sink
from toolkit.plugins._weighting import columns, weigh

__all__ = ["log_metrics"]

# Past this many updates in one interval, the pending 0-d tensors are synced and folded into
# python sums, so memory stays bounded whatever `every` is (one extra sync per _FOLD).
_FOLD = 4096

# Keys that log_metrics itself publishes under "train/"; a record may not reuse them.
_RESERVED = frozenset(
    {"loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "nonfinite", "overflow"}
)


def _scalar(value: Any, where: str) -> torch.Tensor | float:
    """A record value as a 0-d tensor or a python float, or a clear error."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{where} is a tensor of shape {tuple(value.shape)}; records must be numbers "
                "or 0-d tensors. Reduce it first, e.g. x.mean() or x.sum()."
            )
        return value.detach().reshape(()) if value.ndim else value.detach()
    if isinstance(value, (int, float)):
        return float(value)
    raise TypeError(
        f"{where} is a {type(value).__name__}; records must be numbers or 0-d tensors "
        "(nested mappings of them are flattened with '/')."
    )


def _flatten(tree: Mapping[str, Any], prefix: str, where: str, into: dict[str, Any]) -> None:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            _flatten(value, f"{name}/", where, into)
        else:
            into[name] = _scalar(value, f"{where} {name!r}")


def _flat_records(records: Mapping[str, Any]) -> dict[str, Any] | None:
    """A micro-batch's records flattened with "/", or None when it has none."""
    if not records:
        return None
    flat: dict[str, Any] = {}
    _flatten(records, "", "log_metrics: record", flat)
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
        if parsed is None:
            continue
        step, metrics = parsed
        if seen.get(name, _NEVER) == step:
            continue
        seen[name] = step
        flat: dict[str, Any] = {}
        _flatten(metrics, f"{name}/", "state.extras metric", flat)
        for key, value in flat.items():
            if isinstance(value, torch.Tensor):
                raise TypeError(
                    f"log_metrics: state.extras metric {key!r} is a tensor; a plugin stores "
                    "python floats in extras[NAME]['metrics'] (synced once when produced), so "
                    "that publishing costs no host synchronisation."
                )
            out[key] = value


_NEVER = object()


def _check(every: Any, sinks: Any) -> list[Sink]:
    check_count(
        "log_metrics",
        "every",
        every,
        1,
        "updates per published interval",
        "Example: log_metrics(every=100, sinks=[jsonl('runs/a/m.jsonl')]).",
    )
    if isinstance(sinks, Sink):
        sinks = [sinks]
    if not isinstance(sinks, Sequence) or isinstance(sinks, str):
        raise TypeError(
            f"log_metrics: sinks must be a list of sinks; got {type(sinks).__name__}. Example: "
            "log_metrics(every=100, sinks=[jsonl('runs/a/metrics.jsonl')])."
        )
    for sink in sinks:
        if not (callable(getattr(sink, "write", None)) and callable(getattr(sink, "close", None))):
            raise TypeError(
                f"log_metrics: each sink needs write(step, metrics) and close() functions; got "
                f"{type(sink).__name__}. Build one with jsonl(path), tensorboard(log_dir), "
                "wandb(...) or Sink(write, close)."
            )
    return list(sinks)


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
    targets (or samples). Records (nested mappings of numbers or 0-d tensors) are weighted
    alike, key by key (a key missing from some micro-batches is averaged over those that
    have it), and flattened with "/" under ``train/``. Micro-batches of a window that
    :func:`toolkit.guard_nonfinite` rejected are left out (and counted in ``train/nonfinite``).

    Nothing is synchronised per micro-batch: the 0-d tensors are kept and, at each publish,
    stacked and copied to the host with one ``.tolist()`` (one host sync; on the CPU, where
    nothing waits, each value is read directly, which is cheaper). Under data
    parallelism the sums and weights are all-reduced over the ranks in one collective, so
    the published loss is the mean over all ranks' targets; every rank must then report the
    same record keys. Only rank 0 writes to the sinks; every rank does the same work.

    Intervals longer than 4096 updates are folded into python sums every 4096 updates (one
    more sync each), so memory stays bounded.

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
      run starts, e.g. restored from a checkpoint, are not republished). Put such plugins
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

    # The open interval's updates as (closing output, data time, step time, window outputs),
    # taken apart only when it is published or folded: per update the plugin only appends
    # and compares, since code run between two steps finds cold caches and costs several
    # times what it costs in a tight loop. Not the events: their states may hold large
    # extras.
    pending: list[tuple[StepOutput, float, float, tuple[StepOutput, ...]]] = []
    # The interval's micro-batch outputs taken from those (skipped ones have loss None and
    # are dropped when folded; rejected windows never enter).
    entries: list[StepOutput] = []
    folded: dict[str, list[float]] = {}  # key -> [weighted sum, weight] from folds
    totals = {"samples": 0.0, "tokens": 0.0, "data": 0.0, "step": 0.0}
    has = {"samples": False, "tokens": False}
    norms: list[torch.Tensor] = []
    counters = {"updates": 0, "nonfinite": 0, "overflow": 0}
    lr: list[Any] = [None]
    started = [0.0]
    seen: dict[str, Any] = {}
    last_extras: list[Any] = [None]

    def reset() -> None:
        pending.clear()
        entries.clear()
        folded.clear()
        norms.clear()
        for key in totals:
            totals[key] = 0.0
        has["samples"] = has["tokens"] = False
        for key in counters:
            counters[key] = 0
        lr[0] = None

    def take() -> None:
        """Move the pending updates' outputs, times and counts into the interval."""
        for out, data_time, step_time, outs in pending:
            totals["data"] += data_time
            totals["step"] += step_time
            if out.nonfinite:
                counters["nonfinite"] += 1  # its losses are not training's: left out
            else:
                entries.extend(outs)
            if out.overflow:
                counters["overflow"] += 1
            if out.updated:
                counters["updates"] += 1
                lr[0] = out.lr
                if out.grad_norm is not None:
                    norms.append(out.grad_norm)
        pending.clear()

    def fold(also: Sequence[torch.Tensor] = ()) -> list[float]:
        """Sync the entries (and ``also``) into python sums: one host read (``to_host``).

        Returns the values of ``also``. Losses are weighted by ``_weighting`` (as in
        progress); records are weighted alike, key by key.
        """
        window = entries[:]
        entries.clear()
        cols = columns(window)
        records = [o.records for o in cols.outs]
        flats = [_flat_records(r) for r in records] if any(records) else []
        record_tensors = [v for f in flats if f for v in f.values() if isinstance(v, torch.Tensor)]
        synced = to_host([*cols.tensors, *record_tensors, *also])
        sums = weigh(cols, synced)
        if sums.targets is not None:
            totals["tokens"] += sums.targets
            has["tokens"] = True
        if sums.samples is not None:
            totals["samples"] += sums.samples
            has["samples"] = True
        if cols.outs:
            acc = folded.setdefault("loss", [0.0, 0.0])
            acc[0] += sums.loss
            acc[1] += sums.weight
        n = len(cols.tensors) + len(record_tensors)
        if flats:
            rest = iter(synced[len(cols.tensors) : n])
            for flat, weight in zip(flats, sums.weights):
                for key, value in (flat or {}).items():
                    v = next(rest) if isinstance(value, torch.Tensor) else value
                    acc = folded.setdefault(key, [0.0, 0.0])
                    acc[0] += v * weight
                    acc[1] += weight
        return synced[n:]

    def publish(state: TrainState, extra: dict[str, float], collective: bool) -> None:
        take()
        lr_value = lr[0]
        lr_tensor = [lr_value.reshape(())] if isinstance(lr_value, torch.Tensor) else []
        also = fold([*norms, *lr_tensor])  # the one host sync of the publish
        now = clock()
        elapsed = now - started[0]
        started[0] = now
        keys = sorted(folded)
        if collective:
            _all_reduce(keys, folded, totals)
        metrics: dict[str, float] = {}
        for key in keys:
            total, weight = folded[key]
            if weight:
                metrics[f"train/{key}"] = total / weight
        if lr_value is not None:
            metrics["train/lr"] = also[-1] if lr_tensor else float(lr_value)
        if norms:
            metrics["train/grad_norm"] = sum(also[: len(norms)]) / len(norms)
        updates = counters["updates"]
        if updates:
            metrics["time/data"] = totals["data"] / updates
            metrics["time/step"] = totals["step"] / updates
        if elapsed > 0:
            if has["samples"]:
                metrics["train/samples_per_s"] = totals["samples"] / elapsed
            if has["tokens"]:
                metrics["train/tokens_per_s"] = totals["tokens"] / elapsed
        for key in ("nonfinite", "overflow"):
            if counters[key]:
                metrics[f"train/{key}"] = float(counters[key])
        metrics.update(extra)
        reset()
        write(state.step, metrics)

    def write(step: int, metrics: dict[str, float]) -> None:
        if metrics and is_rank_zero():
            for sink in sink_list:
                sink.write(step, metrics)

    def scan(state: TrainState) -> dict[str, float]:
        extra: dict[str, float] = {}
        if state.extras is not last_extras[0]:  # extras are replaced, never mutated
            last_extras[0] = state.extras
            _new_extras(state.extras, seen, extra)
        return extra

    def plugin(event: Event) -> None:
        kind, state = event.kind, event.state
        if kind == "step":
            out = event.out
            assert out is not None
            pending.append((out, event.data_time, event.step_time, event.outs))
            extra = scan(state)
            if state.step % every == 0 and out.updated:
                publish(state, extra, collective=True)
            else:
                if len(pending) >= _FOLD:
                    take()
                    fold()
                if extra:
                    write(state.step, extra)
        elif kind == "start":
            reset()
            started[0] = clock()
            # Entries already there (restored from a checkpoint) were published by their run.
            seen.clear()
            last_extras[0] = state.extras
            for name, entry in state.extras.items():
                parsed = metric_entry(entry)
                if parsed is not None:
                    seen[name] = parsed[0]
        elif kind == "epoch_end":
            write(state.step, scan(state))
        elif kind == "end":
            try:
                take()
                entries.extend(event.outs)  # micro-batches of a window the run left open
                extra = scan(state)
                if entries or counters["updates"] or folded:
                    publish(state, extra, collective=event.error is None)
                else:
                    write(state.step, extra)
            finally:
                _close_all(sink_list)
        return None

    return plugin


def _all_reduce(keys: list[str], folded: dict[str, list[float]], totals: dict[str, float]) -> None:
    """Sum the interval's python sums over data-parallel ranks (one collective)."""
    if not is_distributed():
        return
    world = dist.get_world_size()
    layout = float(zlib.crc32("\0".join(keys).encode()))
    flat = [v for key in keys for v in folded[key]]
    flat += [totals["samples"], totals["tokens"], totals["data"], totals["step"], layout]
    device = _collective_device()
    reduced = torch.tensor(flat, dtype=torch.float64, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    values = reduced.tolist()
    if values[-1] != layout * world:
        raise ValueError(
            "log_metrics: the data-parallel ranks reported different record keys in this "
            f"interval (this rank: {keys}); the sums are all-reduced as one vector, so every "
            "rank must return the same record keys from loss_fn."
        )
    for i, key in enumerate(keys):
        folded[key] = values[2 * i : 2 * i + 2]
    base = 2 * len(keys)
    totals["samples"], totals["tokens"] = values[base], values[base + 1]
    # Times are per rank; the mean over ranks is what one rank typically spends.
    totals["data"], totals["step"] = values[base + 2] / world, values[base + 3] / world


def _collective_device() -> torch.device:
    if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _close_all(sinks: Sequence[Sink]) -> None:
    first: BaseException | None = None
    for sink in sinks:
        try:
            sink.close()
        except Exception as exc:
            first = first or exc
    if first is not None:
        raise first
