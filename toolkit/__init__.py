"""toolkit: a functional, composable toolkit for PyTorch training steps."""

from toolkit._accumulation import accumulate
from toolkit._amp import amp_wrap
from toolkit._clipping import clip
from toolkit._decorating import compose
from toolkit._device import to_device
from toolkit._distributed import data_parallel_group, set_data_parallel_group
from toolkit._evaluate import evaluate
from toolkit._export import export_model
from toolkit._guards import guard_nonfinite
from toolkit._load import load_checkpoint
from toolkit._loop import Event, LoopInfo, run
from toolkit._multi import MultiOptimizer, MultiScheduler, PerEpoch, per_epoch
from toolkit._phases import LossScaleError, NonFiniteError
from toolkit._save import save_checkpoint
from toolkit._state import GuardState, TrainState, WindowState
from toolkit._step import LossSum, Step, StepOutput, make_step
from toolkit._transforms import transform_grads
from toolkit._tree import key_average, map_nested_tensor
from toolkit._unwrap import unwrap

__version__ = "0.1.0"

__all__ = [
    "Event",
    "GuardState",
    "LoopInfo",
    "LossScaleError",
    "LossSum",
    "MultiOptimizer",
    "MultiScheduler",
    "NonFiniteError",
    "PerEpoch",
    "Step",
    "StepOutput",
    "TrainState",
    "WindowState",
    "accumulate",
    "amp_wrap",
    "clip",
    "compose",
    "data_parallel_group",
    "evaluate",
    "export_model",
    "guard_nonfinite",
    "key_average",
    "load_checkpoint",
    "make_step",
    "map_nested_tensor",
    "per_epoch",
    "run",
    "save_checkpoint",
    "set_data_parallel_group",
    "to_device",
    "transform_grads",
    "unwrap",
]
