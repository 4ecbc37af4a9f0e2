"""Tree utilities: map a function over the tensors of a nested structure, average records."""

import dataclasses
import functools
import math
import numbers
import operator
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from toolkit._checks import check_bool, check_type, describe, refuse
from toolkit._weighted import columns, weighted_sums

T = TypeVar("T")


def map_nested_tensor(fn: Callable[[torch.Tensor], Any], tree: T) -> T:
    """Apply ``fn`` to every tensor in a nested structure, keeping every container type.

    Containers are rebuilt with their own type: ``dict`` and any other ``Mapping``
    (``OrderedDict``, ``defaultdict`` with its ``default_factory``, ...), ``list``, ``tuple``,
    namedtuples and ``torch.return_types``, and dataclass instances (frozen ones too, rebuilt
    through ``dataclasses.replace`` so their ``__post_init__`` runs; fields declared with
    ``init=False`` are left to the dataclass to recompute). Key order is kept. An object that
    is none of these but has a ``.to`` method (a torch_geometric ``Data``: tensors the walk
    cannot see) is given to ``fn`` whole, so that ``fn = lambda t: t.to(device)`` moves it
    too (a ``BatchEncoding`` is a mapping: rebuilt, its tensors mapped). Modules have ``.to``
    too but are not data: a model moved from inside a batch would move the training model's
    own weights; they stay, as everything else (numbers, strings, ``None``, arrays),
    unchanged, as the same object. So does a transformers ``Cache`` (``DynamicCache``): it
    has no ``.to`` (transformers 5) and its tensors sit in its layers, which the model
    updates in place; build it on its device (the model's forward there). ``fn`` is called
    exactly once per tensor (or ``.to`` object) occurrence, in depth-first order.

    Args:
        fn: called as ``fn(tensor)``; its result takes the tensor's place.
        tree: any nesting of the containers above.

    Returns:
        A new structure of the same shape and container types; input containers are not
        modified.

    Raises:
        TypeError: when ``fn`` is not callable, a ``Mapping`` subclass cannot be rebuilt
            from a ``dict`` of its items (its constructor takes something else), or ``fn``
            fails on an object with ``.to`` (it expected a tensor).
        ValueError: when ``tree`` contains itself (a list holding itself, a dict holding
            a dict that holds the first, ...); the message names the path where the cycle
            closes. (A structure nested deeper than Python's recursion limit, without a
            cycle, raises ``RecursionError`` as before.)

    Example:
        >>> import torch
        >>> from toolkit import map_nested_tensor
        >>> from typing import NamedTuple
        >>> class Batch(NamedTuple):
        ...     x: torch.Tensor
        ...     meta: dict
        >>> batch = Batch(torch.ones(2), {"ids": [torch.tensor(3)], "name": "a"})
        >>> out = map_nested_tensor(lambda t: t * 2, batch)
        >>> type(out).__name__, out.x.tolist(), out.meta["ids"][0].item(), out.meta["name"]
        ('Batch', [2.0, 2.0], 6, 'a')
    """
    check_type(callable(fn), "map_nested_tensor", "fn", "callable as fn(tensor)", fn)
    try:
        return _map(fn, tree)
    except RecursionError:
        _refuse_cycle("map_nested_tensor", tree, "tree")
        raise  # deep but acyclic, or fn itself recursed too deep


def _map(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    # An own recursion rather than optree.tree_map: optree treats dataclasses (unless each is
    # registered), list/dict subclasses and Mappings other than dict/OrderedDict/defaultdict
    # as leaves, so their tensors would silently stay unmapped. One small recursion handles
    # every container the same way and keeps insertion order.
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, Mapping):
        items = {key: _map(fn, value) for key, value in tree.items()}
        if type(tree) is dict:
            return items
        if isinstance(tree, defaultdict):
            return type(tree)(tree.default_factory, items)
        try:
            return type(tree)(items)  # type: ignore[call-arg]
        except TypeError as error:
            raise TypeError(
                f"map_nested_tensor: cannot rebuild the Mapping type {type(tree).__qualname__} "
                f"from a dict of its items ({error}); convert it to a dict first."
            ) from error
    if isinstance(tree, (tuple, list)):
        values = [_map(fn, value) for value in tree]
        if hasattr(type(tree), "_fields") and hasattr(type(tree), "_make"):  # a namedtuple
            return type(tree)._make(values)  # type: ignore[union-attr]
        # list, tuple, torch.return_types (structseq) and their subclasses take an iterable
        return values if type(tree) is list else type(tree)(values)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        fields = [field.name for field in dataclasses.fields(tree) if field.init]
        return dataclasses.replace(tree, **{f: _map(fn, getattr(tree, f)) for f in fields})
    if callable(getattr(tree, "to", None)) and not isinstance(tree, (torch.nn.Module, type)):
        try:
            return fn(tree)
        except (AttributeError, TypeError) as error:
            raise TypeError(
                f"map_nested_tensor: fn failed on a {type(tree).__name__} ({error}); it holds "
                "tensors the walk cannot see and moves them with .to(): make fn handle it "
                "(e.g. lambda t: t.to(device)) or take it out of the tree."
            ) from error
    return tree


