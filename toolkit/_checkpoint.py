"""save_checkpoint / load_checkpoint: a TrainState as a folder of safetensors and JSON files.

Layout of one checkpoint folder (every file listed, with size and checksum, in
``manifest.json``; see :mod:`toolkit._manifest`)::

    manifest.json
    model.safetensors                       unwrapped state dict, tied tensors stored once
    optimizer.json  [optimizer.safetensors] state keyed by parameter name, param groups
    scheduler.json  [scheduler.safetensors]
    scaler.json                             GradScaler state, when there is an enabled one
    state.json      [state.safetensors]     TrainState's other fields (step, window, ...)
    extras.json     [extras.safetensors]    state.extras (EMA weights, best scores, ...)
    rng.json         rng.safetensors        python, numpy, torch (and CUDA) RNG states
    objects.json    [objects.safetensors]   extra stateful objects given as objects=

A ``.safetensors`` file in brackets exists only when its tree holds tensors. JSON
documents follow :mod:`toolkit._codec`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from toolkit._codec import (
    TreeError,
    decode,
    encode,
    host_tensor,
    separate_shared,
    tensor_paths,
)
from toolkit._files import (
    CHECKSUM,
    checksum,
    fsync_dir,
    read_json,
    temp_name,
    write_json,
    write_tensors,
)
from toolkit._manifest import (
    MANIFEST,
    DamagedCheckpointError,
    Manifest,
    check_metrics,
    file_problems,
    manifest_document,
    read_manifest,
)
from toolkit._model_state import expand, model_differences, model_tensors
from toolkit._optim_names import named_state, numbered_state, optimizer_differences
from toolkit._retention import Retention
from toolkit._rng import capture_rng, restore_rng
from toolkit._state import TrainState
from toolkit._unwrap import unwrap

__all__ = [
    "load_checkpoint",
    "read_model",
    "read_tree",
    "save_checkpoint",
    "save_in_background",
    "verified_manifest",
]

HANDLES = ("model", "optimizer", "scheduler", "scaler")
_OWN_FILE = ("extras",)  # TrainState fields with a component of their own
_KINDS = ("tensors", "tree")
# A model file opened by other tools (transformers, the hub) is expected to say "pt".
_MODEL_METADATA = {"format": "pt"}


@dataclasses.dataclass(frozen=True)
class _Tree:
    """One tree component ready to write: its JSON document and CPU tensors."""

    document: Any
    tensors: dict[str, torch.Tensor]
    info: dict[str, Any]  # extra manifest entries (class names)


@dataclasses.dataclass(frozen=True)
class _Snapshot:
    """Everything a checkpoint holds, gathered in memory before any file is written."""

    step: int
    model: dict[str, torch.Tensor]
    aliases: dict[str, str]
    trees: dict[str, _Tree]
    metrics: dict[str, float]
    rules: dict[str, Any] | None


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _fields(state: TrainState) -> dict[str, Any]:
    """TrainState's non-handle fields except those with their own file; NamedTuples as dicts."""
    out = {}
    for field in dataclasses.fields(state):
        if field.name in HANDLES or field.name in _OWN_FILE:
            continue
        value = getattr(state, field.name)
        out[field.name] = dict(value._asdict()) if _is_namedtuple(value) else value
    return out


def _check_objects(objects: Any, who: str) -> dict[str, Any]:
    if objects is None:
        return {}
    if not isinstance(objects, Mapping):
        raise TypeError(
            f"{who}: objects must be a mapping of name to an object with state_dict() and "
            f"load_state_dict(), e.g. {{'loader': loader}}; got {type(objects).__name__}."
        )
    for name, obj in objects.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"{who}: objects keys must be non-empty strings; got {name!r}.")
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"{who}: objects[{name!r}] ({type(obj).__name__}) has no state_dict() and "
                "load_state_dict() methods; pass objects that have both (a stateful "
                "DataLoader, a metric, ...)."
            )
    return dict(objects)


def _tree(tree: Any, root: str, copy: bool, **info: Any) -> _Tree:
    document, tensors = encode(tree, root, copy=copy)
    return _Tree(document, tensors, info)


