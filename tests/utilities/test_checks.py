"""check_count: the shared int argument check and its message."""

from __future__ import annotations

import pytest

from toolkit._checks import check_count, check_key


@pytest.mark.parametrize("value", [True, 2.0, "3", None, 0])
def test_refuses_what_is_not_an_int_at_least_the_bound(value: object) -> None:
    with pytest.raises(ValueError, match=r"^who: n must be an int >= 1 \(what\); got .*\.$"):
        check_count("who", "n", value, 1, "what")


def test_accepts_the_bound_and_above_and_leaves_out_empty_parts() -> None:
    check_count("who", "n", 1, 1)
    check_count("who", "n", 10**12, 1)
    with pytest.raises(ValueError, match=r"^who: n must be an int >= 0; got -1\.$"):
        check_count("who", "n", -1, 0)


@pytest.mark.parametrize("key", ["", None, 3])
def test_check_key_refuses_what_is_not_a_non_empty_str(key: object) -> None:
    with pytest.raises(ValueError, match=r"^who: key must be a non-empty string .*; got"):
        check_key("who", key)
    check_key("who", "val")
