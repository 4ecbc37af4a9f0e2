"""peak_memory: the peak memory of each interval of updates, as a metric entry."""

from __future__ import annotations

import resource
import sys

import torch

from toolkit._checks import check_count, check_key
from toolkit.loop._run import Event, Plugin, plugin_factory
from toolkit.plugins._shared import MetricsEntry, claim, due
from toolkit.step._state import TrainState

__all__ = ["peak_memory"]

_GIB = float(2**30)


def _cuda_device(model: torch.nn.Module) -> torch.device | None:
    param = next(model.parameters(), None)
    if param is not None and param.device.type == "cuda":
        return param.device
    return None


def _peak_rss_gib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / _GIB if sys.platform == "darwin" else peak / float(2**20)


@plugin_factory(order=20)
def peak_memory(every: int = 10, *, key: str = "memory") -> Plugin:
    """A plugin recording peak memory every ``every`` applied updates, as a metric entry.

    When the model's parameters are on a CUDA device, the value is
    ``torch.cuda.max_memory_allocated(device)`` (memory held by tensors, not the caching
    allocator's reserve) since the previous record; the peak counter is reset at
    ``"start"`` and after each record with ``torch.cuda.reset_peak_memory_stats``. Neither
    call synchronises the device. Otherwise the value is the process's peak resident set size
    (``resource.getrusage(RUSAGE_SELF).ru_maxrss``): a high-water mark of the whole process
    since it started, which the operating system cannot reset, so on the CPU successive
    records never decrease and include whatever ran before training.

    Each record is ``state.extras[key] = {"step": state.step, "metrics": {"peak_gib":
    float}}`` (GiB = 2**30 bytes), which ``log_metrics`` publishes as ``"memory/peak_gib"``.
    The value is this process's; other ranks' are not gathered. The plugin claims ``key``
    for the run at ``"start"``, so another plugin keeping that key is refused before
    training.

    Args:
        every: record after every this many applied updates (``state.step % every == 0``).
        key: the ``state.extras`` key.

    Returns:
        The plugin, ``plugin(event) -> TrainState | None``.

    Raises:
        ValueError: ``every < 1`` or an empty ``key``; at ``"start"``, ``key`` kept by
            another plugin of the run.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, make_step, run
        >>> from toolkit.plugins import peak_memory
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> step = make_step(lambda m, b: m(b).square().mean())
        >>> data = [torch.ones(4, 2)] * 4
        >>> state = run(step, state, data, max_steps=4, plugins=[peak_memory(every=2)])
        >>> state.extras["memory"]["step"], state.extras["memory"]["metrics"]["peak_gib"] > 0
        (4, True)
    """
    check_count("peak_memory", "every", every, 1, "applied updates between records")
    check_key("peak_memory", key)

    def plugin(event: Event) -> TrainState | None:
        state = event.state
        if event.kind == "start":
            claim(event, key, "peak_memory")
            device = _cuda_device(state.model)
            if device is not None:
                torch.cuda.reset_peak_memory_stats(device)
            return None
        if not due(event, every):
            return None
        device = _cuda_device(state.model)
        if device is not None:
            peak = torch.cuda.max_memory_allocated(device) / _GIB
            torch.cuda.reset_peak_memory_stats(device)
        else:
            peak = _peak_rss_gib()
        entry = MetricsEntry(step=state.step, metrics={"peak_gib": peak})
        return state.replace(extras={**state.extras, key: entry})

    return plugin