def _snapshot(
    state: TrainState,
    objects: dict[str, Any],
    metrics: dict[str, float],
    rules: Retention | None,
    copy: bool,
) -> _Snapshot:
    who = "save_checkpoint"
    model, aliases = model_tensors(state.model, who)
    model = {name: host_tensor(value, copy) for name, value in model.items()}
    separate_shared(model)  # distinct views of one buffer (tied ones are aliases already)
    trees = {}
    if state.optimizer is not None:
        trees["optimizer"] = _tree(
            named_state(state.model, state.optimizer),
            "optimizer",
            copy,
            **{"class": type(state.optimizer).__name__},
        )
    if state.scheduler is not None:
        trees["scheduler"] = _tree(
            state.scheduler.state_dict(),
            "scheduler",
            copy,
            **{"class": type(state.scheduler).__name__},
        )
    if state.scaler is not None and state.scaler.is_enabled():
        trees["scaler"] = _tree(
            state.scaler.state_dict(), "scaler", copy, **{"class": type(state.scaler).__name__}
        )
    trees["state"] = _tree(_fields(state), "state", copy)
    trees["extras"] = _tree(dict(state.extras), "extras", copy)
    trees["rng"] = _tree(capture_rng(), "rng", copy)
    if objects:
        trees["objects"] = _tree(
            {name: obj.state_dict() for name, obj in objects.items()},
            "objects",
            copy,
            classes={name: type(obj).__name__ for name, obj in objects.items()},
        )
    return _Snapshot(
        step=state.step,
        model=model,
        aliases=aliases,
        trees=trees,
        metrics=metrics,
        rules=rules.to_document() if rules is not None else None,
    )


def _write_file(folder: Path, name: str, write: Any, files: dict[str, Any]) -> None:
    path = folder / name
    write(path)
    files[name] = {"size": path.stat().st_size, CHECKSUM: checksum(path)}


def _write(snapshot: _Snapshot, folder: Path) -> None:
    """Write every file of the snapshot into the (new, empty) ``folder``; manifest last."""
    files: dict[str, Any] = {}
    components: dict[str, Any] = {}
    _write_file(
        folder,
        "model.safetensors",
        lambda p: write_tensors(p, snapshot.model, _MODEL_METADATA),
        files,
    )
    components["model"] = {
        "kind": "tensors",
        "file": "model.safetensors",
        "aliases": snapshot.aliases,
    }
    for name, tree in snapshot.trees.items():
        entry: dict[str, Any] = {"kind": "tree", "json": f"{name}.json", **tree.info}
        _write_file(folder, f"{name}.json", lambda p, d=tree.document: write_json(p, d), files)
        if tree.tensors:
            entry["tensors"] = f"{name}.safetensors"
            _write_file(
                folder,
                f"{name}.safetensors",
                lambda p, t=tree.tensors: write_tensors(p, t),
                files,
            )
        components[name] = entry
    document = manifest_document(
        step=snapshot.step,
        time=time.time(),
        metrics=snapshot.metrics,
        rules=snapshot.rules,
        components=components,
        files=files,
    )
    write_json(folder / MANIFEST, document)
    fsync_dir(folder)


