"""load_checkpoint: verify a checkpoint folder, compare it with a template, restore in order.

Only JSON and safetensors are read, and only the files the manifest lists, after their
sizes and checksums were checked. All differences from the template are gathered before
anything is touched; then the objects are restored model, scheduler, optimizer, scaler,
extra objects, RNG states. A data-parallel template is loaded by every rank of its group
together: the ranks agree on the outcome of the checks before any rank restores.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optree
import torch
from safetensors.torch import load_file

from toolkit._checks import check
from toolkit.checkpoints._codec import TreeError, decode
from toolkit.checkpoints._files import read_json
from toolkit.checkpoints._manifest import (
    DamagedCheckpointError,
    Manifest,
    file_problems,
    read_manifest,
)
from toolkit.checkpoints._model_state import (
    expand,
    few,
    model_differences,
    model_state,
    parameter_names,
    put_model,
    put_optimizer,
)
from toolkit.checkpoints._rng import restore_rng
from toolkit.checkpoints._save import rank_component
from toolkit.checkpoints._sharded import load_shards, saved_shapes
from toolkit.distributed._collectives import Group, agree, group_of, rank_of
from toolkit.step._components import check_objects, fields_of, is_namedtuple
from toolkit.step._state import TrainState

__all__ = ["full_model", "full_tree", "load_checkpoint", "read_tree", "verified_manifest"]


def verified_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest of ``path`` after checking every file it lists (sizes and checksums)."""
    manifest = read_manifest(path)
    problems = file_problems(manifest, checksums=True)
    if problems:
        raise DamagedCheckpointError(manifest.path, problems)
    return manifest


def _tensors(path: Path, owned: bool) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file: memory-mapped, or (``owned``) in memory of their own."""
    try:
        # pread: kept tensors (optimizer state) must not stay mapped onto a file that may change.
        return load_file(path, backend="pread") if owned else load_file(path)
    except Exception as error:  # checksum-valid but not safetensors: written by something else
        problem = f"{path}: not a safetensors file ({error})"
        raise DamagedCheckpointError(path.parent, [problem]) from None


def read_tree(
    manifest: Manifest,
    name: str,
    *,
    like: Any = None,
    sharded: Callable[[str, Any], torch.Tensor] | None = None,
) -> Any:
    """Component ``name`` of a verified checkpoint, decoded (see :func:`._codec.decode`)."""
    json_path, stored = manifest.path / f"{name}.json", manifest.path / f"{name}.safetensors"
    tensors = _tensors(stored, owned=True) if stored.name in manifest.files else {}
    try:  # UnicodeDecodeError and json's errors are ValueErrors
        return decode(read_json(json_path), tensors, name, like=like, sharded=sharded)
    except (TreeError, KeyError, TypeError, AttributeError, ValueError) as error:
        problem = f"{json_path}: not JSON, or not a tree this format writes ({error})"
        raise DamagedCheckpointError(manifest.path, [problem]) from None


def full_model(manifest: Manifest) -> dict[str, torch.Tensor]:
    """The whole model state dict of a verified checkpoint, of either layout.

    A sharded model's pieces are put together in this process (no process group needed).
    """
    if manifest.sharded:
        model = {k: v for k, v in _empty(manifest).items() if k.startswith("model/")}
        load_shards(model, manifest.path, None)
        return {key.removeprefix("model/"): value for key, value in model.items()}
    return expand(_tensors(manifest.path / "model.safetensors", owned=False), manifest.aliases)


def _empty(manifest: Manifest) -> dict[str, torch.Tensor]:
    return {
        k: torch.empty(size, dtype=dtype)
        for k, (size, dtype) in saved_shapes(manifest.path).items()
    }


def full_tree(manifest: Manifest, name: str) -> Any:
    """Component ``name`` of a verified checkpoint with its sharded tensors put together."""
    shapes = _empty(manifest) if manifest.sharded else {}
    used: dict[str, torch.Tensor] = {}  # a key not in the files: a KeyError, damage
    tree = read_tree(manifest, name, sharded=lambda key, _: used.setdefault(key, shapes[key]))
    if used:
        load_shards(used, manifest.path, None)
    return tree


def _compare(what: str, saved: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    """How ``saved`` (key -> what it holds) differs from the template's ``live``.

    The keys one of them lacks, and the keys whose values differ (a class, a shape, a group).
    """
    lacking = {
        "in the template, not the checkpoint": live.keys() - saved.keys(),
        "in the checkpoint, not the template": saved.keys() - live.keys(),
    }
    out = [f"{what}: {where}: {few(keys)}" for where, keys in lacking.items() if keys]
    changed = [key for key in sorted(saved.keys() & live.keys()) if saved[key] != live[key]]
    return out + [
        f"{what}: {k!r}: {saved[k]} in the checkpoint, {live[k]} in the template" for k in changed
    ]


def _shapes(tree: Any) -> dict[str, str]:
    """Every tensor of ``tree`` by path (``['ema']['params']['w']``), with its shape."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    return {
        "".join(f"[{key!r}]" for key in path): f"shape {list(leaf.shape)}"
        for path, leaf in zip(paths, leaves)
        if isinstance(leaf, torch.Tensor)
    }


