"""Instructions per update, counted by valgrind: overhead figures without timing noise.

Wall and CPU times on a shared machine move by a percent or two between runs; instruction
counts do not. Each variant runs under ``valgrind --tool=callgrind`` twice, for SHORT and
LONG updates after the same warm-up, and the difference divided by ``LONG - SHORT`` is its
cost per update (imports, set-up and warm-up cancel out). Variants, all on the tiny MLP
(32-64-10, batch 32, accumulate 4, clip, guard, AdamW, scheduler):

    bare      the composed step in a plain for loop
    run       run() with no plugins
    progress  run() + progress(every=10)
    metrics   run() + log_metrics(every=10) writing JSONL
    both      run() + progress + log_metrics (every=10)

    make bench-instructions                 # or: python benchmarks/instructions.py
    python benchmarks/instructions.py run both --short 200 --long 600

About 2.5 minutes per valgrind run on the CI machine (two run at a time). Needs valgrind
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

VARIANTS = ("bare", "run", "progress", "metrics", "both")


def workload(variant: str, updates: int) -> None:
    """Warm up, then train ``updates`` updates of ``variant`` (run inside valgrind)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import overhead
    import torch
    from rich.console import Console

    from toolkit import TrainState, run
    from toolkit.plugins import jsonl, log_metrics, progress

    torch.set_num_threads(1)
    objects = overhead.setup([32, 64, 10], 32)
    if variant == "bare":
        train = overhead.bare_loop(objects)
    else:
        model, opt, sched, data = objects
        step = overhead.composed_step()
        plugins = []
        if variant in ("progress", "both"):
            console = Console(file=io.StringIO(), force_terminal=False)
            plugins.append(progress(every=10, console=console))
        if variant in ("metrics", "both"):
            plugins.append(log_metrics(every=10, sinks=[jsonl(tempfile.mktemp(".jsonl"))]))
        holder = [TrainState(model=model, optimizer=opt, scheduler=sched)]
        epoch = data * overhead.EPOCH_UPDATES

        def train(n: int) -> None:
            holder[0] = run(step, holder[0], epoch, max_steps=holder[0].step + n, plugins=plugins)

    train(20)
    train(updates)


def count(variant: str, updates: int) -> int:
    """Instructions of one whole process running ``workload(variant, updates)``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
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
    match = re.search(r"Collected : (\d+)", done.stderr)
    if match is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{done.stderr[-2000:]}")
    return int(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", help=f"some of {', '.join(VARIANTS)} (default all)")
    parser.add_argument("--short", type=int, default=200)
    parser.add_argument("--long", type=int, default=600)
    parser.add_argument("--workload", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workload:
        workload(args.workload[0], int(args.workload[1]))
        return
    chosen = args.variants or list(VARIANTS)
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; expected some of {list(VARIANTS)}")
    variants = ["bare", *[v for v in chosen if v != "bare"]]
    jobs = [(v, n) for v in variants for n in (args.short, args.long)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: count(*job), jobs)))
    span = args.long - args.short
    per_update = {v: (counts[v, args.long] - counts[v, args.short]) / span for v in variants}
    base = per_update["bare"]
    print(f"instructions per update (valgrind, {args.long} - {args.short} updates):")
    for v in variants:
        extra = per_update[v] - base
        print(f"  {v:9s} {per_update[v] / 1e6:8.4f}M  {per_update[v] / base:.4f}x  {extra:+9.0f}")


if __name__ == "__main__":
    main()
