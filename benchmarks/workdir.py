"""Job start overhead of the work dir: checked out of the git store against the copy it replaces.

    .venv/bin/python benchmarks/workdir.py [--files 5000 50000] [--mb 200 800] [--repeat 5] [--fs DIR ...]

A job's work dir is the run's own copy of its snapshot, made once per run inside the job. It used
to be a copy of the snapshot's folder in the store (a tree of one file per object), ``cp -R
--reflink=auto`` then ``chmod -R u+w``; it is now checked out of the store, a git repository, by the
job runtime's own lines (``read-tree`` into an index of the run's own, ``checkout-index -a``, and
``ls-files --deleted`` to be sure nothing is missing). This measures both on the synthetic repos of
benchmarks/sync.py, the git store built by rv itself and the old folder made from it, interleaved,
median of --repeat, page cache warm:

  copy     cp -R -P --preserve=mode,timestamps --reflink=auto SNAP WORK; chmod -R u+w WORK  (before)
  git      rv's rv_work_dir (rv.slurm.script.work_dir_script): read-tree + checkout-index + check

--fs DIR runs the same in another folder (e.g. an XFS or btrfs mount, where reflinks apply).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from sync import make_repo  # noqa: E402

from rv.files.snapshot import make_snapshot  # noqa: E402
from rv.layout import RemoteLayout  # noqa: E402
from rv.remote.transport import LocalTransport  # noqa: E402
from rv.slurm.script import work_dir_script  # noqa: E402

COPY = 'cp -R -P --preserve=mode,timestamps --reflink=auto -- "$1" "$2" && chmod -R u+w -- "$2"'


def timed(script: str, snap: Path, work: Path, env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(["bash", "-c", script, "bash", str(snap), str(work)], check=True, env=env)
    elapsed = time.perf_counter() - start
    subprocess.run(["chmod", "-R", "u+w", str(work)], check=True)
    shutil.rmtree(work)
    for leftover in (Path(f"{work}.index"),):
        leftover.unlink(missing_ok=True)
    return elapsed


def store_with_snapshot(base: Path, files: int, mb: int) -> tuple[str, Path, str]:
    """(the git store's job script for the snapshot, the old store's folder of it, the store's root)."""
    repo = base / "repo"
    make_repo(repo, files, mb)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    layout = RemoteLayout(str(base / "root"))
    snap = make_snapshot(LocalTransport(env=env), layout, repo)
    script = "set -euo pipefail\n" + work_dir_script(layout, snap.id)
    # The old store's folder of the same snapshot: its files, read-only as that store kept them.
    old = base / "old-snapshot"
    subprocess.run(["bash", "-c", script], env={**os.environ, "RV_WORK_DIR": str(old)}, check=True)
    Path(f"{old}.index").unlink()
    subprocess.run(["chmod", "-R", "a-w", str(old)], check=True)
    shutil.rmtree(repo, ignore_errors=True)
    return script, old, layout.root


def fs_type(path: Path) -> str:
    return subprocess.run(
        ["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True
    ).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, nargs="+", default=[5000, 50000])
    ap.add_argument("--mb", type=int, nargs="+", default=[200, 800])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--fs", type=Path, nargs="*", default=[Path(tempfile.gettempdir())])
    args = ap.parse_args()
    print(f"{'folder':<22} {'fs':<10} {'files':>7} {'MB':>5}  {'copy':>8} {'git':>8}  git/copy")
    for where in args.fs:
        for files, mb in zip(args.files, args.mb, strict=True):
            base = Path(tempfile.mkdtemp(prefix="rv-workdir-", dir=where))
            try:
                git_script, old, _root = store_with_snapshot(base, files, mb)
                results: dict[str, list[float]] = {"copy": [], "git": []}
                for i in range(args.repeat):  # interleaved, so drift hits both alike
                    order = ["copy", "git"] if i % 2 == 0 else ["git", "copy"]
                    for name in order:
                        work = base / f"work-{name}-{i}"
                        if name == "copy":
                            results[name].append(timed(COPY, old, work))
                        else:
                            env = {**os.environ, "RV_WORK_DIR": str(work)}
                            results[name].append(timed(git_script, old, work, env))
                copy, git = (statistics.median(results[k]) for k in ("copy", "git"))
                spread = {k: f"{min(v):.2f}-{max(v):.2f}" for k, v in results.items()}
                print(
                    f"{str(where)[:22]:<22} {fs_type(base):<10} {files:>7} {mb:>5}  {copy:>7.2f}s "
                    f"{git:>7.2f}s  {git / copy:>7.2f}x   "
                    f"(spread copy {spread['copy']} s, git {spread['git']} s)",
                    flush=True,
                )
            finally:
                subprocess.run(["chmod", "-R", "u+w", str(base)], check=False)
                shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
