"""A folder of checkpoints: listing, newest intact, fallback past damage, pointer, leftovers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import toolkit.checkpoints._save as save_module
from toolkit import TrainState, load_checkpoint, save_checkpoint
from toolkit.checkpoints import (
    DamagedCheckpointError,
    clean_temporaries,
    latest_checkpoint,
    list_checkpoints,
    load_latest,
    read_pointer,
    verify_checkpoint,
    write_pointer,
)

REPO = Path(__file__).resolve().parents[2]


def state(step: int = 0) -> TrainState:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return TrainState(model=model, optimizer=optimizer, step=step)


def template() -> TrainState:
    model = torch.nn.Linear(3, 2)
    return TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1))


def save_steps(root: Path, *steps: int) -> list[Path]:
    return [save_checkpoint(state(s), root / f"step_{s:06d}") for s in steps]


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 1
    path.write_bytes(bytes(data))


def test_listing_sorts_by_step_reports_damage_and_skips_leftovers(tmp_path: Path) -> None:
    # Bugs caught: sorting by name ("step_10" < "step_9"), hidden temporaries listed as
    # checkpoints, a damaged folder silently dropped from the listing.
    root = tmp_path / "ckpt"
    for step, name in [(10, "b"), (9, "c"), (100, "a")]:
        save_checkpoint(state(step), root / name)
    (root / ".tmp-d-1-abcd").mkdir()
    (root / "broken").mkdir()
    (root / "latest").write_text("a\n")
    found = list_checkpoints(root)
    assert [(c.name, c.step, c.intact) for c in found] == [
        ("broken", None, False),
        ("c", 9, True),
        ("b", 10, True),
        ("a", 100, True),
    ]
    assert found[0].problems == (f"{root / 'broken' / 'manifest.json'}: missing",)
    listed = [p for p in (root / "c").iterdir() if p.name != "manifest.json"]
    assert found[1].size == sum(p.stat().st_size for p in listed)
    assert list_checkpoints(tmp_path / "nowhere") == []


def test_the_newest_intact_checkpoint_is_found_past_damaged_ones(tmp_path: Path) -> None:
    # Bug caught: resuming from a damaged newest checkpoint (or failing) instead of falling
    # back, or falling back without telling.
    root = tmp_path / "ckpt"
    _, second, third = save_steps(root, 1, 2, 3)
    flip_a_bit(third / "optimizer.safetensors")  # only a checksum sees this
    with pytest.warns(UserWarning) as caught:
        assert latest_checkpoint(root) == second
    (warning,) = caught
    assert str(warning.message).startswith(f"checkpoint {third} is damaged and skipped:\n  ")
    assert f"{third / 'optimizer.safetensors'}: xxh3_128 checksum" in str(warning.message)
    # Without checksums the flipped bit is not seen (load_checkpoint sees it):
    assert latest_checkpoint(root, checksums=False) == third


def test_load_latest_falls_back_with_a_warning_and_loads_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    _, second, third = save_steps(root, 1, 2, 3)
    flip_a_bit(third / "model.safetensors")
    (root / "step_000004").mkdir()  # a folder without a manifest: damaged too
    with pytest.warns(UserWarning) as caught:
        loaded, path = load_latest(root, like=template())
    assert path == second and loaded.step == 2
    assert [str(w.message).splitlines()[0] for w in caught] == [
        f"checkpoint {root / 'step_000004'} is damaged and skipped:",
        f"checkpoint {third} is damaged and skipped:",
    ]


def test_load_latest_on_an_empty_folder_is_a_fresh_start_and_all_damaged_raises(
    tmp_path: Path,
) -> None:
    assert load_latest(tmp_path / "none", like=template()) is None
    root = tmp_path / "ckpt"
    (only,) = save_steps(root, 1)
    with open(only / "model.safetensors", "r+b") as file:
        file.truncate(10)
    with pytest.warns(UserWarning), pytest.raises(DamagedCheckpointError) as error:
        load_latest(root, like=template())
    assert error.value.path == only
    assert "model.safetensors: 10 bytes, the manifest says" in str(error.value)


def test_load_latest_raises_a_template_mismatch_instead_of_falling_back(tmp_path: Path) -> None:
    # Bug caught: treating "does not fit" as damage and silently loading an older one.
    root = tmp_path / "ckpt"
    save_steps(root, 1, 2)
    other = TrainState(model=torch.nn.Linear(3, 5))
    with pytest.raises(ValueError, match="does not fit the template state"):
        load_latest(root, like=other)


def test_the_pointer_is_replaced_atomically(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    first, second = save_steps(root, 1, 2)
    assert read_pointer(root) is None
    write_pointer(root, first)
    assert read_pointer(root) == first
    pointer = write_pointer(root, second.name)
    assert pointer == root / "latest" and pointer.read_text() == "step_000002\n"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]
    with pytest.raises(ValueError) as error:
        write_pointer(root, tmp_path / "elsewhere")
    assert str(error.value) == (
        f"write_pointer: checkpoint must be a checkpoint folder inside {root}; "
        f"got {str(tmp_path / 'elsewhere')!r}."
    )
    (root / "latest").write_text("../../etc\n")
    assert read_pointer(root) is None


def test_a_failing_pointer_write_keeps_the_old_pointer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Bug caught: writing the pointer in place (a crash leaves it empty or half-written).
    root = tmp_path / "ckpt"
    first, second = save_steps(root, 1, 2)
    write_pointer(root, first)

    def failing(path: Path, data: bytes) -> None:
        Path(path).write_bytes(data[:3])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("toolkit.checkpoints._folder.write_bytes", failing)
    with pytest.raises(OSError):
        write_pointer(root, second)
    assert read_pointer(root) == first
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]


def test_leftovers_are_removed_and_a_replaced_checkpoint_is_put_back(tmp_path: Path) -> None:
    # Bugs caught: .tmp folders kept (or loaded); an .old folder deleted when the new one
    # never got its name (both copies lost).
    root = tmp_path / "ckpt"
    _, second = save_steps(root, 1, 2)
    (root / ".tmp-step_000003-77-0123abcd").mkdir()
    (root / ".tmp-step_000003-77-0123abcd" / "model.safetensors").write_bytes(b"half")
    (root / ".tmp-latest-77-0123abcd").write_text("x")
    (root / ".del-step_000000-77-0123abcd").mkdir()
    os.rename(second, root / ".old-step_000002-77-0123abcd")  # crash between the renames
    save_checkpoint(state(1), root / ".old-step_000001-78-0123abcd")  # and one superseded
    removed = clean_temporaries(root)
    assert sorted(p.name for p in removed) == [
        ".del-step_000000-77-0123abcd",
        ".old-step_000001-78-0123abcd",
        ".tmp-latest-77-0123abcd",
        ".tmp-step_000003-77-0123abcd",
    ]
    assert sorted(p.name for p in root.iterdir()) == ["step_000001", "step_000002"]
    assert verify_checkpoint(second) == [] and load_checkpoint(second, like=template()).step == 2
    assert clean_temporaries(root) == []


def test_a_crash_between_the_two_renames_of_a_replacement_keeps_the_old_findable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    (path,) = save_steps(root, 5)
    renames = []
    real = os.rename

    def crash_on_second(a: Path, b: Path) -> None:
        renames.append((a, b))
        if len(renames) == 2:
            raise OSError(5, "Input/output error")
        real(a, b)

    monkeypatch.setattr(save_module.os, "rename", crash_on_second)
    with pytest.raises(OSError, match=f"could not write the checkpoint {path}"):
        save_checkpoint(state(5).replace(epoch=1), path)  # a replacement of the same step
    monkeypatch.undo()
    assert not path.exists()
    assert [p.name.startswith(".old-step_000005-") for p in root.iterdir()] == [True]
    clean_temporaries(root)
    assert (
        load_checkpoint(path, like=template()).epoch,
        load_checkpoint(path, like=template()).step,
    ) == (0, 5)


KILLED_SAVE = textwrap.dedent(
    """
    import sys, time, torch
    import toolkit.checkpoints._save as module
    from toolkit import TrainState, save_checkpoint

    real = module.write_json

    def stall(path, document):
        real(path, document)
        if path.name == "manifest.json":  # every file is written: stop before the rename
            print("written", flush=True)
            time.sleep(60)

    module.write_json = stall
    model = torch.nn.Linear(3, 2)
    save_checkpoint(TrainState(model=model, step=2), sys.argv[1])
    """
)


@pytest.mark.slow
def test_a_killed_save_leaves_a_temporary_that_is_never_loaded_and_is_cleaned(
    tmp_path: Path,
) -> None:
    # Bug caught: a save killed before its rename being found as a checkpoint (it holds a
    # complete manifest: only the name tells it was not published).
    root = tmp_path / "ckpt"
    save_steps(root, 1)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE, str(root / "step_000002")],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # blocks until the files are written
        assert line == "written\n"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()
    (leftover,) = [p for p in root.iterdir() if p.name.startswith(".tmp-step_000002-")]
    assert (leftover / "manifest.json").is_file()  # complete, but not published
    assert [c.name for c in list_checkpoints(root)] == ["step_000001"]
    assert latest_checkpoint(root) == root / "step_000001"
    loaded, path = load_latest(root, like=template())
    assert path.name == "step_000001" and loaded.step == 1
    assert clean_temporaries(root) == [leftover]
    assert sorted(p.name for p in root.iterdir()) == ["step_000001"]
