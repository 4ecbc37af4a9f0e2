"""Expert parallelism: examples/moe_expert_parallel.py's model and sharding
on 4 gloo ranks equal one process that holds every expert (float64, below 1e-10).

The mesh is ``("ep_replicate", "ep") = (2, 2)``, every rank a data rank: the dense parts are
FSDP2 over the 4 ranks, the 4 experts are ``Shard(0)`` DTensors over ``"ep"`` (2 per rank)
and FSDP2 over ``"ep_replicate"`` with the example's gradient divide factor, tokens moved by
all-to-all. The step is ``accumulate(2)``, a ``clip`` that bites and ``guard_nonfinite``,
with a ``LossSum`` over ignored targets; window 2 gets a NaN in one expert's gradient on one
rank only, which every rank must reject as one process does. One spawn runs the job; the
tests read its weights, norms, verdicts and collectives; last, the same ranks take one update
of the example's float32 model (where FSDP2 would reduce the experts with gloo's missing
``PREMUL_SUM``: float64 reduces with a SUM anyway).
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import pathlib
import sys
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawning import gloo_group, spawn
from torch.distributed.tensor.debug import CommDebugMode

from toolkit import TrainState, accumulate, clip, compose, guard_nonfinite, make_step
from toolkit.distributed import Layout, set_layout

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built"),
    pytest.mark.skipif(sys.platform != "linux", reason="gloo over FileStore tested on Linux"),
]

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORLD, EP = 4, 2
GLOBAL_BATCH, K, WINDOWS = 8, 2, 4  # sequences per micro-batch over all ranks
MAX_NORM = 0.05  # below every window's norm: the clip bites
POISONED = 2  # the window whose expert POISON_EXPERT gets a NaN gradient...
POISON_EXPERT, POISON_RANK = 3, 1  # ... on this rank only (it holds experts 2 and 3)
COUNTED = 1  # the window whose collectives are counted


def _example() -> Any:
    """examples/moe_expert_parallel.py as a module (examples/ is no package)."""
    name = "moe_expert_parallel"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


ex = _example()
LOCAL = ex.Experts.local  # the example's, before Poison wraps it


def batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global micro-batch: tokens and targets, about a third of them ignored (-100)."""
    g = torch.Generator().manual_seed(100 + index)
    tokens = torch.randint(0, ex.VOCAB, (GLOBAL_BATCH, ex.SEQ), generator=g)
    targets = torch.randint(0, ex.VOCAB, (GLOBAL_BATCH, ex.SEQ), generator=g)
    targets[torch.rand(GLOBAL_BATCH, ex.SEQ, generator=g) < 0.3] = -100
    return tokens, targets


def fresh_model() -> Any:
    torch.manual_seed(0)
    return ex.MoEModel().double()


def train_step() -> Any:
    return compose(accumulate(micro_batches=K), clip(max_norm=MAX_NORM), guard_nonfinite())(
        make_step(ex.loss_fn)
    )


class Poison:
    """While on, a NaN in the gradient of global expert ``POISON_EXPERT``'s ``w_in``, on the
    plain tensors of the experts this process holds (``Experts.local``, wrapped while in
    the ``with`` block)."""

    def __init__(self, first_local_expert: int, here: bool) -> None:
        self.on, self.row, self.here = False, POISON_EXPERT - first_local_expert, here

    def local(self, experts: Any) -> tuple[torch.Tensor, torch.Tensor]:
        w_in, w_out = LOCAL(experts)
        if self.on and self.here and 0 <= self.row < w_in.shape[0]:
            w_in = w_in.view_as(w_in)  # a view, so the hook is this forward's only
            w_in.register_hook(lambda g: g.index_fill(0, torch.tensor([self.row]), torch.nan))
        return w_in, w_out

    def __enter__(self) -> Poison:
        ex.Experts.local = lambda experts: self.local(experts)
        return self

    def __exit__(self, *exc: object) -> None:
        ex.Experts.local = LOCAL


def train(
    state: TrainState, my_part: Any, poison: Poison, counts: collections.Counter | None = None
) -> tuple[TrainState, list[Any]]:
    """WINDOWS windows of K micro-batches: the state and each window's (grad_norm, rejected);
    the collectives of window COUNTED added to ``counts``."""
    step, closed = train_step(), []
    for index in range(WINDOWS * K):
        poison.on = index // K == POISONED
        counting = counts is not None and index // K == COUNTED
        with CommDebugMode() if counting else contextlib.nullcontext() as mode:
            state, out = step(state, my_part(batch(index)))
        if counting:
            counts.update({str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()})
        if out.closed:
            closed.append((out.grad_norm.item(), out.nonfinite))
    return state, closed


