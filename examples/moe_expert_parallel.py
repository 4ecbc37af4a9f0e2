"""Train a tiny mixture-of-experts token model with expert parallelism, one process per rank.

Each token goes to one of ``EXPERTS`` small feed-forward experts (top-1 routing, scaled by
its router probability); the experts are split over the ``"ep"`` dimension of a device mesh
and each token travels to its expert's rank and back by all-to-all. Run::

    torchrun --standalone --nproc_per_node=4 examples/moe_expert_parallel.py
    torchrun --standalone --nproc_per_node=4 examples/moe_expert_parallel.py --quick
    python examples/moe_expert_parallel.py       # a world of one: every expert local

The mesh is ``("ep_replicate", "ep") = (world // ep, ep)``. Every rank reads its own
samples, so both dimensions are the layout's data: the step sums ``LossSum`` counts over all
ranks and expects every gradient averaged over them, as FSDP2 averages the dense ones.

* Dense parts (embedding, dense block, router, head): FSDP2 over all the ranks.
* Experts: ``DTensor``s sharded on the expert dimension over ``"ep"``, then FSDP2 over
  ``"ep_replicate"``, the ranks that hold the same experts. Their reduce-scatter sums what
  those ranks computed (each from the tokens of its ``"ep"`` group), and
  ``set_gradient_divide_factor(world)`` divides by every data rank, not by the group's
  size (FSDP's default, ``ep`` times too large): the mean over all data ranks, on the
  dense gradients' scale. torchtitan does the same. On gloo, which has no
  ``PREMUL_SUM`` (FSDP's reduce op for such a factor), ``set_force_sum_reduction_for_comms``
  makes it a SUM and a division.
* The experts are DTensors on the 2-D mesh, so the step's gradient norm, its clip and its
  non-finite guard see every expert, not only this rank's.
* Tokens move by ``torch.distributed._functional_collectives.all_to_all_single_autograd``
  (its backward is the reverse all-to-all; ``torch.distributed.nn.functional``'s is
  deprecated in torch 2.13), after one small all-to-all of the counts: no token is dropped.
"""

from __future__ import annotations

import argparse
import pathlib
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from toolkit import (
    LossSum,
    TrainState,
    accumulate,
    clip,
    compose,
    guard_nonfinite,
    make_step,
    run,
    to_device,
)
from toolkit.distributed import Layout, process_group, set_layout
from toolkit.plugins import jsonl, log_metrics, progress

# FSDP2 warns that the model's output (the head's logits, a view) would lose its backward
# hook to an in-place op; the loss reads the logits without changing them.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

SEED = 0
VOCAB, DIM, HIDDEN, EXPERTS, SEQ = 32, 16, 32, 4, 16
BATCH_SIZE, MICRO_BATCHES = 16, 2  # sequences per micro-batch over all ranks


class Experts(nn.Module):
    """``n`` two-layer experts as stacked weights: expert ``e`` is ``w_in[e]``, ``w_out[e]``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(n, DIM, HIDDEN) / DIM**0.5)
        self.w_out = nn.Parameter(torch.randn(n, HIDDEN, DIM) / HIDDEN**0.5)

    def local(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights of the experts this rank holds, as plain tensors."""
        return tuple(w.to_local() if isinstance(w, DTensor) else w for w in (self.w_in, self.w_out))

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``tokens`` grouped by expert, ``counts[e]`` of them for local expert ``e``."""
        w_in, w_out = self.local()
        parts = tokens.split(counts)
        return torch.cat([torch.tanh(x @ w_in[e]) @ w_out[e] for e, x in enumerate(parts)])


class MoE(nn.Module):
    """Top-1 routing to ``EXPERTS`` experts; those of other ranks reached by all-to-all."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = Experts(EXPERTS)
        self.ep_group: dist.ProcessGroup | None = None  # set by parallelize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, DIM)
        gate, choice = self.router(flat).softmax(-1).max(-1)
        order = choice.argsort(stable=True)  # the tokens grouped by expert
        counts = torch.bincount(choice, minlength=EXPERTS)
        if self.ep_group is None:
            out = self.experts(flat[order], counts.tolist())
        else:
            out = self.remote(flat[order], counts)
        return x + (gate[:, None] * out[order.argsort()]).view_as(x)

    def remote(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send each token to the rank of its expert, run the experts there, bring it back."""
        group = self.ep_group
        ranks, local = group.size(), EXPERTS // group.size()
        got = torch.empty_like(counts)  # got[r * local + e]: rank r's tokens for my expert e
        dist.all_to_all_single(got, counts, group=group)
        send = counts.view(ranks, local).sum(1).tolist()
        receive = got.view(ranks, local).sum(1).tolist()
        tokens = funcol.all_to_all_single_autograd(routed, receive, send, group)
        # They come by (source rank, expert); the experts take them by (expert, source rank).
        by_rank = [(r, e) for r in range(ranks) for e in range(local)]
        by_expert = sorted(by_rank, key=lambda pair: pair[::-1])
        sizes = dict(zip(by_rank, got.tolist()))
        parts = dict(zip(by_rank, tokens.split(got.tolist())))
        grouped = torch.cat([parts[p] for p in by_expert])
        out = self.experts(grouped, got.view(ranks, local).sum(0).tolist())
        parts = dict(zip(by_expert, out.split([sizes[p] for p in by_expert])))
        back = torch.cat([parts[p] for p in by_rank])
        return funcol.all_to_all_single_autograd(back, send, receive, group)


class MoEModel(nn.Module):
    """Embedding, a dense per-token block, an MoE layer, a head: a per-token classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.dense = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, DIM))
        self.moe = MoE()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(self.moe(h + self.dense(h)))


