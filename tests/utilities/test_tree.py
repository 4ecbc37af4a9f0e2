"""map_nested_tensor keeps every container type; key_average averages records over key unions."""

from __future__ import annotations

import collections
import dataclasses
import math
import random
import re
import sys
import types
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from counting import CountOps, read_as_on_an_accelerator
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit import key_average, map_nested_tensor, to_device

# ---------------------------------------------------------------------------------------------
# map_nested_tensor


class Pair(NamedTuple):
    first: Any
    second: Any


Triple = collections.namedtuple("Triple", ["a", "b", "c"])


@dataclasses.dataclass
class Box:
    content: Any
    label: Any = "box"


@dataclasses.dataclass(frozen=True)
class FrozenBox:
    content: Any
    extra: Any = None


class ListOfThings(list):
    """A list subclass: its type must survive the mapping."""


def _tensors() -> st.SearchStrategy[torch.Tensor]:
    floats = st.floats(-100, 100, allow_nan=False, width=32)
    return st.one_of(
        st.lists(floats, max_size=4).map(lambda xs: torch.tensor(xs, dtype=torch.float32)),
        st.integers(-5, 5).map(torch.tensor),
        floats.map(lambda x: torch.tensor(x, dtype=torch.float64)),
    )


_plain_leaves = st.one_of(
    st.none(),
    st.integers(),
    st.text(max_size=5),
    st.floats(allow_nan=False),
    st.booleans(),
    st.just(np.arange(3)),
)
_keys = st.text(min_size=1, max_size=4)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.dictionaries(_keys, children, max_size=3),
        st.dictionaries(_keys, children, max_size=3).map(collections.OrderedDict),
        st.dictionaries(_keys, children, max_size=3).map(
            lambda d: collections.defaultdict(list, d)
        ),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(ListOfThings),
        st.lists(children, max_size=3).map(tuple),
        st.builds(Pair, children, children),
        st.builds(Triple, children, children, children),
        st.builds(Box, children, children),
        st.builds(FrozenBox, children, children),
    )


trees = st.recursive(st.one_of(_tensors(), _plain_leaves), _containers, max_leaves=12)


def assert_same_structure(before: Any, after: Any, on_tensor: Any) -> None:
    """Walk both trees together: same container types and keys, non-tensors kept as is."""
    assert type(after) is type(before), (type(before), type(after))
    if isinstance(before, torch.Tensor):
        on_tensor(before, after)
    elif isinstance(before, Mapping):
        assert list(after.keys()) == list(before.keys())
        if isinstance(before, collections.defaultdict):
            assert after.default_factory is before.default_factory
        for key in before:
            assert_same_structure(before[key], after[key], on_tensor)
    elif isinstance(before, (list, tuple)):
        assert len(after) == len(before)
        for old, new in zip(before, after):
            assert_same_structure(old, new, on_tensor)
    elif dataclasses.is_dataclass(before):
        for field in dataclasses.fields(before):
            assert_same_structure(
                getattr(before, field.name), getattr(after, field.name), on_tensor
            )
    else:
        assert after is before


