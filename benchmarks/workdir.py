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
  node     --work-dir node, the job's own lines: the same checkout into a folder of the job's own on
           the node's disk (--node-dir: the profile's node_work_dir; default /tmp), then, timed
           apart as "end", what each segment's end adds: rv_work_save (nothing changed here) and
           the folder's removal

The store (and the old folder) are on --fs, the shared filesystem's stand-in; "shared files" is what
each method leaves there per run. On this machine /tmp and the store's folder are one ext4 disk:
--node-dir /dev/shm stands for a node's local SSD.

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
from rv.slurm.script import runtime_files, runtime_path, work_dir_script  # noqa: E402

COPY = 'cp -R -P --preserve=mode,timestamps --reflink=auto -- "$1" "$2" && chmod -R u+w -- "$2"'


def timed(
    script: str, snap: Path, work: Path, env: dict[str, str] | None = None, keep: bool = False
) -> float:
    start = time.perf_counter()
    subprocess.run(["bash", "-c", script, "bash", str(snap), str(work)], check=True, env=env)
    elapsed = time.perf_counter() - start
    if keep:
        return elapsed  # counted by the caller, removed with the folder
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


def node_scripts(layout: RemoteLayout, snapshot_id: str, run_dir: Path, node_dir: Path) -> tuple[str, str]:
    """(the start of a --work-dir node job's work dir, its segment's end), as the job runtime does them."""
    runtime = runtime_files()[os.path.basename(runtime_path(layout, "job"))]
    values = (
        f"RV_SNAPSHOT={snapshot_id} rv_store={layout.store} RV_RUN_ID=bench RV_RUN_DIR={run_dir} "
        f"rv_job=1 rv_work_node=1 rv_work_base={node_dir} SLURMD_NODENAME=node1"
    )
    start = "\n".join(["set -euo pipefail", runtime, values, "rv_work_place", "rv_work_dir"])
    end = "\n".join(["set -euo pipefail", runtime, values, "rv_work_place", "rv_node_work_end"])
    return start, end


def count_files(path: Path) -> int:
    return sum(len(d) + len(f) for _p, d, f in os.walk(path)) if path.exists() else 0


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
    ap.add_argument("--node-dir", type=Path, nargs="*", default=[Path("/tmp")])
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f} (1 min), {os.cpu_count()} CPUs", flush=True)
    for where in args.fs:
        for files, mb in zip(args.files, args.mb, strict=True):
            base = Path(tempfile.mkdtemp(prefix="rv-workdir-", dir=where))
            try:
                git_script, old, root = store_with_snapshot(base, files, mb)
                layout = RemoteLayout(root)
                sid = git_script.rsplit("RV_SNAPSHOT=", 1)[1].split()[0].strip("'")
                nodes = {f"node {d}": Path(tempfile.mkdtemp(prefix="rv-node-", dir=d)) for d in args.node_dir}
                methods = ["copy", "git", *nodes]
                results: dict[str, list[float]] = {k: [] for k in methods}
                ends: dict[str, list[float]] = {k: [] for k in nodes}
                shared: dict[str, int] = {}
                for i in range(args.repeat):  # interleaved, rotated, so drift and load hit all alike
                    order = methods[i % len(methods) :] + methods[: i % len(methods)]
                    for name in order:
                        work = base / f"work-{name.replace(' ', '_').replace('/', '_')}-{i}"
                        if name == "copy":
                            results[name].append(timed(COPY, old, work, keep=i == 0))
                            shared[name] = shared.get(name) or count_files(work)
                        elif name == "git":
                            env = {**os.environ, "RV_WORK_DIR": str(work)}
                            results[name].append(timed(git_script, old, work, env, keep=i == 0))
                            shared[name] = shared.get(name) or count_files(work)
                        else:
                            run_dir = base / f"run-{i}"
                            run_dir.mkdir()
                            start, end = node_scripts(layout, sid, run_dir, nodes[name])
                            t0 = time.perf_counter()
                            subprocess.run(["bash", "-c", start], check=True)
                            results[name].append(time.perf_counter() - t0)
                            t0 = time.perf_counter()
                            subprocess.run(["bash", "-c", end], check=True)
                            ends[name].append(time.perf_counter() - t0)
                            shared[name] = count_files(run_dir)
                            shutil.rmtree(run_dir)
                load = os.getloadavg()[0]
                print(f"\n{files:,} files, {mb} MB; store on {where} ({fs_type(base)}); "
                      f"median of {args.repeat}, load now {load:.1f}")  # fmt: skip
                copy = statistics.median(results["copy"])
                for name in methods:
                    med = statistics.median(results[name])
                    extra = ""
                    if name in ends:
                        extra = f"  + end {statistics.median(ends[name]):.2f}s"
                    low, high = min(results[name]), max(results[name])
                    print(
                        f"  {name:<20} {med:>7.2f}s  {med / copy:>5.2f}x copy (spread {low:.2f}-{high:.2f} s)"
                        f"{extra}  shared files per run: {shared[name]:,}",
                        flush=True,
                    )
                for d in nodes.values():
                    shutil.rmtree(d, ignore_errors=True)
            finally:
                subprocess.run(["chmod", "-R", "u+w", str(base)], check=False)
                shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
