"""toolkit's update under DDP against a hand-written DDP loop, 2 ranks, measured in one run.

Both sides train a DDP-wrapped model (each its own, with the same weights, optimizer and
batches), taking turns (as in ``overhead.py``): one update is 4 micro-batches, gradient
sync only on the last (``no_sync`` on the others), clip by norm, a non-finite check, AdamW
and an LR scheduler. The hand-written loop checks the clipped gradient norm only: DDP has
already averaged the gradients, so a NaN gradient on any rank reaches every rank's norm
and the verdict agrees without a collective of its own. toolkit's verdict also covers each
rank's own losses and the check that no rank skipped a micro-batch alone; those flags ride
on DDP's first gradient bucket through a comm hook toolkit installs (``BucketFlags`` in
``toolkit/distributed/_collectives.py``), so it makes no collective of its own either. A
second row compares it with a hand loop that all-reduces a verdict of its own. Times are
wall-clock (the ranks wait for each other in the all-reduce, and that waiting is part of an
update), the ratio is the median of the per-round ratios, printed by rank 0. Then the
collective calls per update of each side, counted: DDP's bucket all-reduces through a
counting comm hook, toolkit's (its hook's included) through the ``torch.distributed``
functions they call.

    python benchmarks/ddp.py            # starts torchrun --standalone --nproc_per_node=2
    python benchmarks/ddp.py --rounds 40 --updates 10
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
from overhead import MAX_NORM, K, composed_step, loss_fn, mlp
from torch.nn.parallel import DistributedDataParallel

from toolkit import TrainState
from toolkit.distributed import process_group

Objects = tuple  # (DDP model, optimizer, scheduler, micro-batches)


def setup(sizes: list[int], batch: int) -> Objects:
    torch.manual_seed(0)
    model = DistributedDataParallel(mlp(sizes))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    torch.manual_seed(1 + dist.get_rank())  # each rank its own batches
    data = [(torch.randn(batch, sizes[0]), torch.randint(0, sizes[-1], (batch,))) for _ in range(K)]
    return model, opt, sched, data


def hand_written(objects: Objects, verdict: bool = False) -> Callable[[int], None]:
    """DDP by hand: no_sync on all but the closing micro-batch, clip, finite check, step.

    ``verdict=True`` also all-reduces the finite flag of the loss and the norm (MIN), as
    toolkit's guard does: a loss that is NaN on one rank while its gradients are finite
    then stops every rank alike.
    """
    model, opt, sched, data = objects

    def updates(n: int) -> None:
        for _ in range(n):
            window_loss = torch.zeros(())
            for i, (x, y) in enumerate(data):
                sync = i == K - 1
                with contextlib.nullcontext() if sync else model.no_sync():
                    loss = loss_fn(model, (x, y)) / K
                    loss.backward()
                window_loss += loss.detach()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            finite = torch.isfinite(norm)
            if verdict:
                finite = (finite & torch.isfinite(window_loss)).to(torch.int32)
                dist.all_reduce(finite, op=dist.ReduceOp.MIN)
            if not bool(finite):  # one host sync; the same on every rank
                opt.zero_grad(set_to_none=True)
                continue
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()

    return updates


def composed(objects: Objects) -> Callable[[int], None]:
    model, opt, sched, data = objects
    step = composed_step()
    holder = [TrainState(model=model, optimizer=opt, scheduler=sched)]

    def updates(n: int) -> None:
        state = holder[0]
        for _ in range(n):
            for batch in data:
                state, _ = step(state, batch)
        holder[0] = state

    return updates


def measure(
    base: Callable[[int], None], ours: Callable[[int], None], rounds: int, updates: int
) -> tuple[float, float, float]:
    """Median wall time per update of each side, and the median of the per-round ratios."""
    for fn in (base, ours):
        fn(10)
    t_base: list[float] = []
    t_ours: list[float] = []
    for r in range(rounds):
        order = [(base, t_base), (ours, t_ours)]
        for fn, sink in order if r % 2 == 0 else order[::-1]:
            dist.barrier()  # both ranks start the side together
            t0 = time.perf_counter()
            fn(updates)
            sink.append((time.perf_counter() - t0) / updates)
    ratios = [o / b for o, b in zip(t_ours, t_base)]
    return statistics.median(t_base), statistics.median(t_ours), statistics.median(ratios)


COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "barrier",
)


_REAL_ALL_REDUCE = dist.all_reduce  # the bucket hook's own, never counted twice


def _bucket_hook(counts, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
    """DDP's default bucket all-reduce (average over the ranks), counted."""
    counts["ddp bucket all_reduce"] = counts.get("ddp bucket all_reduce", 0) + 1
    tensor = bucket.buffer().div_(dist.get_world_size())
    work = _REAL_ALL_REDUCE(tensor, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


@contextlib.contextmanager
def counting_calls(counts: dict[str, int]) -> Iterator[None]:
    """Count the torch.distributed collective functions called inside, into ``counts``."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(dist, name, counted(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def collectives_per_update(
    make_side: Callable[[Objects], Callable[[int], None]], n: int = 8, hook: bool = True
) -> dict[str, float]:
    """The collective calls per update of ``make_side``'s loop, by kind, over ``n`` updates.

    On a fresh DDP model whose buckets go through a counting comm hook (a Python hook is
    slower than DDP's built-in one, so nothing is timed on it). ``hook=False`` leaves the
    model without one: toolkit then installs its own, whose bucket all-reduces (carrying
    its verdict) count as ``all_reduce``; with the counting hook there, toolkit finds the
    model's hook taken and all-reduces its verdict on its own, as with a hook of yours.
    """
    objects = setup([32, 64, 10], 32)
    counts: dict[str, int] = {}
    if hook:
        objects[0].register_comm_hook(counts, _bucket_hook)
    side = make_side(objects)
    side(1)  # lazy state out of the way
    counts.clear()
    with counting_calls(counts):
        side(n)
    return {name: count / n for name, count in sorted(counts.items())}


def worker(rounds: int, updates: int) -> None:
    with process_group() as launch:
        rows = []
        # Each side trains its own DDP model (the same weights and batches): toolkit installs
        # a comm hook on the model it trains, which the hand-written side must not run on.
        objects = setup([32, 64, 10], 32)
        timed = measure(hand_written(objects), hand_written(objects), rounds, updates)
        rows.append(("A/A: hand-written DDP vs itself, tiny MLP", *timed))
        for name, sizes, batch in [
            ("tiny MLP 32-64-10, batch 32 per rank", [32, 64, 10], 32),
            ("larger MLP 512-1024-1024-10, batch 64 per rank", [512, 1024, 1024, 10], 64),
        ]:
            ours = composed(setup(sizes, batch))
            timed = measure(hand_written(setup(sizes, batch)), ours, rounds, updates)
            rows.append((f"DDP step: {name}", *timed))
            if sizes == [32, 64, 10]:
                hand = hand_written(setup(sizes, batch), verdict=True)
                timed = measure(hand, ours, rounds, updates)
                rows.append(("DDP step vs hand-written + verdict all-reduce, tiny MLP", *timed))
        counts = [
            ("hand-written", collectives_per_update(hand_written)),
            ("hand + verdict", collectives_per_update(lambda o: hand_written(o, verdict=True))),
            ("toolkit", collectives_per_update(composed, hook=False)),
            ("toolkit, model with a hook of your own", collectives_per_update(composed)),
        ]
        if launch.rank == 0:
            print(
                f"torch {torch.__version__}, {launch.world_size} ranks ({launch.backend}), "
                f"{rounds} rounds x {updates} updates, median wall time per update\n"
            )
            width = max(len(r[0]) for r in rows)
            print(f"{'case':<{width}}  {'hand':>10}  {'toolkit':>10}  ratio (median of rounds)")
            for name, base, ours, ratio in rows:
                print(f"{name:<{width}}  {base * 1e6:>8.0f}us  {ours * 1e6:>8.0f}us  {ratio:.3f}x")
            print("\ncollective calls per update (tiny MLP, 4 micro-batches):")
            for side, per_update in counts:
                total = sum(per_update.values())
                kinds = ", ".join(f"{name} {count:g}" for name, count in per_update.items())
                print(f"  {side:<38} {total:g}: {kinds}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--updates", type=int, default=10)
    args = parser.parse_args()
    if "RANK" in os.environ:  # a worker started by torchrun
        torch.set_num_threads(1)
        worker(args.rounds, args.updates)
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", __file__, *sys.argv[1:]]
    sys.exit(subprocess.run(command, check=False).returncode)


if __name__ == "__main__":
    main()
