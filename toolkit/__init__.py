"""toolkit: a functional, composable toolkit for PyTorch training steps."""

from toolkit._device import to_device
from toolkit._tree import key_average, map_nested_tensor
from toolkit._unwrap import unwrap
from toolkit.checkpoints._export import export_model, export_pretrained
from toolkit.checkpoints._load import load_checkpoint
from toolkit.checkpoints._save import save_checkpoint
from toolkit.distributed._collectives import data_parallel_group, set_data_parallel_group
from toolkit.loop._evaluate import evaluate
from toolkit.loop._run import Event, LoopInfo, run
from toolkit.step._decorating import (
    accumulate,
    amp_wrap,
    clip,
    compose,
    guard_nonfinite,
    transform_grads,
)
from toolkit.step._losses import causal_lm_loss
from toolkit.step._multi import MultiOptimizer, MultiScheduler, PerEpoch, per_epoch
from toolkit.step._phases import LossScaleError, NonFiniteError
from toolkit.step._state import GuardState, Metrics, TrainState, WindowState
from toolkit.step._step import LossSum, Step, StepOutput, make_step

__version__ = "0.1.0"

# fmt: off
__all__ = [
    "Event", "GuardState", "LoopInfo", "LossScaleError", "LossSum", "Metrics", "MultiOptimizer",
    "MultiScheduler", "NonFiniteError", "PerEpoch", "Step", "StepOutput", "TrainState",
    "WindowState", "accumulate", "amp_wrap", "causal_lm_loss", "clip", "compose",
    "data_parallel_group", "evaluate", "export_model", "export_pretrained", "guard_nonfinite",
    "key_average", "load_checkpoint", "make_step", "map_nested_tensor", "per_epoch", "run",
    "save_checkpoint", "set_data_parallel_group", "to_device", "transform_grads", "unwrap",
]
# fmt: on
