"""A load's template holding a ``defaultdict``: read, never grown, never guiding decoding."""

from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from toolkit import TrainState, load_checkpoint, save_checkpoint


def test_load_leaves_a_template_defaultdict_unchanged_and_returns_the_saved_counts(
    tmp_path: Path,
) -> None:
    """Catches indexing the template (``template[key]``): a saved key missing from the live
    defaultdict was added to the user's live state (``"b": 0``)."""
    saved = TrainState(model=nn.Linear(1, 1), extras={"counts": defaultdict(int, a=1, b=2)})
    path = save_checkpoint(saved, tmp_path / "step_000000")
    counts: defaultdict[str, int] = defaultdict(int, a=5)
    live = TrainState(model=nn.Linear(1, 1), extras={"counts": counts})

    loaded = load_checkpoint(path, like=live)

    assert dict(counts) == {"a": 5}, "the load added entries to the live template"
    assert loaded.extras["counts"] == {"a": 1, "b": 2}


def test_saved_tensor_is_not_moved_by_a_template_defaultdicts_default(tmp_path: Path) -> None:
    """Catches decoding guided by the default factory's value: a saved tensor whose key the
    live defaultdict lacks went to the default's device (here meta: its data lost)."""
    weights = {"b": torch.tensor([1.0, 2.0])}
    saved = TrainState(model=nn.Linear(1, 1), extras={"w": weights})
    path = save_checkpoint(saved, tmp_path / "step_000000")
    template: defaultdict[str, torch.Tensor] = defaultdict(lambda: torch.empty(2, device="meta"))
    live = TrainState(model=nn.Linear(1, 1), extras={"w": template})

    loaded = load_checkpoint(path, like=live)

    value = loaded.extras["w"]["b"]
    assert value.device == torch.device("cpu")
    assert torch.equal(value, torch.tensor([1.0, 2.0]))
    assert dict(template) == {}, "the load added entries to the live template"