def _differences(
    manifest: Manifest, like: TrainState, objects: dict[str, Any], trees: dict[str, Any]
) -> list[str]:
    """How the decoded components differ from the template (the model aside)."""
    classes, scaler = manifest.classes, like.scaler
    handles = ("optimizer", "scheduler", "scaler")
    saved: dict[str, Any] = {n: classes.get(n) for n in handles if trees[n] is not None}
    live = {n: type(getattr(like, n)).__name__ for n in handles if getattr(like, n) is not None}
    if scaler is None and "scaler" in saved:  # one is built for the saved state
        live["scaler"] = saved["scaler"]
    elif scaler is not None and not scaler.is_enabled():
        del live["scaler"]
    out = _compare("components", saved, live)
    if "optimizer" in saved and "optimizer" in live:
        saved_groups = [g.get("params", []) for g in trees["optimizer"].get("param_groups", [])]
        live_groups = parameter_names(like.model, like.optimizer)
        out += _compare(
            "optimizer parameters",
            {n: f"group {g}" for g, names in enumerate(saved_groups) for n in names},
            {n: f"group {g}" for g, names in enumerate(live_groups) for n in names},
        )
    extras = trees["extras"] or {}
    common = extras.keys() & like.extras.keys()
    out += _compare(
        "extras", *(_shapes({k: tree[k] for k in common}) for tree in (extras, like.extras))
    )
    saved_objects = {n: classes.get("objects", {}).get(n) for n in trees["objects"] or {}}
    return out + _compare(
        "objects", saved_objects, {n: type(o).__name__ for n, o in objects.items()}
    )


def _field_values(
    like: TrainState, saved: Mapping[str, Any], differences: list[str]
) -> dict[str, Any]:
    """The saved fields as TrainState values; NamedTuples rebuilt with the template's type.

    Fields the checkpoint lacks (added to TrainState later) keep the template's values.
    """
    live = {name: getattr(like, name) for name in fields_of(like)}
    tuples = {n: v for n, v in saved.items() if is_namedtuple(live.get(n)) and isinstance(v, dict)}
    # A NamedTuple's fields count as keys of their own ("guard.x").
    known = [*live, *(f"{n}.{f}" for n, v in live.items() if is_namedtuple(v) for f in v._fields)]
    found = [n for n in saved if n not in tuples] + [f"{n}.{k}" for n in tuples for k in tuples[n]]
    known = [k for k in known if k in found]  # a field the checkpoint lacks keeps its value
    problems = _compare("state fields", dict.fromkeys(found), dict.fromkeys(known))
    differences += problems
    if problems:
        return {}
    return {**saved, **{n: type(live[n])(**{**live[n]._asdict(), **v}) for n, v in tuples.items()}}


