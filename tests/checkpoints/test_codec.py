"""The tree codec under checkpoints: a tree of tensors and JSON values <-> JSON + tensors."""

from __future__ import annotations

import json
import math
import types
from collections import OrderedDict
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load, save

from toolkit.checkpoints._codec import TreeError, decode, encode


def to_json(document: Any) -> bytes:
    """The JSON text checkpoints write (write_json's encoding)."""
    return json.dumps(document, allow_nan=False, ensure_ascii=False, indent=1).encode()


def round_trip(tree: Any, root: str = "tree", like: Any = None) -> Any:
    """Through the real formats: JSON text and safetensors bytes."""
    document, tensors = encode(tree, root)
    text = to_json(document)
    back = load(save(tensors)) if tensors else {}
    return decode(json.loads(text), back, root, like=like)


def same(a: Any, b: Any) -> bool:
    """Equal, with the same types all the way down (tuple is not list, 1 is not 1.0)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.cpu(), b.cpu())
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def bytes_of(value: torch.Tensor) -> torch.Tensor:
    return value.contiguous().reshape(-1).view(torch.uint8)


def test_json_values_tuples_and_special_floats_round_trip() -> None:
    # Bug caught: tuples turned into lists (Adam's betas), inf/NaN written as invalid JSON
    # or lost, ints read back as floats, -0.0 losing its sign.
    tree = {
        "betas": (0.9, 0.999),
        "nested": [1, 2.5, -0.0, True, None, "s", (1, (2, "x"))],
        "inf": math.inf,
        "ninf": -math.inf,
        "nan": math.nan,
        "big": 2**70,
        "empty": {"list": [], "tuple": (), "dict": {}},
    }
    back = round_trip(tree)
    assert same(back, tree)
    assert math.copysign(1.0, back["nested"][2]) == -1.0


def test_dicts_with_non_string_keys_keep_their_keys() -> None:
    # Bug caught: int keys silently becoming strings in JSON (read back, they would match
    # nothing the code looks up).
    tree = {0: "a", 1.5: "b", None: "c", True: "d", (1, "x"): "e", "s": {3: [4]}}
    back = round_trip(tree)
    assert same(back, tree)
    assert list(back) == [0, 1.5, None, True, (1, "x"), "s"]


def test_user_keys_that_look_like_tags_are_escaped() -> None:
    # Bug caught: a user dict {"$tensor": "x"} read back as a tensor reference.
    tree = {"$tensor": "not a tensor", "a": {"$tuple": [1]}, "b": {"$float": "nan", "k": 1}}
    assert same(round_trip(tree), tree)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.bool,
        torch.uint8,
        torch.complex64,
        torch.complex128,
        torch.float8_e4m3fn,
    ],
    ids=str,
)
def test_tensors_of_any_dtype_round_trip_bitwise(dtype: torch.dtype) -> None:
    # Bug caught: dtypes safetensors has no code for (complex128) refused or mangled.
    base = torch.randn(3, 4, dtype=torch.float64) * 10
    value = (base.to(torch.complex128) * (1 + 2j) if dtype.is_complex else base).to(dtype)
    tree = {"t": value, "scalar": value[0, 0].clone(), "empty": value[:0]}
    back = round_trip(tree)
    for key in tree:
        assert back[key].dtype == dtype and back[key].shape == tree[key].shape
        assert torch.equal(bytes_of(back[key]), bytes_of(tree[key]))


def test_non_contiguous_views_and_shared_tensors_are_stored() -> None:
    # Bug caught: safetensors refusing views that share memory; a tensor met twice stored
    # twice and coming back as two tensors.
    base = torch.arange(12.0).reshape(3, 4)
    tree = {"t": base.t(), "row": base[1], "again": None}
    tree["again"] = tree["row"]
    document, tensors = encode(tree, "x")
    assert len(tensors) == 2  # "row" and "again" are one tensor
    back = decode(document, tensors, "x")
    assert torch.equal(back["t"], base.t()) and torch.equal(back["row"], base[1])
    assert back["again"] is back["row"]


def test_saving_does_not_copy_contiguous_cpu_tensors_unless_asked() -> None:
    # Speed: a synchronous save writes straight from the tensors; a background save must
    # copy them since training goes on.
    value = torch.ones(4)
    _, tensors = encode({"v": value}, "x")
    assert tensors["x/v"].data_ptr() == value.data_ptr()
    _, copied = encode({"v": value}, "x", copy=True)
    assert copied["x/v"].data_ptr() != value.data_ptr()


def test_tensors_go_to_the_template_device_else_the_cpu() -> None:
    # The template decides the device; no template means CPU (a GPU run read on a CPU box).
    document, tensors = encode({"a": torch.ones(2), "b": torch.ones(2)}, "x")
    document["b"]["device"] = "cuda:7"  # saved on a device this machine lacks
    meta = torch.empty(2, device="meta")
    back = decode(document, tensors, "x", like={"a": meta})
    assert back["a"].device.type == "meta"
    assert back["b"].device.type == "cpu"


class Pair(NamedTuple):
    a: int
    b: int


def _function() -> None:
    return None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            _function,
            "tree['plugin']['fn']: a function, which a checkpoint cannot store; "
            "keep only tensors, numbers, strings, bools, None, lists, tuples and dicts in "
            "checkpointed state.",
        ),
        (lambda: 0, "tree['plugin']['fn']: a function, which"),
        ({1, 2}, "tree['plugin']['fn']: a set, which"),
        (
            Pair(1, 2),
            "tree['plugin']['fn']: a NamedTuple (Pair), which a checkpoint cannot "
            "store; keep only tensors, numbers, strings, bools, None, lists, tuples and dicts "
            "in checkpointed state. Store a dict of its fields (value._asdict()) instead.",
        ),
        (torch.nn.Linear(1, 1), "tree['plugin']['fn']: a torch.nn.modules.linear.Linear, which"),
        (types.SimpleNamespace(), "tree['plugin']['fn']: a types.SimpleNamespace, which"),
        ([1, [2, object()]], "tree['plugin']['fn'][1][1]: a object, which"),
        (
            {torch.ones(1): 1},
            "tree['plugin']['fn']: a dict key that is a torch.Tensor, which "
            "a checkpoint cannot store; use str, int, float, bool, None or tuple keys.",
        ),
        (
            torch.ones(2).to_sparse(),
            "tree['plugin']['fn']: a tensor with layout "
            "torch.sparse_coo, which a checkpoint cannot store; keep dense, materialised tensors "
            "in checkpointed state.",
        ),
        (torch.empty(2, device="meta"), "tree['plugin']['fn']: a tensor on the meta device"),
    ],
    ids=[
        "function",
        "lambda",
        "set",
        "namedtuple",
        "module",
        "namespace",
        "nested",
        "tensor_key",
        "sparse",
        "meta",
    ],
)
def test_values_outside_the_rule_are_refused_naming_their_path(value: Any, message: str) -> None:
    # Bug caught: an unstorable value pickled, dropped or stringified instead of refused.
    with pytest.raises(TreeError) as error:
        encode({"plugin": {"ok": 1, "fn": value}}, "tree")
    assert str(error.value).startswith(message)


def test_numpy_arrays_are_refused_with_a_hint() -> None:
    numpy = pytest.importorskip("numpy")
    with pytest.raises(
        TreeError,
        match=r"tree\['x'\]: a numpy.ndarray, which .* Convert NumPy "
        r"arrays with torch.from_numpy\(\).",
    ):
        encode({"x": numpy.zeros(2)}, "tree")


def test_ordered_dicts_come_back_as_dicts() -> None:
    # model.state_dict() is an OrderedDict: allowed, read back as a plain dict in order.
    back = round_trip(OrderedDict([("b", 1), ("a", 2)]))
    assert type(back) is dict and list(back) == ["b", "a"]


def test_unknown_tags_and_missing_tensors_are_reported() -> None:
    with pytest.raises(TreeError, match=r"x\['a'\]: unknown tag '\$what' in the document."):
        decode({"a": {"$what": 1}}, {}, "x")
    missing = r"x\['a'\]: {'\$tensor': 'x/a'} names no tensor of the file"
    with pytest.raises(TreeError, match=missing):
        decode({"a": {"$tensor": "x/a"}}, {}, "x")


def test_tensor_names_of_colliding_paths_stay_distinct() -> None:
    # Bug caught: {"a/b": t1, "a": {"b": t2}} both named "x/a/b", one overwriting the other.
    tree = {"a/b": torch.zeros(1), "a": {"b": torch.ones(1)}}
    assert same(round_trip(tree, "x"), tree)


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.builds(lambda n: torch.arange(n, dtype=torch.float32), st.integers(0, 3)),
)
keys = st.one_of(
    st.text(max_size=4), st.integers(-5, 5), st.tuples(st.integers(0, 3), st.text(max_size=2))
)
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(trees)
def test_any_tree_of_the_rule_round_trips_exactly(tree: Any) -> None:
    assert same(round_trip(tree), tree)


# ----------------------------------------------------------------------------------------
# Extra objects as users write them: subclasses of str, int, float and
# dict and NumPy scalars are stored as their base type.


class Holder:
    """An extra object whose state is whatever it was given."""

    def __init__(self, state: Any = None) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def _user_values() -> dict[str, tuple[Any, Any]]:
    """name -> (value as a user holds it, value as it comes back)."""
    import enum
    from collections import defaultdict

    numpy = pytest.importorskip("numpy")

    class Mode(enum.StrEnum):
        TRAIN = "train"

    class Level(enum.IntEnum):
        HIGH = 3

    class Color(str, enum.Enum):  # noqa: UP042  (str() gives "Color.RED": stored as its value)
        RED = "red"

    counts = defaultdict(int, {"a": 2})
    return {
        "torch_version": (torch.__version__, str(torch.__version__)),
        "float32": (numpy.float32(1.5), 1.5),
        "int64": (numpy.int64(3), 3),
        "bool_": (numpy.bool_(True), True),
        "float64_nan": (numpy.float64("nan"), math.nan),
        "strenum": (Mode.TRAIN, "train"),
        "intenum": (Level.HIGH, 3),
        "str_enum_mixin": (Color.RED, "red"),
        "defaultdict": (counts, {"a": 2}),
        "ordereddict": (OrderedDict([("b", numpy.int64(1)), ("a", 2)]), {"b": 1, "a": 2}),
        "enum_keys": ({Mode.TRAIN: 1, Level.HIGH: 2}, {"train": 1, 3: 2}),
    }


def test_subclasses_and_numpy_scalars_in_objects_round_trip_as_their_base_type(
    tmp_path: Any,
) -> None:
    # Bug caught: torch.__version__ (a str subclass), NumPy scalars, a StrEnum, an IntEnum,
    # a defaultdict refused in objects= with a message claiming strings were allowed.
    from toolkit import TrainState, load_checkpoint, save_checkpoint

    values = _user_values()
    state = TrainState(model=torch.nn.Linear(1, 1))
    path = save_checkpoint(
        state, tmp_path / "c", objects={"user": Holder({k: v for k, (v, _) in values.items()})}
    )
    fresh = Holder()
    load_checkpoint(path, like=state, objects={"user": fresh})
    assert same(fresh.state, {k: back for k, (_, back) in values.items()})
    assert type(fresh.state["bool_"]) is bool and type(fresh.state["intenum"]) is int


def test_unstorable_objects_raise_the_exported_error_naming_the_path(tmp_path: Any) -> None:
    # Bug caught: the error class only importable from a private module.
    from toolkit import TrainState, save_checkpoint
    from toolkit.checkpoints import TreeError as Exported

    state = TrainState(model=torch.nn.Linear(1, 1))
    with pytest.raises(Exported) as error:
        save_checkpoint(state, tmp_path / "c", objects={"user": Holder({"fn": lambda: 0})})
    assert str(error.value).startswith(
        "objects['user']['fn']: a function, which a checkpoint cannot store; keep only "
        "tensors, numbers, strings, bools, None, lists, tuples and dicts"
    )
    assert not (tmp_path / "c").exists()