def reference() -> tuple[dict[str, torch.Tensor], list[Any]]:
    """One process, every expert local, on the global batches."""
    model = fresh_model()
    state = TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.05))
    with Poison(0, here=True) as poison:
        state, closed = train(state, lambda b: b, poison)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, closed


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    with gloo_group(rank, WORLD, store):
        names = ("ep_replicate", "ep")
        mesh = init_device_mesh("cpu", (WORLD // EP, EP), mesh_dim_names=names)
        layout = Layout(mesh, data=names)
        set_layout(layout)
        model = ex.parallelize(fresh_model(), mesh)
        state = TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.05))
        n, data_rank = GLOBAL_BATCH // WORLD, layout.sampler_options()["rank"]

        def my_part(b: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            return tuple(t[data_rank * n : (data_rank + 1) * n] for t in b)

        first = mesh["ep"].get_local_rank() * (ex.EXPERTS // EP)  # this rank's experts
        counts: collections.Counter = collections.Counter()
        with Poison(first, here=rank == POISON_RANK) as poison, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CommDebugMode's module hooks warn in backward
            state, closed = train(state, my_part, poison, counts)
        weights = {}
        for key, value in model.state_dict().items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            weights[key] = full.detach().clone()
        # The example's float32 model, as a user trains it: FSDP2 would reduce the experts
        # with PREMUL_SUM, which gloo lacks (float64 reduces with a SUM anyway).
        torch.manual_seed(0)
        model = ex.parallelize(ex.MoEModel(), mesh)
        state = TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.05))
        step = train_step()
        for index in range(K):
            state, last = step(state, my_part(batch(index)))
        float32 = (last.updated, bool(torch.isfinite(last.loss)))
        set_layout(None)
    result = {"weights": weights, "closed": closed, "collectives": dict(counts), "float32": float32}
    torch.save(result, pathlib.Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("expert_parallel")

    def attempt(n: int) -> tuple[str, str]:
        (root / str(n)).mkdir()
        return str(root / str(n) / "store"), str(root / str(n))

    spawn(_worker, attempt, nprocs=WORLD, timeout=240)
    folder = sorted(p for p in root.iterdir() if p.is_dir())[-1]
    ranks = [torch.load(folder / f"rank{r}.pt") for r in range(WORLD)]
    weights, closed = reference()
    return {"ranks": ranks, "weights": weights, "closed": closed}


def test_expert_parallel_training_equals_one_process(job: dict[str, Any]) -> None:
    want = job["weights"]
    for got in job["ranks"]:
        assert got["weights"].keys() == want.keys()
        for key in want:
            difference = (got["weights"][key] - want[key]).abs().max().item()
            assert difference < 1e-10, f"{key}: {difference:.3g}"
    start = fresh_model().state_dict()
    moved = {k: (want[k] - start[k]).abs().max().item() for k in want}
    assert min(moved.values()) > 1e-3, moved  # every parameter trained
    for key in ("moe.experts.w_in", "moe.experts.w_out"):  # and every expert
        assert all((want[key][e] - start[key][e]).abs().max() > 1e-2 for e in range(ex.EXPERTS))


def test_the_clip_sees_the_dense_and_the_expert_gradients(job: dict[str, Any]) -> None:
    model = fresh_model()  # the experts' share of the norm is no rounding error
    ex.loss_fn(model, batch(0)).total.backward()
    experts = sum(p.grad.square().sum() for p in model.moe.experts.parameters())
    assert experts > 0.02 * sum(p.grad.square().sum() for p in model.parameters())
    want = [norm for norm, rejected in job["closed"] if not rejected]
    assert len(want) == WINDOWS - 1 and min(want) > 2 * MAX_NORM  # the clip bit every time
    for got in job["ranks"]:  # every rank reports the whole model's norm, before the clip
        norms = [norm for norm, rejected in got["closed"] if not rejected]
        assert norms == pytest.approx(want, rel=1e-12, abs=0)


def test_a_nan_in_one_expert_gradient_on_one_rank_is_rejected_by_every_rank(
    job: dict[str, Any],
) -> None:
    rejected = [i for i, (_, nonfinite) in enumerate(job["closed"]) if nonfinite]
    assert rejected == [POISONED]  # one process rejects the poisoned window only
    for got in job["ranks"]:
        assert [i for i, (_, nonfinite) in enumerate(got["closed"]) if nonfinite] == rejected


def test_the_collectives_of_one_update(job: dict[str, Any]) -> None:
    """2 micro-batches, each: 3 all-gathers (FSDP2: dense forward; experts forward and
    backward), 1 all-to-all of the counts, 4 of tokens (2 forward, 2 backward). Closing the
    window: 2 reduce-scatters (dense, experts), the norms' 2 all-reduces (functional, one per
    mesh: DTensor's full_tensor) and the step's 2 (c10d: the token count, the verdict)."""
    for got in job["ranks"]:
        assert got["collectives"] == {
            "_allgather_base_": 6,
            "alltoall_base_": 2,
            "all_to_all_single": 8,
            "_reduce_scatter_base_": 2,
            "all_reduce": 2,
            "allreduce_": 2,
        }


def test_the_examples_float32_model_reduces_its_experts_on_gloo(job: dict[str, Any]) -> None:
    # Fails without the example's set_force_sum_reduction_for_comms: "Cannot use
    # ReduceOp.PREMUL_SUM with Gloo".
    assert [rank["float32"] for rank in job["ranks"]] == [(True, True)] * WORLD
