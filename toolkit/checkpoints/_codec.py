"""codec: a tree of tensors and JSON values <-> (a JSON document, a dict of named tensors).

The rule every checkpointed tree follows (optimizer and scheduler state, ``state.extras``,
the state of extra objects): dicts with ``str`` keys, lists, tuples, ints, floats (also
inf and NaN), bools, ``None``, strings and tensors (any dtype and device), nested
freely; subclasses of str, int, float and dict (``torch.__version__``, enums,
``defaultdict``) and NumPy scalars are stored as their base type. Anything else is refused
when saving, naming its path: the load path only reads JSON and safetensors, so it could
not rebuild it without running code.

Values JSON has no form for become tagged objects: ``{"$tensor": name}`` (plus ``device``
when not on the CPU, ``"dcp": true`` when kept in the sharded files), ``{"$tuple": [...]}``,
``{"$float": "nan"}``, ``{"$items": [[key, value], ...]}`` (a dict with keys other than
str: int, float, bool, None, str or tuples of these) and ``{"$dict": {...}}`` (a dict with
a key starting with ``$``).
"""

import collections
import math
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

_SCALARS = (bool, int, float, str, type(None))
# The base types' own conversions: a subclass may override __str__ (class Mode(str, Enum)).
_BASES: dict[type, Any] = {str: str.__str__, int: int.__int__, float: float.__float__}
# The dtypes safetensors codes; others (complex128, ...) are stored as their raw bytes.
_STORED = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64}
_STORED |= {torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8}
_STORED |= {getattr(torch, f"{sign}int{bits}") for sign in ("", "u") for bits in (16, 32, 64)}
_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class TreeError(TypeError):
    """A value that the checkpoint format cannot store, or a document it cannot read.

    Saving raises it naming the value's path (nothing is written); on load, a document
    that cannot be read is reported as a ``DamagedCheckpointError`` instead.

    Example:
        >>> import torch
        >>> from toolkit import TrainState, save_checkpoint
        >>> from toolkit.checkpoints import TreeError
        >>> class Meter:
        ...     def state_dict(self):
        ...         return {"version": torch.__version__, "fn": lambda: 0}
        ...     def load_state_dict(self, state):
        ...         pass
        >>> state = TrainState(model=torch.nn.Linear(1, 1))
        >>> try:
        ...     save_checkpoint(state, "ckpt/step_000000", objects={"meter": Meter()})
        ... except TreeError as error:
        ...     print(error)  # doctest: +ELLIPSIS
        objects['meter']['fn']: a function, which a checkpoint cannot store; keep only ...
    """


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


def _plain(value: Any) -> Any:
    """A NumPy scalar or a str, int or float subclass as the Python base type, else ``value``."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()  # np.bool_ -> bool, np.int64 -> int: also 0-d arrays
    return next((plain(value) for b, plain in _BASES.items() if isinstance(value, b)), value)


def _cannot_store(root: str, path: tuple[Any, ...], what: str, fix: str) -> TreeError:
    return TreeError(f"{_where(root, path)}: {what}, which a checkpoint cannot store; {fix}")


def _refused(root: str, path: tuple[Any, ...], value: Any) -> TreeError:
    hints = {"numpy": " Convert NumPy arrays with torch.from_numpy()."}
    hints["tuple"] = " Store a dict of its fields (value._asdict()) instead."
    hint = hints.get("tuple" if isinstance(value, tuple) else type(value).__module__, "")
    keep = "keep only tensors, numbers, strings, bools, None, lists, tuples and dicts"
    return _cannot_store(root, path, describe(value), f"{keep} in checkpointed state.{hint}")


def encode(
    tree: Any, root: str, *, copy: bool = False,
    external: Callable[[torch.Tensor], bool] | None = None,
) -> tuple[Any, dict[str, torch.Tensor]]:  # fmt: skip
    """Split ``tree`` into a JSON-ready document and the tensors it refers to (by path).

    CPU tensors are used as they are unless ``copy``; tensors for which ``external`` is
    true (FSDP2's DTensors) are returned as they are, marked ``"dcp": true``. A tensor met
    twice is stored once. Raises TreeError naming the first value the rule does not allow.
    """
    tensors: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}  # ids stay valid: the tree holds every tensor until the end

    def tensor(value: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        outside = external is not None and external(value)
        if not outside and (why := _unstorable(value)):
            fix = "keep dense, materialised tensors in checkpointed state."
            raise _cannot_store(root, path, why, fix)
        if id(value) not in names:
            name = "/".join(str(p) for p in (root, *path))
            while name in tensors:  # dict keys may hold "/": two paths can join alike
                name += "~"
            names[id(value)] = name
            tensors[name] = value if outside else host_tensor(value, copy)
        ref: dict[str, Any] = {"$tensor": names[id(value)]}
        if outside:
            return {**ref, "dcp": True}
        if value.dtype not in _STORED:
            ref.update(dtype=str(value.dtype).removeprefix("torch."), shape=list(value.shape))
        if value.device.type != "cpu":
            ref["device"] = str(value.device)
        return ref

    def key(value: Any, path: tuple[Any, ...]) -> Any:
        value = _plain(value)
        if type(value) is tuple:
            return {"$tuple": [key(item, path) for item in value]}
        if type(value) not in _SCALARS:
            fix = "use str, int, float, bool, None or tuple keys."
            raise _cannot_store(root, path, f"a dict key that is {describe(value)}", fix)
        return walk(value, path)

    def walk(value: Any, path: tuple[Any, ...]) -> Any:
        kind = type(value)
        if kind is float and not math.isfinite(value):
            return {"$float": repr(value)}
        if kind in _SCALARS:
            return value
        if isinstance(value, torch.Tensor):
            return tensor(value, path)
        if kind is tuple or kind is list:
            items = [walk(item, (*path, i)) for i, item in enumerate(value)]
            return {"$tuple": items} if kind is tuple else items
        if isinstance(value, dict):  # OrderedDict, defaultdict, ...
            if any(type(k) is not str for k in value):  # JSON keys are strings: keep the kind
                return {"$items": [[key(k, path), walk(v, (*path, k))] for k, v in value.items()]}
            body = {k: walk(v, (*path, k)) for k, v in value.items()}
            return {"$dict": body} if any(k.startswith("$") for k in value) else body
        plain = _plain(value)
        if plain is value:
            raise _refused(root, path, value)
        return walk(plain, path)

    document = walk(tree, ())
    local = {n: t for n, t in tensors.items() if external is None or not external(t)}
    separate_shared(local)
    tensors.update(local)
    return document, tensors


def _unstorable(value: torch.Tensor) -> str:
    subclass = f"a {type(value).__name__} (sharded or subclassed tensors are not supported)"
    found = {subclass: type(value) not in (torch.Tensor, torch.nn.Parameter)}
    found[f"a tensor with layout {value.layout}"] = value.layout != torch.strided
    found["a quantized tensor"] = value.is_quantized
    found["a tensor on the meta device (no data)"] = value.device.type == "meta"
    return next((why for why, bad in found.items() if bad), "")


def host_tensor(value: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """A contiguous CPU tensor with the value's data (a copy when ``copy`` or when needed)."""
    host = value.detach()
    if copy or host.device.type != "cpu" or not host.is_contiguous():
        host = host.to("cpu", copy=True, memory_format=torch.contiguous_format)  # one copy
    return host if host.dtype in _STORED else host.reshape(-1).view(torch.uint8)


def separate_shared(tensors: dict[str, torch.Tensor]) -> None:
    """Give tensors that share memory copies of their own (safetensors refuses shared memory)."""
    storage = {name: t.untyped_storage().data_ptr() for name, t in tensors.items() if t.numel()}
    shared = collections.Counter(storage.values())
    tensors.update({name: tensors[name].clone() for name, at in storage.items() if shared[at] > 1})


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, (list, tuple)) else value


