"""Instructions per update, counted by valgrind: overhead figures without timing noise.

Wall and CPU times on a shared machine move by a percent or two between runs; instruction
counts do not. Each variant runs once under ``valgrind --tool=callgrind`` with
instrumentation off; after imports and a warm-up the workload switches it on and zeroes the
counters (``callgrind_control``), trains UPDATES updates and dumps: the count divided by
UPDATES is its cost per update. Variants, all on the tiny MLP (32-64-10, batch 32,
accumulate 4, clip, guard; AdamW and a scheduler unless said otherwise):

    hand      the hand-written loop of overhead.py, plain SGD, no scheduler
    step      the composed step in a plain for loop, plain SGD, no scheduler
    bare      the composed step in a plain for loop
    run       run() with no plugins
    progress  run() + progress(every=10, min_interval=0): a refresh at every 10th update
    metrics   run() + log_metrics(every=10) writing JSONL
    both      run() + progress + log_metrics (every=10)
    read      what progress and log_metrics read at a refresh: read() of 10 windows per
              "update" (the composed step's outputs), compared with nothing

``--cache-sim`` adds valgrind's cache and branch simulation and prints, per update, the L1
instruction and data misses and the mispredicted conditional and indirect branches too.

    make bench-instructions                 # or: python benchmarks/instructions.py
    python benchmarks/instructions.py run both --updates 400

About 1.5 minutes per variant on the CI machine (two run at a time). Needs valgrind
(Debian: apt-get install valgrind). Not part of `make test`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = ("hand", "step", "bare", "run", "progress", "metrics", "both", "read")


SGD = ("hand", "step")  # plain SGD, no scheduler: the step against the hand-written loop


def workload(variant: str, updates: int) -> None:
    """Warm up, then count ``updates`` updates of ``variant`` (run inside valgrind)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import overhead
    import torch
    from rich.console import Console

    from toolkit import TrainState, run
    from toolkit.plugins import jsonl, log_metrics, progress

    torch.set_num_threads(1)
    objects = overhead.setup([32, 64, 10], 32, optimizer="sgd" if variant in SGD else "adamw")
    if variant == "hand":
        train = overhead.hand_written(objects)
    elif variant == "read":
        from toolkit.plugins._interval import Interval, read

        step, state, windows = overhead.composed_step(), TrainState(*objects[:3]), []
        for _ in range(10):
            outs = []
            for batch in objects[3]:
                state, out = step(state, batch)
                outs.append(out)
            windows.append(tuple(outs))

        def train(n: int) -> None:
            for _ in range(n):
                read(Interval(), windows)
    elif variant in ("step", "bare"):
        train = overhead.bare_loop(objects)
    else:
        model, opt, sched, data = objects
        step = overhead.composed_step()
        plugins = []
        if variant in ("progress", "both"):
            console = Console(file=io.StringIO(), force_terminal=False)
            # Under valgrind an update takes ~50x longer, so progress's 0.1 s limit would
            # never bite; min_interval=0 makes that explicit: these are unthrottled counts.
            plugins.append(progress(every=10, console=console, min_interval=0))
        if variant in ("metrics", "both"):
            plugins.append(log_metrics(every=10, sinks=[jsonl(tempfile.mktemp(".jsonl"))]))
        holder = [TrainState(model=model, optimizer=opt, scheduler=sched)]
        epoch = data * overhead.EPOCH_UPDATES

        def train(n: int) -> None:
            holder[0] = run(step, holder[0], epoch, max_steps=holder[0].step + n, plugins=plugins)

    def callgrind(*args: str) -> None:
        subprocess.run(
            ["callgrind_control", *args, str(os.getpid())], check=True, capture_output=True
        )

    train(20)
    callgrind("--instr=on")
    train(10)  # the first updates after the switch, outside the count
    callgrind("--zero")
    train(updates)
    callgrind("--dump")


SIMULATED = ("I1mr", "D1mr", "Bcm", "Bim")  # --cache-sim: valgrind's names of what it prints


def count(variant: str, updates: int, simulate: bool = False) -> dict[str, int]:
    """Valgrind's totals over ``updates`` updates of ``workload(variant)``: ``Ir``
    (instructions) and, with ``simulate``, the cache misses and mispredicts of SIMULATED."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        simulation = ["--cache-sim=yes", "--branch-sim=yes"] if simulate else []
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                *simulation,
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "--workload",
                variant,
                str(updates),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            check=True,
        )
        dump = Path(f"{out}.1").read_text()  # the dump the workload asked for
    events = re.search(r"^events: (.*)$", dump, re.MULTILINE)
    summary = re.search(r"^summary: (.*)$", dump, re.MULTILINE)
    if events is None or summary is None:
        raise RuntimeError(f"no instruction summary in callgrind's dump:\n{dump[-2000:]}")
    return dict(zip(events.group(1).split(), map(int, summary.group(1).split())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", help=f"some of {', '.join(VARIANTS)} (default all)")
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--cache-sim", action="store_true", help="also cache misses, mispredicts")
    parser.add_argument("--workload", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workload:
        workload(args.workload[0], int(args.workload[1]))
        return
    chosen = args.variants or list(VARIANTS)
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; expected some of {list(VARIANTS)}")
    # Each variant is compared with its baseline: the step with the hand-written loop, the
    # run() variants with the step in a for loop ("bare"); read() with nothing (itself).
    baseline = {v: "hand" if v in SGD else v if v == "read" else "bare" for v in VARIANTS}
    variants = sorted({*chosen, *(baseline[v] for v in chosen)}, key=VARIANTS.index)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        runs = pool.map(lambda v: count(v, args.updates, args.cache_sim), variants)
        counts = dict(zip(variants, runs))
    per_update = {v: counts[v]["Ir"] / args.updates for v in variants}
    print(f"instructions per update (valgrind, {args.updates} updates after warm-up):")
    for v in variants:
        base = per_update[baseline[v]]
        extra = per_update[v] - base
        print(
            f"  {v:9s} {per_update[v] / 1e6:8.4f}M  {per_update[v] / base:.4f}x  {extra:+9.0f}"
            f"  (vs {baseline[v]})"
        )
    if args.cache_sim:
        print(f"simulated, per update: {', '.join(SIMULATED)}")
        for v in variants:
            values = (f"{counts[v][e] / args.updates:9.0f}" for e in SIMULATED)
            print(f"  {v:9s} " + "  ".join(values))


if __name__ == "__main__":
    main()