def _children(node: Any) -> list[tuple[str, Any]] | None:
    """The children that :func:`_map` (and, of mappings, :func:`key_average`) recurses into,
    each with its path suffix."""
    if isinstance(node, Mapping):
        return [(f"[{key!r}]", value) for key, value in node.items()]
    if isinstance(node, (tuple, list)):
        return [(f"[{i}]", value) for i, value in enumerate(node)]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return [(f".{f.name}", getattr(node, f.name)) for f in dataclasses.fields(node) if f.init]
    return None


def _refuse_cycle(who: str, tree: Any, name: str) -> None:
    """After a RecursionError, a ValueError naming where ``tree`` contains itself, if it does.

    Looked for only once the recursion failed: the common, acyclic call pays nothing for it.
    An explicit stack rather than recursion, since it runs after a RecursionError.
    """
    on_path: dict[int, str] = {}  # id of each container on the current path -> its path
    stack: list[tuple[Any, str, bool]] = [(tree, name, False)]
    while stack:
        node, path, leaving = stack.pop()
        if leaving:
            del on_path[id(node)]
            continue
        on_path[id(node)] = path
        stack.append((node, path, True))
        for suffix, child in reversed(_children(node) or []):
            if id(child) in on_path:
                raise ValueError(
                    f"{who}: {name} contains itself: {path + suffix} is {on_path[id(child)]}; "
                    "expected a structure without cycles; remove the back-reference."
                ) from None
            stack.append((child, path + suffix, False))


_Path = tuple[Hashable, ...]
_Kinds = dict[_Path, tuple[bool, int]]  # by path: whether a mapping, and the first record's index


def key_average(
    records: Iterable[Mapping[Hashable, Any]],
    *,
    exclude_nan: bool = False,
    weights: Iterable[float | torch.Tensor] | None = None,
) -> dict[Hashable, Any]:
    """Average a sequence of nested records, key by key, over the records that have the key.

    Each record is a nested mapping whose leaves are numbers or 0-d tensors (the ``records``
    of a :class:`toolkit.StepOutput`, for instance). The result has the union of the keys of
    all records, nested the same way, and each leaf is the mean of that leaf over the records
    that contain it, as a python ``float``. Sums are exact (``math.fsum``), so the result
    does not depend on record order.

    Host syncs: all 0-d tensors (values and weights) are copied to the host together, at
    most one host sync per call whatever the number of records; on the CPU, with nothing to
    wait for, each value is read directly. ``log_metrics``, ``progress`` and ``validate``
    read their values back the same way, once per publish, refresh or evaluation.

    Args:
        records: a sequence (or other iterable) of mappings; nested mappings are averaged
            recursively. An empty sequence gives ``{}``.
        exclude_nan: when ``True``, NaN values are left out of their key's mean; a key whose
            values are all NaN averages to NaN.
        weights: optional non-negative finite weights, numbers or 0-d tensors, one per record
            (e.g. the target count of each step): each leaf is then the weighted mean
            ``sum(w * v) / sum(w)`` over the records that have it. A record with weight 0
            contributes nothing (not even a NaN); a key with no positive weight gives NaN.

    Returns:
        A nested ``dict`` of python floats, keys in order of first appearance.

    Raises:
        TypeError: when ``records`` is a single mapping or not iterable, a record is not a
            mapping, a leaf is neither a real number nor a 0-d real tensor (the message
            names its key path), ``exclude_nan`` is not a bool, ``weights`` is not a
            sequence, or a weight is not a real number or 0-d real tensor (bools neither).
        ValueError: when ``weights`` does not have one entry per record, a weight is negative
            or not finite, a key holds a mapping in one record and a value in another, or a
            record contains itself (the message names the path where the cycle closes).

    Example:
        >>> import torch
        >>> from toolkit import key_average
        >>> records = [
        ...     {"loss": torch.tensor(2.0), "acc": {"top1": 0.5}},
        ...     {"loss": torch.tensor(4.0), "acc": {"top1": 1.0, "top5": 1.0}},
        ... ]
        >>> key_average(records)
        {'loss': 3.0, 'acc': {'top1': 0.75, 'top5': 1.0}}
        >>> key_average(records, weights=[3, 1])
        {'loss': 2.5, 'acc': {'top1': 0.625, 'top5': 1.0}}
        >>> key_average([{"x": float("nan")}, {"x": 1.0}], exclude_nan=True)
        {'x': 1.0}
    """
    iterable = isinstance(records, Iterable) and not isinstance(records, (Mapping, str, bytes))
    fix = "For one record, pass key_average([record])."
    check_type(iterable, "key_average", "records", "a sequence of mappings", records, fix)
    check_bool("key_average", "exclude_nan", exclude_nan)
    records = list(records)
    weight_list = [1] * len(records) if weights is None else _check_weights(weights, len(records))
    # Every path, in pre-order (a parent before its children): whether it holds a mapping,
    # and the record that first gave it that kind.
    kinds: _Kinds = {}
    flat: list[dict[_Path, Any]] = []  # each record's leaves by path
    expected = "a mapping of numbers, 0-d tensors or nested mappings"
    for index, record in enumerate(records):
        where = f"records[{index}]"
        check_type(isinstance(record, Mapping), "key_average", where, expected, record)
        flat.append({})
        try:
            _collect(record, (), index, kinds, flat[-1])
        except RecursionError:
            _refuse_cycle("key_average", record, where)
            raise
    reduced = weighted_sums(columns(flat), weight_list, exclude_nan=exclude_nan)
    if weights is not None:
        check_weight_values("key_average", "weights[{}]", reduced.weights)
    result: dict[Hashable, Any] = {}
    for path, (nested, _) in kinds.items():  # a parent before its children
        parent = functools.reduce(operator.getitem, path[:-1], result)
        parent[path[-1]] = {} if nested else _mean(*reduced.sums[path])
    return result


