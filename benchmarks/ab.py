"""A/B of the tiny-MLP step rows (or the run() rows) between trees, in alternating processes.

One pass of ``overhead.py`` moves by about 0.5% between processes on a shared 2-core
machine, more than many changes to the step are worth. This script runs ``measure()`` of
the plain-SGD and AdamW rows (60 rounds of 10 updates) in a fresh process per tree, the
trees taking turns, and prints each process's ratios and the medians per tree. A tree is a
checkout or a ``git archive`` of one (``git archive REV | tar -x -C /tmp/rev``).

    python benchmarks/ab.py /tmp/old /path/to/checkout --pairs 5
    python benchmarks/ab.py . . --wrap 0 1   # one more Python frame per micro-batch

``--wrap N`` (one per tree) wraps the step in N ``lambda s, b: f(s, b)`` layers: what one
more Python call per micro-batch costs. ``--rows run`` compares the rows "run(), no
plugins" and "run()+progress+log_metrics(every=10)" instead (200 rounds of 10 updates).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import os, sys
sys.path[:0] = [os.environ["TREE"], os.path.join(os.environ["TREE"], "benchmarks")]
import torch, overhead as o, toolkit
from toolkit import TrainState
assert toolkit.__file__.startswith(os.path.abspath(os.environ["TREE"])), toolkit.__file__
torch.set_num_threads(1)
ratios, rows = [], os.environ["ROWS"]
for path in (None, os.path.join(os.environ["TMP"], "a.jsonl")) if rows == "run" else ():
    objects = o.setup([32, 64, 10], 32)
    ratios.append(o.measure_in_run(objects, o.plugins_for(path, 10, 0.1), 200, 10)[2])
for name in ("sgd", "adamw") if rows == "step" else ():
    model, opt, sched, data = objects = o.setup([32, 64, 10], 32, optimizer=name)
    step = o.composed_step()
    for _ in range(int(os.environ["WRAP"])):
        step = (lambda f: lambda s, b: f(s, b))(step)
    holder = [TrainState(model=model, optimizer=opt, scheduler=sched)]
    def ours(n):
        s = holder[0]
        for _ in range(n):
            for b in data:
                s, _ = step(s, b)
        holder[0] = s
    ratios.append(o.measure(o.hand_written(objects), ours, 60, 10)[2])
print(*ratios)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs=2)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--wrap", type=int, nargs=2, default=(0, 0))
    parser.add_argument("--rows", choices=("step", "run"), default="step")
    args = parser.parse_args()
    names = ("sgd", "adamw") if args.rows == "step" else ("run()", "run()+progress+log_metrics")
    runs: dict[int, list[list[float]]] = {0: [], 1: []}
    for _ in range(args.pairs):
        for side, tree in enumerate(args.trees):
            with tempfile.TemporaryDirectory() as tmp:
                env = {**os.environ, "OMP_NUM_THREADS": "1", "TREE": os.path.abspath(tree)}
                env.update(WRAP=str(args.wrap[side]), ROWS=args.rows, TMP=tmp)
                out = subprocess.run(
                    [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                    check=True,
                )  # fmt: skip
            runs[side].append([float(x) for x in out.stdout.split()])
            shown = ", ".join(f"{n} {r:.4f}x" for n, r in zip(names, runs[side][-1]))
            print(f"{tree} (wrap {args.wrap[side]}): {shown}", flush=True)
    for side, tree in enumerate(args.trees):
        medians = (statistics.median(r[i] for r in runs[side]) for i in range(len(names)))
        shown = ", ".join(f"{n} {m:.4f}x" for n, m in zip(names, medians))
        print(f"median {tree} (wrap {args.wrap[side]}): {shown}")


if __name__ == "__main__":
    main()
