"""The parts of a checkpoint, in one table: each says how to take its state and put it back.

Like torchtitan's ``CheckpointManager``, which holds a dict of stateful objects, a save and
a load walk :data:`COMPONENTS`; adding a part is one entry. A component ``name`` is stored
as ``name.json``, plus ``name.safetensors`` when its tree holds tensors (see :mod:`._codec`).
The model is the one exception: a plain state dict in ``model.safetensors`` (or DCP's files
in ``sharded/``), which :mod:`._save` writes and :mod:`._load` reads and checks.

The table is in the order a load restores: the extra objects first (only they can check
their state), the model, the scheduler before the optimizer (loading a scheduler sets the
optimizer's learning rates, pytorch#119168: the saved rates win), the GradScaler, the RNG
states last. Every TrainState field that no entry holds (step, window, guard, epoch,
batches_seen, stop, data_state, and any field added later) goes into ``state``,
NamedTuples as dicts of their fields.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from toolkit._checks import check
from toolkit._rng import capture_rng, restore_rng
from toolkit.checkpoints._fit import extras_fit, is_namedtuple, optimizer_fit, settings_fit
from toolkit.checkpoints._model_state import load_shards, optimizer_state, put_model, put_optimizer
from toolkit.step._state import TrainState


@dataclasses.dataclass(frozen=True)
class Restoring:
    """What a component's ``put`` may need besides its tree: the load's context."""

    manifest: Any  # the checkpoint's (._manifest.Manifest)
    objects: Mapping[str, Any]  # the extra objects given to the load
    shards: dict[str, torch.Tensor]  # what DCP fills in place, before the model is put
    group: Any  # the data-parallel group that loads together, or None


@dataclasses.dataclass(frozen=True)
class Component:
    """One entry of :data:`COMPONENTS`.

    Attributes:
        name: the file stem (``optimizer`` -> ``optimizer.json``).
        take: ``take(state, objects)``: the tree to save, ``None`` when there is none; the
            model's is ``None`` (it has its own file).
        put: ``put(state, tree, restoring)``: restore the loaded tree in place; ``None``
            when the tree becomes fields of the loaded TrainState.
        field: the TrainState field it holds (so that ``state`` leaves it out), or ``""``.
        kind: ``kind(state, objects)``: the class name recorded in the manifest and
            compared at load (a dict of them for the objects), ``None`` for none.
        template: ``template(like, sharded)``: what the saved tree is decoded against
            (devices) and fitted to.
        fit: ``fit(where, saved, template, like, alike)``: how the saved tree does not fit
            the template, one line per difference (``alike``: the recorded classes agree).
        model_only: kept when retention reduces a checkpoint to its model.
        shard: for an FSDP2 model, the tensors of the tree kept in ``sharded/``.

    Example:
        >>> from toolkit.checkpoints._components import COMPONENTS
        >>> [c.name for c in COMPONENTS]
        ['objects', 'model', 'scheduler', 'optimizer', 'scaler', 'state', 'extras', 'rng']
    """

    name: str
    take: Callable[[TrainState, Mapping[str, Any]], Any]
    put: Callable[[TrainState, Any, Restoring], None] | None = None
    field: str = ""
    kind: Callable[[TrainState, Mapping[str, Any]], Any] | None = None
    template: Callable[[TrainState, bool], Any] = lambda like, sharded: None
    fit: Callable[[str, Any, Any, TrainState, bool], list[str]] | None = None
    model_only: bool = False
    shard: Callable[[torch.Tensor], bool] = lambda tensor: isinstance(tensor, DTensor)


def _optimizer(state: TrainState, keep: bool) -> Any:
    """The optimizer's state keyed by parameter name; ``keep``: the zero state made for an
    optimizer without state stays (DCP loads a sharded checkpoint into it)."""
    return None if state.optimizer is None else optimizer_state(state.model, state.optimizer, keep)


def _put_objects(state: TrainState, tree: Any, restoring: Restoring) -> None:
    for name, obj in restoring.objects.items():
        obj.load_state_dict(tree[name])


def _put_model(state: TrainState, model: Any, restoring: Restoring) -> None:
    if restoring.shards:
        load_shards(restoring.shards, restoring.manifest.path, restoring.group)  # all, in place
    manifest = restoring.manifest  # a trainable-only one lacks the frozen parameters: not strict
    put_model(state.model, model, not manifest.sharded, manifest.frozen is None)
    model.clear()  # drop the file mapping


def _stateful(field: str, **entry: Any) -> Component:
    """The entry of a TrainState field that holds an object with ``state_dict`` and
    ``load_state_dict`` (none saved for ``None`` or a disabled GradScaler)."""

    def kind(state: TrainState, objects: Mapping[str, Any]) -> str | None:
        value = getattr(state, field)
        enabled = value is not None and getattr(value, "is_enabled", lambda: True)()
        return type(value).__name__ if enabled else None  # a disabled GradScaler: none

    return Component(**{  # type: ignore[arg-type]
        "name": field, "field": field, "kind": kind,
        "take": lambda s, objects: kind(s, objects) and getattr(s, field).state_dict(),
        "put": lambda s, tree, restoring: getattr(s, field).load_state_dict(tree),
        "template": lambda like, sharded: getattr(like, field), **entry,
    })  # fmt: skip


COMPONENTS = (
    Component(
        "objects", lambda s, objects: {n: o.state_dict() for n, o in objects.items()} or None,
        _put_objects, kind=lambda s, objects: {n: type(o).__name__ for n, o in objects.items()},
    ),
    Component("model", lambda s, objects: None, _put_model, "model", model_only=True),
    _stateful("scheduler", fit=settings_fit),
    _stateful(
        "optimizer", take=lambda s, objects: _optimizer(s, False), fit=optimizer_fit,
        put=lambda s, tree, r: put_optimizer(s.model, s.optimizer, tree, not r.manifest.sharded),
        template=_optimizer,  # sharded: DCP fills the template's own state (zero state if none)
        shard=lambda tensor: True,  # all of it: DCP loads it back as one
    ),
    _stateful("scaler", fit=settings_fit),  # the load builds one when the template has none
    Component("state", lambda s, objects: fields_of(s), model_only=True),
    Component(  # the EMA is model_only
        "extras", lambda s, objects: dict(s.extras), field="extras", fit=extras_fit,
        template=lambda like, sharded: dict(like.extras), model_only=True,
    ),
    Component("rng", lambda s, objects: capture_rng(), lambda s, tree, _: restore_rng(tree)),
)  # fmt: skip


def fields_of(state: TrainState, plain: bool = True) -> dict[str, Any]:
    """TrainState's fields that no component holds (``plain``: NamedTuples as dicts)."""
    held = {component.field for component in COMPONENTS}
    names = [f.name for f in dataclasses.fields(state) if f.name not in held]
    values = {name: getattr(state, name) for name in names}
    return {n: dict(v._asdict()) if plain and is_namedtuple(v) else v for n, v in values.items()}


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
