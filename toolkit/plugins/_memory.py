"""peak_memory: the peak memory of each interval of updates, published in state.metrics."""

import resource
import sys

import torch

from toolkit._checks import check_count, check_key
from toolkit.loop._run import Event, Plugin, declare, plugin_factory
from toolkit.plugins._shared import due
from toolkit.step._state import Metrics, TrainState


def _cuda_device(model: torch.nn.Module) -> torch.device | None:
    param = next(model.parameters(), None)
    return param.device if param is not None and param.device.type == "cuda" else None


def _peak_gib(model: torch.nn.Module) -> dict[str, float]:
    """The peak since the last call on the model's CUDA device (then reset), else the RSS."""
    device = _cuda_device(model)
    if device is not None:
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return {"peak_gib": peak / 2**30}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"rss_peak_gib": rss / 2**30 if sys.platform == "darwin" else rss / 2**20}  # B, KiB


@plugin_factory(order=20)
def peak_memory(every: int = 10, *, key: str = "memory") -> Plugin:
    """A plugin publishing peak memory every ``every`` applied updates, in ``state.metrics``.

    When the model's parameters are on a CUDA device, the value is
    ``torch.cuda.max_memory_allocated(device)`` (memory held by tensors, not the caching
    allocator's reserve) since the previous record; the peak counter is reset at
    ``"start"`` and after each record with ``torch.cuda.reset_peak_memory_stats``. Neither
    call synchronises the device. Otherwise the value is the process's peak resident set size
    (``resource.getrusage(RUSAGE_SELF).ru_maxrss``): a high-water mark of the whole process
    since it started, which the operating system cannot reset, so on the CPU successive
    records never decrease and include whatever ran before training.

    Each record is ``state.metrics[key] = {"step": state.step, "values": {name: float}}``
    (GiB = 2**30 bytes), which ``log_metrics`` publishes as ``"memory/<name>"``; the name
    says what was measured: ``"peak_gib"`` (the CUDA peak allocated) or ``"rss_peak_gib"``
    (the process's peak RSS, on the CPU).
    The value is this process's; other ranks' are not gathered. Another plugin of the run
    under the same ``key`` is refused before training.

    Args:
        every: record after every this many applied updates (``state.step % every == 0``).
        key: the name of the record in ``state.metrics``.

    Returns:
        The plugin, ``plugin(event) -> TrainState | None``.

    Raises:
        ValueError: ``every < 1`` or an empty ``key``; before training, ``key`` kept by
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
        >>> state.metrics["memory"]["step"], state.metrics["memory"]["values"]["rss_peak_gib"] > 0
        (4, True)
    """
    check_count("peak_memory", "every", every, 1, "applied updates between records")
    check_key("peak_memory", key)

    def plugin(event: Event) -> TrainState | None:
        state = event.state
        if event.kind == "start":
            _peak_gib(state.model)  # resets the CUDA peak counter
        if not due(event, every):
            return None
        entry = Metrics(step=state.step, values=_peak_gib(state.model))
        return state.replace(metrics={**state.metrics, key: entry})

    return declare(plugin, key)
