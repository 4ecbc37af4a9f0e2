"""An optimizer's state dict keyed by parameter names instead of positions.

``optimizer.state_dict()`` numbers the parameters in the order of its groups. Those numbers
mean nothing outside the process (and JSON would turn them into strings that
``load_state_dict`` silently ignores), so a checkpoint keys the state by the unwrapped
model's parameter names, and a load maps the names back to the template optimizer's own
numbering before calling its ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from toolkit._unwrap import unwrap

__all__ = ["named_state", "numbered_state", "optimizer_differences", "parameter_names"]


def parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Per parameter group, the names of its parameters, in the optimizer's order.

    Raises:
        ValueError: the optimizer holds a tensor that is not a parameter of the model.
    """
    names = {id(p): name for name, p in unwrap(model).named_parameters()}
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        row = []
        for i, param in enumerate(group["params"]):
            if id(param) not in names:
                raise ValueError(
                    f"save_checkpoint: optimizer.param_groups[{g}]['params'][{i}] (shape "
                    f"{list(param.shape)}) is not a parameter of the model, so the checkpoint "
                    "cannot name it; register it on the model (e.g. as an nn.Parameter "
                    "attribute) or keep it in a separate optimizer saved through objects=."
                )
            row.append(names[id(param)])
        groups.append(row)
    return groups


def named_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with names in place of parameter numbers."""
    groups = parameter_names(model, optimizer)
    raw = optimizer.state_dict()
    index_to_name: dict[int, str] = {}
    for names, group in zip(groups, raw["param_groups"], strict=True):
        index_to_name.update(zip(group["params"], names, strict=True))
    return {
        "state": {index_to_name[i]: value for i, value in raw["state"].items()},
        "param_groups": [
            {**group, "params": names}
            for names, group in zip(groups, raw["param_groups"], strict=True)
        ],
    }


def optimizer_differences(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    saved_class: str,
    saved: Mapping[str, Any],
) -> list[str]:
    """How a saved named state differs from the template optimizer; empty if none."""
    out = []
    live_class = type(optimizer).__name__
    if saved_class != live_class:
        out.append(f"optimizer: the checkpoint holds a {saved_class}, the template a {live_class}")
    live_groups = parameter_names(model, optimizer)
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
            detail = (
                f"missing {missing}, unexpected {unexpected}"
                if missing or unexpected
                else "same names in another order"
            )
            out.append(f"optimizer: parameter group {g} differs: {detail}")
    known = {name for row in live_groups for name in row}
    stray = sorted(set(saved.get("state", {})) - known)
    if stray:
        out.append(f"optimizer: state for parameters the template lacks: {stray}")
    return out


def numbered_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]
) -> dict[str, Any]:
    """The saved named state renumbered for ``optimizer.load_state_dict``."""
    live = optimizer.state_dict()["param_groups"]
    name_to_index: dict[str, int] = {}
    for names, group in zip(parameter_names(model, optimizer), live, strict=True):
        name_to_index.update(zip(names, group["params"], strict=True))
    return {
        "state": {name_to_index[name]: value for name, value in saved["state"].items()},
        "param_groups": [
            {**group, "params": [name_to_index[name] for name in group["params"]]}
            for group in saved["param_groups"]
        ],
    }
