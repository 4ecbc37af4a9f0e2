"""log_images: images made from the state, every N updates, to image sinks."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from toolkit._checks import check, check_count
from toolkit.distributed._collectives import is_rank_zero
from toolkit.loop._run import Event, plugin_factory
from toolkit.plugins._shared import due
from toolkit.plugins._sinks import Sink, check_sinks, close_all
from toolkit.step._state import TrainState


@plugin_factory(order=60)
def log_images(
    fn: Callable[[TrainState], Mapping[str, Any]], every: int = 1000, *,
    sinks: Sequence[Sink] | Sink,
) -> Callable[[Event], TrainState | None]:  # fmt: skip
    """A plugin recording the images ``fn(state)`` returns, every ``every`` updates.

    On rank 0 only, after each applied update that makes ``state.step`` a multiple of
    ``every`` and at the end of a run that made updates since the last images, ``fn(state)``
    returns ``{name: image}`` and each sink's ``images(state.step, images)`` records them.
    An image is a tensor, uint8 pixels or float intensities in [0, 1], shaped ``(H, W)``,
    CHW when its first dimension is 1, 3 or 4, else HWC; or a matplotlib figure (see
    :class:`Sink`). ``fn`` runs on rank 0 alone: it must not call collectives (no forward
    of an FSDP2 model); it is not called at the end of a run that raised.

    The sinks are started at ``"start"`` with the step of the (restored) state, so a
    resumed run's images follow its step, as its metrics do, and closed at ``"end"``. One
    sink may serve both this plugin and :func:`toolkit.plugins.log_metrics` (e.g. one W&B
    run): it is started once and released at the second close.

    Args:
        fn: ``fn(state) -> {name: image}``; a name with ``/`` groups images
            (``"val/samples"``).
        every: updates between images (>= 1).
        sinks: sinks that record images: :func:`png_dir`, :func:`tensorboard`,
            :func:`wandb`, or a :class:`Sink` with ``images=``.

    Returns:
        The plugin.

    Raises:
        TypeError: ``fn`` is not callable, a sink records no images, or ``fn`` returns no
            mapping of names; (while training) an image that is neither a tensor nor a
            figure, or a tensor neither uint8 nor floating-point.
        ValueError: ``every`` is not an int >= 1; a sink listed twice; (while training) an
            image of an unsupported shape, a float image with NaN or inf, a bad image name.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, make_step, run
        >>> from toolkit.plugins import Sink, log_images
        >>> seen = []
        >>> sink = Sink(write=lambda s, m: None, close=lambda: None,
        ...             images=lambda step, images: seen.append((step, sorted(images))))
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> weights = lambda state: {"weights": state.model.weight.detach().abs().clamp(0, 1)}
        >>> _ = run(make_step(lambda m, b: m(b).mean()), state, [torch.ones(1, 2)] * 5,
        ...         max_steps=5, plugins=[log_images(weights, every=2, sinks=[sink])])
        >>> seen
        [(2, ['weights']), (4, ['weights']), (5, ['weights'])]
    """
    example = "a function state -> {name: image}"
    check(callable(fn), "log_images", "fn", example, fn, "", TypeError)
    check_count("log_images", "every", every, 1, "updates between images")
    sink_list = check_sinks("log_images", sinks, images=True)
    last = [0]  # the step of the last images

    def record(state: TrainState) -> None:
        images = fn(state)
        named = isinstance(images, Mapping) and all(isinstance(k, str) for k in images)
        check(named, "log_images", "fn", example, images, "", TypeError)
        last[0] = state.step
        for sink in sink_list if images else ():
            sink.images(state.step, dict(images))

    def plugin(event: Event) -> None:
        if not is_rank_zero():
            return
        if event.kind == "start":
            last[0] = event.state.step
            for sink in sink_list:
                sink.start(event.state.step)
        elif event.kind == "step" and due(event, every):
            record(event.state)
        elif event.kind == "end":
            try:
                if event.error is None and event.state.step != last[0]:
                    record(event.state)
            finally:
                close_all(sink_list)

    return plugin