def load_checkpoint(
    path: str | os.PathLike[str],
    like: TrainState,
    *,
    objects: Mapping[str, Any] | None = None,
    rng: bool = True,
) -> TrainState:
    """Restore a checkpoint into the objects of a template state built the normal way.

    Every file the manifest lists is checked (size and xxh3 checksum) first; files it
    does not list are never opened, and only JSON and safetensors are read (nothing is
    unpickled). The checkpoint is then compared with the template, and *all* differences
    are reported at once before anything is touched. Then the objects are restored in
    place in this order: the model (``load_state_dict(strict=True)`` on the unwrapped
    model; tied weights stay tied), the scheduler, the optimizer (after the scheduler,
    whose loading changes the optimizer's learning rates, pytorch#119168: the saved
    rates win), the GradScaler, the extra ``objects``, and last the RNG states.

    TrainState fields missing from an older checkpoint keep the template's values.

    A data-parallel template (DDP or FSDP2) is loaded on every rank of its group together
    (all load, or all raise the same error). Each rank gets its own saved RNG states and
    data position; a rank the checkpoint has none for (it was written by fewer ranks)
    keeps its seeding and rank 0's data position, with a warning. A sharded (FSDP2)
    checkpoint loads into any sharding, a DDP model or a plain one, on any number of ranks;
    a plain one into an FSDP2 model too. The sharded files are read with ``safetensors``
    through DCP's Hugging Face storage reader (no pickle), after the manifest's checks and
    a check that ``sharded/`` holds no file the manifest does not list.

    Args:
        path: a checkpoint folder written by :func:`save_checkpoint`.
        like: the template: a TrainState with the same kind of model, optimizer,
            scheduler (and scaler) as the saved run, e.g. freshly built.
        objects: the extra stateful objects saved with ``objects=``, by the same names.
        rng: restore the Python, NumPy, torch and CUDA RNG states.

    Returns:
        A new TrainState with the template's handles (now holding the saved state), every
        saved non-handle field, and the saved ``extras`` (template entries the checkpoint
        lacks are kept). When the checkpoint holds a GradScaler and the template none, a
        ``torch.amp.GradScaler`` for the model's device is built and loaded.

    Raises:
        DamagedCheckpointError: a listed file is missing, truncated or corrupted, or the
            manifest is damaged; the message names each file.
        ValueError: the checkpoint does not fit the template (the message lists every
            difference), or it is of another format or a newer version.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, load_checkpoint, save_checkpoint
        >>> def build():
        ...     model = torch.nn.Linear(2, 1)
        ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ...     return TrainState(model=model, optimizer=optimizer)
        >>> path = save_checkpoint(build().replace(step=7), "ckpt/step_000007")
        >>> state = load_checkpoint(path, like=build())
        >>> state.step
        7
    """
    who = "load_checkpoint"
    ok = isinstance(like, TrainState)
    check(ok, who, "like", "a TrainState (the template)", type(like).__name__, "", TypeError)
    objects = check_objects(objects, who)
    group = group_of(like.model)
    plan: _Plan | None = None
    error: BaseException | None = None
    try:
        plan = _plan(path, like, objects, rng, rank_of(group)[0])
    except Exception as caught:
        error = caught
    agree(error, group, who)  # all ranks restore, or none
    assert plan is not None
    return _restore(plan, like, objects, group)


@dataclasses.dataclass
class _Plan:
    """What a load restores, read and compared with the template (nothing touched yet)."""

    manifest: Manifest
    model: dict[str, Any]  # the saved state dict, or (sharded) the template's to fill
    shards: dict[str, torch.Tensor]  # sharded layout: DCP key -> template tensor to fill
    trees: dict[str, Any]  # component name -> decoded tree (None when absent)
    fields: dict[str, Any]
    rng_state: Any


def _rank_state(manifest: Manifest, rank: int, rng: bool) -> tuple[Any, dict[str, Any]]:
    """``(the RNG states this rank restores or None, the fields this rank has of its own)``.

    A rank the checkpoint has no state for (it was written by fewer ranks) is warned
    about and keeps its seeding and rank 0's data position.
    """
    if rank == 0:
        return (read_tree(manifest, "rng") if rng and manifest.has("rng") else None), {}
    if manifest.has(rank_component(rank)):
        own = read_tree(manifest, rank_component(rank))
        return (own["rng"] if rng else None), {"data_state": own["data_state"]}
    warnings.warn(
        f"load_checkpoint: {manifest.path} holds no RNG states or data position for rank "
        f"{rank} (it was written by {manifest.world_size} rank(s)); this rank keeps its own "
        "RNG seeding and rank 0's data position (the model and optimizer are restored).",
        RuntimeWarning,
        stacklevel=4,
    )
    return None, {}