def count_tensors(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return 1
    if isinstance(tree, Mapping):
        return sum(count_tensors(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(count_tensors(v) for v in tree)
    if dataclasses.is_dataclass(tree):
        return sum(count_tensors(getattr(tree, f.name)) for f in dataclasses.fields(tree))
    return 0


@settings(max_examples=150, deadline=None)
@given(tree=trees)
def test_types_and_structure_are_kept_and_fn_runs_once_per_tensor(tree: Any) -> None:
    calls: list[torch.Tensor] = []

    def double(t: torch.Tensor) -> torch.Tensor:
        calls.append(t)
        return t.to(torch.float64) * 2

    out = map_nested_tensor(double, tree)

    def check(old: torch.Tensor, new: torch.Tensor) -> None:
        assert new.dtype == torch.float64
        torch.testing.assert_close(new, old.to(torch.float64) * 2, rtol=0, atol=0)

    assert_same_structure(tree, out, check)
    assert len(calls) == count_tensors(tree)
    assert len({id(t) for t in calls}) == len(calls)  # each tensor object exactly once


@settings(max_examples=100, deadline=None)
@given(tree=trees)
def test_identity_gives_an_equal_tree(tree: Any) -> None:
    def same_object(old: torch.Tensor, new: torch.Tensor) -> None:
        assert new is old

    assert_same_structure(tree, map_nested_tensor(lambda t: t, tree), same_object)


def test_moves_a_batch_and_keeps_everything_else() -> None:
    ids = np.arange(4)
    batch = {
        "x": torch.ones(2, 3),
        "pairs": [Pair(torch.zeros(1), "name")],
        "meta": collections.OrderedDict(ids=ids, step=7, note=None),
    }
    out = map_nested_tensor(lambda t: t.to(torch.float64), batch)
    assert out["x"].dtype == torch.float64
    assert isinstance(out["pairs"][0], Pair)
    assert out["pairs"][0].first.dtype == torch.float64
    assert out["pairs"][0].second == "name"
    assert type(out["meta"]) is collections.OrderedDict
    assert out["meta"]["ids"] is ids
    assert out["meta"]["step"] == 7 and out["meta"]["note"] is None
    assert batch["x"].dtype == torch.float32  # the input is not modified


def test_detach_records_from_the_graph() -> None:
    weight = torch.ones(2, requires_grad=True)
    records = {"loss": (weight * 3).sum(), "parts": [weight * 2]}
    detached = map_nested_tensor(torch.Tensor.detach, records)
    assert not detached["loss"].requires_grad
    assert not detached["parts"][0].requires_grad
    assert records["loss"].requires_grad


def test_frozen_dataclass_is_rebuilt_and_post_init_runs() -> None:
    @dataclasses.dataclass(frozen=True)
    class Scaled:
        value: torch.Tensor
        total: torch.Tensor = dataclasses.field(init=False)

        def __post_init__(self) -> None:
            object.__setattr__(self, "total", self.value.sum())

    before = Scaled(torch.tensor([1.0, 2.0]))
    after = map_nested_tensor(lambda t: t * 10, before)
    assert type(after) is Scaled
    assert after.value.tolist() == [10.0, 20.0]
    # init=False fields are the dataclass's to compute, from the mapped inputs
    assert after.total.item() == 30.0
    assert before.value.tolist() == [1.0, 2.0]


def test_the_same_tensor_twice_is_mapped_per_occurrence() -> None:
    shared = torch.ones(1)
    calls = []
    map_nested_tensor(calls.append, [shared, {"again": shared}])
    assert len(calls) == 2


def test_return_types_parameters_and_mapping_proxies() -> None:
    values = torch.tensor([[1.0, 5.0], [3.0, 2.0]])
    result = torch.max(values, dim=0)
    out = map_nested_tensor(lambda t: t + 1, result)
    assert type(out) is type(result)
    assert out.values.tolist() == [4.0, 6.0]
    assert out.indices.tolist() == [2, 1]

    parameter = torch.nn.Parameter(torch.zeros(2))
    assert map_nested_tensor(lambda t: t.detach() + 1, [parameter])[0].tolist() == [1.0, 1.0]

    proxy = types.MappingProxyType({"a": torch.zeros(1)})
    mapped = map_nested_tensor(lambda t: t + 2, proxy)
    assert type(mapped) is types.MappingProxyType
    assert mapped["a"].tolist() == [2.0]


def test_non_containers_are_leaves() -> None:
    module = torch.nn.Linear(1, 1)
    tree = {"text": "abc", "set": {1, 2}, "class": Box, "module": module, "bytes": b"xy"}
    out = map_nested_tensor(lambda t: pytest.fail("no tensor here"), tree)
    for key in tree:
        assert out[key] is tree[key]


class Held:
    """A stand-in for a Hugging Face Cache or a torch_geometric Data: tensors behind .to()."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys

    def to(self, device: Any, non_blocking: bool = False) -> Held:
        return Held(self.keys.to(device, non_blocking=non_blocking))


def test_objects_with_a_to_method_are_moved_modules_are_not() -> None:
    model = torch.nn.Linear(1, 1)
    batch = {"past": Held(torch.ones(2)), "ids": [torch.zeros(3)], "model": model}
    moved = to_device(batch, "meta")
    assert isinstance(moved["past"], Held) and moved["past"].keys.device.type == "meta"
    assert moved["ids"][0].device.type == "meta"
    # a module is not data: moving it would move the training model's weights
    assert moved["model"] is model and model.weight.device.type == "cpu"
    assert batch["past"].keys.device.type == "cpu"


def test_fn_that_cannot_take_an_object_with_to_is_named() -> None:
    with pytest.raises(TypeError, match=r"fn failed on a Held .*make fn handle it"):
        map_nested_tensor(lambda t: t * 2, {"past": Held(torch.ones(2))})


def test_mapping_that_cannot_be_rebuilt_raises() -> None:
    class Registry(Mapping):
        def __init__(self, **entries: Any) -> None:
            self._entries = entries

        def __getitem__(self, key: str) -> Any:
            return self._entries[key]

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(self._entries)

        def __len__(self) -> int:
            return len(self._entries)

    with pytest.raises(TypeError, match=r"cannot rebuild the Mapping type .*Registry.*dict"):
        map_nested_tensor(lambda t: t, Registry(a=torch.zeros(1)))


# ---------------------------------------------------------------------------------------------
# key_average


def test_mean_of_nested_records_matches_hand_computation() -> None:
    records = [
        {"loss": torch.tensor(1.0), "acc": {"top1": 0.5, "top5": 1.0}, "n": 4},
        {"loss": torch.tensor(2.0), "acc": {"top1": 0.25, "top5": 0.75}, "n": 8},
        {"loss": torch.tensor(6.0), "acc": {"top1": 0.0, "top5": 0.5}, "n": 3},
    ]
    result = key_average(records)
    assert result == {
        "loss": (1.0 + 2.0 + 6.0) / 3,
        "acc": {"top1": (0.5 + 0.25 + 0.0) / 3, "top5": (1.0 + 0.75 + 0.5) / 3},
        "n": 5.0,
    }
    assert all(type(v) is float for v in (result["loss"], result["n"], result["acc"]["top1"]))


def test_union_of_keys_averages_each_over_the_records_that_have_it() -> None:
    records = [
        {"a": 1.0},
        {"a": 3.0, "b": 10.0, "nested": {"x": 1}},
        {"b": 20.0, "nested": {"x": 2, "y": torch.tensor(5)}},
    ]
    assert key_average(records) == {"a": 2.0, "b": 15.0, "nested": {"x": 1.5, "y": 5.0}}
    assert list(key_average(records)) == ["a", "b", "nested"]  # first-appearance order


def test_exclude_nan() -> None:
    nan = math.nan
    records = [
        {"loss": 1.0, "bad": nan},
        {"loss": torch.tensor(nan), "bad": torch.tensor(nan)},
        {"loss": 3.0},
    ]
    kept = key_average(records)
    assert math.isnan(kept["loss"]) and math.isnan(kept["bad"])
    excluded = key_average(records, exclude_nan=True)
    assert excluded["loss"] == 2.0
    assert math.isnan(excluded["bad"])  # only NaNs: NaN
    # infinities are values, not NaN: they stay
    assert key_average([{"x": math.inf}, {"x": 1.0}], exclude_nan=True) == {"x": math.inf}
    assert math.isnan(key_average([{"x": math.inf}, {"x": -math.inf}])["x"])


def test_weighted_mean_matches_hand_computation() -> None:
    records = [{"loss": 2.0, "acc": 1.0}, {"loss": torch.tensor(5.0)}, {"loss": 1.0, "acc": 0.0}]
    result = key_average(records, weights=[1, 2, torch.tensor(3)])
    assert result["loss"] == pytest.approx((2.0 * 1 + 5.0 * 2 + 1.0 * 3) / 6, rel=1e-15)
    assert result["acc"] == pytest.approx((1.0 * 1 + 0.0 * 3) / 4, rel=1e-15)
    as_tensor = key_average(records, weights=torch.tensor([1, 2, 3]))
    assert as_tensor == result


def test_zero_weight_records_contribute_nothing() -> None:
    records = [{"loss": math.nan, "only_here": 1.0}, {"loss": 4.0}]
    result = key_average(records, weights=[0, 2])
    assert result["loss"] == 4.0
    assert math.isnan(result["only_here"])  # no positive weight: no data


def test_tensor_dtypes_and_autograd_leaves() -> None:
    weight = torch.tensor(3.0, requires_grad=True)
    records = [
        {"f32": torch.tensor(1.5), "bf16": torch.tensor(2.5, dtype=torch.bfloat16)},
        {"f32": weight * 2, "int": torch.tensor(7), "flag": torch.tensor(True)},
        {"flag": False, "int": np.int64(3), "f64": torch.tensor(0.1, dtype=torch.float64)},
    ]
    result = key_average(records)
    assert result == {"f32": 3.75, "bf16": 2.5, "int": 5.0, "flag": 0.5, "f64": 0.1}


def test_empty_inputs() -> None:
    assert key_average([]) == {}
    assert key_average([], weights=[]) == {}
    assert key_average([{"a": {}}, {}]) == {"a": {}}


def test_tensors_are_synced_once_not_per_value(monkeypatch: pytest.MonkeyPatch) -> None:
    read_as_on_an_accelerator(monkeypatch)
    records = [
        {"loss": torch.tensor(float(i)), "parts": {"a": torch.tensor(1.0), "b": 2.0}}
        for i in range(50)
    ]
    weights = [torch.tensor(2.0)] * 50
    with CountOps() as counter:
        result = key_average(records, weights=weights)
    assert result == {"loss": 24.5, "parts": {"a": 1.0, "b": 2.0}}
    # .item() / float(t) per value would show up as _local_scalar_dense calls
    assert counter.calls["_local_scalar_dense.default"] == 0
    assert counter.calls["stack.default"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_host_sync_on_cuda() -> None:
    import warnings

    records = [{"loss": torch.tensor(float(i), device="cuda"), "n": i} for i in range(20)]
    weights = [torch.tensor(1.0, device="cuda")] * 20
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = key_average(records, weights=weights)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert result == {"loss": 9.5, "n": 9.5}
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


# Properties ------------------------------------------------------------------------------------

_values = st.floats(-1e6, 1e6, allow_nan=False)
_flat_records = st.lists(
    st.dictionaries(st.sampled_from(["a", "b", "c"]), _values, max_size=3), max_size=8
)


@settings(max_examples=200, deadline=None)
@given(records=_flat_records)
def test_matches_an_exact_reference_mean(records: list[dict[str, float]]) -> None:
    result = key_average(records)
    keys = {key for record in records for key in record}
    assert set(result) == keys
    for key in keys:
        values = [Fraction(record[key]) for record in records if key in record]
        exact = float(sum(values) / len(values))
        assert math.isclose(result[key], exact, rel_tol=1e-15, abs_tol=0.0)


@settings(max_examples=200, deadline=None)
@given(records=_flat_records, weight=st.floats(1e-3, 1e3))
def test_equal_weights_equal_the_plain_mean(records: list[dict[str, float]], weight: float) -> None:
    plain = key_average(records)
    assert key_average(records, weights=[1] * len(records)) == plain
    weighted = key_average(records, weights=[weight] * len(records))
    assert weighted.keys() == plain.keys()
    for key in plain:
        assert math.isclose(weighted[key], plain[key], rel_tol=1e-12, abs_tol=1e-9)


@settings(max_examples=200, deadline=None)
@given(
    data=st.lists(
        st.tuples(
            st.dictionaries(
                st.sampled_from(["a", "b"]),
                st.one_of(_values, st.just(math.nan)),
                max_size=2,
            ),
            st.integers(0, 100),
        ),
        max_size=8,
    ),
    seed=st.integers(0, 2**32 - 1),
    exclude_nan=st.booleans(),
)
def test_permutation_invariance(
    data: list[tuple[dict[str, float], int]], seed: int, exclude_nan: bool
) -> None:
    shuffled = list(data)
    random.Random(seed).shuffle(shuffled)

    def run(pairs: list[tuple[dict[str, float], int]]) -> dict[str, float]:
        records = [record for record, _ in pairs]
        return key_average(records, exclude_nan=exclude_nan, weights=[w for _, w in pairs])

    first, second = run(data), run(shuffled)
    assert first.keys() == second.keys()
    for key in first:  # exact sums: bitwise the same, NaN where NaN
        assert first[key] == second[key] or (math.isnan(first[key]) and math.isnan(second[key]))


# Errors ----------------------------------------------------------------------------------------


def test_weights_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match=r"got 2 weights for 3 records; expected one each"):
        key_average([{"a": 1}] * 3, weights=[1, 2])


@pytest.mark.parametrize(
    ("weights", "error", "match"),
    [
        ([1, -1], ValueError, r"weights\[1\] is -1; expected a finite number >= 0"),
        ([1, torch.tensor(math.nan)], ValueError, r"weights\[1\] is nan; expected a finite"),
        ([1, math.inf], ValueError, r"weights\[1\] is inf"),
        (
            [1, "2"],
            TypeError,
            r"weights\[1\] is a str \('2'\); expected a number >= 0 or a one-element real",
        ),
        ([1, torch.ones(2)], TypeError, r"weights\[1\] is a torch.float32 tensor of shape \(2,\)"),
        ([1, True], TypeError, r"weights\[1\] is a bool \(True\); expected a number >= 0"),
        ([1, torch.tensor(True)], TypeError, r"weights\[1\] is a torch.bool tensor of shape \(\)"),
        (
            3,
            TypeError,
            r"weights must be a sequence of numbers or 0-d tensors, one per record; got a int",
        ),
        (
            torch.tensor(1.0),
            TypeError,
            r"weights must be a sequence .*; got a Tensor\.",
        ),
        ({"a": 1, "b": 2}, TypeError, r"weights must be a sequence .*; got a dict"),
    ],
)
def test_bad_weights(weights: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        key_average([{"a": 1.0}, {"a": 2.0}], weights=weights)


@pytest.mark.parametrize(
    ("leaf", "match"),
    [
        ("fast", r"records\[1\]\['train'\]\['mode'\] is a str \('fast'\); expected a real"),
        (None, r"records\[1\]\['train'\]\['mode'\] is a NoneType"),
        ([1.0], r"records\[1\]\['train'\]\['mode'\] is a list"),
        (
            torch.ones(3),
            r"records\[1\]\['train'\]\['mode'\] is a torch.float32 tensor of shape \(3,\).*"
            r"\.mean\(\)",
        ),
        (torch.tensor(1j), r"\['mode'\] is a torch\.complex64 tensor of shape \(\)"),
        (1 + 2j, r"\['mode'\] is a complex"),
    ],
)
def test_bad_leaf_names_its_key_path(leaf: Any, match: str) -> None:
    records = [{"train": {"loss": 1.0}}, {"train": {"loss": 2.0, "mode": leaf}}]
    with pytest.raises(TypeError, match=match):
        key_average(records)


def test_mapping_in_one_record_and_value_in_another() -> None:
    with pytest.raises(
        ValueError,
        match=r"\['val'\]\['acc'\] is a nested mapping in records\[0\] but a value in "
        r"records\[2\]; expected the same structure in every record",
    ):
        key_average([{"val": {"acc": {"top1": 1.0}}}, {}, {"val": {"acc": 0.5}}])
    with pytest.raises(ValueError, match=r"\['acc'\] is a value in records\[0\] but a nested"):
        key_average([{"acc": 0.5}, {"acc": {"top1": 1.0}}])


def test_records_that_are_not_a_sequence_of_mappings() -> None:
    with pytest.raises(
        TypeError,
        match=r"got a dict\. For one record, pass key_average\(\[record\]\)",
    ):
        key_average({"loss": 1.0})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"records\[1\] must be a mapping .*; got a list"):
        key_average([{"loss": 1.0}, [1.0]])  # type: ignore[list-item]


def test_key_average_arguments_name_the_mistake() -> None:
    with pytest.raises(
        TypeError, match=r"key_average: exclude_nan must be True or False; got 'yes'"
    ):
        key_average([{"a": 1.0}], exclude_nan="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"exclude_nan must be True or False; got 1"):
        key_average([{"a": 1.0}], exclude_nan=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"records must be a sequence of mappings; got a NoneType"):
        key_average(None)  # type: ignore[arg-type]


def test_a_record_that_contains_itself_names_the_path() -> None:
    inner: dict[str, Any] = {"loss": 1.0}
    record = {"train": inner}
    inner["again"] = record
    with pytest.raises(
        ValueError,
        match=re.escape(
            "key_average: records[1] contains itself: records[1]['train']['again'] "
            "is records[1]; expected a structure without cycles"
        ),
    ):
        key_average([{"train": {"loss": 2.0}}, record])


# map_nested_tensor: misuse --------------------------------------------------------------------


def _cyclic_list() -> list[Any]:
    tree: list[Any] = [torch.ones(1)]
    tree.append(tree)
    return tree


def _cyclic_dict() -> dict[str, Any]:
    tree: dict[str, Any] = {"x": torch.ones(1), "sub": {"y": [torch.ones(1)]}}
    tree["sub"]["y"].append(tree["sub"])
    return tree


def _cyclic_dataclass() -> Box:
    box = Box([torch.ones(1)])
    box.content.append((box, 1))
    return box


@pytest.mark.parametrize(
    ("make", "closes"),
    [
        (_cyclic_list, "tree[1] is tree;"),
        (_cyclic_dict, "tree['sub']['y'][1] is tree['sub'];"),
        (_cyclic_dataclass, "tree.content[1][0] is tree;"),
    ],
)
def test_a_structure_that_contains_itself_names_where_the_cycle_closes(make, closes) -> None:
    calls: list[int] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t

    message = f"map_nested_tensor: tree contains itself: {closes} expected a structure without"
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        map_nested_tensor(fn, make())
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_a_shared_but_acyclic_structure_is_mapped_per_occurrence() -> None:
    shared = [torch.ones(1)]
    out = map_nested_tensor(lambda t: t + 1, {"a": shared, "b": [shared, shared]})
    assert [v.item() for v in (out["a"][0], out["b"][0][0], out["b"][1][0])] == [2.0] * 3


def test_a_deep_acyclic_structure_still_raises_recursion_error() -> None:
    tree: Any = torch.ones(1)
    for _ in range(sys.getrecursionlimit() + 10):
        tree = [tree]
    with pytest.raises(RecursionError):
        map_nested_tensor(lambda t: t, tree)


def test_a_recursion_error_inside_fn_is_not_taken_for_a_cycle() -> None:
    def fn(t: torch.Tensor) -> torch.Tensor:
        return fn(t)

    shared = [torch.ones(1)]  # met twice, but never inside itself: no cycle to report
    with pytest.raises(RecursionError):
        map_nested_tensor(fn, {"a": shared, "b": (shared,)})


def test_fn_that_is_not_callable_is_named() -> None:
    message = "map_nested_tensor: fn must be callable as fn(tensor); got a dict."
    with pytest.raises(TypeError, match=re.escape(message)):
        map_nested_tensor({"x": torch.ones(1)}, lambda t: t)  # type: ignore[arg-type]
