"""save_checkpoint and save_in_background: a TrainState as a folder of safetensors and JSON.

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

from toolkit._codec import encode, host_tensor, separate_shared
from toolkit._components import check_objects, fields_of
from toolkit._files import CHECKSUM, checksum, fsync_dir, temp_name, write_json, write_tensors
from toolkit._manifest import MANIFEST, check_metrics, manifest_document
from toolkit._model_state import model_tensors
from toolkit._optim_names import named_state
from toolkit._retention import Retention
from toolkit._rng import capture_rng
from toolkit._state import TrainState

__all__ = ["MODEL_METADATA", "save_checkpoint", "save_in_background"]

# A model file opened by other tools (transformers, the hub) is expected to say "pt".
MODEL_METADATA = {"format": "pt"}


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
    trees["state"] = _tree(fields_of(state), "state", copy)
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
        lambda p: write_tensors(p, snapshot.model, MODEL_METADATA),
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
    :func:`toolkit.checkpoints.clean_temporaries`). The caller waits for all of it;
    :func:`toolkit.checkpoints.save_in_background` waits only for a host copy.

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
    return _snapshot(state, check_objects(objects, who), check_metrics(metrics), rules, copy)


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
