"""Checkpoints across ranks: DDP and FSDP2 on 2 gloo ranks.

One mp.spawn runs every 2-rank scenario (spawning costs seconds); each rank writes its
findings to a JSON file, and the test asserts on them and on the checkpoints on disk,
which it also loads in this (single) process: a 2-rank FSDP2 checkpoint into a plain model.
"""

from __future__ import annotations

import itertools
import json
import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from spawning import gloo_group, spawn

from toolkit import (
    TrainState,
    export_model,
    load_checkpoint,
    make_step,
    run,
    save_checkpoint,
    unwrap,
)
from toolkit.checkpoints import list_checkpoints, verify_checkpoint
from toolkit.plugins import checkpoints

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built"),
    pytest.mark.skipif(sys.platform != "linux", reason="gloo over FileStore tested on Linux"),
]

WORLD = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _state(wrap: str) -> TrainState:
    model = _model()
    if wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif wrap == "fsdp2":
        model = _fsdp2(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler)


def _batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)) for _ in range(n)]


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _full(value: torch.Tensor) -> list:
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    return full.detach().tolist()


def _weights(state: TrainState) -> dict:
    params = {n: _full(p) for n, p in unwrap(state.model).named_parameters()}
    moments = [_full(s["exp_avg"]) for s in state.optimizer.state.values()]
    return {"params": params, "exp_avg": moments, "lr": state.optimizer.param_groups[0]["lr"]}


def _train(state: TrainState, rank: int, n: int) -> TrainState:
    step = make_step(_loss)
    for batch in _batches(rank, n):
        state, _ = step(state, batch)
    return state


def _scenarios(rank: int, wrap: str, folder: Path) -> dict:
    report: dict = {}
    state = _train(_state(wrap), rank, 2)
    torch.manual_seed(100 + rank)  # each rank's own RNG, to be kept per rank
    path = save_checkpoint(state.replace(extras={"note": "x"}), folder / "step_000002")
    report["saved"] = _weights(state)
    report["draws"] = torch.rand(3).tolist()  # what each rank's RNG gives after the save
    torch.manual_seed(7)  # forget it
    loaded = load_checkpoint(path, like=_state(wrap))
    report["loaded"] = _weights(loaded)
    report["draws_after_load"] = torch.rand(3).tolist()
    report["step"] = loaded.step

    # A save that fails on rank 1 only fails on both, with one message, and writes nothing.
    bad = state.replace(extras={"bad": object()} if rank == 1 else {})
    try:
        save_checkpoint(bad, folder / "failed")
    except TypeError as error:
        report["error"] = str(error)
    report["leftovers"] = sorted(p.name for p in folder.iterdir() if p.name != "step_000002")
    return report


def _signal_count(rank: int, wrap: str, folder: Path, signals: tuple) -> list[int]:
    """All-reduces the plugin makes per update (counted between "step" events)."""
    calls: list[int] = []
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    marks: list[int] = []

    def mark(event):
        if event.kind == "step":
            marks.append(len(calls))

    import toolkit.plugins._checkpoints as plugin_module

    dist.all_reduce = counting
    plugin_module.SIGNAL_EVERY = 2  # the ranks agree on signals at every second update
    try:
        plugin = checkpoints(folder, at_end=False, signals=signals)
        run(make_step(_loss), _state(wrap), _batches(rank, 4), max_steps=4, plugins=[plugin, mark])
    finally:
        dist.all_reduce = original
        plugin_module.SIGNAL_EVERY = 10
    return [b - a for a, b in itertools.pairwise(marks)]


