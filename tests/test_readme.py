"""The README's quick start runs as written and trains (issue 2, item 10)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.slow
def test_quick_start_runs_and_trains(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert blocks, "README.md has no python block"
    script = tmp_path / "quick_start.py"
    script.write_text(blocks[0])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    accuracy = float(re.search(r"train accuracy: ([0-9.]+)", done.stdout).group(1))
    assert accuracy > 0.9  # chance is 0.1
    assert (tmp_path / "runs" / "a" / "metrics.jsonl").read_text().count("\n") >= 4
