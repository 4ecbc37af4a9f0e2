"""A training job that resumes itself from its checkpoints: the subject of the kill tests.

    python tests/resumable_job.py --ckpt DIR --out RESULT.json [--steps N] [--every K]

Dropout, a shuffled DataLoader with a seeded generator, accumulation, the guard, EMA and
an LR schedule: everything an exact resume must restore. Each trained micro-batch's first
sample index is kept in ``state.extras["seen"]`` (saved with every checkpoint), so the
sequence of batches an interrupted job trained on can be compared with an uninterrupted
one. Prints ``step N`` after every update and writes digests of the final parameters,
optimizer state and EMA, and the batch sequence, to ``--out``.

Options to make the bad moments easy to hit: ``--slow-save S`` sleeps S seconds inside
each save (after the temporary folder exists), ``--slow-first S`` sleeps before the first
batch, ``--pad-mb M`` saves an M MiB tensor with every checkpoint.

Several ranks: start one process per rank with ``--world W --rank R --store
FILE`` (a fresh FileStore file per launch) and ``--wrap ddp`` or ``--wrap fsdp2`` (with
``--bf16``: a bf16 ``MixedPrecisionPolicy``). Each rank reads its part of the data through
a ``DistributedSampler``, draws its own dropout (seeded per rank), records the batches of
every rank (all-gathered, so the record is the same on all) and writes ``--out`` with
``.rank<R>`` appended.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch.utils.data import DataLoader, Dataset

from toolkit import TrainState, accumulate, compose, guard_nonfinite, make_step, run
from toolkit.plugins import Retention, checkpoints, ema


class Numbered(Dataset):
    def __init__(self, n: int, slow_first: float) -> None:
        self.n, self.slow_first = n, slow_first

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        if self.slow_first:
            time.sleep(self.slow_first)
            self.slow_first = 0.0
        g = torch.Generator().manual_seed(i)
        return i, torch.randn(6, generator=g), torch.randn(2, generator=g)


def loss_fn(model: torch.nn.Module, batch):
    ids, x, y = batch
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    return loss, {"id": int(ids[0])}


def remember(event):
    """Keep the first sample index of every micro-batch trained on (of every rank)."""
    if event.kind != "step":
        return None
    state = event.state
    ids = [int(o.records["id"]) for o in event.outs]
    if torch.distributed.is_initialized():
        mine = torch.tensor(ids, dtype=torch.int64)
        every = torch.empty(len(ids) * torch.distributed.get_world_size(), dtype=torch.int64)
        torch.distributed.all_gather_into_tensor(every, mine)
        ids = every.tolist()
    seen = [*state.extras.get("seen", []), *ids]
    return state.replace(extras={**state.extras, "seen": seen})


def announce(event):
    if event.kind == "step":
        print(f"step {event.state.step}", flush=True)
    elif event.kind == "start":
        print(f"start {event.state.step}", flush=True)


def whole(tensor):
    """A DTensor's whole value (a collective: every rank calls it in the same order)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def digest(value) -> str:
    h = hashlib.sha256()
    for key in sorted(value):
        h.update(key.encode())
        tensor = value[key]
        if isinstance(tensor, torch.Tensor):
            tensor = whole(tensor)
            h.update(tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(tensor).encode())
    return h.hexdigest()


def flat(tree, prefix=""):
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}{k}/"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(flat(v, f"{prefix}{i}/"))
    else:
        out[prefix] = tree
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--slow-save", type=float, default=0.0)
    parser.add_argument("--slow-first", type=float, default=0.0)
    parser.add_argument("--pad-mb", type=int, default=0)
    parser.add_argument("--exit-code", type=int, default=None)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--store", default=None)
    parser.add_argument("--wrap", choices=("none", "ddp", "fsdp2"), default="none")
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()

    if args.slow_save:
        import toolkit.checkpoints._save as saving

        original = saving._write_parts

        def slow_write(*parts):
            print("saving", flush=True)
            time.sleep(args.slow_save)
            return original(*parts)

        saving._write_parts = slow_write

    if args.world > 1:
        store = torch.distributed.FileStore(args.store, args.world)
        torch.distributed.init_process_group(
            "gloo", store=store, rank=args.rank, world_size=args.world
        )
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2)
    )
    torch.manual_seed(1000 + args.rank)  # each rank its own dropout
    model = wrapped(model, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s))
    extras = {"pad": torch.zeros(args.pad_mb * 2**18)} if args.pad_mb else {}
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler, extras=extras)
    dataset = Numbered(40, args.slow_first)
    if args.world > 1:
        sampler = torch.utils.data.DistributedSampler(
            dataset, num_replicas=args.world, rank=args.rank, shuffle=True, seed=1
        )
        loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    else:
        loader = DataLoader(
            dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)
        )
    step = compose(accumulate(micro_batches=2), guard_nonfinite())(make_step(loss_fn))
    plugins = [
        ema(0.9),
        remember,
        checkpoints(
            args.ckpt,
            every=args.every or None,
            keep=Retention(keep_last=2),
            exit_code=args.exit_code,
        ),
        announce,
    ]
    try:
        state = run(step, state, loader, max_steps=args.steps, plugins=plugins)
    except SystemExit as stop:
        # A signal stopped every rank after the same update: leave the group together, or
        # gloo may abort this process at exit ("terminate called without an active
        # exception") when the ranks destroy it at different moments.
        if args.world > 1:
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        leave(stop.code if isinstance(stop.code, int) else 1)
    result = {
        "step": state.step,
        "model": digest(model.state_dict()),
        "optimizer": digest(flat(optimizer.state_dict())),
        "ema": digest(state.extras["ema"]["params"]),
        "seen": state.extras["seen"],
    }
    out = Path(args.out) if args.world == 1 else Path(f"{args.out}.rank{args.rank}")
    out.write_text(json.dumps(result))
    if args.world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    leave(0)


def leave(code: int) -> None:
    """Exit with ``code`` once the results are written and the ranks left the group.

    Without the interpreter's teardown: gloo can abort a process at exit even after a
    barrier and destroy_process_group ("terminate called without an active exception",
    exit -6; shared/research/feasibility.md item 1c, and tests/spawning.py retries for it).
    Here an FSDP2 rank that had finished and saved did so in 2 of about 10 full-suite runs
    under load; this job tests what happens before that.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def wrapped(model: torch.nn.Module, args) -> torch.nn.Module:
    if args.wrap == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if args.wrap == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (args.world,))
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if args.bf16
            else MixedPrecisionPolicy()
        )
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        return fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


if __name__ == "__main__":
    main()
