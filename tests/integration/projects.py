"""What many integration tests need: a committed git project to run from, a bounded wait, and a
look at the cluster's snapshot store."""

from __future__ import annotations

import json
import shlex
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


STORE_CHECK = r"""
import json, os, subprocess, sys
store = os.path.join(sys.argv[1], "store.git")
env = dict(os.environ, GIT_DIR=store)
def git(*args):
    return subprocess.run(["git"] + list(args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
if not os.path.isdir(os.path.join(store, "objects")):
    print(json.dumps({"objects": [], "fsck": 0, "fsck_err": "", "refs": [], "temps": []}))
    sys.exit(0)
fsck = git("fsck", "--no-dangling", "--no-progress")
cat = git("cat-file", "--batch-all-objects", "--batch-check=%(objecttype) %(objectname)").stdout.decode()
refs = git("for-each-ref", "--format=%(refname)", "refs/rv/").stdout.decode().split()
temps = [n for n in os.listdir(store) if n.startswith("rv-incoming-")]
temps += [n for n in os.listdir(os.path.join(store, "objects", "pack")) if n.startswith("tmp_")]
tmp = os.path.join(sys.argv[1], "tmp")
temps += os.listdir(tmp) if os.path.isdir(tmp) else []
print(json.dumps({"objects": [l.split()[1] for l in cat.splitlines() if l.startswith("blob ")],
                  "fsck": fsck.returncode, "fsck_err": fsck.stderr.decode()[-300:], "refs": refs,
                  "temps": temps}))
"""


def store_state(transport, root: str) -> dict:
    """The git store as git sees it, read on the cluster by git itself: its blobs, fsck's verdict,
    the refs, the temp files and quarantines an upload leaves while it runs."""
    res = transport.run(f"python3 -c {shlex.quote(STORE_CHECK)} {shlex.quote(root)}")
    return json.loads(res.check("reading the store").stdout)
