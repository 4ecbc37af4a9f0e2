"""A pass resumed mid-epoch draws the batches an uninterrupted run would, without reading the
seen ones again: every source a PyTorch user passes to run().

Each test trains once without interruption and once stopped mid-epoch and resumed in what
stands for a new process: the global RNGs are scrambled and set back to the moment of the
stop (what load_checkpoint does), and the data source is built anew from the same seed.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from toolkit import TrainState, accumulate, make_step, run
from toolkit._rng import capture_rng, restore_rng


class Numbered(Dataset):
    """Samples that carry their index, and a count of the samples read."""

    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        self.reads += 1
        return i, torch.full((3,), float(i) / self.n)


class Stream(IterableDataset):
    """An iterable dataset without a length."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        for i in range(self.n):
            yield i, torch.full((3,), float(i) / self.n)


def _batches_of(seen: list[list[int]]) -> Callable[[torch.nn.Module, Any], torch.Tensor]:
    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        ids, x = batch
        seen.append([int(i) for i in ids])
        # Dropout draws from the global RNG, so a resume that does not restore it differs.
        return torch.nn.functional.dropout(model(x), 0.5).square().mean()

    return loss_fn


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _train(
    make_data: Callable[[], Any], total: int, stop_at: int | None, k: int = 1, **run_kwargs
) -> tuple[list[list[int]], TrainState]:
    """The batch ids trained on and the final state, stopped and resumed at ``stop_at``."""
    seen: list[list[int]] = []
    step = make_step(_batches_of(seen))
    step = accumulate(step, micro_batches=k) if k > 1 else step
    torch.manual_seed(1)
    state = _state()
    if stop_at is None:
        return seen, run(step, state, make_data(), max_steps=total, **run_kwargs)
    state = run(step, state, make_data(), max_steps=stop_at, **run_kwargs)
    rngs = capture_rng()  # what a checkpoint records
    torch.manual_seed(12345)  # a new process
    restore_rng(rngs)  # what load_checkpoint restores
    state = run(step, state, make_data(), max_steps=total, **run_kwargs)
    return seen, state


def _assert_same(make_data: Callable[[], Any], total: int, stop_at: int, k: int = 1) -> None:
    expected, reference = _train(make_data, total, None, k)
    got, resumed = _train(make_data, total, stop_at, k)
    assert got == expected
    for p, q in zip(reference.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)


def _loader(**kwargs) -> Callable[[], DataLoader]:
    return lambda: DataLoader(Numbered(40), batch_size=4, **kwargs)


SEEDED = {"shuffle": True, "generator": None}  # the generator is made per loader, below


def _seeded(**kwargs) -> Callable[[], DataLoader]:
    def make() -> DataLoader:
        return DataLoader(
            Numbered(40),
            batch_size=4,
            shuffle=True,
            generator=torch.Generator().manual_seed(7),
            **kwargs,
        )

    return make


@pytest.mark.parametrize("stop_at", [3, 10, 13, 20])  # mid-epoch, at an epoch's end, later
def test_a_seeded_shuffle_resumes_exactly(stop_at: int) -> None:
    _assert_same(_seeded(), total=26, stop_at=stop_at)


def test_an_unseeded_shuffle_resumes_exactly_too() -> None:
    # RandomSampler without a generator draws from the global RNG, recorded at the pass start.
    _assert_same(_loader(shuffle=True), total=26, stop_at=13)


@pytest.mark.slow
def test_worker_processes_resume_exactly() -> None:
    _assert_same(_seeded(num_workers=2), total=16, stop_at=7)


def test_accumulation_windows_resume_at_their_boundary() -> None:
    _assert_same(_seeded(), total=9, stop_at=4, k=3)


def test_a_distributed_sampler_resumes_exactly() -> None:
    def make() -> DataLoader:
        data = Numbered(40)
        sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
        return DataLoader(data, batch_size=4, sampler=sampler)

    _assert_same(make, total=12, stop_at=7)


def test_lists_resume_exactly() -> None:
    def make() -> list:
        return [(torch.tensor([i]), torch.full((1, 3), i / 10)) for i in range(10)]

    _assert_same(make, total=25, stop_at=13)


