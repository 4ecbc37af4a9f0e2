"""export_model: one plain safetensors file of a model's weights, for inference and hub tools."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from toolkit._checks import check, check_one_of
from toolkit.checkpoints._codec import host_tensor, separate_shared
from toolkit.checkpoints._files import replace_file, write_tensors
from toolkit.checkpoints._load import full_model, full_tree, verified_manifest
from toolkit.checkpoints._model_state import model_state, split_aliases
from toolkit.step._state import TrainState

_WHO = "export_model"


def _with_average(
    full: dict[str, torch.Tensor], aliases: Mapping[str, str], extras: Any, key: str, where: str
) -> dict[str, torch.Tensor]:
    """``full`` with the EMA's parameters and buffers (``extras[key]``) for the live ones."""
    entry = extras.get(key)
    if not isinstance(entry, Mapping) or not isinstance(entry.get("params"), Mapping):
        raise KeyError(
            f"{_WHO}: {where} has no EMA weights under extras[{key!r}] (extras keys: "
            f"{sorted(extras)}); train with the ema(key={key!r}) plugin, or export "
            "weights='model'."
        )
    averaged = {**entry["params"], **(entry.get("buffers") or {})}
    unknown = sorted(set(averaged) - set(full))
    if unknown:
        raise ValueError(
            f"{_WHO}: the EMA holds names the model lacks: {unknown[:5]}; it was made for "
            "another model."
        )
    tied = {alias: averaged[name] for alias, name in aliases.items() if name in averaged}
    return {**full, **averaged, **tied}  # the EMA names a tied tensor once


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
    check_one_of(_WHO, "weights", weights, ("model", "ema"))
    if isinstance(source, (str, os.PathLike)):
        manifest = verified_manifest(source)
        full, aliases, where = full_model(manifest), manifest.aliases, f"checkpoint {source}"
        ema = weights == "ema" and manifest.has("extras")
        extras = full_tree(manifest, "extras") if ema else {}
    else:
        model = source.model if isinstance(source, TrainState) else source
        kinds = "a module, a TrainState or a checkpoint folder"
        check(isinstance(model, torch.nn.Module), _WHO, "source", kinds, source, "", TypeError)
        full, where = model_state(model), "the state"
        aliases = split_aliases(full, _WHO)[1]  # and a clear error for a non-tensor entry
        extras = source.extras if isinstance(source, TrainState) else None
    if weights == "ema":
        if extras is None:
            raise ValueError(
                f"{_WHO}: weights='ema' needs a TrainState or a checkpoint folder (the EMA "
                "lives in state.extras); got a bare module."
            )
        full = _with_average(full, aliases, extras, key, where)
    if dtype is not None:
        full = {n: v.to(dtype) if v.is_floating_point() else v for n, v in full.items()}
    tensors = {name: host_tensor(value) for name, value in full.items()}
    separate_shared(tensors)  # a tied tensor is written under each name: copies
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, lambda temp: write_tensors(temp, tensors, {"format": "pt"}))
    return path
