"""export_model: one plain safetensors file of a model's weights, for inference and hub tools."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from toolkit.checkpoints._codec import host_tensor, separate_shared
from toolkit.checkpoints._files import replace_file, write_tensors
from toolkit.checkpoints._load import full_model, full_tree, verified_manifest
from toolkit.checkpoints._model_state import expand, model_state, split_aliases
from toolkit.step._state import TrainState

__all__ = ["export_model"]

_WHO = "export_model"


def _ema_entry(extras: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    entry = extras.get(key)
    if not isinstance(entry, Mapping) or not isinstance(entry.get("params"), Mapping):
        raise KeyError(
            f"{_WHO}: {where} has no EMA weights under extras[{key!r}] (extras keys: "
            f"{sorted(extras)}); train with the ema(key={key!r}) plugin, or export "
            "weights='model'."
        )
    return entry


def _with_average(
    full: dict[str, torch.Tensor], aliases: Mapping[str, str], entry: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """``full`` with the EMA's parameters and buffers in place of the live ones."""
    averaged = {**entry["params"], **(entry.get("buffers") or {})}
    unknown = sorted(set(averaged) - set(full))
    if unknown:
        raise ValueError(
            f"{_WHO}: the EMA holds names the model lacks: {unknown[:5]}; it was made for "
            "another model."
        )
    out = dict(full)
    for name, value in averaged.items():
        out[name] = value
    for alias, name in aliases.items():  # the EMA names a tied tensor once
        if name in averaged:
            out[alias] = averaged[name]
    return out


def _from_folder(path: Path, weights: str, key: str) -> dict[str, torch.Tensor]:
    manifest = verified_manifest(path)
    full = full_model(manifest)
    if weights == "model":
        return full
    extras = full_tree(manifest, "extras") if manifest.has("extras") else {}
    entry = _ema_entry(extras, key, f"checkpoint {path}")
    return _with_average(full, manifest.aliases, entry)


def _from_state(state: TrainState, weights: str, key: str) -> dict[str, torch.Tensor]:
    tensors, aliases = split_aliases(model_state(state.model), _WHO)
    full = expand(tensors, aliases)
    if weights == "model":
        return full
    return _with_average(full, aliases, _ema_entry(state.extras, key, "the state"))


def export_model(
    source: torch.nn.Module | TrainState | str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    weights: str = "model",
    key: str = "ema",
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a model's weights as one plain safetensors file, for inference and hub tools.

    The names are the unwrapped model's (no ``_orig_mod.``/``module.`` prefixes), so
    ``model.load_state_dict(safetensors.torch.load_file(path), strict=True)`` loads it
    into the plain model. Tied weights are written under *each* of their names (the file
    then holds the tied tensor more than once) because a strict load needs every name;
    training checkpoints store them once instead. The file is written to a temporary
    sibling, fsync'ed and renamed, with the metadata ``{"format": "pt"}`` that hub tools
    expect.

    Args:
        source: a module, a TrainState (its model), or a checkpoint folder written by
            :func:`save_checkpoint` (verified before reading; a sharded FSDP2 checkpoint
            is put together in this process, whatever the number of ranks that wrote it).
        path: the file to write, e.g. ``"runs/a/model.safetensors"``.
        weights: ``"model"`` for the trained weights, ``"ema"`` for the exponential moving
            average kept by :func:`toolkit.plugins.ema` in ``extras[key]`` (buffers it does
            not average are the model's).
        key: the ``extras`` key of the EMA.
        dtype: cast floating-point tensors to this dtype (e.g. ``torch.bfloat16``).

    Returns:
        The path written.

    Raises:
        ValueError: ``weights`` is not ``"model"``/``"ema"``, ``"ema"`` with a bare module,
            or an EMA whose names the model lacks.
        KeyError: ``weights="ema"`` and no EMA under ``extras[key]``.
        TypeError: ``source`` is none of the accepted kinds.
        DamagedCheckpointError: a checkpoint folder whose files are damaged.

    Example:
        >>> import torch
        >>> from safetensors.torch import load_file
        >>> from toolkit import export_model
        >>> net = torch.nn.Linear(2, 1)
        >>> path = export_model(torch.compile(net, backend="eager"), "model.safetensors")
        >>> torch.nn.Linear(2, 1).load_state_dict(load_file(path), strict=True)
        <All keys matched successfully>
    """
    if weights not in ("model", "ema"):
        raise ValueError(f"{_WHO}: weights must be 'model' or 'ema'; got {weights!r}.")
    if isinstance(source, TrainState):
        full = _from_state(source, weights, key)
    elif isinstance(source, torch.nn.Module):
        if weights == "ema":
            raise ValueError(
                f"{_WHO}: weights='ema' needs a TrainState or a checkpoint folder (the EMA "
                "lives in state.extras); got a bare module."
            )
        full = expand(*split_aliases(model_state(source), _WHO))
    elif isinstance(source, (str, os.PathLike)):
        full = _from_folder(Path(source), weights, key)
    else:
        raise TypeError(
            f"{_WHO}: source must be a module, a TrainState or a checkpoint folder; got "
            f"{type(source).__name__}."
        )
    tensors = {}
    for name, value in full.items():
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        tensors[name] = host_tensor(value)
    separate_shared(tensors)  # a tied tensor is written under each name: copies
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, lambda temp: write_tensors(temp, tensors, {"format": "pt"}))
    return path
