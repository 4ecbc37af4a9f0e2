"""A 2-rank DDP job that resumes itself: the subject of the lost-worker test.

    torchrun --standalone --nproc_per_node=2 --max-restarts=2 tests/elastic_job.py \\
        --ckpt DIR --out PREFIX [--kill-at STEP]

Dropout (seeded per rank), a DistributedSampler, accumulation, the guard and an LR schedule:
what an exact resume must restore on every rank. ``--kill-at S``: on the first attempt, rank
1 SIGKILLs itself in the middle of update S+1 (after its first micro-batch's forward), as a
lost machine would; torchrun restarts the group and the job resumes from its newest
checkpoint. Each rank writes ``PREFIX.rank<r>.json`` at the end: the attempt, digests of the
final parameters and optimizer state, the samples its dataset loaded in that attempt and
the update at which that attempt started.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from toolkit import TrainState, accumulate, compose, guard_nonfinite, make_step, run
from toolkit.distributed import process_group
from toolkit.plugins import Retention, checkpoints

STEPS = 12  # updates; an epoch is 40 samples / 2 ranks / batch 2 = 10 micro-batches = 5 updates


class Numbered(Dataset):
    """Fixed samples (seeded by index), counting the loads."""

    def __init__(self) -> None:
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.loaded.append(i)
        g = torch.Generator().manual_seed(i)
        return torch.randn(6, generator=g), torch.randn(2, generator=g)


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args()

    with process_group(seed=0) as launch:
        torch.manual_seed(0)  # rank 0's weights win anyway: DDP broadcasts them
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2)
        )
        torch.manual_seed(launch.seed)  # back to this rank's own stream
        model = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s))
        state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler)
        data = Numbered()
        sampler = DistributedSampler(data, shuffle=True, seed=1)
        loader = DataLoader(data, batch_size=2, sampler=sampler)
        kill = args.kill_at is not None and launch.restart == 0 and launch.rank == 1

        def loss_fn(model, batch):
            x, y = batch
            loss = torch.nn.functional.mse_loss(model(x), y)
            if kill and state_now["step"] == args.kill_at and state_now["micro"] == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # a lost worker: no handler runs
            state_now["micro"] += 1
            return loss

        state_now = {"step": -1, "micro": 0}

        def track(event):
            if event.kind in ("start", "step"):
                state_now.update(step=event.state.step, micro=0)
                if event.kind == "start":
                    state_now["started"] = event.state.step
            return None

        step = compose(accumulate(micro_batches=2), guard_nonfinite())(make_step(loss_fn))
        saving = checkpoints(args.ckpt, every=3, keep=Retention(keep_last=2), resume="latest")
        plugins = [saving, track]
        state = run(step, state, loader, max_steps=STEPS, plugins=plugins)
        params = [p for p in model.parameters()]
        moments = [
            optimizer.state[p][key] for p in params for key in ("exp_avg", "exp_avg_sq", "step")
        ]
        result = {
            "attempt": launch.restart,
            "step": state.step,
            "started": state_now["started"],
            "params": digest(params),
            "optimizer": digest(moments),
            "loaded": data.loaded,
        }
        Path(f"{args.out}.rank{launch.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
