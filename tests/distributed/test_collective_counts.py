"""Collective calls per DDP update, counted: a count, not a timing.

``benchmarks/ddp.py`` prints these counts next to its timings; this test pins them on 2
spawned gloo ranks: the hand-written DDP loop makes one all-reduce per update (DDP's
gradient bucket, on the closing micro-batch only), and so does toolkit's accumulate + clip
+ guard step: the verdict's flags (each rank's loss check and skipped micro-batches) ride
on that bucket through toolkit's comm hook. On a model with a comm hook of the user's own,
toolkit all-reduces them on their own: one more.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist
from spawning import spawn

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _count(rank: int, store: str, out: str) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ddp  # benchmarks/ddp.py

    import toolkit.step._step

    # A collective that never completes fails after 30 s instead of hanging the suite.
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, 2),
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=30),
    )
    try:
        counts = {
            "hand": ddp.collectives_per_update(ddp.hand_written),
            "toolkit": ddp.collectives_per_update(ddp.composed, hook=False),
            "toolkit, a hook of the user's": ddp.collectives_per_update(ddp.composed),
        }
        # The counter is not blind: a step that syncs every micro-batch shows 4 buckets.
        toolkit.step._step.suppress_grad_sync = lambda model, kind: contextlib.nullcontext()
        counts["toolkit, no no_sync"] = ddp.collectives_per_update(ddp.composed, hook=False)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    pathlib.Path(out, f"rank{rank}.json").write_text(json.dumps(counts))


@pytest.mark.slow
def test_a_ddp_update_makes_one_all_reduce_its_gradient_bucket(tmp_path) -> None:
    def arguments(attempt: int) -> tuple[str, str]:
        out = tmp_path / str(attempt)
        out.mkdir()
        return str(out / "store"), str(out)

    spawn(_count, arguments, nprocs=2, timeout=90)
    out = sorted(p for p in tmp_path.iterdir() if p.is_dir())[-1]
    for rank in (0, 1):
        counts = json.loads((out / f"rank{rank}.json").read_text())
        assert counts["hand"] == {"ddp bucket all_reduce": 1.0}
        assert counts["toolkit"] == {"all_reduce": 1.0}  # the bucket, through toolkit's hook
        assert counts["toolkit, a hook of the user's"] == {
            "all_reduce": 1.0,  # the verdict, on its own
            "ddp bucket all_reduce": 1.0,
        }
        assert counts["toolkit, no no_sync"] == {"all_reduce": 4.0}
