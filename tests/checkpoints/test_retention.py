"""Retention: the union of the rules, decided from what is on disk, the newest always kept."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from toolkit import TrainState, save_checkpoint
from toolkit.checkpoints import Retention, list_checkpoints, prune_checkpoints, retain

NAN = math.nan


def disk(*rows: tuple[int, dict[str, float]]) -> list[tuple[str, int, dict[str, float]]]:
    return [(f"step_{step:06d}", step, metrics) for step, metrics in rows]


def steps(*values: int) -> list[tuple[str, int, dict[str, float]]]:
    return disk(*((v, {}) for v in values))


def kept(result: dict[str, tuple[str, ...]]) -> dict[int, tuple[str, ...]]:
    """Only the kept ones, by step, for short expectations."""
    return {int(name.split("_")[1]): why for name, why in result.items() if why}


# (id, checkpoints on disk, rules, {step: reasons} of the kept ones; every other is pruned)
CASES = [
    ("nothing on disk", [], Retention(), {}),
    ("default keeps the last one", steps(1, 2, 3), Retention(), {3: ("newest", "keep_last")}),
    (
        "keep_last=0 still keeps the newest",
        steps(1, 2, 3),
        Retention(keep_last=0),
        {3: ("newest",)},
    ),
    (
        "keep_last=2",
        steps(10, 20, 30, 40),
        Retention(keep_last=2),
        {30: ("keep_last",), 40: ("newest", "keep_last")},
    ),
    (
        "keep_last larger than what is there",
        steps(10, 20),
        Retention(keep_last=5),
        {10: ("keep_last",), 20: ("newest", "keep_last")},
    ),
    (
        "order on disk does not matter",
        steps(30, 10, 40, 20),
        Retention(keep_last=2),
        {30: ("keep_last",), 40: ("newest", "keep_last")},
    ),
    (
        "keep_every",
        steps(100, 200, 300, 400, 500),
        Retention(keep_last=1, keep_every=200),
        {200: ("keep_every",), 400: ("keep_every",), 500: ("newest", "keep_last")},
    ),
    (
        "keep_every includes step 0",
        steps(0, 50, 100),
        Retention(keep_last=0, keep_every=100),
        {0: ("keep_every",), 100: ("newest", "keep_every")},
    ),
    (
        "keep_steps",
        steps(1, 2, 3, 4),
        Retention(keep_last=1, keep_steps=(1, 3, 99)),
        {1: ("keep_steps",), 3: ("keep_steps",), 4: ("newest", "keep_last")},
    ),
    (
        "keep_best min",
        disk((1, {"loss": 0.5}), (2, {"loss": 0.1}), (3, {"loss": 0.3}), (4, {"loss": 0.9})),
        Retention(keep_last=1, keep_best=2, metric="loss"),
        {2: ("keep_best",), 3: ("keep_best",), 4: ("newest", "keep_last")},
    ),
    (
        "keep_best max",
        disk((1, {"acc": 0.5}), (2, {"acc": 0.1}), (3, {"acc": 0.9})),
        Retention(keep_last=0, keep_best=1, metric="acc", mode="max"),
        {3: ("newest", "keep_best")},
    ),
    (
        "keep_best skips checkpoints without the metric and NaN",
        disk((1, {"loss": NAN}), (2, {}), (3, {"other": 0.0}), (4, {"loss": 2.0}), (5, {})),
        Retention(keep_last=0, keep_best=2, metric="loss"),
        {4: ("keep_best",), 5: ("newest",)},
    ),
    (
        "keep_best ties prefer the later checkpoint",
        disk((1, {"loss": 0.5}), (2, {"loss": 0.5}), (3, {"loss": 0.7})),
        Retention(keep_last=0, keep_best=1, metric="loss"),
        {2: ("keep_best",), 3: ("newest",)},
    ),
    (
        "keep_best counts inf and -inf",
        disk((1, {"loss": math.inf}), (2, {"loss": -math.inf}), (3, {"loss": 1.0})),
        Retention(keep_last=0, keep_best=1, metric="loss"),
        {2: ("keep_best",), 3: ("newest",)},
    ),
    (
        "the union of every rule, with all the reasons",
        disk(
            (100, {"loss": 0.1}),
            (200, {"loss": 0.5}),
            (250, {"loss": 0.4}),
            (300, {"loss": 0.6}),
            (350, {"loss": 0.9}),
            (400, {"loss": 0.7}),
        ),
        Retention(keep_last=2, keep_every=200, keep_steps=(250,), keep_best=1, metric="loss"),
        {
            100: ("keep_best",),
            200: ("keep_every",),
            250: ("keep_steps",),
            350: ("keep_last",),
            400: ("newest", "keep_last", "keep_every"),
        },
    ),
    (
        "the newest is kept even when it is the worst",
        disk((1, {"loss": 0.1}), (2, {"loss": 9.0})),
        Retention(keep_last=0, keep_best=1, metric="loss"),
        {1: ("keep_best",), 2: ("newest",)},
    ),
]


@pytest.mark.parametrize(
    ("on_disk", "rules", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_retention_table(on_disk: list, rules: Retention, expected: dict) -> None:
    # Bugs caught by rows: the newest deleted (keep_last=0, worst score), rules as an
    # intersection instead of a union, the wrong end of keep_last (oldest), best-K ranking
    # NaN or missing metrics, min/max swapped, order-dependent results.
    result = retain(on_disk, rules)
    assert set(result) == {name for name, _, _ in on_disk}
    assert kept(result) == expected


def test_the_newest_by_step_ties_are_all_kept() -> None:
    # Two folders of one step (e.g. a copy): neither is deleted as "not the newest".
    result = retain([("a", 5, {}), ("b", 5, {}), ("c", 1, {})], Retention(keep_last=0))
    assert result == {"a": ("newest",), "b": ("newest",), "c": ()}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_last": -1}, "Retention: keep_last must be an int >= 0; got -1."),
        ({"keep_best": True}, "Retention: keep_best must be an int >= 0; got True."),
        ({"keep_every": 0}, "Retention: keep_every must be an int >= 1 (or None); got 0."),
        ({"keep_steps": "10"}, "Retention: keep_steps must be a sequence of ints; got '10'."),
        ({"mode": "lowest"}, "Retention: mode must be one of ['min', 'max']; got 'lowest'."),
        ({"keep_full": 0}, "Retention: keep_full must be an int >= 1 (or None); got 0."),
        (
            {"keep_best": 2},
            "Retention: metric must be the manifest metric to rank by (e.g. 'val/loss') "
            "with keep_best=2; got None.",
        ),
    ],
)
def test_bad_rules_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        Retention(**kwargs)
    assert str(error.value) == message


def test_rules_describe_themselves_and_round_trip_through_a_manifest() -> None:
    from toolkit.checkpoints._retention import retention_from_document

    rules = Retention(
        keep_last=3,
        keep_every=1000,
        keep_steps=(5, 1, 5),
        keep_best=2,
        metric="val/loss",
        mode="min",
    )
    assert rules.keep_steps == (1, 5)
    assert rules.describe() == (
        "keep_last=3, keep_every=1000, keep_steps=[1, 5], keep_best=2 by val/loss (min)"
    )
    assert retention_from_document(rules.to_document()) == rules


def save_steps(root: Path, losses: dict[int, float], rules: Retention) -> None:
    state = TrainState(model=torch.nn.Linear(1, 1))
    for step, loss in losses.items():
        save_checkpoint(
            state.replace(step=step),
            root / f"step_{step:06d}",
            metrics={"val/loss": loss},
            rules=rules,
        )


def test_pruning_decides_from_disk_and_survives_a_restart(tmp_path: Path) -> None:
    # Bug caught: a retention memory kept in the process (lost at restart), so a second
    # process prunes the best checkpoint it never saw saved.
    rules = Retention(keep_last=1, keep_best=1, metric="val/loss")
    root = tmp_path / "ckpt"
    save_steps(root, {100: 0.1, 200: 0.5}, rules)
    assert [p.name for p in prune_checkpoints(root, rules)] == []  # 100 best, 200 newest
    save_steps(root, {300: 0.7}, rules)  # "a new process" saves more
    assert [p.name for p in prune_checkpoints(root, rules, dry_run=True)] == ["step_000200"]
    assert [c.name for c in list_checkpoints(root)] == ["step_000100", "step_000200", "step_000300"]
    assert [p.name for p in prune_checkpoints(root, rules)] == ["step_000200"]
    assert sorted(p.name for p in root.iterdir()) == ["step_000100", "step_000300"]


def test_pruning_never_touches_folders_it_cannot_read(tmp_path: Path) -> None:
    # Bug caught: deleting a damaged or foreign folder because it has no step.
    root = tmp_path / "ckpt"
    save_steps(root, {1: 0.0, 2: 0.0, 3: 0.0}, Retention())
    (root / "notes").mkdir()
    (root / "step_000002" / "manifest.json").unlink()  # damaged
    assert [p.name for p in prune_checkpoints(root, Retention(keep_last=1))] == ["step_000001"]
    assert sorted(p.name for p in root.iterdir()) == ["notes", "step_000002", "step_000003"]
