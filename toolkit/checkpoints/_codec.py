"""codec: a tree of tensors and JSON values <-> (a JSON document, a dict of named tensors).

The rule every checkpointed tree follows (optimizer and scheduler state, ``state.extras``,
the state of extra objects): dicts with ``str`` keys, lists, tuples, ints, floats (also
inf and NaN), bools, ``None``, strings and tensors, nested freely. Dicts with other keys
are allowed when every key is an int, float, bool, ``None``, str or a tuple of these.
Anything else is refused when saving, naming its path: the load path only reads JSON and
safetensors, so it could not rebuild it without running code.

Values JSON has no form for become tagged objects: ``{"$tensor": name}`` (plus ``dtype``
and ``shape`` for dtypes safetensors has no code for, ``device`` when not on the CPU,
``"dcp": true`` when kept in the sharded files), ``{"$tuple": [...]}``,
``{"$float": "nan"}``, ``{"$items": [[key, value], ...]}`` (non-str keys) and
``{"$dict": {...}}`` (a str key starting with ``$``).
"""

from __future__ import annotations

import math
import types
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "TreeError",
    "decode",
    "describe",
    "encode",
    "host_tensor",
    "separate_shared",
    "tensor_paths",
]

_SCALARS = (bool, int, float, str, type(None))
_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
# safetensors codes the dtypes below; others (complex128, ...) are stored as raw bytes.
_NATIVE = frozenset(
    getattr(torch, name)
    for name in (
        *("float64", "float32", "float16", "bfloat16", "complex64", "bool", "float8_e4m3fn"),
        *("int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "float8_e5m2"),
    )
    if hasattr(torch, name)
)


class TreeError(TypeError):
    """A value that the checkpoint format cannot store, or a document it cannot read."""


def describe(value: Any) -> str:
    """A short phrase for a value's kind, for error messages ("a function", "a numpy.int64")."""
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return "a function"
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return f"a NamedTuple ({type(value).__qualname__})"
    module = "" if type(value).__module__ == "builtins" else f"{type(value).__module__}."
    return f"a {module}{type(value).__qualname__}"


def _where(root: str, path: tuple[Any, ...]) -> str:
    return root + "".join(f"[{part!r}]" for part in path)


def _refused(root: str, path: tuple[Any, ...], value: Any) -> TreeError:
    hint = ""
    if type(value).__module__ == "numpy":
        hint = " Convert numpy values with .item() or torch.from_numpy()."
    elif isinstance(value, tuple):
        hint = " Store a dict of its fields (value._asdict()) instead."
    return TreeError(
        f"{_where(root, path)}: {describe(value)}, which a checkpoint cannot store; keep only "
        f"tensors, numbers, strings, bools, None, lists, tuples and dicts in checkpointed "
        f"state.{hint}"
    )


def encode(
    tree: Any,
    root: str,
    *,
    copy: bool = False,
    external: Callable[[torch.Tensor], bool] | None = None,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``tree`` into a JSON-ready document and the tensors it refers to (by path).

    CPU tensors are used as they are unless ``copy``; tensors for which ``external`` is
    true (FSDP2's DTensors) are returned as they are, marked ``"dcp": true``. A tensor met
    twice is stored once. Raises TreeError naming the first value the rule does not allow.
    """
    tensors: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}
    keep: list[torch.Tensor] = []  # keeps ids valid until the end

    def tensor(value: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        outside = external is not None and external(value)
        if not outside and _unstorable(value):
            raise TreeError(
                f"{_where(root, path)}: {_unstorable(value)}, which a checkpoint cannot "
                "store; keep dense, materialised tensors in checkpointed state."
            )
        if id(value) not in names:
            name = "/".join(str(p) for p in (root, *path))
            while name in tensors:  # dict keys may hold "/": two paths can join alike
                name += "~"
            names[id(value)] = name
            keep.append(value)
            tensors[name] = value if outside else host_tensor(value, copy)
        ref: dict[str, Any] = {"$tensor": names[id(value)]}
        if outside:
            return {**ref, "dcp": True}
        if value.dtype not in _NATIVE:
            ref.update(dtype=str(value.dtype).removeprefix("torch."), shape=list(value.shape))
        if value.device.type != "cpu":
            ref["device"] = str(value.device)
        return ref

    def walk(value: Any, path: tuple[Any, ...], key: bool = False) -> Any:
        kind = type(value)
        if kind is float and not math.isfinite(value):
            return {"$float": repr(value)}
        if kind in _SCALARS:
            return value
        if kind is tuple:
            return {"$tuple": [walk(item, (*path, i), key) for i, item in enumerate(value)]}
        if key:
            raise TreeError(
                f"{_where(root, path)}: a dict key that is {describe(value)}, which a "
                "checkpoint cannot store; use str, int, float, bool, None or tuple keys."
            )
        if isinstance(value, torch.Tensor):
            return tensor(value, path)
        if kind is list:
            return [walk(item, (*path, i)) for i, item in enumerate(value)]
        if kind is dict or kind is OrderedDict:
            if any(type(k) is not str for k in value):
                return {
                    "$items": [[walk(k, path, True), walk(v, (*path, k))] for k, v in value.items()]
                }
            body = {k: walk(v, (*path, k)) for k, v in value.items()}
            return {"$dict": body} if any(k.startswith("$") for k in value) else body
        raise _refused(root, path, value)

    document = walk(tree, ())
    local = {n: t for n, t in tensors.items() if external is None or not external(t)}
    separate_shared(local)
    tensors.update(local)
    return document, tensors


def _unstorable(value: torch.Tensor) -> str:
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        return f"a {type(value).__name__} (sharded or subclassed tensors are not supported)"
    if value.layout != torch.strided:
        return f"a tensor with layout {value.layout}"
    if value.is_quantized:
        return "a quantized tensor"
    if value.device.type == "meta":
        return "a tensor on the meta device (no data)"
    return ""


def host_tensor(value: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """A contiguous CPU tensor with the value's data (a copy when ``copy`` or when needed).

    Dtypes safetensors has no code for come back as flat ``uint8`` bytes.
    """
    host = value.detach()
    if host.device.type != "cpu":
        host = host.to("cpu")  # a new tensor already: no extra copy needed
    elif copy or not host.is_contiguous():
        host = host.clone(memory_format=torch.contiguous_format)
    host = host.contiguous()
    return host if host.dtype in _NATIVE else host.reshape(-1).view(torch.uint8)


def separate_shared(tensors: dict[str, torch.Tensor]) -> None:
    """Give tensors that share memory copies of their own (safetensors refuses shared memory)."""
    owners: dict[int, list[str]] = {}
    for name, value in tensors.items():
        if value.numel():
            owners.setdefault(value.untyped_storage().data_ptr(), []).append(name)
    for group in owners.values():
        for name in group if len(group) > 1 else ():
            tensors[name] = tensors[name].clone()


def _child(template: Any, key: Any) -> Any:
    if isinstance(template, Mapping):
        return template.get(key)
    if isinstance(template, (list, tuple)) and isinstance(key, int) and key < len(template):
        return template[key]
    return None


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, (list, tuple)) else value


def decode(
    document: Any,
    tensors: Mapping[str, torch.Tensor],
    root: str,
    *,
    like: Any = None,
    sharded: Callable[[str, Any], torch.Tensor] | None = None,
) -> Any:
    """Rebuild the tree that :func:`encode` split.

    A tensor goes to the device of the template's tensor at the same path in ``like``,
    else to the device it was saved from when this process has it, else to the CPU.
    A ``"dcp"`` reference becomes ``sharded(name, template leaf)`` (a tensor to fill).
    Raises TreeError for a missing tensor or an unknown tag.
    """

    def tensor(ref: Mapping[str, Any], template: Any, path: tuple[Any, ...]) -> torch.Tensor:
        name = ref["$tensor"]
        if ref.get("dcp") and sharded is not None:
            return sharded(name, template)
        if name not in tensors:
            raise TreeError(f"{_where(root, path)}: tensor {name!r} is not in the file.")
        value = tensors[name]
        if "dtype" in ref:
            dtype = getattr(torch, ref["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise TreeError(f"{_where(root, path)}: unknown dtype {ref['dtype']!r}.")
            value = value.view(dtype).reshape(ref["shape"])
        if isinstance(template, torch.Tensor):
            return value.to(template.device)
        return value.to(_usable(ref["device"])) if "device" in ref else value

    def walk(node: Any, template: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(node, list):
            return [walk(v, _child(template, i), (*path, i)) for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        tag = next((key for key in node if key.startswith("$")), None)
        if tag is None or tag == "$dict":
            body = node if tag is None else node[tag]
            return {k: walk(v, _child(template, k), (*path, k)) for k, v in body.items()}
        if tag == "$tensor":
            return tensor(node, template, path)
        if tag == "$tuple":
            return tuple(walk(v, _child(template, i), (*path, i)) for i, v in enumerate(node[tag]))
        if tag == "$float":
            return _FLOATS[node[tag]]
        if tag == "$items":
            pairs = [(_hashable(walk(k, None, path)), v) for k, v in node[tag]]
            return {k: walk(v, _child(template, k), (*path, k)) for k, v in pairs}
        raise TreeError(f"{_where(root, path)}: unknown tag {tag!r} in the document.")

    return walk(document, like, ())


def _usable(saved: str) -> torch.device:
    """The saved device when this process has it, else the CPU (a GPU run read on a laptop)."""
    device = torch.device(saved)
    here = device.type == "cuda" and torch.cuda.is_available()
    return (
        device if here and (device.index or 0) < torch.cuda.device_count() else torch.device("cpu")
    )


def tensor_paths(tree: Any, root: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's path (as an error message writes it) and shape, for template checks."""
    out: dict[str, tuple[int, ...]] = {}

    def walk(value: Any, path: tuple[Any, ...]) -> None:
        if isinstance(value, torch.Tensor):
            out[_where(root, path)] = tuple(value.shape)
        elif isinstance(value, (Mapping, list, tuple)):
            items = value.items() if isinstance(value, Mapping) else enumerate(value)
            for key, item in items:
                walk(item, (*path, key))

    walk(tree, ())
    return out
