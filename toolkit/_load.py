"""load_checkpoint: verify a checkpoint folder, compare it with a template, restore in order.

Only JSON and safetensors are read, and only the files the manifest lists, after their
sizes and checksums were checked. All differences from the template are gathered before
anything is touched; then the objects are restored model, scheduler, optimizer, scaler,
extra objects, RNG states.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from toolkit._codec import TreeError, decode, tensor_paths
from toolkit._components import HANDLES, OWN_FILE, check_objects, fields_of, is_namedtuple
from toolkit._files import read_json
from toolkit._manifest import DamagedCheckpointError, Manifest, file_problems, read_manifest
from toolkit._model_state import expand, model_differences
from toolkit._optim_names import numbered_state, optimizer_differences
from toolkit._rng import restore_rng
from toolkit._state import TrainState
from toolkit._unwrap import unwrap

__all__ = ["load_checkpoint", "read_model", "read_tree", "verified_manifest"]

_KINDS = ("tensors", "tree")


def verified_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest of ``path`` after checking every file it lists (sizes and checksums).

    Raises:
        DamagedCheckpointError: a problem with the manifest or a file (named by path).
        ValueError: another format, a newer version, or a component kind this toolkit
            does not know.
    """
    manifest = read_manifest(path)
    problems = file_problems(manifest, checksums=True)
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


def read_tree(manifest: Manifest, name: str, *, like: Any = None) -> Any:
    """Component ``name`` of a verified checkpoint, decoded (tensors on like's devices)."""
    entry = manifest.components[name]
    json_path = manifest.path / entry["json"]
    try:
        document = read_json(json_path)
    except (UnicodeDecodeError, ValueError) as error:
        problem = f"{json_path}: not JSON ({error})"
        raise DamagedCheckpointError(manifest.path, [problem]) from None
    # pread: these tensors are kept (e.g. as optimizer state), so they must not stay
    # mapped onto a file that could change under them.
    tensors = _tensors(manifest.path / entry["tensors"], owned=True) if "tensors" in entry else {}
    try:
        return decode(document, tensors, name, like=like)
    except (TreeError, KeyError, TypeError, AttributeError, ValueError) as error:
        raise DamagedCheckpointError(
            manifest.path, [f"{json_path}: does not decode ({error})"]
        ) from None


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
    manifest = verified_manifest(path)
    parts = manifest.components
    differences: list[str] = []

    model, aliases = read_model(manifest)
    differences += model_differences(
        like.model, {n: tuple(t.shape) for n, t in model.items()}, aliases
    )

    optimizer = read_tree(manifest, "optimizer") if "optimizer" in parts else None
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
    extras = read_tree(manifest, "extras", like=live_extras) if "extras" in parts else {}
    differences += _extras_differences(extras, live_extras)

    live_fields = fields_of(like)
    saved_fields = read_tree(manifest, "state", like=live_fields) if "state" in parts else {}
    fields = _field_values(like, saved_fields, differences)

    saved_objects = read_tree(manifest, "objects") if "objects" in parts else {}
    missing = sorted(objects.keys() - saved_objects.keys())
    unexpected = sorted(saved_objects.keys() - objects.keys())
    if missing:
        differences.append(f"objects: {missing} given but not in the checkpoint")
    if unexpected:
        differences.append(f"objects: {unexpected} in the checkpoint but not given")
    classes = parts.get("objects", {}).get("classes", {})
    for name in sorted(objects.keys() & saved_objects.keys()):
        differences += _class_difference(f"objects[{name!r}]", classes.get(name), objects[name])

    rng_state = read_tree(manifest, "rng") if rng and "rng" in parts else None

    if differences:
        listing = "\n  ".join(differences)
        raise ValueError(
            f"{who}: {manifest.path} does not fit the template state "
            f"({len(differences)} difference(s)):\n  {listing}\nBuild the template like the "
            "saved run (same model, optimizer, scheduler and plugins), or load the model alone "
            "with safetensors.torch.load_file."
        )

    # Restore, in the order that keeps each object's saved values (see the docstring).
    unwrap(like.model).load_state_dict(expand(model, aliases), strict=True)
    del model  # drop the file mapping
    if scheduler is not None:
        like.scheduler.load_state_dict(scheduler)
    if optimizer is not None and like.optimizer is not None:
        like.optimizer.load_state_dict(numbered_state(like.model, like.optimizer, optimizer))
    if scaler_state is not None:
        if scaler is None:
            scaler = torch.amp.GradScaler(_device_type(like.model))
        scaler.load_state_dict(scaler_state)
    for name, obj in objects.items():
        obj.load_state_dict(saved_objects[name])
    if rng_state is not None:
        restore_rng(rng_state)
    # A new state, not like.replace(): the template may carry a train step's "consumed" mark.
    values = {field.name: getattr(like, field.name) for field in dataclasses.fields(like)}
    values.update(fields, extras={**live_extras, **extras}, scaler=scaler)
    return TrainState(**values)


def _device_type(model: torch.nn.Module) -> str:
    for param in model.parameters():
        return param.device.type
    return "cpu"
