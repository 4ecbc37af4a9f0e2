"""ema: an exponential moving average of the weights, kept in ``state.extras``."""

import copy
from collections.abc import Mapping
from typing import Any

import torch

from toolkit._checks import check, check_bool, check_count, check_key
from toolkit._unwrap import unwrap
from toolkit.loop._run import Event, Plugin, declare, plugin_factory
from toolkit.plugins._shared import EmaEntry, due
from toolkit.step._state import TrainState


def _averaged(model: torch.nn.Module, frozen: bool) -> dict[str, torch.nn.Parameter]:
    """The parameters the average holds: the trainable ones, with ``frozen`` all of them."""
    return {n: p for n, p in model.named_parameters() if frozen or p.requires_grad}


def _placed(entry: Mapping, model: torch.nn.Module, buffers: bool, key: str, frozen: bool) -> dict:
    """``entry`` with its tensors on the weights' devices and dtypes, once its names match."""
    out = dict(entry)
    live_buffers = dict(model.named_buffers()) if buffers else {}
    for kind, live in (("params", _averaged(model, frozen)), ("buffers", live_buffers)):
        held = entry[kind]
        if held.keys() != live.keys():
            said = f"ema: state.extras[{key!r}][{kind!r}] does not match the model's {kind}: "
            said += f"missing {sorted(live.keys() - held.keys())[:5]}, unexpected "
            fix = "Resume with the same model, trainable parameters and ema(buffers=, frozen=) "
            fix += f"options, or drop state.extras[{key!r}]."
            raise ValueError(f"{said}{sorted(held.keys() - live.keys())[:5]}. {fix}")
        # The average lives on the weights' device for the fused update.
        out[kind] = {n: t.to(device=live[n].device, dtype=live[n].dtype) for n, t in held.items()}
    return out


def _lists(model: torch.nn.Module, entry: Mapping[str, Any], buffers: bool, frozen: bool) -> tuple:
    """The fused update's lists: averaged and live floating-point tensors, then the held and
    live integer ones (buffers such as counters), which are copied."""
    bare = unwrap(model)
    live = _averaged(bare, frozen) | (dict(bare.named_buffers()) if buffers else {})
    held = entry["params"] | entry["buffers"]
    mean = {n for n, t in live.items() if t.is_floating_point() or t.is_complex()}
    names = ([n for n in live if n in mean], [n for n in live if n not in mean])
    return tuple([d[n] for n in group] for group in names for d in (held, live))


