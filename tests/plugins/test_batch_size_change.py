"""A pass resumed with another batch size goes on at its first unseen sample.

Reference: the sample ids a pass hands out with the old batch size, uninterrupted. A run
stopped after some batches of the old size and resumed with the new one must have trained,
together, exactly that pass once, in its order (the first batch after the resume short),
then go on with the new size's own passes, with full batches.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SubsetRandomSampler,
)

from toolkit import TrainState, make_step, run
from toolkit.plugins import checkpoints

N = 42  # samples per pass: neither 4, 6 nor 5 divides it


class Numbered(Dataset):
    """Sample i is the row [i, 1]: the loss function reads which samples a batch holds."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), 1.0])


class Stream(IterableDataset):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return (torch.tensor([float(i), 1.0]) for i in range(N))


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(3)


SOURCES: dict[str, Callable[[int], Any]] = {
    "in order": lambda size: DataLoader(Numbered(), batch_size=size),
    "seeded shuffle": lambda size: DataLoader(
        Numbered(), batch_size=size, shuffle=True, generator=_generator()
    ),
    "unseeded shuffle": lambda size: DataLoader(Numbered(), batch_size=size, shuffle=True),
    "a sampler": lambda size: DataLoader(
        Numbered(), batch_size=size, sampler=SubsetRandomSampler(range(N), _generator())
    ),
    "DistributedSampler": lambda size: DataLoader(
        Numbered(), batch_size=size, sampler=DistributedSampler(Numbered(), 2, 1, seed=5)
    ),
    "batch_sampler=BatchSampler": lambda size: DataLoader(
        Numbered(),
        batch_sampler=BatchSampler(RandomSampler(range(N), generator=_generator()), size, False),
    ),
    "a list": lambda size: [
        torch.stack([Numbered()[i] for i in range(start, min(start + size, N))])
        for start in range(0, N, size)
    ],
}


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _recording(batches: list[list[int]]):
    def loss_fn(model, batch):
        batches.append([int(i) for i in batch[:, 0]])
        return model(batch).square().mean()

    return make_step(loss_fn)


def _resumed(
    make: Callable[[int], Any], folder: Path, old: int, stop: int, new: int, epochs: int = 2
) -> tuple[list[list[int]], list[list[int]], TrainState, list[str]]:
    """The batches of a run stopped after ``stop`` batches of ``old``, those of its resume
    with ``new`` for ``epochs`` passes, the final state and the warnings."""
    before: list[list[int]] = []
    run(_recording(before), _state(), make(old), max_steps=stop, plugins=[checkpoints(folder)])
    after: list[list[int]] = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        state = run(
            _recording(after), _state(), make(new), epochs=epochs, plugins=[checkpoints(folder)]
        )
    return before, after, state, [str(w.message) for w in said]


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


@pytest.mark.parametrize("old, stop, new", [(4, 5, 6), (6, 3, 4), (4, 1, 6)])
@pytest.mark.parametrize("source", list(SOURCES))
def test_a_changed_batch_size_trains_the_pass_once_in_its_order(
    tmp_path: Path, source: str, old: int, stop: int, new: int
) -> None:
    # Bug caught: the position was rounded down to whole batches of the new size, so up to a
    # batch of seen samples were trained twice (4 -> 6 after 7 batches: 4 samples twice).
    # (4, 1, 6): a position inside the first batch of the new size; a pass 0 batches in was
    # taken for a fresh one and started again, its 4 seen samples trained twice.
    make = SOURCES[source]
    pass_: list[list[int]] = []
    run(_recording(pass_), _state(), make(old), epochs=1)
    fresh: list[list[int]] = []  # the new batch size's own passes, uninterrupted
    run(_recording(fresh), _state(), make(new), epochs=2)
    before, after, state, said = _resumed(make, tmp_path, old, stop, new)
    per_pass = len(make(new))
    rest, second = after[: len(after) - per_pass], after[len(after) - per_pass :]
    assert _flat(before) + _flat(rest) == _flat(pass_)  # each sample once, in the pass's order
    part = stop * old % new
    tail = [len(b) for b in fresh[per_pass - len(rest) : per_pass]]  # the new size's own
    assert [len(b) for b in rest] == [tail[0] - part, *tail[1:]]  # only the first one is cut
    assert second == fresh[per_pass:]  # the next pass: the new size's, full batches
    assert (state.epoch, state.batches_seen, state.step) == (2, 0, stop + len(after))
    where = f"after {stop * old // new} batches" + f" and {part} samples" * bool(part)
    assert [w for w in said if "this pass goes on" in w and where in w] != [], said
    assert not [w for w in said if w.startswith("run:")], said  # exact: nothing to warn of


def test_drop_last_leaves_out_the_rest_of_the_batch_the_change_split(tmp_path: Path) -> None:
    # Decided: drop_last=True promises full batches, so the unseen samples of the split batch
    # are left out of this pass (as drop_last leaves out a short last batch), never repeated.
    def make(size: int) -> DataLoader:
        return DataLoader(
            Numbered(), batch_size=size, shuffle=True, generator=_generator(), drop_last=True
        )

    fresh: list[list[int]] = []
    run(_recording(fresh), _state(), make(6), epochs=1)
    before, after, state, said = _resumed(make, tmp_path, 4, 7, 6, epochs=1)
    assert _flat(before) == _flat(fresh)[:28] and after == fresh[5:]  # batch 5 (24..29) out
    assert state.batches_seen == 0 and state.epoch == 1
    assert any("drop_last=True leaves out the 2 unseen samples of batch 5" in w for w in said)


def test_an_iterable_dataset_says_how_many_samples_it_trains_again(tmp_path: Path) -> None:
    def make(size: int) -> DataLoader:
        return DataLoader(Stream(), batch_size=size)

    before, after, _, said = _resumed(make, tmp_path, 4, 7, 6, epochs=1)
    assert _flat(before) + _flat(after)[4:] == list(range(N))  # samples 24..27 twice
    assert any(
        "4 samples trained before the batch size changed are trained again" in w for w in said
    )


class Pairs:
    """A batch sampler of its own: toolkit cannot know how many samples its batches hold."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[list[int]]:
        return (list(range(i, min(i + self.size, N))) for i in range(0, N, self.size))

    def __len__(self) -> int:
        return -(-N // self.size)


def test_a_batch_sampler_of_unknown_batch_size_is_refused_mid_pass(tmp_path: Path) -> None:
    def make(size: int) -> DataLoader:
        return DataLoader(Numbered(), batch_sampler=Pairs(size))

    run(_recording([]), _state(), make(4), max_steps=3, plugins=[checkpoints(tmp_path)])
    with pytest.raises(ValueError, match=r"stopped 3 batches .*batches 11 -> 7.*cannot be mapped"):
        run(_recording([]), _state(), make(6), epochs=1, plugins=[checkpoints(tmp_path)])
