"""Training on a 2-D device mesh (4 gloo ranks): tensor, sequence and context parallelism
with FSDP2, each equal to one process that trains on the global batches (float64, 1e-10).

One spawn runs every job in turn (4 processes on 2 cores start slowly); each test reads its
job's weights. The step is ``accumulate(2)``, ``clip``, ``guard_nonfinite`` and a
``LossSum`` with ignored targets, over 7 batches of which one is skipped on every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mesh_jobs as jobs
import pytest
import torch
import torch.distributed as dist
from spawning import gloo_group, spawn

from toolkit import TrainState, load_checkpoint, save_checkpoint
from toolkit.distributed import current_layout, init_layout, set_layout

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built"),
    pytest.mark.skipif(sys.platform != "linux", reason="gloo over FileStore tested on Linux"),
]

WORLD = 4
PLANS = ("full", "blocks", "sequence")


_LAYOUTS: dict[tuple[int, ...], object] = {}


def _layout(dp_shard: int, tp: int = 1, cp: int = 1):  # type: ignore[no-untyped-def]
    """init_layout once per shape in this process (each builds process groups: slow on 4
    ranks of 2 cores), then set again as the job's."""
    key = (dp_shard, tp, cp)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = init_layout(dp_shard=dp_shard, tp=tp, cp=cp)
    set_layout(_LAYOUTS[key])  # type: ignore[arg-type]
    return _LAYOUTS[key]


def _tensor_parallel(plan: str, dp: int, tp: int) -> TrainState:
    layout = _layout(dp_shard=dp, tp=tp)
    model = jobs.fresh_model(norms=plan != "full")
    jobs.tensor_parallel(model, layout.mesh["tp"], plan)
    jobs.shard_data(model, layout.mesh["dp_shard"])
    return TrainState(model=model, optimizer=jobs.optimizer(model))


def _train(state: TrainState, batches: range, context: bool = False) -> TrainState:
    groups, step = current_layout().groups, jobs.train_step()  # type: ignore[union-attr]
    context_group = current_layout().mesh["cp"].get_group() if context else None  # type: ignore[union-attr]
    for index in batches:
        state, _ = step(state, jobs.my_part(jobs.batch(index), groups.data, context_group))
    return state


def _context_parallel() -> TrainState:
    """dp=2 x cp=2: FSDP2 over the data x context ranks, each rank's loss over its slice."""
    layout = _layout(dp_shard=2, cp=2)
    model = jobs.fresh_model(norms=True)
    jobs.shard_data(model, layout.mesh["dp_shard", "cp"]._flatten())
    return TrainState(model=model, optimizer=jobs.optimizer(model))


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    results: dict[str, dict[str, torch.Tensor]] = {}
    with gloo_group(rank, WORLD, store):
        for plan in PLANS:
            state = _train(_tensor_parallel(plan, 2, 2), range(jobs.BATCHES))
            results[plan] = jobs.full_weights(state.model)
        state = _train(_context_parallel(), range(jobs.BATCHES), context=True)
        results["context"] = jobs.full_weights(state.model)
        # Saved on dp=2 x tp=2, resumed on 1 x 4 and on 4 x 1 (DCP reshards): one more update.
        folder = Path(out) / "checkpoint"
        state = _train(_tensor_parallel("sequence", 2, 2), range(jobs.BATCHES))
        save_checkpoint(state, folder)
        for dp, tp in ((1, 4), (4, 1)):
            like = _tensor_parallel("sequence", dp, tp)
            state = _train(load_checkpoint(folder, like), range(jobs.BATCHES, jobs.BATCHES + 2))
            results[f"resumed {dp}x{tp}"] = jobs.full_weights(state.model)
        results["refused"] = _refusals()
        results["folder"] = str(folder)
        ran = _run_jobs(out)  # run() on the mesh, below: the same spawn (4 ranks start slowly)
        set_layout(None)
    torch.save({"plans": results, "run": ran}, Path(out) / f"rank{rank}.pt")


