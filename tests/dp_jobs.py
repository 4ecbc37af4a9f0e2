"""A small data-parallel job and its one-process reference, shared by the DDP, FSDP2, HSDP
and sub-group tests: counted cross-entropy over micro-batches whose sizes differ by rank and
micro-batch (a count summed over the wrong ranks changes the result), clipping, the guard,
and a window with a NaN on rank 1 only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from toolkit import LossSum, TrainState, accumulate, clip, compose, guard_nonfinite, make_step

K = 2  # micro-batches per update
NAN_UPDATE = 9  # the update index whose batches carry rank 1's NaN
# The NaN window as a rank that must reject it reports it: nothing applied, one rejection.
REJECTED = {"updated": False, "nonfinite": True, "notfinite_count": 1, "unchanged": True}


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    ).double()


def sharded_mlp(mesh: object) -> torch.nn.Module:
    """:func:`mlp` under FSDP2 on ``mesh`` (a device mesh): each Linear its own unit."""
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def micro_batches(rank: int, update: int, k: int = K) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 * update + rank)
    return [
        (
            torch.randn(n, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g),
        )
        for n in (2 + rank + i for i in range(k))
    ]


def counted(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
    x, y = batch
    return LossSum(torch.nn.functional.cross_entropy(model(x), y, reduction="sum"), y.shape[0])


def train(
    model: torch.nn.Module,
    full: Callable[[torch.Tensor], torch.Tensor],
    updates: int,
    k: int = K,
    calls: list[int] | None = None,
) -> dict:
    """``updates`` updates on this rank's micro-batches, then the NaN window; a JSON report.

    ``full(p)`` gives a parameter's whole value (FSDP2 shards them); ``calls``, when given,
    grows by one per gradient collective, and the report lists the count per micro-batch.
    """
    rank, calls = dist.get_rank(), calls if calls is not None else []
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step = compose(accumulate(micro_batches=k), clip(max_norm=10.0), guard_nonfinite())(
        make_step(counted)
    )
    state, per_micro = TrainState(model=model, optimizer=opt), []
    for update in range(updates):
        for batch in micro_batches(rank, update, k):
            before = len(calls)
            state, out = step(state, batch)
            per_micro.append(len(calls) - before)
    report = {"params": [full(p).tolist() for p in model.parameters()], "step": state.step}
    report |= {"collectives": per_micro, "grad_norm_is_plain": type(out.grad_norm) is torch.Tensor}
    before_nan = [full(p).clone() for p in model.parameters()]
    for i, (x, y) in enumerate(micro_batches(rank, NAN_UPDATE, k)):
        if rank == 1 and i == 0:
            x = x.clone()
            x[0, 0] = float("nan")
        state, out = step(state, (x, y))
    report["nan_window"] = {
        "updated": out.updated,
        "nonfinite": out.nonfinite,
        "notfinite_count": state.guard.notfinite_count,
        "unchanged": all(torch.equal(a, full(b)) for a, b in zip(before_nan, model.parameters())),
    }
    return report


def reference(ranks: Iterable[int], updates: int, k: int = K) -> list[list]:
    """One process training on the concatenation of ``ranks``' micro-batches."""
    model, ranks = mlp(), list(ranks)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for update in range(updates):
        batches = [b for r in ranks for b in micro_batches(r, update, k)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        torch.nn.functional.cross_entropy(model(x), y).backward()  # mean over all targets
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().tolist() for p in model.parameters()]


def assert_params_close(got: list, want: list) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(
            torch.tensor(a, dtype=torch.float64),
            torch.tensor(b, dtype=torch.float64),
            rtol=1e-12,
            atol=1e-12,
        )
