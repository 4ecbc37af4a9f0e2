"""load_checkpoint: verify a checkpoint folder, compare it with a template, restore in order.

Only JSON and safetensors are read, and only the files the manifest lists, after their
sizes and checksums were checked. All differences from the template are gathered before
anything is touched; then the objects are restored model, scheduler, optimizer, scaler,
extra objects, RNG states.

A data-parallel template (DDP or FSDP2) is loaded by every rank of its group together:
the ranks agree on the outcome of the checks (one small all-reduce) before any rank
restores, so all load or all raise the same error. A sharded checkpoint (FSDP2) is read
through DCP into the template's own sharding, whatever the number of ranks that wrote it;
a plain one is spread over an FSDP2 template with
``torch.distributed.checkpoint.state_dict.set_state_dict``.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from toolkit._unwrap import unwrap
from toolkit.checkpoints._codec import (
    TreeError,
    decode,
    sharded_references,
    tensor_paths,
    usable_device,
)
from toolkit.checkpoints._files import read_json
from toolkit.checkpoints._manifest import (
    DamagedCheckpointError,
    Manifest,
    file_problems,
    read_manifest,
)
from toolkit.checkpoints._model_state import expand, model_differences
from toolkit.checkpoints._optim_names import numbered_state, optimizer_differences
from toolkit.checkpoints._rng import restore_rng
from toolkit.checkpoints._sharded import (
    check_listing,
    is_sharded,
    load_shards,
    saved_shapes,
    template_state,
)
from toolkit.distributed._collectives import Group, agree, group_of, rank_of
from toolkit.step._components import HANDLES, OWN_FILE, check_objects, fields_of, is_namedtuple
from toolkit.step._state import TrainState

__all__ = [
    "full_model",
    "full_tree",
    "load_checkpoint",
    "put_model",
    "read_model",
    "read_tree",
    "verified_manifest",
]

_KINDS = ("tensors", "tree", "dcp")


def verified_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest of ``path`` after checking every file it lists (sizes and checksums).

    Raises:
        DamagedCheckpointError: a problem with the manifest or a file (named by path).
        ValueError: another format, a newer version, or a component kind this toolkit
            does not know.
    """
    manifest = read_manifest(path)
    problems = file_problems(manifest, checksums=True)
    if any(entry.get("kind") == "dcp" for entry in manifest.components.values()):
        problems += check_listing(manifest.path, manifest.files)
    if problems:
        raise DamagedCheckpointError(manifest.path, problems)
    for name, entry in manifest.components.items():
        if entry.get("kind") not in _KINDS:
            raise ValueError(
                f"{manifest.path}: component {name!r} has kind {entry.get('kind')!r}, which "
                f"this toolkit does not read (it reads {list(_KINDS)}); upgrade toolkit."
            )
    return manifest


