"""Does a checkpoint fit a template state? One line per difference, everything at once.

The model: the same names, shapes and ties (and, for a trainable-only checkpoint, the
same frozen parameters). The optimizer: the same parameters in the same groups, state of
the same shapes and dtypes, each group through the optimizer's own argument checks. The
scheduler's and scaler's settings (constructor arguments, base learning rates, scale):
finite, and > 0 where the template's int is. ``extras`` entries that hold tensors (an
EMA's): the same shapes. Counters and best values are not compared, so a checkpoint also
loads into a live state that trained on.
"""

import inspect
import math
from collections.abc import Mapping
from typing import Any

import optree
import torch

from toolkit.checkpoints._model_state import few, model_part, split_aliases
from toolkit.step._state import TrainState


def compare(what: str, saved: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    """The keys one of ``saved`` and ``live`` lacks, and those whose values differ.

    Example:
        >>> compare("components", {"optimizer": "SGD"}, {"optimizer": "AdamW"})
        ["components: 'optimizer': SGD in the checkpoint, AdamW in the template"]
    """
    lacking = {"in the template, not the checkpoint": live.keys() - saved.keys()}
    lacking["in the checkpoint, not the template"] = saved.keys() - live.keys()
    out = [f"{what}: {where}: {few(keys)}" for where, keys in lacking.items() if keys]
    diff = [key for key in sorted(saved.keys() & live.keys()) if saved[key] != live[key]]
    line = "{}: {!r}: {} in the checkpoint, {} in the template"
    return out + [line.format(what, k, saved[k], live[k]) for k in diff]


def model_fit(
    model: torch.nn.Module, stored: Mapping, aliases: Mapping[str, str], frozen: Any
) -> list[str]:
    """How a saved model (every name, aliases too -> shape and dtype; the aliases) differs
    from ``model``.

    With ``frozen`` (the fingerprint of a trainable-only save) the saved names are compared
    with ``model``'s trainable part and ``frozen`` with the fingerprint of the rest.
    """
    live, fingerprint = model_part(model, frozen is not None, "load_checkpoint")
    out = [] if fingerprint == frozen else [
        f"model: its frozen parameters ({fingerprint}) are not those the trainable-only "
        f"checkpoint was saved with ({frozen}); build the template on the same base model "
        "(the same pretrained weights, the same parameters frozen)."
    ]  # fmt: skip
    live_aliases = split_aliases(live, "load_checkpoint")[1]  # live names every tensor already
    saved = {n: f"shape {list(shape)}" for n, (shape, _) in stored.items()}
    full = {n: f"shape {list(t.shape)}" for n, t in live.items()}
    common = saved.keys() & full.keys()
    out += [
        f"model: {n!r}: {stored[n][1]} in the checkpoint, {live[n].dtype} in the template; "
        f"cast the model first, e.g. model.to({stored[n][1]})"
        for n in sorted(common) if stored[n][1] != live[n].dtype
    ]  # fmt: skip
    theirs, ours = _ties(aliases, common), _ties(live_aliases, common)
    differ = {(theirs[n], ours[n]) for n in common if theirs[n] != ours[n]}
    return out + compare("model", saved, full) + [
        f"model: tied weights differ: the checkpoint shares one tensor among {sorted(a)}, "
        f"the model among {sorted(b)} (tie the weights as in the saved model)"
        for a, b in sorted(differ, key=str)
    ]  # fmt: skip


def _ties(aliases: Mapping[str, str], names: set[str]) -> dict[str, frozenset[str]]:
    """For each name, the names (among ``names``) that share its tensor."""
    groups: dict[str, set[str]] = {}
    for name in names:
        groups.setdefault(aliases.get(name, name), set()).add(name)
    return {name: frozenset(groups[aliases.get(name, name)]) for name in names}


def kind_of(value: Any) -> str:
    tensor = isinstance(value, torch.Tensor)
    return f"shape {list(value.shape)} {value.dtype}" if tensor else repr(value)[:40]


def _fits(saved: Any, live: Any, strict: bool) -> bool:
    if isinstance(live, torch.Tensor):
        return isinstance(saved, torch.Tensor) and kind_of(saved) == kind_of(live)
    if isinstance(live, bool):
        return isinstance(saved, bool)
    if isinstance(live, (int, float)):
        if type(saved) not in (int, float) or saved != saved:  # a number, not NaN
            return False
        finite = abs(saved) < math.inf or abs(live) == math.inf
        return not strict or (finite and (saved > 0 or not (type(live) is int and live > 0)))
    return not isinstance(live, (dict, list, tuple))


def _mismatches(where: str, saved: Any, live: Any, settings: Any, strict: bool) -> list[str]:
    """Where ``saved`` holds what could not replace the template's ``live`` value.

    Tensors of the same shape and dtype, a bool for a bool, a number (not NaN) for a
    number, lists of the same length, a dict for a dict. A setting (under a key of
    ``settings``: a constructor argument) is also finite where the template's is (no
    infinite learning rate) and > 0 where the template's is an int > 0 (``StepLR``'s
    ``step_size``); a counter or a best value is not held to that (``strict``: this value
    is a setting). No ``settings`` (an optimizer's state, an EMA's): every key of the
    template that holds more than a flag must be there.
    """
    out: list[str] = []
    if isinstance(live, dict) and isinstance(saved, dict):
        required = [k for k, v in live.items() if v is not None and not isinstance(v, (bool, str))]
        out = [f"{where}[{k!r}]: missing" for k in required if k not in saved and not settings]
        children = [(k, saved[k], live[k], strict or k in settings) for k in live if k in saved]
    elif isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)):
        children = [(i, s, v, strict) for i, (s, v) in enumerate(zip(saved, live))]
        if len(saved) != len(live):
            return [f"{where}: {len(saved)} items in the checkpoint, {len(live)} in the template"]
    else:
        differ = f"{where}: {kind_of(saved)} in the checkpoint, {kind_of(live)} in the template"
        return [] if _fits(saved, live, strict) else [differ]
    nested = (_mismatches(f"{where}[{k!r}]", s, v, settings, q) for k, s, v, q in children)
    return out + [m for found in nested for m in found]


