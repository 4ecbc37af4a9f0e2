"""codec: a tree of tensors and JSON values <-> (a JSON document, a dict of named tensors).

The rule every checkpointed tree follows (optimizer and scheduler state, ``state.extras``,
the state of extra objects): dicts with ``str`` keys, lists, tuples, ints, floats (also
inf and NaN), bools, ``None``, strings and tensors, nested freely. Dicts with other keys
(an optimizer's ``state`` is keyed by int) are allowed when every key is an int, float,
bool, ``None``, str or a tuple of these. Anything else (functions, modules, numpy values,
NamedTuples, sets, ...) is refused when saving, naming its path, because the load path
only reads JSON and safetensors and so could not rebuild it without running code.

The JSON document mirrors the tree. Values JSON has no form for become small tagged
objects, each with a key starting with ``$``:

* ``{"$tensor": "name"}``: the tensor stored under ``name`` in the companion safetensors
  file; ``"dtype"`` and ``"shape"`` are added when the dtype has no safetensors code (it
  is then stored as raw bytes), ``"device"`` when the tensor was not on the CPU, and
  ``"dcp": true`` when it is kept in the sharded files instead (:mod:`._sharded`).
* ``{"$tuple": [...]}``: a tuple (Adam's ``betas`` must come back as one).
* ``{"$float": "nan" | "inf" | "-inf"}``: a non-finite float (JSON has none).
* ``{"$items": [[key, value], ...]}``: a dict whose keys are not all strings.
* ``{"$dict": {...}}``: a str-keyed dict that itself has a key starting with ``$``.
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
    "sharded_references",
    "tensor_paths",
    "usable_device",
]

_SCALARS = (bool, int, float, str, type(None))
_FLOAT_NAMES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
# safetensors codes the dtypes below; others (complex128, ...) are stored as raw bytes.
_NATIVE = frozenset(
    getattr(torch, name)
    for name in (
        *("float64", "float32", "float16", "bfloat16", "complex64", "bool"),
        *("int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8"),
        *("float8_e4m3fn", "float8_e5m2"),
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
    kind = type(value)
    module = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
    return f"a {module}{kind.__qualname__}"


def _path_text(root: str, path: tuple[Any, ...]) -> str:
    return root + "".join(f"[{part!r}]" for part in path)


def _hint(value: Any) -> str:
    if type(value).__module__ == "numpy":
        return " Convert numpy values with .item() or torch.from_numpy()."
    if isinstance(value, tuple):
        return " Store a dict of its fields (value._asdict()) instead."
    return ""


def encode(
    tree: Any,
    root: str,
    *,
    copy: bool = False,
    external: Callable[[torch.Tensor], bool] | None = None,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``tree`` into a JSON-ready document and the CPU tensors it refers to.

    Args:
        tree: a tree following the module's rule.
        root: the tree's name in error messages and tensor names (e.g. ``"extras"``).
        copy: always copy the tensors (for a save that runs while training goes on);
            otherwise CPU tensors that are already contiguous are used as they are.
        external: tensors for which it is true (e.g. FSDP2's DTensors) are stored
            elsewhere (see :mod:`._sharded`): they are returned as they are, and
            their references in the document carry ``"dcp": true``.

    Returns:
        ``(document, tensors)``; each tensor name is the tree path joined by ``/``.

    Raises:
        TreeError: naming the path of the first value the rule does not allow.
    """
    tensors: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}  # id(tensor) -> name: a tensor met twice is stored once
    keep: list[torch.Tensor] = []  # keeps ids valid until the end

    def tensor(value: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        if external is not None and external(value):
            known = names.get(id(value))
            if known is None:
                known = _unique("/".join(str(p) for p in (root, *path)), tensors)
                names[id(value)] = known
                keep.append(value)
                tensors[known] = value
            return {"$tensor": known, "dcp": True}
        reason = _unstorable(value)
        if reason:
            raise TreeError(
                f"{_path_text(root, path)}: {reason}, which a checkpoint cannot store; "
                "keep dense, materialised tensors in checkpointed state."
            )
        known = names.get(id(value))
        if known is None:
            known = _unique("/".join(str(p) for p in (root, *path)), tensors)
            names[id(value)] = known
            keep.append(value)
            tensors[known] = host_tensor(value, copy)
        ref: dict[str, Any] = {"$tensor": known}
        if value.dtype not in _NATIVE:
            ref["dtype"] = str(value.dtype).removeprefix("torch.")
            ref["shape"] = list(value.shape)
        if value.device.type != "cpu":
            ref["device"] = str(value.device)
        return ref

    def walk(value: Any, path: tuple[Any, ...]) -> Any:
        kind = type(value)
        if kind is float:
            return value if math.isfinite(value) else {"$float": repr(value)}
        if kind in _SCALARS:
            return value
        if isinstance(value, torch.Tensor):
            return tensor(value, path)
        if kind is list:
            return [walk(item, (*path, i)) for i, item in enumerate(value)]
        if kind is tuple:
            return {"$tuple": [walk(item, (*path, i)) for i, item in enumerate(value)]}
        if kind is dict or kind is OrderedDict:
            if all(type(key) is str for key in value):
                body = {key: walk(item, (*path, key)) for key, item in value.items()}
                return {"$dict": body} if any(k.startswith("$") for k in value) else body
            return {"$items": [[dict_key(k, path), walk(v, (*path, k))] for k, v in value.items()]}
        raise TreeError(
            f"{_path_text(root, path)}: {describe(value)}, which a checkpoint cannot store; "
            "keep only tensors, numbers, strings, bools, None, lists, tuples and dicts in "
            f"checkpointed state.{_hint(value)}"
        )

    def dict_key(key: Any, path: tuple[Any, ...]) -> Any:
        if type(key) is tuple:
            return {"$tuple": [dict_key(part, path) for part in key]}
        if type(key) in _SCALARS:
            return walk(key, path)
        raise TreeError(
            f"{_path_text(root, path)}: a dict key that is {describe(key)}, which a "
            "checkpoint cannot store; use str, int, float, bool, None or tuple keys."
        )

    document = walk(tree, ())
    if external is None:
        separate_shared(tensors)
    else:
        local = {n: t for n, t in tensors.items() if not external(t)}
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
    if host.dtype not in _NATIVE:
        host = host.reshape(-1).view(torch.uint8)
    return host


def _unique(name: str, taken: Mapping[str, Any]) -> str:
    # Dict keys may contain "/", so two paths can join to the same name.
    if name not in taken:
        return name
    n = 1
    while f"{name}~{n}" in taken:
        n += 1
    return f"{name}~{n}"


def separate_shared(tensors: dict[str, torch.Tensor]) -> None:
    """Give tensors that share memory their own copies, in place of the shared ones.

    safetensors refuses to write two entries that share memory (tied weights, views of one
    buffer); their values are what a file keeps, so copies do.
    """
    owners: dict[int, list[str]] = {}
    for name, value in tensors.items():
        if value.numel():
            owners.setdefault(value.untyped_storage().data_ptr(), []).append(name)
    for group in owners.values():
        if len(group) > 1:
            for name in group:
                tensors[name] = tensors[name].clone()


def decode(
    document: Any,
    tensors: Mapping[str, torch.Tensor],
    root: str,
    *,
    like: Any = None,
    place: Callable[[torch.Tensor, str | None], torch.Tensor] | None = None,
) -> Any:
    """Rebuild the tree that :func:`encode` split.

    Args:
        document: the JSON document (as read with ``json.loads``).
        tensors: the tensors of the companion safetensors file, by name.
        root: the tree's name in error messages.
        like: a template tree; a tensor whose template (same path) is a tensor goes to that
            tensor's device, others to the device they were saved from when it exists here,
            else to the CPU.
        place: overrides that choice: ``place(tensor, saved_device) -> tensor``.

    Returns:
        The tree, with tuples as tuples and tensors of the saved dtype and shape.

    Raises:
        TreeError: the document refers to a missing tensor or has an unknown tag.
    """

    def tensor(ref: Mapping[str, Any], template: Any, path: tuple[Any, ...]) -> torch.Tensor:
        name = ref["$tensor"]
        if name not in tensors:
            raise TreeError(f"{_path_text(root, path)}: tensor {name!r} is not in the file.")
        value = tensors[name]
        if "dtype" in ref:
            dtype = getattr(torch, ref["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise TreeError(f"{_path_text(root, path)}: unknown dtype {ref['dtype']!r}.")
            value = value.view(dtype).reshape(ref["shape"])
        saved = ref.get("device")
        if place is not None:
            return place(value, saved)
        if isinstance(template, torch.Tensor):
            return value.to(template.device)
        return value.to(usable_device(saved)) if saved else value

    def child(template: Any, key: Any) -> Any:
        if isinstance(template, Mapping):
            return template.get(key)
        if isinstance(template, (list, tuple)) and isinstance(key, int) and key < len(template):
            return template[key]
        return None

    def walk(node: Any, template: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(node, list):
            return [walk(v, child(template, i), (*path, i)) for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        tags = [key for key in node if key.startswith("$")]
        if not tags:
            return {k: walk(v, child(template, k), (*path, k)) for k, v in node.items()}
        tag = tags[0]
        if tag == "$tensor":
            return tensor(node, template, path)
        if tag == "$tuple":
            return tuple(walk(v, child(template, i), (*path, i)) for i, v in enumerate(node[tag]))
        if tag == "$float":
            return _FLOAT_NAMES[node[tag]]
        if tag == "$dict":
            body = node[tag]
            return {k: walk(v, child(template, k), (*path, k)) for k, v in body.items()}
        if tag == "$items":
            out = {}
            for raw_key, raw_value in node[tag]:
                key = _key(walk(raw_key, None, path))
                out[key] = walk(raw_value, child(template, key), (*path, key))
            return out
        raise TreeError(f"{_path_text(root, path)}: unknown tag {tag!r} in the document.")

    return walk(document, like, ())


def sharded_references(document: Any, like: Any) -> dict[str, Any]:
    """The ``"dcp": true`` tensor references of ``document``, each with the template's value.

    ``like`` is walked alongside as :func:`decode` walks it; the value is the template's
    leaf at the reference's path (a tensor to load into), or ``None`` where it has none.
    """
    found: dict[str, Any] = {}

    def child(template: Any, key: Any) -> Any:
        if isinstance(template, Mapping):
            return template.get(key)
        if isinstance(template, (list, tuple)) and isinstance(key, int) and key < len(template):
            return template[key]
        return None

    def walk(node: Any, template: Any) -> None:
        if isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, child(template, i))
            return
        if not isinstance(node, dict):
            return
        if "$tensor" in node:
            if node.get("dcp") is True:
                found[node["$tensor"]] = template
            return
        if "$tuple" in node:
            for i, value in enumerate(node["$tuple"]):
                walk(value, child(template, i))
        elif "$dict" in node:
            for key, value in node["$dict"].items():
                walk(value, child(template, key))
        elif "$items" in node:
            for raw_key, raw_value in node["$items"]:
                walk(raw_value, child(template, _key(decode(raw_key, {}, "key"))))
        elif not any(key.startswith("$") for key in node):
            for key, value in node.items():
                walk(value, child(template, key))

    walk(document, like)
    return found


def _key(value: Any) -> Any:
    # Keys come back as lists inside "$tuple" only when nested: make them hashable again.
    return tuple(_key(v) for v in value) if isinstance(value, (list, tuple)) else value


def usable_device(saved: str) -> torch.device:
    """The saved device when this process has it, else the CPU (e.g. a GPU run read on a laptop)."""
    device = torch.device(saved)
    if (
        device.type == "cuda"
        and torch.cuda.is_available()
        and (device.index is None or device.index < torch.cuda.device_count())
    ):
        return device
    return torch.device("cpu")


def tensor_paths(tree: Any, root: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's path (as an error message writes it) and shape, for template checks."""
    out: dict[str, tuple[int, ...]] = {}

    def walk(value: Any, path: tuple[Any, ...]) -> None:
        if isinstance(value, torch.Tensor):
            out[_path_text(root, path)] = tuple(value.shape)
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, (*path, key))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, (*path, i))

    walk(tree, ())
    return out