def test_seen_batches_are_not_read_again() -> None:
    # Resuming at batch 10,000 of an epoch reads only what it trains on.
    data = Numbered(20_000)
    loader = DataLoader(
        data, batch_size=1, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    state = _state().replace(batches_seen=10_000)
    state = state.replace(data_state={"rng": capture_rng()})
    step = make_step(lambda m, b: m(b[1]).square().mean())
    run(step, state, loader, max_steps=5)
    assert data.reads == 5


def test_an_iterable_dataset_without_a_length_is_taken() -> None:
    # Before: run() called len(data), and DataLoader.__len__ raised TypeError.
    loader = DataLoader(Stream(10), batch_size=2)
    seen: list[list[int]] = []
    state = run(make_step(_batches_of(seen)), _state(), loader, epochs=2)
    assert state.step == 10 and seen[:5] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


def test_an_iterable_dataset_resumes_by_reading_again_with_a_warning() -> None:
    with pytest.warns(
        RuntimeWarning, match="resuming a DataLoader over an IterableDataset: its first 3 batches"
    ):
        _assert_same(lambda: DataLoader(Stream(10), batch_size=2), total=8, stop_at=3)


def test_a_generator_is_taken_and_its_resume_warns() -> None:
    def make() -> Iterator:
        return ((torch.tensor([i]), torch.full((1, 3), i / 10)) for i in range(20))

    with pytest.warns(RuntimeWarning, match="resuming a one-shot iterator: its first 3 batches"):
        _assert_same(make, total=8, stop_at=3)


def test_iter_of_a_loader_is_taken() -> None:
    seen: list[list[int]] = []
    run(make_step(_batches_of(seen)), _state(), iter(_seeded()()), max_steps=4)
    expected: list[list[int]] = []
    run(make_step(_batches_of(expected)), _state(), _seeded()(), max_steps=4)
    assert seen == expected


def test_persistent_workers_are_not_resumed_exactly_and_say_so() -> None:
    make = _seeded(num_workers=1, persistent_workers=True)
    with pytest.warns(RuntimeWarning, match="persistent_workers=True draws from its generator"):
        _train(make, total=6, stop_at=3)


def test_a_state_without_a_record_of_the_pass_warns() -> None:
    state = _state().replace(batches_seen=2)  # made by hand: no data_state
    with pytest.warns(RuntimeWarning, match=r"carries no record of the randomness"):
        run(make_step(lambda m, b: m(b[1]).square().mean()), state, _seeded()(), max_steps=1)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata import
def test_stateful_dataloader_restores_its_own_position() -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    sampler_module = pytest.importorskip("torchdata.stateful_dataloader.sampler")
    from toolkit.loop._data import position

    def make() -> Any:
        data = Numbered(40)
        sampler = sampler_module.RandomSampler(data, generator=torch.Generator().manual_seed(5))
        return stateful.StatefulDataLoader(data, batch_size=4, sampler=sampler)

    expected, _ = _train(make, 26, None)
    seen: list[list[int]] = []
    step = make_step(_batches_of(seen))
    torch.manual_seed(1)
    loader = make()
    state = run(step, _state(), loader, max_steps=13)
    state = state.replace(data_state=position(loader, state.data_state))  # what a save records
    fresh = make()
    before = fresh.dataset.reads
    run(step, state, fresh, max_steps=26)
    assert seen == expected
    assert fresh.dataset.reads - before == 13 * 4  # the 3 seen batches of epoch 1 not read


def test_skipping_an_index_sampler_keeps_its_length() -> None:
    from toolkit.loop._data import _SkipFirst

    skipper = _SkipFirst([[0, 1], [2, 3], [4, 5]], 2)
    assert len(skipper) == 1 and list(skipper) == [[4, 5]]
    assert list(itertools.islice(_SkipFirst([[0]], 5), 3)) == []


@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_resumes_its_share_without_loading_seen_batches(rank: int) -> None:
    # 42 samples on 2 ranks: 21 each, so every pass ends with a batch of 1 on both ranks.
    datasets: list[Numbered] = []

    def make() -> DataLoader:
        data = Numbered(42)
        datasets.append(data)
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=3)
        return DataLoader(data, batch_size=4, sampler=sampler)

    expected, _ = _train(make, total=12, stop_at=None)
    datasets.clear()
    got, _ = _train(make, total=12, stop_at=8)  # 2 batches into the second pass (6 per pass)
    assert got == expected
    first, resumed = datasets
    assert first.reads == 21 + 8  # a pass and the 2 batches of the second pass trained
    assert resumed.reads == 4 + 4 + 4 + 1  # the second pass's last 4 batches only
    assert [len(ids) for ids in got[8:]] == [4, 4, 4, 1]


CASES = [  # each rank's batches per pass, and what both ranks must say
    ((6, 6), "even"),
    ((6, 5), r"this rank \d: \d batches; the ranks range from 5 batches to 6 batches"),
    ((6, None), r"from no length to 6 batches per pass\), so at the end of the shortest"),
]


def _lengths(rank: int, store: str, out: str) -> None:
    import pathlib

    import torch.distributed as dist
    from spawning import gloo_group

    from toolkit.distributed._collectives import check_even

    with gloo_group(rank, 2, store):
        for case, (lengths, _) in enumerate(
            CASES
        ):  # one spawn for every case: 2 ranks start slowly
            try:
                check_even(lengths[rank], dist.group.WORLD)
                said = "even"
            except ValueError as error:
                said = str(error)
            pathlib.Path(out, f"case{case}.rank{rank}.txt").write_text(said)