def _worker(rank: int, store: str, out: str, plain: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, WORLD, store):
        report = {wrap: _scenarios(rank, wrap, Path(out) / wrap) for wrap in ("ddp", "fsdp2")}
        # A single-process checkpoint loads into an FSDP2 model on 2 ranks.
        report["one_to_two"] = _weights(load_checkpoint(plain, like=_state("fsdp2")))
        report["per_update"] = {
            "signals": _signal_count(rank, "ddp", Path(out) / "count", (signal.SIGTERM,)),
            "none": _signal_count(rank, "ddp", Path(out) / "count_none", ()),
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], dict]:
    tmp = tmp_path_factory.mktemp("distributed")
    single = _train(_state("none"), 0, 3)
    plain = save_checkpoint(single, tmp / "plain" / "step_000003")

    def attempt_args(attempt: int) -> tuple[str, str, str]:
        out = tmp / f"attempt{attempt}"
        out.mkdir()
        return str(out / "store"), str(out), str(plain)

    spawn(_worker, attempt_args, nprocs=WORLD)
    out = max(tmp.glob("attempt*"))
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return out, reports, _weights(single)


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_a_checkpoint_of_two_ranks_loads_on_both_with_each_ranks_rng(spawned, wrap) -> None:
    out, reports, _ = spawned
    for report in reports:
        mine = report[wrap]
        assert mine["loaded"] == mine["saved"] and mine["step"] == 2
        assert mine["draws_after_load"] == mine["draws"]  # this rank's RNG, restored
    assert reports[0][wrap]["saved"] == reports[1][wrap]["saved"]
    assert reports[0][wrap]["draws"] != reports[1][wrap]["draws"]  # per rank, not rank 0's
    assert verify_checkpoint(out / wrap / "step_000002") == []


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_a_save_failing_on_one_rank_fails_on_every_rank_and_leaves_nothing(spawned, wrap) -> None:
    _, reports, _ = spawned
    assert "extras['bad']: a object, which a checkpoint cannot store" in reports[1][wrap]["error"]
    assert reports[0][wrap]["error"].startswith("save_checkpoint: rank 1 of the group failed")
    assert "extras['bad']" in reports[0][wrap]["error"]
    assert reports[0][wrap]["leftovers"] == reports[1][wrap]["leftovers"] == []


def test_ddp_writes_the_single_process_format_plus_each_ranks_own_state(spawned) -> None:
    out, reports, _ = spawned
    folder = out / "ddp" / "step_000002"
    names = sorted(p.name for p in folder.iterdir())
    assert "model.safetensors" in names and "rank_00001.json" in names
    assert "rank_00000.json" not in names  # rank 0's are the ordinary rng and state files
    # It loads in a single process, as rank 0.
    state = load_checkpoint(folder, like=_state("none"))
    assert _weights(state) == reports[0]["ddp"]["saved"]
    assert torch.rand(3).tolist() == reports[0]["ddp"]["draws"]


def test_a_sharded_checkpoint_of_two_ranks_loads_in_one_process_and_exports(
    spawned, tmp_path
) -> None:
    out, reports, _ = spawned
    folder = out / "fsdp2" / "step_000002"
    assert sorted(p.name for p in (folder / "sharded").iterdir()) == [
        "shard-00001-model-00001-of-00001.safetensors",
        "shard-00002-model-00001-of-00001.safetensors",
    ]
    assert not (folder / "model.safetensors").exists()
    state = load_checkpoint(folder, like=_state("none"))
    assert _weights(state) == reports[0]["fsdp2"]["saved"]
    assert torch.rand(3).tolist() == reports[0]["fsdp2"]["draws"]  # rank 0's RNG
    exported = load_file(export_model(folder, tmp_path / "model.safetensors"))
    model = _model()
    model.load_state_dict(exported, strict=True)
    assert {n: p.tolist() for n, p in model.named_parameters()} == reports[0]["fsdp2"]["saved"][
        "params"
    ]


def test_a_single_process_checkpoint_loads_into_fsdp2_on_two_ranks(spawned) -> None:
    _, reports, single = spawned
    for report in reports:
        assert report["one_to_two"] == single


def test_the_signal_flag_costs_one_all_reduce_every_n_updates_and_none_without_signals(
    spawned,
) -> None:
    _, reports, _ = spawned
    for report in reports:
        # Counted against the same run without signals: the step itself may all-reduce.
        counts = report["per_update"]
        assert [a - b for a, b in zip(counts["signals"], counts["none"])] == [0, 1, 0], counts


def test_a_file_planted_among_the_shards_is_refused_before_anything_reads_it(
    spawned, tmp_path
) -> None:
    import shutil

    out, _, _ = spawned
    folder = tmp_path / "step_000002"
    shutil.copytree(out / "fsdp2" / "step_000002", folder)
    (folder / "sharded" / ".metadata").write_bytes(b"\x80\x04planted pickle")
    with pytest.raises(Exception, match=r"sharded/\.metadata: not listed in the manifest"):
        load_checkpoint(folder, like=_state("none"))
    assert any("not listed in the manifest" in p for p in verify_checkpoint(folder))
    assert list_checkpoints(tmp_path)[0].step == 2