def settings_fit(where: str, saved: Any, template: Any, like: TrainState, alike: bool) -> list[str]:
    """A scheduler's (or GradScaler's) state, once of the template's class (``alike``): its
    settings (the arguments of its constructor and of the schedulers it chains, base
    learning rates, scale) held to the strict rule; counters only to be numbers."""
    if not alike:
        return []
    kinds = [type(o) for o in (template, *getattr(template, "_schedulers", ()))]
    settings = {name for kind in kinds for name in inspect.signature(kind).parameters}
    settings = settings - {"last_epoch"} | {"base_lrs", "scale"}
    return _mismatches(where, saved, template.state_dict(), settings, False)


def optimizer_fit(path: str, saved: Any, template: Any, like: TrainState, alike: bool) -> list[str]:
    """The same parameters in the same groups; then, of the template's class (``alike``),
    state and hyperparameters as the template's (all of it strict) and each saved group
    through the optimizer's own argument checks (Adam's betas in [0, 1), lr >= 0, ...)."""
    stateless = dict.fromkeys(saved["state"], "state without a group")
    out = compare("optimizer parameters", {**stateless, **_groups(saved)}, _groups(template))
    if out or not alike:
        return out
    out = _mismatches(path, saved, template, None, True)
    members = getattr(like.optimizer, "optimizers", [like.optimizer])
    kinds = [(type(o), [*g["params"], torch.empty(0)][0]) for o in members for g in o.param_groups]
    groups = [] if out else saved["param_groups"]
    for i, ((kind, param), group) in enumerate(zip(kinds, groups)):
        names = inspect.signature(kind).parameters.keys() - {"params"}
        # A new optimizer over one new tensor of the parameter's kind (Muon takes 2-D ones).
        scratch = param.new_zeros((1,) * param.dim(), requires_grad=True)
        try:
            kind([scratch], **{name: group[name] for name in names & group.keys()})
        except (TypeError, ValueError, RuntimeError) as error:  # TypeError: other arguments
            out += [] if isinstance(error, TypeError) else [f"{path}: param_groups[{i}]: {error}"]
    return out


def _groups(optimizer: Mapping[str, Any]) -> dict[str, str]:
    """Each parameter name of an optimizer state dict (DCP's) -> "group N"."""
    groups = enumerate(optimizer["param_groups"])
    return {name: f"group {g}" for g, group in groups for name in group["params"]}


def extras_fit(where: str, saved: Any, template: Any, like: TrainState, alike: bool) -> list[str]:
    """The entries of the template's ``extras`` that hold tensors (an EMA's); the rest is
    the plugins' own (a best score may differ)."""
    leaves = {k: optree.tree_leaves(v) for k, v in template.items()}
    tensors = [k for k, found in leaves.items() if any(isinstance(x, torch.Tensor) for x in found)]
    return _mismatches(where, {**template, **saved}, {k: template[k] for k in tensors}, (), False)


def is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def field_values(saved: Mapping, live: Mapping[str, Any], differences: list[str]) -> dict[str, Any]:
    """The saved ``state`` component as TrainState values (``live``: the template's);
    NamedTuples rebuilt with the template's type. A field the checkpoint lacks (added
    to TrainState later) keeps the template's value; one the template lacks is a difference.
    """
    tuples = {n: v for n, v in saved.items() if is_namedtuple(live.get(n)) and isinstance(v, dict)}
    # A NamedTuple's fields count as keys of their own ("guard.x").
    known = [*live, *(f"{n}.{f}" for n, v in live.items() if is_namedtuple(v) for f in v._fields)]
    found = [n for n in saved if n not in tuples] + [f"{n}.{k}" for n in tuples for k in tuples[n]]
    if unknown := set(found) - set(known):
        differences.append(f"state fields: in the checkpoint, not the template: {few(unknown)}")
        return {}
    return {**saved, **{n: type(live[n])(**{**live[n]._asdict(), **v}) for n, v in tuples.items()}}
