"""Overhead of toolkit against the same training written by hand, measured in one run.

Each case times one optimizer update (4 micro-batches, clip by norm, non-finite guard; AdamW
and an LR scheduler, or plain SGD without one) of the composed toolkit step and of a
hand-written loop doing the same arithmetic, interleaved
in rounds so that machine noise hits both alike, and prints the median of the per-round
ratios. The run() rows take their turns inside one long run() call (a real job starts and
ends run() once), over five times the rounds.

    make bench                      # or: OMP_NUM_THREADS=1 python benchmarks/overhead.py
    python benchmarks/overhead.py --rounds 30 --updates 50
    python benchmarks/overhead.py --compiled   # adds a torch.compile'd transformer row
"""

from __future__ import annotations

import argparse
import io
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")

import warnings

import torch

from toolkit import (
    Event,
    TrainState,
    accumulate,
    clip,
    compose,
    guard_nonfinite,
    make_step,
    run,
)

# Both sides of a row take turns on one model, optimizer and scheduler: the hand-written loop's
# scheduler.step() is, to the step, a step outside it.
warnings.filterwarnings("ignore", "the LR scheduler was stepped outside the train step")
K = 4  # micro-batches per update
EPOCH_UPDATES = 50  # updates per epoch in the run() case
MAX_NORM = 1.0
RUN_ROUNDS = 5  # the run() rows' rounds, per round of the other rows: their effect is smaller


def mlp(sizes: list[int]) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def setup(sizes: list[int], batch: int, seed: int = 0, optimizer: str = "adamw"):
    """Model, optimizer, scheduler (None with plain SGD) and the K micro-batches of an update.

    ``optimizer="sgd"`` is plain SGD without a scheduler: the cheapest update, so the one
    where the step's own Python shows most.
    """
    torch.manual_seed(seed)
    model = mlp(sizes)
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        sched = None
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    data = [(torch.randn(batch, sizes[0]), torch.randint(0, sizes[-1], (batch,))) for _ in range(K)]
    return model, opt, sched, data


Setup = tuple  # (model, optimizer, scheduler, micro-batches), from setup()


def composed_step(loss=loss_fn):
    """The toolkit step every case times: accumulate K, clip by norm, non-finite guard."""
    return compose(accumulate(micro_batches=K), clip(max_norm=MAX_NORM), guard_nonfinite())(
        make_step(loss)
    )


def hand_written(objects: Setup, loss_of=loss_fn) -> Callable[[int], None]:
    """The nanoGPT-order loop a careful user writes: accumulate, clip, guard, step."""
    model, opt, sched, data = objects

    def updates(n: int) -> None:
        for _ in range(n):
            window_loss = 0.0
            for x, y in data:
                loss = loss_of(model, (x, y)) / K
                loss.backward()
                window_loss = window_loss + loss.detach()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            if not bool(torch.isfinite(norm) & torch.isfinite(window_loss)):  # one host sync
                opt.zero_grad(set_to_none=True)
                continue
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()

    return updates


def composed(objects: Setup, loss=loss_fn) -> Callable[[int], None]:
    """The toolkit step over the same objects, driven by a plain for loop."""
    model, opt, sched, data = objects
    step = composed_step(loss)
    holder = [TrainState(model=model, optimizer=opt, scheduler=sched)]

    def updates(n: int) -> None:
        state = holder[0]
        for _ in range(n):
            for b in data:
                state, _ = step(state, b)
        holder[0] = state

    return updates


def plugins_for(
    sink_path: str | None, every: int = 10, min_interval: float = 0.1
) -> list[Callable[[Event], object]]:
    """progress and log_metrics(every) writing JSONL, as in a real job; none without a path.

    ``min_interval`` is progress's limit on refreshes per second (its default 0.1 s; 0
    refreshes at every multiple of ``every``). The console is a string buffer that is not a
    terminal, so progress writes its plain lines there.
    """
    from rich.console import Console

    from toolkit.plugins import jsonl, log_metrics, progress

    if sink_path is None:
        return []
    console = Console(file=io.StringIO(), force_terminal=False)
    return [
        progress(every=every, console=console, min_interval=min_interval),
        log_metrics(every=every, sinks=[jsonl(sink_path)]),
    ]