def _refusals() -> dict[str, str]:
    """What bad input on a mesh raises, on every rank (each rank's message, rank 0's kept)."""
    from torch.distributed.device_mesh import DeviceMesh

    from toolkit.distributed import Layout

    said: dict[str, str] = {}
    state = _tensor_parallel("full", 2, 2)
    before = jobs.full_weights(state.model)
    try:  # the ranks of one replica given different batches: rank 1 has more targets
        step, tp_rank = jobs.train_step(), current_layout().mesh["tp"].get_local_rank()  # type: ignore[union-attr]
        for index in range(jobs.K):
            tokens, targets, skip = jobs.my_part(jobs.batch(index), current_layout().groups.data)  # type: ignore[union-attr]
            targets = targets.clone()
            targets[0, 0] = 3 if tp_rank else -100
            state, _ = step(state, (tokens, targets, skip))
    except ValueError as error:
        said["replica counts"] = str(error)
    after = jobs.full_weights(state.model)
    said["unchanged"] = str(all(torch.equal(before[k], after[k]) for k in before))
    try:
        Layout(current_layout().mesh, data=("dp",))  # type: ignore[union-attr]
    except ValueError as error:
        said["dimension"] = str(error)
    try:
        Layout(DeviceMesh("cpu", [0, 1], mesh_dim_names=("dp",)), data=("dp",))
        said["outside"] = "accepted"
    except ValueError as error:
        said["outside"] = str(error)
    return said


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every rank's results of the one spawn."""
    root = tmp_path_factory.mktemp("mesh")

    def attempt(n: int) -> tuple[str, str]:
        (root / str(n)).mkdir()
        return str(root / str(n) / "store"), str(root / str(n))

    spawn(_worker, attempt, nprocs=WORLD, timeout=600)
    last = sorted(p for p in root.iterdir() if p.is_dir())[-1]
    return [torch.load(last / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def results(spawned: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    return spawned[0]["plans"]


@pytest.fixture(scope="module")
def ran(spawned: list[dict]) -> list[dict]:
    return [rank["run"] for rank in spawned]


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        difference = (got[key] - want[key]).abs().max().item()
        assert difference < 1e-10, f"{key}: {difference:.3g}"
    start = jobs.fresh_model(norms=True).state_dict()
    assert max((want[k] - start[k]).abs().max() for k in want) > 1e-3  # the job trained


@pytest.mark.parametrize("plan", PLANS)
def test_fsdp2_with_tensor_parallelism_equals_one_process(results: dict, plan: str) -> None:
    _assert_equal(results[plan], jobs.reference(norms=plan != "full"))


def test_a_sequence_sharded_loss_over_a_context_dimension_equals_one_process(results: dict) -> None:
    _assert_equal(results["context"], jobs.reference(norms=True))


def test_bad_input_on_a_mesh_is_refused_on_every_rank_before_anything_changes(
    results: dict, spawned: list[dict]
) -> None:
    said = results["refused"]
    assert "ranks of one data replica" in said["replica counts"]
    assert "different target counts" in said["replica counts"]
    assert said["unchanged"] == "True"
    assert (
        "dimension must be one of ('dp_replicate', 'dp_shard', 'cp', 'tp'); got 'dp'"
        in (said["dimension"])
    )
    assert said["outside"] == "accepted"  # rank 0 is in the mesh of ranks 0 and 1, rank 2 not
    outside = spawned[2]["plans"]["refused"]["outside"]
    assert "mesh must be a mesh holding this rank (2); got [0, 1]" in outside, outside


def test_init_layout_refuses_sizes_that_do_not_make_the_world() -> None:
    with pytest.raises(ValueError, match=r"sizes must be a product of 1.*'tp': 2"):
        init_layout(tp=2)
    with pytest.raises(ValueError, match=r"sizes must be >= 1 \(one may be -1\)"):
        init_layout(dp_shard=-1, tp=-1)


def test_set_layout_refuses_what_is_not_a_layout_and_says_how_to_build_one() -> None:
    fix = r"layout must be a Layout \(or None\); got a tuple\. Build it with init_layout"
    with pytest.raises(TypeError, match=fix):
        set_layout(("dp",))  # type: ignore[arg-type]
    assert current_layout() is None


def test_a_2d_checkpoint_verifies_and_exports_whole_tensors(results: dict, tmp_path: Path) -> None:
    import subprocess

    from safetensors.torch import load_file

    from toolkit import export_model

    folder = results["folder"]
    verified = subprocess.run(
        [sys.executable, "-m", "toolkit.checkpoints", "--verify", folder],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stdout + verified.stderr
    exported = load_file(export_model(folder, tmp_path / "model.safetensors"))
    want = jobs.reference(norms=True)
    assert exported.keys() == want.keys()
    assert all((exported[k] - want[k]).abs().max() < 1e-10 for k in want)
    from toolkit.checkpoints._manifest import read_manifest

    assert read_manifest(folder).mesh == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}


@pytest.mark.parametrize("mesh", ["1x4", "4x1"])
def test_a_2d_checkpoint_resumes_on_another_mesh_exactly(results: dict, mesh: str) -> None:
    _assert_equal(results[f"resumed {mesh}"], jobs.reference(jobs.BATCHES + 2, norms=True))


# --- run() on a mesh: the data ranks' sampler, metrics over the token ranks, a resume ---

_LOSS = jobs.loss_fn
SAMPLES = 16  # global samples: 2 data ranks x 2 samples per batch x 4 batches per pass


def _dataset() -> torch.utils.data.TensorDataset:
    tokens, targets, _ = jobs.batch(99, size=SAMPLES)
    return torch.utils.data.TensorDataset(tokens, targets)


def _counted(model: torch.nn.Module, batch: list[torch.Tensor]) -> object:
    tokens, targets = batch
    out = _LOSS(model, (tokens, targets, torch.tensor(False)))
    seen = _counted.seen  # type: ignore[attr-defined]
    seen.append(int(tokens.sum()))
    return out._replace(records={"tokens": out.count})  # type: ignore[union-attr]


def _run(
    folder: Path, max_steps: int, metrics: list[dict], mesh: tuple[int, int] = (2, 2),
    on_change: str = "warn",
) -> TrainState:  # fmt: skip
    from toolkit import run
    from toolkit.plugins import Sink, checkpoints, log_metrics

    state = _tensor_parallel("sequence", *mesh)
    sampler = torch.utils.data.DistributedSampler(
        _dataset(),
        **current_layout().sampler_options(),
        shuffle=True,
        seed=0,  # type: ignore[union-attr]
    )
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=2, sampler=sampler)
    sink = Sink(write=lambda step, m: metrics.append(m), close=list)
    plugins = [
        log_metrics(1, sinks=[sink], reduce={"tokens": "sum"}, totals=["tokens"]),
        checkpoints(folder, every=1, resume="latest", on_change=on_change),
    ]
    return run(jobs.train_step(), state, loader, max_steps=max_steps, plugins=plugins)


def _eval_fn(model: torch.nn.Module, batch: list[torch.Tensor]) -> tuple[dict, torch.Tensor]:
    tokens, targets = batch
    out = _LOSS(model, (tokens, targets, torch.tensor(False)))
    return {"loss": out.total.detach() / out.count}, out.count  # type: ignore[union-attr]


def _evaluate(model: torch.nn.Module) -> float:
    """The mean loss per target over the whole set, each data rank evaluating its half."""
    from toolkit import evaluate

    options = current_layout().sampler_options()  # type: ignore[union-attr]
    sampler = torch.utils.data.DistributedSampler(_dataset(), **options, shuffle=False)
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=4, sampler=sampler)
    return evaluate(_eval_fn, model, loader)["loss"]


def _run_jobs(out: str) -> dict[str, object]:
    _counted.seen = []  # type: ignore[attr-defined]
    jobs.loss_fn = _counted  # type: ignore[assignment]  # train_step() looks it up
    results: dict[str, object] = {}
    metrics: list[dict] = []
    state = _run(Path(out) / "whole", 3, metrics)
    results.update(whole=jobs.full_weights(state.model), metrics=metrics)
    results["evaluated"] = _evaluate(state.model)
    _run(Path(out) / "parts", 1, [])
    state = _run(Path(out) / "parts", 3, [])  # resumed after one update
    results["resumed"] = jobs.full_weights(state.model)
    try:
        _run(Path(out) / "parts", 4, [], mesh=(4, 1), on_change="error")
    except ValueError as error:
        results["changed mesh"] = str(error)
    jobs.loss_fn = _LOSS
    results["seen"] = _counted.seen  # type: ignore[attr-defined]
    return results


def test_the_ranks_of_one_replica_see_the_same_batches_and_replicas_different_ones(
    ran: list[dict],
) -> None:
    # init_layout(dp_shard=2, tp=2): ranks 0 and 1 are replica 0's, 2 and 3 replica 1's.
    assert ran[0]["seen"] == ran[1]["seen"] and ran[2]["seen"] == ran[3]["seen"]
    assert ran[0]["seen"] != ran[2]["seen"]


def _order(epoch: int) -> list[list[int]]:
    """Each data rank's samples of a pass, as run()'s DistributedSampler gives them."""
    orders = []
    for rank in range(2):
        sampler = torch.utils.data.DistributedSampler(_dataset(), 2, rank, seed=0)
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def test_metrics_count_a_tensor_parallel_replica_once(ran: list[dict]) -> None:
    targets = _dataset().tensors[1]
    first, second = _order(0), _order(1)
    # An update is 2 micro-batches of 2 samples on each data rank; 3 updates: a pass and a half.
    window = first[0][:4] + first[1][:4]
    used = first[0] + first[1] + second[0][:4] + second[1][:4]
    metrics = ran[0]["metrics"]
    assert metrics[0]["train/tokens"] == int((targets[window] != -100).sum())  # not twice
    assert metrics[-1]["train/total/tokens"] == int((targets[used] != -100).sum())


def test_evaluate_averages_over_the_data_ranks_once(ran: list[dict]) -> None:
    model = jobs.fresh_model(norms=True)
    model.load_state_dict(ran[0]["whole"])
    tokens, targets = _dataset().tensors
    out = _LOSS(model, (tokens, targets, torch.tensor(False)))
    want = (out.total / out.count).item()  # type: ignore[union-attr]
    assert all(abs(r["evaluated"] - want) < 1e-10 for r in ran), [r["evaluated"] for r in ran]


def test_a_resume_on_another_mesh_names_it(ran: list[dict]) -> None:
    said = ran[0]["changed mesh"]
    assert "mesh.dp_shard 2 -> 4" in said and "mesh.tp 2 -> 1" in said, said
    assert "data.world_size 2 -> 4" in said  # the data ranks, not the world (4 both times)


def test_the_checkpoints_plugin_resumes_a_2d_job_exactly(ran: list[dict]) -> None:
    for key, want in ran[0]["whole"].items():
        assert (ran[0]["resumed"][key] - want).abs().max().item() < 1e-10, key
