"""The process's random number generators as a tree of tensors and JSON values.

Python's ``random``, NumPy's legacy global generator (``np.random.seed``/``rand``; when
NumPy is installed), torch's CPU generator and, when CUDA is available, every CUDA
device's generator. Explicit ``torch.Generator`` objects (e.g. a DataLoader's) are the
data position's business, not this module's.
"""

import random
from typing import Any

import torch

from toolkit._checks import warn

try:
    import numpy
except ImportError:  # an optional dependency
    numpy = None  # type: ignore[assignment]

_NUMPY = ("bit_generator", "key", "pos", "has_gauss", "gauss")  # np.random.get_state()'s


def capture_rng() -> dict[str, Any]:
    """Every global generator's state (see the module docstring)."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if numpy is not None:
        name, key, pos, has_gauss, gauss = numpy.random.get_state(legacy=True)
        # key.tolist(): python ints, five times faster than int() per item
        values = (str(name), key.tolist(), int(pos), int(has_gauss), float(gauss))  # type: ignore[union-attr]
        states["numpy"] = dict(zip(_NUMPY, values))
    if torch.cuda.is_available():
        states["cuda"] = list(torch.cuda.get_rng_state_all())
    return states


def restore_rng(states: dict[str, Any], *, trial: bool = False) -> None:
    """Set the generators from :func:`capture_rng`'s result (as a checkpoint returns it).

    ``trial``: set new generators instead, so that a state a generator refuses raises
    while the process's own are untouched (NumPy's position is checked here: NumPy takes
    any, and crashes on the next draw).
    """
    (random.Random().setstate if trial else random.setstate)(states["python"])
    (torch.Generator().set_state if trial else torch.set_rng_state)(states["torch"].cpu())
    saved = states.get("numpy")
    if numpy is not None and saved is not None:
        name, key, pos, has_gauss, gauss = (saved[field] for field in _NUMPY)
        key = numpy.asarray(key, dtype=numpy.uint32)
        if not (type(pos) is int and 0 <= pos <= len(key) == 624):
            raise ValueError(f"numpy: position {pos!r} of a key of {len(key)} words")
        generator = numpy.random.RandomState() if trial else numpy.random
        generator.set_state((name, key, pos, has_gauss, gauss))
    cuda = states.get("cuda")
    if cuda and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if count != len(cuda) and not trial:
            warn(
                f"load_checkpoint: the checkpoint holds the RNG states of {len(cuda)} CUDA "
                f"device(s), this process sees {count}; restoring the first "
                f"{min(count, len(cuda))} only.",
                UserWarning,
            )
        for index, state in enumerate(cuda[:count]):
            if trial:
                torch.Generator(f"cuda:{index}").set_state(state.cpu())
            else:
                torch.cuda.set_rng_state(state.cpu(), index)