def _tensors(path: Path, owned: bool) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file: memory-mapped, or in memory of their own."""
    try:
        if not owned:
            return load_file(path)
        try:
            return load_file(path, backend="pread")
        except TypeError:  # safetensors < 0.8 has no backend choice: copy out of the map
            return {name: value.clone() for name, value in load_file(path).items()}
    except Exception as error:  # checksum-valid but not safetensors: written by something else
        problem = f"{path}: not a safetensors file ({error})"
        raise DamagedCheckpointError(path.parent, [problem]) from None


def _document(manifest: Manifest, name: str) -> Any:
    json_path = manifest.path / manifest.components[name]["json"]
    try:
        return read_json(json_path)
    except (UnicodeDecodeError, ValueError) as error:
        problem = f"{json_path}: not JSON ({error})"
        raise DamagedCheckpointError(manifest.path, [problem]) from None


def read_tree(
    manifest: Manifest,
    name: str,
    *,
    like: Any = None,
    sharded: Mapping[str, torch.Tensor] | None = None,
) -> Any:
    """Component ``name`` of a verified checkpoint, decoded (tensors on like's devices).

    ``sharded`` gives the tensors of its ``"dcp"`` references (the template's tensors that
    :func:`toolkit.checkpoints._sharded.load_shards` fills), which are used as they are.
    """
    entry = manifest.components[name]
    json_path = manifest.path / entry["json"]
    document = _document(manifest, name)
    # pread: these tensors are kept (e.g. as optimizer state), so they must not stay
    # mapped onto a file that could change under them.
    tensors = _tensors(manifest.path / entry["tensors"], owned=True) if "tensors" in entry else {}
    given = dict(sharded or {})
    try:
        if given:
            tensors = {**tensors, **given}
            return decode(document, tensors, name, like=like, place=_placer(given, like))
        return decode(document, tensors, name, like=like)
    except (TreeError, KeyError, TypeError, AttributeError, ValueError) as error:
        raise DamagedCheckpointError(
            manifest.path, [f"{json_path}: does not decode ({error})"]
        ) from None


def _placer(given: Mapping[str, torch.Tensor], like: Any) -> Any:
    """Device placement for a tree with sharded references: those stay as they are."""
    ids = {id(t) for t in given.values()}

    def place(value: torch.Tensor, saved: str | None) -> torch.Tensor:
        if id(value) in ids:
            return value
        return value.to(usable_device(saved)) if saved else value

    return place


def read_model(manifest: Manifest) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model tensors (memory-mapped: they are copied into a model right away) and aliases."""
    entry = manifest.components["model"]
    tensors = _tensors(manifest.path / entry["file"], owned=False)
    aliases = dict(entry.get("aliases") or {})
    lost = sorted(name for name in set(aliases.values()) if name not in tensors)
    if lost:
        raise DamagedCheckpointError(
            manifest.path, [f"{manifest.path / entry['file']}: aliased tensors missing: {lost}"]
        )
    return tensors, aliases


def full_model(manifest: Manifest) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The whole model tensors and aliases of a verified checkpoint, of either layout.

    A sharded model's pieces are put together in this process (no process group needed).
    """
    if manifest.components["model"].get("kind") != "dcp":
        return read_model(manifest)
    targets = {
        key: torch.empty(size, dtype=dtype)
        for key, (size, dtype) in saved_shapes(manifest.path).items()
        if key.startswith("model/")
    }
    load_shards(targets, manifest.path, None)
    return {key.removeprefix("model/"): value for key, value in targets.items()}, {}


def full_tree(manifest: Manifest, name: str) -> Any:
    """Component ``name`` of a verified checkpoint with its sharded tensors put together."""
    found = sharded_references(_document(manifest, name), None)
    if not found:
        return read_tree(manifest, name)
    shapes = saved_shapes(manifest.path)
    missing = sorted(key for key in found if key not in shapes)
    if missing:
        problem = f"{manifest.path}: sharded tensors missing from the files: {_few(missing)}"
        raise DamagedCheckpointError(manifest.path, [problem])
    targets = {key: torch.empty(shapes[key][0], dtype=shapes[key][1]) for key in found}
    load_shards(targets, manifest.path, None)
    return read_tree(manifest, name, sharded=targets)


def _presence(name: str, saved: bool, live: bool) -> list[str]:
    if saved and not live:
        return [f"{name}: the checkpoint has one, the template has none (its state would be lost)"]
    if live and not saved:
        return [f"{name}: the template has one, the checkpoint has none"]
    return []


def _class_difference(name: str, saved: str | None, live: Any) -> list[str]:
    if live is None or saved is None or saved == type(live).__name__:
        return []
    return [f"{name}: the checkpoint holds a {saved}, the template a {type(live).__name__}"]


def _extras_differences(saved: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    """For entries in both: tensors at paths the other lacks, or of another shape."""
    out = []
    for key in sorted(saved.keys() & live.keys(), key=repr):
        root = f"extras[{key!r}]"
        saved_paths, live_paths = tensor_paths(saved[key], root), tensor_paths(live[key], root)
        missing = sorted(live_paths.keys() - saved_paths.keys())
        unexpected = sorted(saved_paths.keys() - live_paths.keys())
        if missing:
            out.append(f"{root}: tensors missing from the checkpoint: {_few(missing)}")
        if unexpected:
            out.append(f"{root}: unexpected tensors in the checkpoint: {_few(unexpected)}")
        for path in sorted(saved_paths.keys() & live_paths.keys()):
            if saved_paths[path] != live_paths[path]:
                out.append(
                    f"{path}: shape {list(saved_paths[path])} in the checkpoint, "
                    f"{list(live_paths[path])} in the template"
                )
    return out


def _few(names: list[str], limit: int = 10) -> str:
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


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
    model: dict[str, torch.Tensor]  # plain layout: the saved tensors (memory-mapped)
    aliases: dict[str, str]
    shards: dict[str, torch.Tensor]  # sharded layout: DCP key -> template tensor to fill
    model_state: dict[str, Any] | None  # sharded layout: the template's model state
    optimizer: Any
    scheduler: Any
    scaler_state: Any
    extras: dict[str, Any]
    fields: dict[str, Any]
    saved_objects: dict[str, Any]
    rng_state: Any


def _own_state(manifest: Manifest, rank: int) -> tuple[Any, Any]:
    """This rank's ``(rng, data_state)`` tree of a multi-rank checkpoint, or ``(None, None)``.

    Rank 0's are the ordinary ``rng`` and ``state`` components. A rank the checkpoint has
    no state for (it was written by fewer ranks) is warned about and keeps its seeding.
    """
    if rank == 0:
        return None, None
    name = f"rank_{rank:05d}"
    if name not in manifest.components:
        warnings.warn(
            f"load_checkpoint: {manifest.path} was written by {manifest.world_size} rank(s) "
            f"and holds no RNG states or data position for rank {rank}; this rank keeps its "
            "own RNG seeding and rank 0's data position, so its randomness does not continue "
            "the saved run's (the model and optimizer are restored all the same).",
            RuntimeWarning,
            stacklevel=4,
        )
        return False, None
    own = read_tree(manifest, name)
    return own["rng"], own["data_state"]


def _plan(
    path: str | os.PathLike[str],
    like: TrainState,
    objects: dict[str, Any],
    rng: bool,
    rank: int,
) -> _Plan:
    manifest = verified_manifest(path)
    parts = manifest.components
    differences: list[str] = []
    sharded_layout = parts["model"].get("kind") == "dcp"
    model: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    shards: dict[str, torch.Tensor] = {}
    model_state: dict[str, Any] | None = None
    optimizer_state: dict[str, Any] | None = None
    if sharded_layout:
        saved = saved_shapes(manifest.path)
        model_state, optimizer_state = template_state(like.model, like.optimizer)
        shards = {f"model/{name}": value for name, value in model_state.items()}
        shapes = {
            key.removeprefix("model/"): tuple(size)
            for key, (size, _) in saved.items()
            if key.startswith("model/")
        }
        differences += model_differences(like.model, shapes, {})
    else:
        model, aliases = read_model(manifest)
        differences += model_differences(
            like.model, {n: tuple(t.shape) for n, t in model.items()}, aliases
        )

    optimizer = None
    if "optimizer" in parts and sharded_layout:
        found = sharded_references(_document(manifest, "optimizer"), optimizer_state)
        differences += _targets(found, "optimizer", shards)
        optimizer = read_tree(manifest, "optimizer", sharded=shards)
    elif "optimizer" in parts:
        optimizer = read_tree(manifest, "optimizer")
    differences += _presence("optimizer", optimizer is not None, like.optimizer is not None)
    if optimizer is not None and like.optimizer is not None:
        differences += optimizer_differences(
            like.model, like.optimizer, parts["optimizer"].get("class", "?"), optimizer
        )

    scheduler = read_tree(manifest, "scheduler") if "scheduler" in parts else None
    differences += _presence("scheduler", scheduler is not None, like.scheduler is not None)
    differences += _class_difference(
        "scheduler", parts.get("scheduler", {}).get("class"), like.scheduler
    )

    scaler_state = read_tree(manifest, "scaler") if "scaler" in parts else None
    scaler = like.scaler
    if scaler is not None and scaler.is_enabled() and scaler_state is None:
        differences.append("scaler: the template has an enabled GradScaler, the checkpoint none")
    if scaler is not None and not scaler.is_enabled() and scaler_state is not None:
        differences.append(
            "scaler: the checkpoint has GradScaler state, the template's is disabled"
        )

    live_extras = dict(like.extras)
    extras = _tree_with_shards(manifest, "extras", live_extras, shards, differences, {})
    differences += _extras_differences(extras, live_extras)

    live_fields = fields_of(like)
    saved_fields = _tree_with_shards(manifest, "state", live_fields, shards, differences, {})
    fields = _field_values(like, saved_fields, differences)

    saved_objects = _tree_with_shards(manifest, "objects", None, shards, differences, {})
    missing = sorted(objects.keys() - saved_objects.keys())
    unexpected = sorted(saved_objects.keys() - objects.keys())
    if missing:
        differences.append(f"objects: {missing} given but not in the checkpoint")
    if unexpected:
        differences.append(f"objects: {unexpected} in the checkpoint but not given")
    classes = parts.get("objects", {}).get("classes", {})
    for name in sorted(objects.keys() & saved_objects.keys()):
        differences += _class_difference(f"objects[{name!r}]", classes.get(name), objects[name])

    if sharded_layout:
        differences += _shard_shapes(saved, shards)
    rng_state = read_tree(manifest, "rng") if rng and "rng" in parts else None
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
    return _Plan(
        manifest=manifest,
        model=model,
        aliases=aliases,
        shards=shards,
        model_state=model_state,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler_state=scaler_state,
        extras=extras,
        fields=fields,
        saved_objects=saved_objects,
        rng_state=rng_state,
    )


def _targets(found: Mapping[str, Any], root: str, shards: dict[str, torch.Tensor]) -> list[str]:
    """Add the template's tensors of sharded references to ``shards``; list those it lacks."""
    lacking = sorted(name for name, value in found.items() if not isinstance(value, torch.Tensor))
    shards.update({n: v for n, v in found.items() if isinstance(v, torch.Tensor)})
    if lacking:
        return [f"{root}: sharded tensors the template has no tensor for: {_few(lacking)}"]
    return []


def _tree_with_shards(
    manifest: Manifest,
    name: str,
    like: Any,
    shards: dict[str, torch.Tensor],
    differences: list[str],
    default: Any,
) -> Any:
    if name not in manifest.components:
        return default
    found = sharded_references(_document(manifest, name), like)
    if not found:
        return read_tree(manifest, name, like=like)
    differences += _targets(found, name, shards)
    for key, value in found.items():
        if not isinstance(value, torch.Tensor):  # reported; a stand-in keeps the decode going
            shards[key] = torch.empty(0)
    return read_tree(manifest, name, like=like, sharded={k: shards[k] for k in found})


def _shard_shapes(
    saved: Mapping[str, tuple[torch.Size, torch.dtype]], shards: Mapping[str, torch.Tensor]
) -> list[str]:
    """Sharded tensors missing from the files or of another whole shape than the template's."""
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


def put_model(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state dict into ``model``, strictly, whatever its sharding."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True))
    else:
        unwrap(model).load_state_dict(dict(state), strict=True)


def _restore(
    plan: _Plan, like: TrainState, objects: dict[str, Any], group: Group | None
) -> TrainState:
    """Restore, in the order that keeps each object's saved values (see load_checkpoint)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if plan.model_state is not None:
        load_shards(plan.shards, plan.manifest.path, group)  # every sharded tensor, in place
        set_model_state_dict(like.model, plan.model_state)
    else:
        put_model(like.model, expand(plan.model, plan.aliases))
    plan.model.clear()  # drop the file mapping
    if plan.scheduler is not None:
        like.scheduler.load_state_dict(plan.scheduler)
    if plan.optimizer is not None and like.optimizer is not None:
        if plan.model_state is not None:
            set_optimizer_state_dict(like.model, like.optimizer, plan.optimizer)
        elif is_sharded(like.model):
            options = StateDictOptions(full_state_dict=True)
            set_optimizer_state_dict(like.model, like.optimizer, plan.optimizer, options=options)
        else:
            like.optimizer.load_state_dict(
                numbered_state(like.model, like.optimizer, plan.optimizer)
            )
    scaler = like.scaler
    if plan.scaler_state is not None:
        if scaler is None:
            scaler = torch.amp.GradScaler(_device_type(like.model))
        scaler.load_state_dict(plan.scaler_state)
    for name, obj in objects.items():
        obj.load_state_dict(plan.saved_objects[name])
    if plan.rng_state is not None:
        restore_rng(plan.rng_state)
    # A new state, not like.replace(): the template may carry a train step's "consumed" mark.
    values = {field.name: getattr(like, field.name) for field in dataclasses.fields(like)}
    values.update(plan.fields, extras={**like.extras, **plan.extras}, scaler=scaler)
    return TrainState(**values)


def _device_type(model: torch.nn.Module) -> str:
    for param in model.parameters():
        return param.device.type
    return "cpu"
