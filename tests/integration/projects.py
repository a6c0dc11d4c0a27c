"""What many integration tests need: a committed git project to run from, and a bounded wait."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


# A program that prints, for each of these names, a hash of the job's value or MISSING: what a job
# received, with no secret's value in its output.
SHOW_ENV = (
    "import hashlib, os\n"
    "for name in ('ALPHA_ONLY', 'BARE_ONLY', 'SHARED', 'CLASH', 'PEM'):\n"
    "    v = os.environ.get(name)\n"
    "    print(name, 'MISSING' if v is None else hashlib.sha256(v.encode()).hexdigest()[:16])\n"
)


def git_project(path: Path, files: dict[str, str]) -> Path:
    """``files`` (name -> text) written under ``path`` (which may already hold some) and committed."""
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "init"]):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=path, check=True)
    return path


def wait_for(predicate: Callable[[], T], timeout: float, what: str, step: float = 1.0) -> T:
    """``predicate()``'s first true value, asked every ``step`` s; an AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
