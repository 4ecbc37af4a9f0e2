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

import torch
from safetensors.torch import load_file

from toolkit.checkpoints._codec import TreeError, decode, tensor_paths
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
from toolkit.step._components import HANDLES, OWN_FILE, check_objects, fields_of, is_namedtuple
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
    json_path = manifest.path / f"{name}.json"
    try:
        document = read_json(json_path)
    except (UnicodeDecodeError, ValueError) as error:
        raise DamagedCheckpointError(manifest.path, [f"{json_path}: not JSON ({error})"]) from None
    tensors = {}
    if f"{name}.safetensors" in manifest.files:
        tensors = _tensors(manifest.path / f"{name}.safetensors", owned=True)
    try:
        return decode(document, tensors, name, like=like, sharded=sharded)
    except (TreeError, KeyError, TypeError, AttributeError, ValueError) as error:
        problem = f"{json_path}: does not decode ({error})"
        raise DamagedCheckpointError(manifest.path, [problem]) from None


def full_model(manifest: Manifest) -> dict[str, torch.Tensor]:
    """The whole model state dict of a verified checkpoint, of either layout.

    A sharded model's pieces are put together in this process (no process group needed).
    """
    if manifest.sharded:
        model = {k: v for k, v in _empty(manifest).items() if k.startswith("model/")}
        load_shards(model, manifest.path, None)
        return {key.removeprefix("model/"): value for key, value in model.items()}
    tensors = _tensors(manifest.path / "model.safetensors", owned=False)
    lost = sorted(set(manifest.aliases.values()) - set(tensors))
    if lost:
        problem = f"{manifest.path / 'model.safetensors'}: aliased tensors missing: {lost}"
        raise DamagedCheckpointError(manifest.path, [problem])
    return expand(tensors, manifest.aliases)


def _empty(manifest: Manifest) -> dict[str, torch.Tensor]:
    return {
        k: torch.empty(size, dtype=dtype)
        for k, (size, dtype) in saved_shapes(manifest.path).items()
    }


def full_tree(manifest: Manifest, name: str) -> Any:
    """Component ``name`` of a verified checkpoint with its sharded tensors put together."""
    shapes = _empty(manifest) if manifest.sharded else {}
    targets: dict[str, torch.Tensor] = {}

    def take(key: str, _: Any) -> torch.Tensor:
        if key not in shapes:
            problem = f"{manifest.path}: sharded tensors missing from the files: {key}"
            raise DamagedCheckpointError(manifest.path, [problem])
        return targets.setdefault(key, shapes[key])

    tree = read_tree(manifest, name, sharded=take)
    if targets:
        load_shards(targets, manifest.path, None)
    return tree


def _difference(name: str, saved: Any, saved_class: str | None, live: Any) -> list[str]:
    """A handle (or object) the checkpoint or the template lacks, or of another class."""
    if saved is not None and live is None:
        return [f"{name}: the checkpoint has one, the template has none (its state would be lost)"]
    if live is not None and saved is None:
        return [f"{name}: the template has one, the checkpoint has none"]
    if live is None or saved_class is None or saved_class == type(live).__name__:
        return []
    return [f"{name}: the checkpoint holds a {saved_class}, the template a {type(live).__name__}"]