def bare_loop(objects: Setup) -> Callable[[int], None]:
    """The composed step driven by a plain for loop: the baseline for run()'s overhead."""
    return composed(objects)


def measure_in_run(
    objects: Setup, plugins: list[Callable[[Event], object]], rounds: int, updates: int
) -> tuple[float, float, float]:
    """Like :func:`measure`, for run(): both sides take turns inside one long run() call.

    run()'s data hands over to the bare loop (same objects) at the start of every round of
    ``updates`` updates, that is when run() asks for the round's first batch, after the
    previous update and its plugins. run()'s time for a round is the time between two
    turns: the loop, the plugins and the epoch boundaries, and nothing a real job would
    not have (no extra plugin); run() starts and ends once, as in a real job.
    """
    base = bare_loop(objects)
    model, opt, sched, data = objects
    t_base: list[float] = []
    t_ours: list[float] = []
    warm = 2  # rounds left out: allocator, lazy optimizer state, code paths
    turns = [0]
    mark = [0.0]

    def turn() -> None:
        now = time.process_time()
        if turns[0] > warm:
            t_ours.append((now - mark[0]) / updates)
        base(updates)
        if turns[0] >= warm:
            t_base.append((time.process_time() - now) / updates)
        turns[0] += 1
        mark[0] = time.process_time()

    round_batches = data * updates  # the same tensors again, as epochs of a real dataset do
    rounds_per_epoch = max(EPOCH_UPDATES // updates, 1)

    class TakingTurns:
        def __len__(self) -> int:
            return len(round_batches) * rounds_per_epoch

        def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for _ in range(rounds_per_epoch):
                turn()
                yield from round_batches

    state = TrainState(model=model, optimizer=opt, scheduler=sched)
    # One more round than measured: a round's time is taken when the next one starts.
    max_steps = (warm + rounds + 1) * updates
    run(composed_step(), state, TakingTurns(), max_steps=max_steps, plugins=plugins)
    ratios = [o / b for o, b in zip(t_ours, t_base)]
    return statistics.median(t_base), statistics.median(t_ours), statistics.median(ratios)


def measure(
    base: Callable[[int], None], ours: Callable[[int], None], rounds: int, updates: int
) -> tuple[float, float, float]:
    """Median time per update of each, and the median of the per-round ratios.

    Both sides should train the same model, optimizer and batches (they take turns), so
    that memory placement, which moves small-model timings by several percent from one
    allocation to the next, is the same for both and only the code differs.

    Rounds alternate which side runs first, and each round is short, so a burst of load
    from elsewhere on the machine hits both sides of a ratio alike. Time is this process's
    CPU time: the work is single-threaded on the calling thread (OMP_NUM_THREADS=1), and CPU
    time leaves out the time the process waits while the shared machine runs others.
    """
    for fn in (base, ours):  # warm-up: allocator, lazy optimizer state, code paths
        fn(10)
    t_base: list[float] = []
    t_ours: list[float] = []
    for r in range(rounds):
        order = [(base, t_base), (ours, t_ours)]
        for fn, sink in order if r % 2 == 0 else order[::-1]:
            t0 = time.process_time()
            fn(updates)
            sink.append((time.process_time() - t0) / updates)
    ratios = [o / b for o, b in zip(t_ours, t_base)]
    return statistics.median(t_base), statistics.median(t_ours), statistics.median(ratios)


def transformer_setup(compiled: bool) -> Setup:
    """A small causal transformer (4 layers, width 256, context 128, batch 16), its loss
    inside the model, torch.compile'd or eager; AdamW and a scheduler, as setup() makes."""
    from gpu import GPT, Config  # benchmarks/gpu.py's GPT-2, at a CPU size

    torch.manual_seed(0)
    model = GPT(Config(layers=4, width=256, heads=4, context=128, vocab=256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ids = [torch.randint(0, 256, (16, 129)) for _ in range(K)]
    data = [(i[:, :-1].contiguous(), i[:, 1:].contiguous()) for i in ids]
    return torch.compile(model) if compiled else model, opt, sched, data


def lm_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(*batch)


def transformer_rows(rounds: int, updates: int) -> list[tuple[str, float, float, float]]:
    """--compiled: both sides compiled the same way (the model), and the eager pair."""
    rows = []
    for compiled in (True, False):
        objects = transformer_setup(compiled)
        timed = measure(hand_written(objects, lm_loss), composed(objects, lm_loss), rounds, updates)
        name = "compiled" if compiled else "eager"
        rows.append((f"step: transformer 4x256, ctx 128, batch 16, {name}", *timed))
    return rows


def one_pass(rounds: int, updates: int) -> list[tuple[str, float, float, float]]:
    """Every case once: (name, baseline s/update, toolkit s/update, median ratio)."""
    rows = []
    # The noise floor: the hand-written loop against itself, taking turns on one model.
    objects = setup([32, 64, 10], 32)
    timed = measure(hand_written(objects), hand_written(objects), rounds, updates)
    rows.append(("A/A: hand-written vs itself, tiny MLP", *timed))
    for name, sizes, batch, optimizer in [
        ("tiny MLP 32-64-10, batch 32", [32, 64, 10], 32, "adamw"),
        ("tiny MLP, plain SGD, no scheduler", [32, 64, 10], 32, "sgd"),
        ("larger MLP 512-1024-1024-10, batch 64", [512, 1024, 1024, 10], 64, "adamw"),
    ]:
        objects = setup(sizes, batch, optimizer=optimizer)
        timed = measure(hand_written(objects), composed(objects), rounds, updates)
        rows.append((f"step: {name}", *timed))
    sizes, batch = [32, 64, 10], 32
    with tempfile.TemporaryDirectory() as tmp:
        for name, path, every, min_interval in [
            ("run(), no plugins", None, 10, 0.1),
            ("run()+progress+log_metrics(every=10)", os.path.join(tmp, "a.jsonl"), 10, 0.1),
            ("same, progress(min_interval=0)", os.path.join(tmp, "b.jsonl"), 10, 0.0),
            ("run()+progress+log_metrics(every=100)", os.path.join(tmp, "c.jsonl"), 100, 0.1),
        ]:
            objects = setup(sizes, batch)
            plugins = plugins_for(path, every, min_interval)
            timed = measure_in_run(objects, plugins, RUN_ROUNDS * rounds, updates)
            rows.append((f"{name} vs for-loop, tiny MLP", *timed))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument(
        "--repeat", type=int, default=1, help="measure everything N times; print the range"
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="also a torch.compile'd transformer and its eager pair (slow: ~10 minutes)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"{args.rounds} rounds x {args.updates} updates (run() rows: {RUN_ROUNDS * args.rounds} "
        f"x {args.updates}), median CPU time per update\n"
    )
    # The transformer rows take about 1-2 s an update on one shared core: a tenth of the
    # rounds (at least 3), 3 updates each; some 10 minutes with the compile.
    passes = [
        one_pass(args.rounds, args.updates)
        + (transformer_rows(max(args.rounds // 10, 3), 3) if args.compiled else [])
        for _ in range(args.repeat)
    ]
    rows = passes[-1]
    width = max(len(r[0]) for r in rows)
    print(f"{'case':<{width}}  {'baseline':>10}  {'toolkit':>10}  ratio (median of rounds)")
    for name, base, ours, ratio in rows:
        print(f"{name:<{width}}  {base * 1e6:>8.0f}us  {ours * 1e6:>8.0f}us  {ratio:.3f}x")
    if args.repeat > 1:
        print(f"\nratio over {args.repeat} passes: min / median / max")
        for i, (name, *_) in enumerate(rows):
            ratios = sorted(p[i][3] for p in passes)
            print(
                f"{name:<{width}}  {ratios[0]:.3f}x / {statistics.median(ratios):.3f}x / "
                f"{ratios[-1]:.3f}x"
            )


if __name__ == "__main__":
    main()
