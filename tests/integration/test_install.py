"""toolkit installs into an environment of one's own from a wheel, as the README says (no
package index has it): the wheel `make wheel` builds, into a fresh virtual environment."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import sysconfig
import venv

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_wheel_installs_into_a_fresh_environment_and_imports(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "checkout"  # a copy: the build leaves build/ and *.egg-info behind
    shutil.copytree(ROOT / "toolkit", source / "toolkit", ignore=shutil.ignore_patterns("__py*"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # make wheel's command, without build isolation: nothing to download here.
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--wheel-dir"]
    subprocess.run([*build, str(tmp_path / "dist"), str(source)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("toolkit_steps-*-py3-none-any.whl")

    env = tmp_path / "env"
    venv.create(env)  # empty: the wheel goes in with --no-deps, torch & co. come from here
    packages = sysconfig.get_path("purelib", vars={"base": str(env), "platbase": str(env)})
    pathlib.Path(packages, "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    python = env / "bin" / "python"
    install = [*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(install, check=True, capture_output=True)
    code = "import toolkit, toolkit.plugins; print(toolkit.__file__, toolkit.make_step.__name__)"
    out = subprocess.run([python, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        str(pathlib.Path(packages, "toolkit", "__init__.py")),
        "make_step",
    ]