@pytest.mark.slow
def test_ranks_with_passes_of_different_lengths_are_refused(tmp_path) -> None:
    from spawning import spawn

    def arguments(attempt: int) -> tuple[str, str]:
        out = tmp_path / str(attempt)
        out.mkdir()
        return str(out / "store"), str(out)

    spawn(_lengths, arguments, nprocs=2, timeout=60)
    out = sorted(p for p in tmp_path.iterdir() if p.is_dir())[-1]
    for case, (_, said) in enumerate(CASES):
        for rank in (0, 1):  # both ranks raise, neither waits for the other
            assert re.search(said, (out / f"case{case}.rank{rank}.txt").read_text()), case


def _uneven_run(rank: int, store: str, out: str) -> None:
    import pathlib

    from spawning import gloo_group
    from torch.nn.parallel import DistributedDataParallel

    from toolkit import TrainState, make_step, run

    with gloo_group(rank, 2, store):
        model = DistributedDataParallel(torch.nn.Linear(2, 1))
        state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        data = [torch.ones(2, 2)] * (3 if rank == 0 else 2)  # a hand-made split that is uneven
        step = make_step(lambda m, b: m(b).square().mean())
        try:
            run(step, state, data, epochs=1)
            said = f"ran {state.step} updates"
        except ValueError as error:
            said = str(error)
    pathlib.Path(out, f"rank{rank}.txt").write_text(said)


@pytest.mark.slow
def test_run_refuses_data_parallel_ranks_with_uneven_data_before_training(tmp_path) -> None:
    # Without the check rank 0's third update waits forever for rank 1 in DDP's all-reduce.
    from spawning import spawn

    def arguments(attempt: int) -> tuple[str, str]:
        out = tmp_path / str(attempt)
        out.mkdir()
        return str(out / "store"), str(out)

    spawn(_uneven_run, arguments, nprocs=2, timeout=60)
    out = sorted(p for p in tmp_path.iterdir() if p.is_dir())[-1]
    for rank in (0, 1):
        said = (out / f"rank{rank}.txt").read_text()
        assert re.search(r"the ranks range from 2 batches to 3 batches", said), said


def test_a_changed_batch_size_maps_by_samples_unless_the_loader_keeps_its_own_position() -> None:
    from toolkit.loop._data import seen_after_change

    class Stateful(DataLoader):  # keeps its position in batches of its own size
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    saved = {"batch_size": 2, "samples": 12, "batches": 6, "world_size": 1}
    now = {"batch_size": 4, "samples": 12, "batches": 3, "world_size": 1}
    # 3 batches of 2 seen: 6 samples; batch 0 of 4 is done, 2 samples of batch 1 too.
    loader = DataLoader(range(12), batch_size=4)
    assert seen_after_change(loader, 3, saved, now, {}) == (1, 2, "after 1 batch and 2 samples")
    # Resumed there and saved again before the short batch: 1 batch of 4 and 2 samples seen.
    assert seen_after_change(loader, 1, now, saved, {"split": [1, 2]})[:2] == (3, 0)
    assert seen_after_change(loader, 1, now, now, {"split": [1, 2]})[:2] == (1, 2)
    with pytest.raises(ValueError, match=r"other batch_size 2 -> 4, batches 6 -> 3"):
        seen_after_change(Stateful(range(12), batch_size=4), 3, saved, now, {})
    with pytest.raises(ValueError, match=r"stopped 3 batches .* other world_size 1 -> 2"):
        seen_after_change(loader, 3, saved, {**now, "world_size": 2}, {})
    assert seen_after_change(loader, 0, saved, {**now, "samples": 8}, {})[:2] == (0, 0)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata import
def test_the_batch_size_of_a_pass_is_known_where_its_batches_are_torchs_own() -> None:
    from torch.utils.data import BatchSampler, SequentialSampler

    from toolkit.loop._data import pass_settings

    batches = BatchSampler(SequentialSampler(range(10)), 4, False)
    assert pass_settings(DataLoader(range(10), batch_sampler=batches))["batch_size"] == 4
    custom = DataLoader(range(10), batch_sampler=[[0, 1], [2, 3, 4]])  # sizes toolkit can't know
    assert pass_settings(custom) == {"batch_size": None, "samples": 10, "batches": 2}
    in_memory = [torch.zeros(4, 3), torch.zeros(4, 3), (torch.zeros(2, 3), "text")]
    assert pass_settings(in_memory) == {"batch_size": 4, "samples": 10, "batches": 3}
    assert (
        pass_settings([torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(4, 3)])["samples"] is None
    )
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    assert pass_settings(stateful.StatefulDataLoader(range(10), batch_size=4))["batch_size"] == 4