def _extras_differences(saved: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    """For entries in both: tensors at paths the other lacks, or of another shape."""
    out = []
    for key in sorted(saved.keys() & live.keys(), key=repr):
        root = f"extras[{key!r}]"
        saved_paths, live_paths = tensor_paths(saved[key], root), tensor_paths(live[key], root)
        if live_paths.keys() - saved_paths.keys():
            missing = few(live_paths.keys() - saved_paths.keys(), str)
            out.append(f"{root}: tensors missing from the checkpoint: {missing}")
        if saved_paths.keys() - live_paths.keys():
            unexpected = few(saved_paths.keys() - live_paths.keys(), str)
            out.append(f"{root}: unexpected tensors in the checkpoint: {unexpected}")
        for path in sorted(saved_paths.keys() & live_paths.keys()):
            if saved_paths[path] != live_paths[path]:
                out.append(
                    f"{path}: shape {list(saved_paths[path])} in the checkpoint, "
                    f"{list(live_paths[path])} in the template"
                )
    return out


def _optimizer_differences(
    like: TrainState, saved_class: str, saved: Mapping[str, Any]
) -> list[str]:
    """How a saved named optimizer state differs from the template optimizer."""
    out = _difference("optimizer", saved, saved_class, like.optimizer)
    live_groups = parameter_names(like.model, like.optimizer)
    saved_groups = [list(group.get("params", [])) for group in saved.get("param_groups", [])]
    if len(saved_groups) != len(live_groups):
        out.append(
            f"optimizer: {len(saved_groups)} parameter group(s) in the checkpoint, "
            f"{len(live_groups)} in the template"
        )
    for g, (saved_names, live_names) in enumerate(zip(saved_groups, live_groups)):
        if saved_names != live_names:
            missing = [n for n in live_names if n not in saved_names]
            unexpected = [n for n in saved_names if n not in live_names]
            detail = f"missing {missing}, unexpected {unexpected}"
            detail = detail if missing or unexpected else "same names in another order"
            out.append(f"optimizer: parameter group {g} differs: {detail}")
    stray = sorted(set(saved.get("state", {})) - {n for row in live_groups for n in row})
    if stray:
        out.append(f"optimizer: state for parameters the template lacks: {stray}")
    return out


def _field_values(
    like: TrainState, saved: Mapping[str, Any], differences: list[str]
) -> dict[str, Any]:
    """The saved fields as TrainState values; NamedTuples rebuilt with the template's type."""
    live = {f.name: getattr(like, f.name) for f in dataclasses.fields(like)}
    out = {}
    for name, value in saved.items():
        if name not in live or name in HANDLES or name in OWN_FILE:
            differences.append(f"state: field {name!r} is not a TrainState field here")
            continue
        template = live[name]
        if is_namedtuple(template) and isinstance(value, Mapping):
            unknown = sorted(set(value) - set(template._fields))
            if unknown:
                differences.append(
                    f"state[{name!r}]: fields {unknown} are not fields of {type(template).__name__}"
                )
                continue
            # Fields the checkpoint lacks (added to the type later) keep the template's value.
            value = type(template)(**{**template._asdict(), **value})
        out[name] = value
    return out


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
    if not isinstance(like, TrainState):
        raise TypeError(
            f"{who}: like must be a TrainState built the normal way (the template the "
            f"checkpoint is loaded into); got {type(like).__name__}."
        )
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


def _own_state(manifest: Manifest, rank: int) -> tuple[Any, Any]:
    """This rank's ``(rng, data_state)`` of a multi-rank checkpoint, or ``(None, None)``.

    A rank the checkpoint has no state for (it was written by fewer ranks) is warned
    about and keeps its seeding (``False``).
    """
    if rank == 0:
        return None, None
    if not manifest.has(rank_component(rank)):
        warnings.warn(
            f"load_checkpoint: {manifest.path} was written by {manifest.world_size} rank(s) "
            f"and holds no RNG states or data position for rank {rank}; this rank keeps its "
            "own RNG seeding and rank 0's data position, so its randomness does not continue "
            "the saved run's (the model and optimizer are restored all the same).",
            RuntimeWarning,
            stacklevel=4,
        )
        return False, None
    own = read_tree(manifest, rank_component(rank))
    return own["rng"], own["data_state"]


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
    manifest: Manifest,
    like: TrainState,
    objects: dict[str, Any],
    shards: dict[str, Any],
    differences: list[str],
) -> dict[str, Any]:
    """Every tree component, decoded against the template, with their differences."""
    lacking: list[str] = []

    def take(key: str, template: Any) -> torch.Tensor:
        if not isinstance(template, torch.Tensor):  # reported; a stand-in keeps decoding
            lacking.append(key)
            template = torch.empty(0)
        return shards.setdefault(key, template)

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
    classes = manifest.classes
    if trees["optimizer"] is not None and like.optimizer is not None:
        differences += _optimizer_differences(
            like, classes.get("optimizer", "?"), trees["optimizer"]
        )
    else:
        differences += _difference("optimizer", trees["optimizer"], None, like.optimizer)
    differences += _difference(
        "scheduler", trees["scheduler"], classes.get("scheduler"), like.scheduler
    )
    enabled = like.scaler is not None and like.scaler.is_enabled()
    if enabled and trees["scaler"] is None:
        differences.append("scaler: the template has an enabled GradScaler, the checkpoint none")
    if like.scaler is not None and not enabled and trees["scaler"] is not None:
        differences.append(
            "scaler: the checkpoint has GradScaler state, the template's is disabled"
        )
    differences += _extras_differences(trees["extras"] or {}, dict(like.extras))
    saved_objects = trees["objects"] or {}
    missing, unexpected = objects.keys() - saved_objects.keys(), saved_objects.keys() - objects
    if missing:
        differences.append(f"objects: {sorted(missing)} given but not in the checkpoint")
    if unexpected:
        differences.append(f"objects: {sorted(unexpected)} in the checkpoint but not given")
    for name in sorted(objects.keys() & saved_objects.keys()):
        saved_class = classes.get("objects", {}).get(name)
        differences += _difference(f"objects[{name!r}]", name, saved_class, objects[name])
    if lacking:
        differences.append(f"sharded tensors the template has no tensor for: {few(lacking, str)}")
    return trees


