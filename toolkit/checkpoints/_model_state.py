"""A model's state dict as a safetensors file: unwrapped names, tied weights stored once.

``unwrap(model).state_dict()`` has plain names (no ``_orig_mod.``/``module.``) and lists a
tied tensor under each of its names. safetensors refuses to write shared memory twice, so
each tied group is stored under its first name and the other names are recorded as
*aliases* (``{"lm_head.weight": "embed.weight"}``); loading puts the stored tensor back
under every name, so a strict ``load_state_dict`` sees all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from toolkit._unwrap import unwrap
from toolkit.checkpoints._codec import TreeError, describe

__all__ = ["expand", "model_differences", "model_tensors", "split_aliases"]


def _identity(value: torch.Tensor) -> tuple[Any, ...] | None:
    # Two state-dict entries are the same tensor when they view the same memory the same
    # way. Empty tensors have no memory to share.
    if not value.numel():
        return None
    if type(value) not in (torch.Tensor, torch.nn.Parameter) and hasattr(value, "to_local"):
        local = value.to_local()  # a DTensor: its shard tells ties apart
        if not local.numel():
            return None
        return ("shard", local.data_ptr(), local.dtype, tuple(value.shape), local.stride())
    return (value.device, value.data_ptr(), value.dtype, tuple(value.shape), value.stride())


def split_aliases(
    state_dict: Mapping[str, Any], who: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors by first name, {alias: first name})`` of a state dict with tied entries.

    Raises:
        TreeError: an entry is not a tensor (e.g. a module's ``get_extra_state``).
    """
    first: dict[tuple[Any, ...], str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TreeError(
                f"{who}: state_dict entry {name!r} is {describe(value)}, not a tensor; a "
                "model file holds tensors only (return a tensor from get_extra_state)."
            )
        key = _identity(value)
        if key is not None and key in first:
            aliases[name] = first[key]
            continue
        if key is not None:
            first[key] = name
        tensors[name] = value
    return tensors, aliases


def model_tensors(
    model: torch.nn.Module, who: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The unwrapped model's state dict, split with :func:`split_aliases` (no copies)."""
    return split_aliases(unwrap(model).state_dict(), who)


def expand(tensors: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> dict[str, Any]:
    """The full state dict: every alias maps to its stored tensor."""
    full = dict(tensors)
    for alias, name in aliases.items():
        full[alias] = tensors[name]
    return full


def model_differences(
    model: torch.nn.Module,
    shapes: Mapping[str, tuple[int, ...]],
    aliases: Mapping[str, str],
) -> list[str]:
    """How a saved model (names -> shapes, aliases) differs from ``model``; empty if none."""
    live, live_aliases = model_tensors(model, "load_checkpoint")
    saved_names = set(shapes) | set(aliases)
    live_names = set(live) | set(live_aliases)
    out = []
    missing = sorted(live_names - saved_names)
    unexpected = sorted(saved_names - live_names)
    if missing:
        out.append(f"model: keys missing from the checkpoint: {_few(missing)}")
    if unexpected:
        out.append(f"model: unexpected keys in the checkpoint: {_few(unexpected)}")
    full_live = expand(live, live_aliases)
    for name in sorted(saved_names & live_names):
        saved_shape = shapes[aliases.get(name, name)]
        live_shape = tuple(full_live[name].shape)
        if saved_shape != live_shape:
            out.append(
                f"model: {name!r} has shape {list(saved_shape)} in the checkpoint, "
                f"{list(live_shape)} in the model"
            )
    common = saved_names & live_names
    saved_ties, live_ties = _ties(aliases, common), _ties(live_aliases, common)
    reported = set()
    for name in sorted(common):
        pair = (saved_ties[name], live_ties[name])
        if pair[0] != pair[1] and pair not in reported:
            reported.add(pair)
            out.append(
                f"model: tied weights differ: the checkpoint shares one tensor among "
                f"{sorted(pair[0])}, the model among {sorted(pair[1])} (tie the weights as "
                "in the saved model)"
            )
    return out


def _ties(aliases: Mapping[str, str], names: set[str]) -> dict[str, frozenset[str]]:
    """For each name, the names (among ``names``) that share its tensor."""
    groups: dict[str, set[str]] = {}
    for name in names:
        groups.setdefault(aliases.get(name, name), set()).add(name)
    return {name: frozenset(groups[aliases.get(name, name)]) for name in names}


def _few(names: list[str], limit: int = 10) -> str:
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more