def _model_plan(
    manifest: Manifest, like: TrainState, shards: dict[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    if manifest.sharded:
        state = model_state(like.model)
        shards.update({f"model/{name}": value for name, value in state.items()})
        shapes = {
            key.removeprefix("model/"): tuple(size)
            for key, (size, _) in saved_shapes(manifest.path).items()
            if key.startswith("model/")
        }
        return state, model_differences(like.model, shapes, {})
    tensors = _tensors(manifest.path / "model.safetensors", owned=False)
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    differences = model_differences(like.model, shapes, manifest.aliases)
    return expand(tensors, manifest.aliases) if not differences else {}, differences


def _trees(
    manifest: Manifest, like: TrainState, shards: dict[str, Any], differences: list[str]
) -> dict[str, Any]:
    """Every tree component, decoded against the template (``None`` when absent)."""
    referenced: list[str] = []  # keys of sharded tensors

    def take(key: str, template: Any) -> torch.Tensor:
        referenced.append(key)
        if isinstance(template, torch.Tensor):
            return shards.setdefault(key, template)
        return torch.empty(0)  # a stand-in keeps decoding; the difference is reported below

    optimizer_like = None
    if manifest.sharded and like.optimizer is not None and manifest.has("optimizer"):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        # The template's own state (zero state first, if none) is what DCP loads into.
        optimizer_like = get_optimizer_state_dict(
            like.model, list(getattr(like.optimizer, "optimizers", [like.optimizer]))
        )
    lives = {"optimizer": optimizer_like, "extras": dict(like.extras), "state": fields_of(like)}
    names = ("optimizer", "scheduler", "scaler", "extras", "state", "objects")
    trees = {
        n: read_tree(manifest, n, like=lives.get(n), sharded=take) if manifest.has(n) else None
        for n in names
    }
    if referenced:  # their whole shapes
        saved = {k: f"shape {list(size)}" for k, (size, _) in saved_shapes(manifest.path).items()}
        live = {k: f"shape {list(shards[k].shape)}" for k in referenced if k in shards}
        found = {k: saved.get(k, "not in the files") for k in referenced}
        differences += _compare("sharded tensors", found, live)
    return trees


def _plan(
    path: str | os.PathLike[str], like: TrainState, objects: dict[str, Any], rng: bool, rank: int
) -> _Plan:
    manifest = verified_manifest(path)
    shards: dict[str, torch.Tensor] = {}
    model, differences = _model_plan(manifest, like, shards)
    trees = _trees(manifest, like, shards, differences)
    differences += _differences(manifest, like, objects, trees)
    fields = _field_values(like, trees["state"] or {}, differences)
    rng_state, own = _rank_state(manifest, rank, rng)
    if differences:
        listing = "\n  ".join(differences)
        raise ValueError(
            f"load_checkpoint: {manifest.path} does not fit the template state "
            f"({len(differences)} difference(s)):\n  {listing}\nBuild the template like the "
            "saved run (same model, optimizer, scheduler and plugins), or load the model alone "
            "with safetensors.torch.load_file."
        )
    return _Plan(manifest, model, shards, trees, {**fields, **own}, rng_state)


def _restore(
    plan: _Plan, like: TrainState, objects: dict[str, Any], group: Group | None
) -> TrainState:
    """Restore, in the order that keeps each object's saved values (see load_checkpoint)."""
    full = not plan.manifest.sharded
    if plan.shards:
        load_shards(plan.shards, plan.manifest.path, group)  # every sharded tensor, in place
    put_model(like.model, plan.model, full=full)
    plan.model.clear()  # drop the file mapping
    trees = plan.trees
    if trees["scheduler"] is not None:
        like.scheduler.load_state_dict(trees["scheduler"])
    if trees["optimizer"] is not None:
        put_optimizer(like.model, like.optimizer, trees["optimizer"], full=full)
    scaler = like.scaler
    if trees["scaler"] is not None:
        device = next((p.device.type for p in like.model.parameters()), "cpu")
        scaler = scaler or torch.amp.GradScaler(device)
        scaler.load_state_dict(trees["scaler"])
    for name, obj in objects.items():
        obj.load_state_dict(trees["objects"][name])
    if plan.rng_state is not None:
        restore_rng(plan.rng_state)
    # A new state, not like.replace(): the template may carry a train step's "consumed" mark.
    values = {field.name: getattr(like, field.name) for field in dataclasses.fields(like)}
    values.update(plan.fields, extras={**like.extras, **(trees["extras"] or {})}, scaler=scaler)
    return TrainState(**values)