def _publish(temp: Path, path: Path) -> None:
    """Give ``temp`` the name ``path``; a crash leaves the old or the new folder findable.

    A folder cannot replace a non-empty one in a single rename, so an existing ``path`` is
    first renamed to a hidden ``.old-`` sibling; :func:`toolkit.checkpoints.clean_temporaries`
    puts such a sibling back when a crash left no ``path``, and removes it otherwise.
    """
    parent = path.parent
    if not path.exists():
        os.rename(temp, path)
        fsync_dir(parent)
        return
    old = parent / temp_name("old", path.name)
    os.rename(path, old)
    fsync_dir(parent)
    os.rename(temp, path)
    fsync_dir(parent)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    state: TrainState,
    path: str | os.PathLike[str],
    *,
    objects: Mapping[str, Any] | None = None,
    metrics: Mapping[str, float] | None = None,
    rules: Retention | None = None,
) -> Path:
    """Write ``state`` (and ``objects``) as a checkpoint folder, atomically.

    The folder holds the unwrapped model's tensors (no ``_orig_mod.``/``module.``
    prefixes; tied tensors once) in ``model.safetensors``, which ``safetensors`` and
    ``load_state_dict(strict=True)`` open alone; the optimizer's state keyed by parameter
    names; the scheduler, the GradScaler (when enabled), the TrainState counters and
    ``extras``, the Python/NumPy/torch(/CUDA) RNG states and each object's
    ``state_dict()``, as JSON plus safetensors for their tensors; and ``manifest.json``
    with the size and xxh3 checksum of every file. Nothing is pickled.

    Plugin state (``state.extras``), object state and any new TrainState field must be a
    tree of dicts (str keys; or int/float/bool/None/str/tuple keys), lists, tuples, ints,
    floats (inf and NaN too), bools, ``None``, strings and tensors (any dtype and device).
    Anything else is refused before any file is written, naming its path.

    The files go to a hidden temporary sibling ``.tmp-<name>-<pid>-<hex>`` and are fsync'ed,
    then the folder is renamed to ``path`` and the parent fsync'ed. An existing checkpoint at
    ``path`` is replaced so that a crash at any point leaves the old or the new one (see
    :func:`toolkit.checkpoints.clean_temporaries`).

    Args:
        state: the state to save, at an update boundary (no open accumulation window).
        path: the checkpoint folder to create, e.g. ``"runs/a/ckpt/step_000100"``.
        objects: extra stateful objects by name (anything with ``state_dict()`` and
            ``load_state_dict()``, e.g. a stateful DataLoader); pass the same names to
            :func:`load_checkpoint`.
        metrics: flat ``{name: number}`` recorded in the manifest (for best-K retention and
            ``python -m toolkit.checkpoints``).
        rules: the retention rules in force, recorded in the manifest so the shell tool can
            say which rule keeps each checkpoint.

    Returns:
        The checkpoint folder's path.

    Raises:
        ValueError: the accumulation window is open (``state.window.micro_step > 0``); the
            state was already passed to a train step (save the one it returned); a metric
            is not a number; ``path`` exists and is not a checkpoint; the optimizer
            holds a tensor that is not a model parameter.
        TypeError: state that breaks the rule above (the message names its path), or bad
            ``objects``.
        OSError: writing failed (e.g. ``ENOSPC``); the message names ``path``. The
            temporary folder is removed and earlier checkpoints are untouched.

    Example:
        >>> import torch
        >>> from safetensors.torch import load_file
        >>> from toolkit import TrainState, save_checkpoint
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()))
        >>> path = save_checkpoint(state, "ckpt/step_000000", metrics={"val/loss": 0.5})
        >>> sorted(load_file(path / "model.safetensors"))
        ['bias', 'weight']
    """
    path = Path(path)
    return _write_snapshot(_prepare(state, path, objects, metrics, rules, copy=False), path)


