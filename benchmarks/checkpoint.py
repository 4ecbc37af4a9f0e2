"""Checkpoint speed: save_checkpoint / load_checkpoint against torch.save / torch.load.

The state is a model of about 67 MB and its AdamW state (two moments: 134 MB), about 200 MB
in all. Each round times, interleaved so that machine noise hits both sides alike:

* save: ``save_checkpoint(state, dir)`` against a careful ``torch.save`` of the same state
  dicts (``{"model": ..., "optimizer": ...}``) to a temporary file, fsync'ed and renamed,
  the folder fsync'ed. Both sides fsync (a checkpoint not on disk is no checkpoint), so
  both include the disk's write-back. Each round writes new files, as a run writes new
  step folders; the previous round's are deleted outside the timings.
* load: ``load_checkpoint(dir, like=state)`` (which verifies every xxh3 checksum and
  restores model, optimizer and RNG states) against ``torch.load`` (weights_only, the
  default) followed by ``model.load_state_dict`` and ``optimizer.load_state_dict``. The
  files were just written, so both read from the page cache ("warm"); the "cold" rows
  first drop the files' pages (posix_fadvise DONTNEED) so both read from the disk.
* blocked: how long the training loop waits per save. save_checkpoint is synchronous: the
  whole save. ``toolkit.checkpoints.save_in_background`` blocks only while it copies the
  state to host memory, then writes in a thread (the "written" row: call to file on disk,
  against the same synchronous torch.save).
* checksum: the standard library's crc32 against xxh3-128 (what the manifests use) over
  the two tensor files' bytes in memory.

The two sides take turns going first (the second writer finds the disk busier). Printed:
the median over rounds of each side's time and the median of the per-round ratios.

    OMP_NUM_THREADS=1 python benchmarks/checkpoint.py              # 5 rounds
    python benchmarks/checkpoint.py --rounds 9 --dir /mnt/fast     # another disk
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import xxhash

from toolkit import TrainState, load_checkpoint, save_checkpoint
from toolkit.checkpoints import save_in_background


def state_of_about_200mb(width: int = 1024, layers: int = 16) -> TrainState:
    """An MLP of ``layers`` square layers and AdamW moments after one update."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return TrainState(model=model, optimizer=optimizer, step=1)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(state: TrainState, path: Path) -> None:
    """What a careful user writes: temp file, fsync, rename, fsync the folder."""
    temp = path.with_name(path.name + ".tmp")
    assert state.optimizer is not None
    torch.save({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict()}, temp)
    fsync_path(temp)
    os.replace(temp, path)
    fsync_path(path.parent)


def torch_load(state: TrainState, path: Path) -> None:
    saved = torch.load(path)  # weights_only=True, the default since torch 2.6
    state.model.load_state_dict(saved["model"])
    assert state.optimizer is not None
    state.optimizer.load_state_dict(saved["optimizer"])


def drop_cache(path: Path) -> None:
    """Evict a file's (or a folder's files') pages, so the next read comes from the disk."""
    files = [p for p in path.iterdir()] if path.is_dir() else [path]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def both(base: Callable[[], object], ours: Callable[[], object], swap: bool) -> tuple[float, float]:
    """Time both, ``ours`` first when ``swap``; return (base time, our time)."""
    if swap:
        mine = timed(ours)
        return timed(base), mine
    first = timed(base)
    return first, timed(ours)


def megabytes(state: TrainState) -> float:
    tensors = list(state.model.state_dict().values())
    assert state.optimizer is not None
    for entry in state.optimizer.state_dict()["state"].values():
        tensors += [v for v in entry.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: $TMPDIR)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    state = state_of_about_200mb()
    root = Path(tempfile.mkdtemp(prefix="toolkit-bench-", dir=args.dir))
    rows: dict[str, list[tuple[float, float]]] = {}

    def pair(name: str, base: float, ours: float) -> None:
        rows.setdefault(name, []).append((base, ours))

    try:
        # New files each round; the previous round's are deleted outside the timings.
        torch_save(state, root / "warmup.pt")  # first writes allocate the disk's blocks
        save_checkpoint(state, root / "warmup")
        for i in range(args.rounds):
            pt, folder, background = root / f"{i}.pt", root / f"ckpt_{i}", root / f"bg_{i}"
            # Who writes second finds the disk busier (the first's journal and write-back):
            # take turns.
            base, ours = both(
                lambda pt=pt: torch_save(state, pt),
                lambda folder=folder: save_checkpoint(state, folder),
                swap=i % 2 == 1,
            )
            pair("save (blocks for all of it)", base, ours)
            start = time.perf_counter()
            pending = save_in_background(state, background)
            blocked = time.perf_counter() - start
            pending.result()
            written = time.perf_counter() - start
            pair("save_in_background: blocked", base, blocked)
            pair("save_in_background: written", base, written)
            base, ours = both(
                lambda pt=pt: torch_load(state, pt),
                lambda folder=folder: load_checkpoint(folder, like=state),
                swap=i % 2 == 1,
            )
            pair("load, warm (page cache)", base, ours)
            drop_cache(pt)
            base = timed(lambda pt=pt: torch_load(state, pt))
            drop_cache(folder)
            ours = timed(lambda folder=folder: load_checkpoint(folder, like=state))
            pair("load, cold (from disk)", base, ours)
            data = b"".join(
                (folder / name).read_bytes()
                for name in ("model.safetensors", "optimizer.safetensors")
            )
            crc = timed(lambda data=data: zlib.crc32(data))
            xxh = timed(lambda data=data: xxhash.xxh3_128_hexdigest(data))
            pair("checksum: crc32 vs xxh3_128", crc, xxh)
            for old in root.iterdir():
                if old.name not in (pt.name, folder.name):
                    shutil.rmtree(old) if old.is_dir() else old.unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    size = megabytes(state)
    print(
        f"checkpoint of {size:.0f} MB (model + AdamW state), {args.rounds} rounds, median; "
        f"fsync on both sides; files in {args.dir or tempfile.gettempdir()}"
    )
    width = max(len(name) for name in rows) + 2
    print(f"{'':<{width}}{'torch':>8}  {'toolkit':>8}  ratio (median of rounds)")
    for name, values in rows.items():
        base = statistics.median(b for b, _ in values)
        ours = statistics.median(o for _, o in values)
        ratio = statistics.median(o / b for b, o in values)
        print(f"{name:<{width}}{base * 1e3:>6.0f}ms  {ours * 1e3:>6.0f}ms  {ratio:.2f}x")


if __name__ == "__main__":
    main()
