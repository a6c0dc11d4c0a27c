"""The built wheel carries every file rv and rv_train read at run time, not only their modules.

An editable install reads the checkout, so only a wheel shows a file left out of the package data
(issue 33: without rv/agent/job.sh every `rv run` failed after `pip install .`, pipx or uv tool).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_wheel_holds_every_tracked_file_of_the_packages(tmp_path):
    tracked = subprocess.run(
        ["git", "ls-files", "-z", "rv", "rv_train"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.split("\0")
    wanted = {name for name in tracked if name}
    assert "rv/agent/job.sh" in wanted  # the positive case: a non-module file is among them
    # Built from the tracked files alone, as from a fresh clone: the checkout's rv.egg-info (left by the
    # editable install) lists every file and would hide one missing from the package data.
    source = tmp_path / "src"
    for name in [*wanted, "pyproject.toml", "README.md"]:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes((REPO / name).read_bytes())
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    built = subprocess.run([*pip_wheel, "-w", str(tmp_path), str(source)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("rv-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        inside = set(archive.namelist())
    assert sorted(wanted - inside) == []
