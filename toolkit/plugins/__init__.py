"""Plugins for :func:`toolkit.run`: plain functions ``plugin(event) -> TrainState | None``.

:class:`Retention` (``checkpoints(keep=)``'s rules) is :class:`toolkit.checkpoints.Retention`.
"""

from toolkit.checkpoints._retention import Retention
from toolkit.plugins._checkpoints import checkpoints
from toolkit.plugins._early_stop import early_stop
from toolkit.plugins._ema import ema, ema_model
from toolkit.plugins._images import log_images
from toolkit.plugins._memory import peak_memory
from toolkit.plugins._metrics import log_metrics
from toolkit.plugins._profiling import profile
from toolkit.plugins._progress import progress
from toolkit.plugins._sinks import Sink, jsonl, png_dir, tensorboard, wandb
from toolkit.plugins._validation import validate

__all__ = [
    "Retention", "Sink", "checkpoints", "early_stop", "ema", "ema_model", "jsonl", "log_images",
    "log_metrics", "peak_memory", "png_dir", "profile", "progress", "tensorboard", "validate",
    "wandb",
]  # fmt: skip