def _child(template: Any, key: Any) -> Any:
    if isinstance(template, Mapping):  # .get: a defaultdict must not grow an entry
        return template.get(key)
    listed = isinstance(template, (list, tuple)) and type(key) is int and key < len(template)
    return template[key] if listed else None  # the template's entry at key, if any


def decode(
    document: Any, tensors: Mapping[str, torch.Tensor], root: str, *, like: Any = None,
    sharded: Callable[[str, Any], torch.Tensor] | None = None,
) -> Any:  # fmt: skip
    """Rebuild the tree that :func:`encode` split.

    A tensor goes to the device of the template's tensor at the same path in ``like``,
    else to the device it was saved from when this process has it, else to the CPU.
    A ``"dcp"`` reference becomes ``sharded(name, template leaf)`` (a tensor to fill).
    Raises TreeError for a tensor reference that names no stored tensor or an unknown tag.
    """

    def tensor(ref: Mapping[str, Any], template: Any, path: tuple[Any, ...]) -> torch.Tensor:
        name = ref["$tensor"]
        if ref.get("dcp") and sharded is not None:
            return sharded(name, template)
        try:  # raw bytes of a dtype safetensors has no code for; the device it was saved from
            value = tensors[name]
            if "dtype" in ref:
                value = value.view(getattr(torch, ref["dtype"])).reshape(ref["shape"])
            device = _usable(ref["device"]) if "device" in ref else None
        except Exception as error:  # a name, dtype, shape or device no save writes
            what = f"{ref} names no tensor of the file ({error})"
            raise TreeError(f"{_where(root, path)}: {what}") from None
        device = template.device if isinstance(template, torch.Tensor) else device
        return value if device is None else value.to(device)

    def walk(node: Any, template: Any, path: tuple[Any, ...]) -> Any:
        tag = next((k for k in node if k.startswith("$")), None) if isinstance(node, dict) else None
        if tag == "$tensor":
            return tensor(node, template, path)
        if tag == "$float":
            return _FLOATS[node[tag]]
        if tag == "$items":
            pairs = [(_hashable(walk(k, None, path)), v) for k, v in node[tag]]
            return {k: walk(v, _child(template, k), (*path, k)) for k, v in pairs}
        if tag not in (None, "$dict", "$tuple"):
            raise TreeError(f"{_where(root, path)}: unknown tag {tag!r} in the document.")
        node = node if tag is None else node[tag]
        if isinstance(node, dict):
            return {k: walk(v, _child(template, k), (*path, k)) for k, v in node.items()}
        if isinstance(node, list):
            items = [walk(v, _child(template, i), (*path, i)) for i, v in enumerate(node)]
            return tuple(items) if tag == "$tuple" else items
        return node

    return walk(document, like, ())


def _usable(saved: str) -> torch.device:
    """The saved device when this process has it, else the CPU (a GPU run read on a laptop)."""
    device = torch.device(saved)
    here = device.type == "cuda" and (device.index or 0) < torch.cuda.device_count()
    return device if here else torch.device("cpu")
