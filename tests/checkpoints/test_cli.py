"""python -m toolkit.checkpoints DIR [--verify]: the listing and its exit codes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from toolkit import TrainState, save_checkpoint
from toolkit.checkpoints import Retention, main, write_pointer
from toolkit.checkpoints._manifest import read_manifest

REPO = Path(__file__).resolve().parents[2]
RULES = Retention(keep_last=1, keep_best=1, metric="val/loss")


def make(root: Path) -> list[Path]:
    state = TrainState(model=torch.nn.Linear(100, 100))
    paths = []
    for step, loss in [(100, 0.3), (200, 0.5), (300, 0.4)]:
        paths.append(
            save_checkpoint(
                state.replace(step=step),
                root / f"step_{step:06d}",
                metrics={"val/loss": loss, "val/acc": 0.9},
                rules=RULES,
            )
        )
    write_pointer(root, paths[-1])
    return paths


def saved_at(path: Path) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(read_manifest(path).time))


def size_of(path: Path) -> str:
    return f"{read_manifest(path).size / 1024:.1f} KiB"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "toolkit.checkpoints", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_listing_shows_step_time_size_metrics_and_the_rule_keeping_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Bugs caught: rules read from memory instead of the manifests (nothing to say after a
    # restart), the wrong rule named, the pointer or leftovers not shown.
    root = tmp_path / "ckpt"
    paths = make(root)
    (root / ".tmp-step_000400-12-abcdef01").mkdir()
    assert main([str(root)]) == 0
    size = size_of(paths[0])
    total = f"{3 * read_manifest(paths[0]).size / 1024:.1f} KiB"
    assert capsys.readouterr().out.splitlines() == [
        f"{root}: 3 checkpoints, {total}; latest: step_000300",
        "retention (recorded by step_000300): keep_last=1, keep_best=1 by val/loss (min)",
        "step  name         saved                size      metrics                    kept by"
        "                         check",
        f" 100  step_000100  {saved_at(paths[0])}  {size}  val/acc=0.9, val/loss=0.3  keep_best"
        f"                       ok",
        f" 200  step_000200  {saved_at(paths[1])}  {size}  val/acc=0.9, val/loss=0.5  none "
        f"(pruned at the next save)  ok",
        f" 300  step_000300  {saved_at(paths[2])}  {size}  val/acc=0.9, val/loss=0.4  newest, "
        f"keep_last               ok",
        "checked: manifests and sizes (--verify: also checksums, contents)",
        "leftover of an interrupted save or prune: .tmp-step_000400-12-abcdef01 "
        "(clean_temporaries removes it)",
    ]


def test_verify_reports_a_flipped_bit_by_path_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Bug caught: --verify checking only sizes (a flipped bit passes), or exiting 0.
    root = tmp_path / "ckpt"
    paths = make(root)
    target = paths[1] / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-4] ^= 1
    target.write_bytes(bytes(data))

    assert main([str(root)]) == 0  # sizes match: the cheap listing cannot see it
    assert "DAMAGED" not in capsys.readouterr().out

    assert main([str(root), "--verify"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[4].endswith("none (pruned at the next save)  DAMAGED")
    assert lines[5].startswith(f"    {target}: xxh3_128 checksum ")
    assert lines[5].endswith(" (corrupted)")
    assert lines[-2:] == [
        "checked: manifests, sizes, checksums and contents",
        "1 of 3 checkpoints damaged",
    ]


@pytest.mark.slow  # starts Python processes: seconds each
def test_a_truncated_file_shows_without_verify_and_exit_codes_from_the_shell(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    paths = make(root)
    good = cli(str(root), "--verify")
    assert good.returncode == 0, good.stderr
    assert good.stdout.splitlines()[-1] == "checked: manifests, sizes, checksums and contents"

    with open(paths[0] / "rng.json", "r+b") as file:
        file.truncate(5)
    listing = cli(str(root))
    assert listing.returncode == 0
    assert f"    {paths[0] / 'rng.json'}: 5 bytes, the manifest says" in listing.stdout
    verify = cli(str(root), "--verify")
    assert verify.returncode == 1
    assert verify.stdout.splitlines()[-1] == "1 of 3 checkpoints damaged"

    missing = cli(str(tmp_path / "nowhere"))
    assert (missing.returncode, missing.stdout, missing.stderr) == (
        2,
        "",
        f"{tmp_path / 'nowhere'}: no such folder\n",
    )
    usage = cli()
    assert usage.returncode == 2 and "usage: python -m toolkit.checkpoints" in usage.stderr


def test_a_single_checkpoint_folder_and_a_folder_without_rules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = save_checkpoint(TrainState(model=torch.nn.Linear(1, 1)), tmp_path / "one")
    assert main([str(path), "--verify"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{path}: 1 checkpoint, ")
    assert lines[2].split() == [
        "0",
        "one",
        *saved_at(path).split(),
        *size_of(path).split(),
        "-",
        "newest",
        "ok",
    ]
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{tmp_path / 'empty'}: 0 checkpoints, 0 B",
        "checked: manifests and sizes (--verify: also checksums, contents)",
    ]
