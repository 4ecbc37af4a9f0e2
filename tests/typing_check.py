# mypy: warn-unused-ignores
"""Calls of each decorator in both forms, for mypy (tests/step/test_typing.py runs it on this file).

Not a test module: mypy reads it, pytest does not collect it. The ``type: ignore`` lines are
mistakes that fail at run time; with ``--warn-unused-ignores`` mypy fails if it stops
seeing them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, assert_type

import torch

from toolkit import (
    Step,
    accumulate,
    amp_wrap,
    clip,
    compose,
    guard_nonfinite,
    make_step,
    transform_grads,
)
from toolkit.step._decorating import Decorator


def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return model(batch).mean()


def centralise(grads: list[torch.Tensor]) -> None:
    for g in grads:
        g.sub_(g.mean())


step = make_step(loss_fn)
assert_type(step, Step)
assert_type(amp_wrap(step, dtype="bf16"), Step)
assert_type(amp_wrap(dtype=torch.float16, min_scale=1.0), Decorator)
assert_type(accumulate(step, micro_batches=4), Step)
assert_type(accumulate(micro_batches=4), Decorator)
assert_type(clip(step, max_norm=1.0), Step)
assert_type(clip(max_value=0.5), Decorator)
assert_type(guard_nonfinite(step), Step)
assert_type(guard_nonfinite(on_exhaust="skip"), Decorator)
assert_type(transform_grads(step, centralise), Step)
assert_type(transform_grads(centralise), Decorator)
chain = compose(clip(max_norm=1.0), accumulate(micro_batches=2), lambda s: s)
assert_type(chain, Callable[[Step], Step])
assert_type(chain(step), Step)

# Mistakes that fail at run time, seen by mypy.
decorator_as_step: Step = clip(max_norm=1.0)  # type: ignore[assignment]
clip(1.0)  # type: ignore[call-overload]
accumulate(step)  # type: ignore[call-overload]
guard_nonfinite(step, on_exhaust="ignore")  # type: ignore[call-overload]
amp_wrap(step)  # type: ignore[call-overload]