def _shard_shapes(manifest: Manifest, shards: Mapping[str, torch.Tensor]) -> list[str]:
    """Sharded tensors missing from the files or of another whole shape than the template's."""
    saved = saved_shapes(manifest.path) if shards else {}
    out = []
    for key, target in shards.items():
        if key.startswith("model/"):
            continue  # compared by model_differences, by name
        if key not in saved:
            out.append(f"{key}: not in the checkpoint's sharded files")
        elif tuple(saved[key][0]) != tuple(target.shape) and target.numel():
            out.append(
                f"{key}: shape {list(saved[key][0])} in the checkpoint, "
                f"{list(target.shape)} in the template"
            )
    return out


def _plan(
    path: str | os.PathLike[str], like: TrainState, objects: dict[str, Any], rng: bool, rank: int
) -> _Plan:
    manifest = verified_manifest(path)
    shards: dict[str, torch.Tensor] = {}
    model, differences = _model_plan(manifest, like, shards)
    trees = _trees(manifest, like, objects, shards, differences)
    fields = _field_values(like, trees["state"] or {}, differences)
    differences += _shard_shapes(manifest, shards)
    rng_state = read_tree(manifest, "rng") if rng and manifest.has("rng") else None
    own_rng, own_data = _own_state(manifest, rank)
    if own_rng is not None:
        rng_state = (own_rng or None) if rng else None
    if own_data is not None:
        fields["data_state"] = own_data
    if differences:
        listing = "\n  ".join(differences)
        raise ValueError(
            f"load_checkpoint: {manifest.path} does not fit the template state "
            f"({len(differences)} difference(s)):\n  {listing}\nBuild the template like the "
            "saved run (same model, optimizer, scheduler and plugins), or load the model alone "
            "with safetensors.torch.load_file."
        )
    return _Plan(manifest, model, shards, trees, fields, rng_state)


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
        if scaler is None:
            device = next((p.device.type for p in like.model.parameters()), "cpu")
            scaler = torch.amp.GradScaler(device)
        scaler.load_state_dict(trees["scaler"])
    for name, obj in objects.items():
        obj.load_state_dict(trees["objects"][name])
    if plan.rng_state is not None:
        restore_rng(plan.rng_state)
    # A new state, not like.replace(): the template may carry a train step's "consumed" mark.
    values = {field.name: getattr(like, field.name) for field in dataclasses.fields(like)}
    values.update(plan.fields, extras={**like.extras, **(trees["extras"] or {})}, scaler=scaler)
    return TrainState(**values)
