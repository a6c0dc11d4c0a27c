"""Job start overhead of the immutable work dir: private copies against the old hard-link farm.

    .venv/bin/python benchmarks/workdir.py [--files 5000 50000] [--mb 200 800] [--repeat 5] [--fs DIR ...]

A job's work dir used to be ``cp -al`` of its snapshot (hard links into the store, read-only files):
instant, but a job that ran ``chmod u+w`` on a file and edited it changed the store, and every later
job with that content. It is now the run's own copy, made once per run inside the job (never while
``rv run`` waits): ``cp -R --reflink=auto`` (free where the filesystem can share blocks: XFS, btrfs),
then ``chmod -R u+w``. This measures both on the synthetic repos of benchmarks/sync.py, in a real
content-addressed store built by rv itself, interleaved, median of --repeat, page cache warm:

  links    cp -al SNAP WORK; find WORK -type d -exec chmod u+w {} +     (the old way)
  copy     cp -R -P --preserve=mode,timestamps --reflink=auto SNAP WORK; chmod -R u+w WORK

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

LINKS = 'cp -al -- "$1" "$2" && find "$2" -type d -exec chmod u+w {} +'
COPY = 'cp -R -P --preserve=mode,timestamps --reflink=auto -- "$1" "$2" && chmod -R u+w -- "$2"'


def timed(script: str, snap: Path, work: Path) -> float:
    start = time.perf_counter()
    subprocess.run(["bash", "-c", script, "bash", str(snap), str(work)], check=True)
    elapsed = time.perf_counter() - start
    subprocess.run(["chmod", "-R", "u+w", str(work)], check=True)
    shutil.rmtree(work)
    return elapsed


def store_with_snapshot(base: Path, files: int, mb: int) -> Path:
    repo = base / "repo"
    make_repo(repo, files, mb)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    layout = RemoteLayout(str(base / "root"))
    snap = make_snapshot(LocalTransport(env=env), layout, repo)
    # git may still be running its automatic gc in the background: whatever it leaves goes with base.
    shutil.rmtree(repo, ignore_errors=True)
    return Path(layout.snapshot(snap.id))


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
    print(
        f"{'folder':<22} {'fs':<10} {'files':>7} {'MB':>5}  {'links':>8} {'copy':>8}  copy/links  copy-links"
    )
    for where in args.fs:
        for files, mb in zip(args.files, args.mb, strict=True):
            base = Path(tempfile.mkdtemp(prefix="rv-workdir-", dir=where))
            try:
                snap = store_with_snapshot(base, files, mb)
                results: dict[str, list[float]] = {"links": [], "copy": []}
                for i in range(args.repeat):  # interleaved, so drift hits both alike
                    order = [("links", LINKS), ("copy", COPY)]
                    for name, script in order if i % 2 == 0 else reversed(order):
                        results[name].append(timed(script, snap, base / f"work-{name}-{i}"))
                links, copy = (statistics.median(results[k]) for k in ("links", "copy"))
                spread = {k: f"{min(v):.2f}-{max(v):.2f}" for k, v in results.items()}
                print(
                    f"{str(where)[:22]:<22} {fs_type(base):<10} {files:>7} {mb:>5}  {links:>7.2f}s "
                    f"{copy:>7.2f}s  {copy / links:>9.1f}x  {copy - links:>+9.2f}s   "
                    f"(spread links {spread['links']} s, copy {spread['copy']} s)",
                    flush=True,
                )
            finally:
                subprocess.run(["chmod", "-R", "u+w", str(base)], check=False)
                shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