def save_in_background(
    state: TrainState,
    path: str | os.PathLike[str],
    *,
    objects: Mapping[str, Any] | None = None,
    metrics: Mapping[str, float] | None = None,
    rules: Retention | None = None,
) -> Future[Path]:
    """Like :func:`toolkit.save_checkpoint`, but write the files in a background thread.

    The caller is blocked only while the state is copied to host memory (every tensor,
    plus the JSON values and RNG states, as they are at the call); training can then go on
    and change the model in place while the copy is written, fsync'ed and renamed exactly
    as ``save_checkpoint`` does. The copy costs host memory the size of the checkpoint
    until the write ends. The thread is not a daemon: a normal interpreter exit waits for
    the write. Wait for one save (``future.result()``) before starting the next into the
    same folder, and prune old checkpoints or move a pointer only once it has succeeded.

    Args:
        state: the state to save, at an update boundary.
        path: the checkpoint folder to create.
        objects: extra stateful objects by name (their ``state_dict()`` is taken now).
        metrics: flat ``{name: number}`` recorded in the manifest.
        rules: the retention rules in force, recorded in the manifest.

    Returns:
        A ``concurrent.futures.Future`` whose ``result()`` is the checkpoint's path, or
        raises what the write raised (e.g. an ``OSError`` naming ``path``).

    Raises:
        ValueError, TypeError: at the call, as :func:`toolkit.save_checkpoint` (nothing is
            written then).

    Example:
        >>> import torch
        >>> from toolkit import TrainState, load_checkpoint
        >>> from toolkit.checkpoints import save_in_background
        >>> state = TrainState(model=torch.nn.Linear(1, 1))
        >>> pending = save_in_background(state.replace(step=3), "ckpt/step_000003")
        >>> with torch.no_grad():
        ...     _ = state.model.weight.add_(1.0)  # training goes on; the copy is already taken
        >>> load_checkpoint(pending.result(), like=state).step
        3
    """
    path = Path(path)
    snapshot = _prepare(state, path, objects, metrics, rules, copy=True)
    future: Future[Path] = Future()

    def write() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(_write_snapshot(snapshot, path))
        except BaseException as error:  # handed to whoever waits on the future
            future.set_exception(error)

    threading.Thread(target=write, name=f"save_checkpoint {path}").start()
    return future


def _prepare(
    state: TrainState,
    path: Path,
    objects: Mapping[str, Any] | None,
    metrics: Mapping[str, float] | None,
    rules: Retention | None,
    copy: bool,
) -> _Snapshot:
    """Check the arguments and gather everything in memory; nothing is written yet."""
    who = "save_checkpoint"
    if not isinstance(state, TrainState):
        raise TypeError(f"{who}: expected a TrainState, got {type(state).__name__}.")
    if getattr(state, "_consumed", False):
        raise ValueError(
            f"{who}: this TrainState (step {state.step}) was passed to a train step, which "
            "returned its successor; its counters are behind the model. Save the state the "
            "step returned: state, out = step(state, batch)."
        )
    if state.window.micro_step > 0:
        raise ValueError(
            f"{who}: the accumulation window is open (state.window.micro_step="
            f"{state.window.micro_step}), and its gradients are in no state dict; save "
            "after the update that closes the window (when out.updated is true)."
        )
    if rules is not None and not isinstance(rules, Retention):
        raise TypeError(f"{who}: rules must be a Retention or None; got {type(rules).__name__}.")
    if path.exists() and not (path / MANIFEST).is_file():
        raise ValueError(
            f"{who}: {path} exists and is not a checkpoint folder (no {MANIFEST}); refusing "
            "to replace it. Pick another path or remove it."
        )
    return _snapshot(state, _check_objects(objects, who), check_metrics(metrics), rules, copy)


def _write_snapshot(snapshot: _Snapshot, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.parent / temp_name("tmp", path.name)
    try:
        temp.mkdir()
        _write(snapshot, temp)
        _publish(temp, path)
    except BaseException as error:
        shutil.rmtree(temp, ignore_errors=True)
        code = _os_error_code(error)
        if code is None:
            raise
        raise OSError(
            code,
            f"save_checkpoint: could not write the checkpoint {path} ({_reason(error)}); "
            "earlier checkpoints are untouched and the temporary folder was removed. Free "
            "space or save elsewhere.",
        ) from error
    return path


def _os_error_code(error: BaseException) -> int | None:
    """The errno of an I/O failure; safetensors reports them as "... (os error N)"."""
    if isinstance(error, OSError):
        return error.errno if error.errno is not None else 0
    found = re.search(r"\(os error (\d+)\)", str(error))
    return int(found.group(1)) if found else None


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error)


# --------------------------------------------------------------------------------------
# Loading


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
        if name not in live or name in HANDLES or name in _OWN_FILE:
            differences.append(f"state: field {name!r} is not a TrainState field here")
            continue
        template = live[name]
        if _is_namedtuple(template) and isinstance(value, Mapping):
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
    objects = _check_objects(objects, who)
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

    live_fields = _fields(like)
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