def parallelize(model: MoEModel, mesh) -> MoEModel:
    """Experts over ``mesh["ep"]`` and FSDP2 over ``"ep_replicate"``, the rest FSDP2 over all."""
    experts = model.moe.experts
    for name, weight in list(experts.named_parameters()):
        sharded = distribute_tensor(weight.detach(), mesh["ep"], [Shard(0)])
        experts.register_parameter(name, nn.Parameter(sharded))
    model.moe.ep_group = mesh["ep"].get_group() if mesh["ep"].size() > 1 else None
    fully_shard(experts, mesh=mesh["ep_replicate"])
    experts.set_gradient_divide_factor(mesh.size())  # the mean over every data rank
    if mesh.device_type == "cpu":  # gloo lacks PREMUL_SUM, FSDP's op for such a factor
        experts.set_force_sum_reduction_for_comms(True)  # a SUM, then a division
    return fully_shard(model, mesh=mesh._flatten())


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
    tokens, targets = to_device(batch, next(model.parameters()).device, non_blocking=True)
    logits = model(tokens)
    total = nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
    )
    return LossSum(total, (targets != -100).sum())


def dataset(samples: int) -> TensorDataset:
    """Random tokens; each target is a fixed function of its token (a shuffled vocabulary)."""
    g = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (samples, SEQ), generator=g)
    return TensorDataset(tokens, torch.randperm(VOCAB, generator=g)[tokens])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 updates, not 300: a smoke test")
    parser.add_argument("--ep", type=int, default=2, help="ranks the experts are split over")
    parser.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path("runs/moe_expert_parallel")
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda: each rank takes cuda:LOCAL_RANK (the default when available); or cpu",
    )
    args = parser.parse_args()
    max_steps = 20 if args.quick else 300

    device = None if args.device == "cuda" else args.device
    with process_group(seed=SEED, device=device) as launch:
        ep = min(args.ep, launch.world_size)
        assert launch.world_size % ep == 0 and EXPERTS % ep == 0, "ep must divide both"
        names = ("ep_replicate", "ep")
        mesh = init_device_mesh(
            launch.device.type, (launch.world_size // ep, ep), mesh_dim_names=names
        )
        layout = Layout(mesh, data=names)  # every rank reads its own samples
        set_layout(layout)
        with torch.random.fork_rng(devices=[]):  # the same initial weights on every rank
            torch.manual_seed(SEED)
            model = parallelize(MoEModel().to(launch.device), mesh)
        data = dataset(BATCH_SIZE * MICRO_BATCHES * max_steps)
        sampler = DistributedSampler(data, **layout.sampler_options(), shuffle=True, seed=SEED)
        loader = DataLoader(data, batch_size=BATCH_SIZE // launch.world_size, sampler=sampler)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = TrainState(model=model, optimizer=optimizer)
        step = compose(
            accumulate(micro_batches=MICRO_BATCHES), clip(max_norm=1.0), guard_nonfinite()
        )(make_step(loss_fn))
        plugins = [
            progress(every=10, counts="tokens"),
            log_metrics(every=5, sinks=[jsonl(args.out / "metrics.jsonl")]),
        ]
        started = time.perf_counter()
        state = run(step, state, loader, max_steps=max_steps, plugins=plugins)
        if launch.rank == 0:
            print(
                f"{state.step} updates on {launch.world_size} rank(s) ({ep} expert ranks) in "
                f"{time.perf_counter() - started:.1f} s"
            )
        set_layout(None)


if __name__ == "__main__":
    main()
