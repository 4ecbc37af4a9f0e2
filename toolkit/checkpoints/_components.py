"""What a TrainState's checkpoint consists of: its fields by kind, and the extra objects.

The handles (model, optimizer, scheduler, scaler) have components of their own; so does
``extras``. Every other field (``dataclasses.fields(TrainState)``: step, window, guard,
epoch, batches_seen, stop, data_state, and any field added later) goes into the ``state``
component generically, NamedTuples as dicts of their fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from toolkit._checks import check
from toolkit.step._state import TrainState

__all__ = ["HANDLES", "OWN_FILE", "check_objects", "fields_of", "is_namedtuple"]

HANDLES = ("model", "optimizer", "scheduler", "scaler")
OWN_FILE = ("extras",)  # TrainState fields with a component of their own


def is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def fields_of(state: TrainState) -> dict[str, Any]:
    """TrainState's non-handle fields except those with their own file; NamedTuples as dicts."""
    names = [f.name for f in dataclasses.fields(state) if f.name not in HANDLES + OWN_FILE]
    values = {name: getattr(state, name) for name in names}
    return {name: dict(v._asdict()) if is_namedtuple(v) else v for name, v in values.items()}


def check_objects(objects: Any, who: str) -> dict[str, Any]:
    """``objects`` (name -> object with ``state_dict`` and ``load_state_dict``) as a dict."""
    objects = {} if objects is None else objects
    expected = "a mapping of name to an object with state_dict() and load_state_dict()"
    check(isinstance(objects, Mapping), who, "objects", expected, type(objects), error=TypeError)
    for name, obj in objects.items():
        ok = isinstance(name, str) and bool(name)
        check(ok, who, "each key of objects", "a non-empty string", name, error=TypeError)
        if not all(callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict")):
            raise TypeError(
                f"{who}: objects[{name!r}] ({type(obj).__name__}) has no state_dict() and "
                "load_state_dict() methods; pass objects that have both (a stateful "
                "DataLoader, a metric, ...)."
            )
    return dict(objects)