@plugin_factory(order=10)
def ema(
    decay: float = 0.999, *, warmup: bool = True, every: int = 1, buffers: bool = False,
    frozen: bool = False, key: str = "ema",
) -> Plugin:  # fmt: skip
    """A plugin keeping an exponential moving average (EMA) of the model's weights.

    After every ``every``-th *applied* optimizer update (``state.step % every == 0`` on a
    ``"step"`` event whose ``out.updated`` is true; micro-batches that do not close an
    accumulation window and windows rejected by the guard or skipped by the fp16 scaler do
    not count), each averaged tensor moves towards the live one::

        ema <- d_n * ema + (1 - d_n) * param

    With ``warmup=True`` the decay ramps up as ``d_n = min(decay, (1 + n) / (10 + n))``,
    where ``n`` is the number of EMA updates done before this one (the convention of
    TensorFlow's ``ExponentialMovingAverage(num_updates=...)`` and timm's ``ModelEma``): the
    early average follows the fast-moving weights instead of being dominated by the random
    initialisation. With ``warmup=False``, ``d_n = decay`` always.

    Only trainable parameters (``requires_grad``) are averaged: a frozen one never changes,
    so its average is itself, and for a LoRA adapter on a 7B base a copy of the base would
    be a second 7B model in memory. :func:`ema_model` and ``export_model(weights="ema")``
    take the frozen parameters from the model.

    The average lives in ``state.extras[key]`` as ``{"step": state.step of the last EMA
    update, "num_updates": n, "params": {name: tensor}, "buffers": {name: tensor}}``. Names
    are those of the unwrapped model (no ``torch.compile``/DDP prefixes); tensors have the
    weights' device and dtype and are updated in place with fused ``torch._foreach_lerp_``
    kernels, without a host sync. On ``"start"`` the entry is created from the current
    weights when absent; an entry already in the state (from an earlier run) is kept,
    checked against the model and moved to the weights' device. ema runs before
    ``validate``, which so evaluates the new average. A second ``ema()`` under the same key,
    or another plugin of the run under it (e.g. ``validate(key="ema")``), is refused before
    training; give each its own ``key=``. Read the average with :func:`ema_model`.

    Args:
        decay: the decay in ``[0, 1)``; the average spans roughly ``1 / (1 - decay)`` updates.
        warmup: ramp the decay up as described above.
        every: update the average every this many applied updates.
        buffers: also average floating-point buffers (e.g. BatchNorm running statistics);
            other buffers (e.g. ``num_batches_tracked``) are copied. With ``False`` only
            parameters are averaged and :func:`ema_model` keeps the live model's buffers.
        frozen: also average parameters with ``requires_grad=False``, for a run that
            unfreezes them later (a frozen base fine-tuned in a second phase); integer ones
            are copied, as integer buffers are.
        key: the ``state.extras`` key.

    Returns:
        The plugin, ``plugin(event) -> TrainState | None``.

    Raises:
        ValueError: ``decay`` outside ``[0, 1)``, ``every < 1``, an empty ``key``; before
            training, ``key`` kept by another plugin of the run; at ``"start"``, an existing
            entry whose names do not match the model.
        TypeError: ``warmup``, ``buffers`` or ``frozen`` not a bool.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, make_step, run
        >>> from toolkit.plugins import ema, ema_model
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> data = [torch.ones(4, 2)] * 5
        >>> step = make_step(lambda m, b: m(b).square().mean())
        >>> state = run(step, state, data, max_steps=5, plugins=[ema(0.9)])
        >>> state.extras["ema"]["num_updates"], sorted(state.extras["ema"]["params"])
        (5, ['bias', 'weight'])
        >>> ema_model(state).training
        False
    """
    number = isinstance(decay, (int, float)) and not isinstance(decay, bool)
    check(number and 0 <= decay < 1, "ema", "decay", "a number in [0, 1), e.g. 0.999", decay)
    check_count("ema", "every", every, 1, "applied updates between averages")
    for name, value in (("warmup", warmup), ("buffers", buffers), ("frozen", frozen)):
        check_bool("ema", name, value)
    check_key("ema", key)

    def fresh(state: TrainState) -> TrainState:
        """The state with a new average: a copy of the current weights."""
        bare = unwrap(state.model)
        params = {name: p.detach().clone() for name, p in _averaged(bare, frozen).items()}
        bufs = {name: b.detach().clone() for name, b in bare.named_buffers()} if buffers else {}
        entry = EmaEntry(step=state.step, num_updates=0, params=params, buffers=bufs)
        return state.replace(extras={**state.extras, key: entry})

    # The fused update's lists, and the model and entry dicts they were built for: rebuilt
    # only when those change (a resume, the adoption at "start"), since walking the module
    # tree per update costs about as much as the lerp itself on a model of many small tensors.
    built_for: tuple[Any, ...] = ()
    lists: tuple[Any, ...] = ()

    def plugin(event: Event) -> TrainState | None:
        nonlocal built_for, lists
        kind, state = event.kind, event.state
        entry = state.extras.get(key)
        if entry is None:  # at a step: called outside run(), no "start" was delivered
            # At "restore": the template a checkpoint restores the average into.
            return fresh(state) if kind in ("restore", "start") or due(event, every) else None
        if kind == "start":
            entry = _placed(entry, unwrap(state.model), buffers, key, frozen)
            return state.replace(extras={**state.extras, key: entry})
        if not due(event, every):
            return None
        n = entry["num_updates"]
        d = min(decay, (1 + n) / (10 + n)) if warmup else decay
        held = (state.model, entry["params"], entry["buffers"])
        if not built_for or any(a is not b for a, b in zip(built_for, held)):
            built_for, lists = held, _lists(state.model, entry, buffers, frozen)
        averaged, live, copied, sources = lists
        with torch.no_grad():
            if averaged:
                # lerp(ema, p, 1 - d) = d * ema + (1 - d) * p, one fused kernel per device/dtype.
                torch._foreach_lerp_(averaged, live, 1.0 - d)
            if copied:
                torch._foreach_copy_(copied, sources)
        new = {**entry, "step": state.step, "num_updates": n + 1}
        return state.replace(extras={**state.extras, key: new})

    return declare(plugin, key)


def ema_model(state: TrainState, key: str = "ema") -> torch.nn.Module:
    """A copy of the (unwrapped) model carrying the EMA weights, in eval mode.

    The training model is not touched. Parameters and buffers that the average does not
    hold (frozen parameters, and all buffers with ``ema(buffers=False)``) keep the training
    model's current values.

    Args:
        state: a state that went through a run with the :func:`ema` plugin.
        key: the ``state.extras`` key given to :func:`ema`.

    Returns:
        A deep copy of ``state.model`` without compile/DDP wrappers, with the averaged
        parameters (and buffers) loaded, in ``eval()`` mode.

    Raises:
        KeyError: ``state.extras`` has no EMA under ``key``.
        ValueError: the EMA's names do not match the model's.

    Example:
        >>> import torch
        >>> from toolkit import TrainState
        >>> from toolkit.plugins import ema, ema_model
        >>> model = torch.nn.Linear(1, 1)
        >>> extras = {"ema": {"step": 0, "num_updates": 0, "buffers": {},
        ...           "params": {"weight": torch.full((1, 1), 2.0), "bias": torch.zeros(1)}}}
        >>> state = TrainState(model=model, extras=extras)
        >>> ema_model(state).weight.item(), ema_model(state) is model
        (2.0, False)
    """
    keys = f"a key of state.extras, one of {sorted(state.extras)}"
    fix = f"Add ema(key={key!r}) to run()'s plugins, or pass the key that ema() used."
    check(key in state.extras, "ema_model", "key", keys, key, fix, KeyError)
    entry = state.extras[key]
    averaged = copy.deepcopy(unwrap(state.model))
    params = dict(averaged.named_parameters())
    frozen = any(not params[n].requires_grad for n in entry["params"] if n in params)
    placed = _placed(entry, averaged, bool(entry["buffers"]), key, frozen)
    tensors = params | dict(averaged.named_buffers())
    with torch.no_grad():
        for name, t in (placed["params"] | placed["buffers"]).items():
            tensors[name].copy_(t)
    return averaged.eval()