def _mean(total: float, weight: float) -> float:
    return float(total / weight) if weight else math.nan


def _collect(
    record: Mapping[Hashable, Any], at: _Path, index: int, kinds: _Kinds, leaves: dict[_Path, Any]
) -> None:
    """Note in ``kinds`` each path of ``record`` (under path ``at``), its leaves in ``leaves``."""
    for key, value in record.items():
        path = (*at, key)
        nested = isinstance(value, Mapping)
        first_nested, first = kinds.setdefault(path, (nested, index))
        if first_nested != nested:
            said = ("a value", "a nested mapping")
            got = f"{said[first_nested]} in records[{first}] but {said[nested]} in records[{index}]"
            refuse("key_average", _name(path), got, "the same structure in every record")
        tensor = isinstance(value, torch.Tensor)
        if nested:
            _collect(value, path, index, kinds, leaves)
        elif tensor and value.ndim == 0 and not value.is_complex():
            leaves[path] = value.detach()
        elif not tensor and isinstance(value, numbers.Real):
            leaves[path] = value
        else:
            expected = "a real number, a 0-d real tensor (reduce it: .mean()) or a mapping"
            where = f"records[{index}]{_name(path)}"
            refuse("key_average", where, describe(value), expected, TypeError)


def _check_weights(weights: Any, count: int) -> list[Any]:
    # A 1-d tensor iterates into 0-d tensors, which are fine; a 0-d one cannot be iterated.
    iterable = isinstance(weights, Iterable) and not isinstance(weights, (Mapping, str, bytes))
    ok = iterable and getattr(weights, "ndim", 1) == 1
    expected = "a sequence of numbers or 0-d tensors, one per record"
    check_type(ok, "key_average", "weights", expected, weights)
    weight_list = [check_weight("key_average", f"weights[{i}]", w) for i, w in enumerate(weights)]
    if len(weight_list) != count:
        raise ValueError(
            f"key_average: got {len(weight_list)} weights for {count} records; expected one each."
        )
    return weight_list


def check_weight(who: str, name: str, weight: Any, fix: str = "") -> Any:
    """``weight`` (0-d if a tensor); TypeError unless a real number or a one-element real tensor.

    Its value is checked by :func:`check_weight_values` once read (one host sync for all).
    """
    if isinstance(weight, torch.Tensor):
        ok = weight.numel() == 1 and not weight.is_complex() and weight.dtype != torch.bool
    else:  # True/False are Reals to Python, but as a weight they are a mix-up (a mask?)
        ok = isinstance(weight, numbers.Real) and not isinstance(weight, bool)
    if not ok:
        expected = f"a number >= 0 or a one-element real tensor{fix}"
        refuse(who, name, describe(weight), expected, TypeError)
    return weight.reshape(()) if isinstance(weight, torch.Tensor) else weight


def check_weight_values(who: str, name: str, weights: Sequence[Any], start: int = 0) -> None:
    """ValueError unless every weight (read back) is a finite number >= 0; ``name.format(i)``
    names weight ``i`` (counted from ``start``)."""
    for i, weight in enumerate(weights, start):
        if not (math.isfinite(weight) and weight >= 0):
            refuse(who, name.format(i), repr(weight), "a finite number >= 0")


def _name(path: _Path) -> str:
    return "".join(f"[{key!r}]" for key in path)
