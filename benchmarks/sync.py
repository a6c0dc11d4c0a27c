"""Sync benchmark: rv snapshots side by side with `rsync -a` over ssh and `git archive | ssh tar -x`.

    scripts/testcluster up
    .venv/bin/python benchmarks/sync.py [--files 5000] [--mb 200] [--repeat 3]

One synthetic repo (default 5,000 files, ~200 MB: many small text files, some medium ones, a few
large incompressible binaries), against the loopback cluster, in four situations:

  (a) first sync            every method starts from an empty destination
  (b) resync, no change     the same tree again
  (c) one file changed      one text file edited (uncommitted)
  (d) 1% of files changed   50 files edited (uncommitted)

Methods:

  rsync      rsync -a --delete --exclude=.git -e ssh  (OpenSSH, a new connection per run)
  tar        git archive $(git stash create || echo HEAD) | ssh HOST 'tar -x -C DEST'  (all, every time)
  rv cli     `rv sync snapshot`: a whole rv process (Python start-up, imports, connect, snapshot)
  rv api     make_snapshot() on an open connection: what `rv run` pays inside its own process

Each figure is the median of --repeat runs. Targets (issue 3): (b) rv at most 0.5x rsync; (a) rv at
most 1.3x the tar stream; (c) rv sends only the changed file's bytes (object bytes are reported
apart from the manifest and framing). The page cache is warm for everyone: the repo was just written.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from rv.layout import RemoteLayout  # noqa: E402
from rv.snapshot import make_snapshot  # noqa: E402
from rv.transport import SSHTransport, resolve_target  # noqa: E402

WORDS = [
    "import", "torch", "model", "data", "loss", "step", "batch", "rank", "world", "size", "grad", "optimizer",
    "lr", "schedule", "warmup", "eval", "def", "return", "self", "config", "path", "tokens", "logits",
    "reward", "policy", "value", "advantage", "clip", "ratio", "kl", "beta",
]  # fmt: skip


def read_env(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.removeprefix("export ").strip()
        if "=" in line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k] = v.strip("'\"")
    return out


def text_blob(rng: random.Random, size: int) -> bytes:
    out = []
    n = 0
    while n < size:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + "\n"
        out.append(line)
        n += len(line)
    return "".join(out).encode()[:size]


def make_repo(path: Path, files: int, total_mb: int) -> tuple[int, list[Path]]:
    """~80% small text, ~18% medium text, ~2% large binary, scaled to about total_mb."""
    rng = random.Random(1234)
    path.mkdir(parents=True)
    n_large = max(1, files // 50)
    n_medium = files * 18 // 100
    n_small = files - n_large - n_medium
    budget = total_mb * 1_000_000
    small_sizes = [rng.randint(500, 8_000) for _ in range(n_small)]
    medium_sizes = [rng.randint(20_000, 120_000) for _ in range(n_medium)]
    large_each = max(1, (budget - sum(small_sizes) - sum(medium_sizes)) // n_large)
    written, text_files = 0, []
    for i, size in enumerate(small_sizes + medium_sizes):
        f = path / f"pkg{i % 40:02d}" / f"mod{i % 13}" / f"file{i:05d}.py"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(text_blob(rng, size))
        written += size
        text_files.append(f)
    for i in range(n_large):
        f = path / "assets" / f"blob{i:03d}.bin"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(os.urandom(large_each))
        written += large_each
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@example.org"]
    subprocess.run([*git, "init", "-q", "-b", "main"], cwd=path, check=True)
    subprocess.run([*git, "add", "-A"], cwd=path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "synthetic"], cwd=path, check=True)
    return written, text_files


class Bench:
    def __init__(self, env: dict[str, str], repo: Path, workdir: Path) -> None:
        self.env = env
        self.repo = repo
        self.workdir = workdir
        self.port = env["RV_TESTCLUSTER_SSH_PORT"]
        self.key = env["RV_TESTCLUSTER_KEY"]
        self.known = env["RV_TESTCLUSTER_KNOWN_HOSTS"]
        self.base = f"{env['RV_TESTCLUSTER_REMOTE_ROOT']}/bench-{os.getpid()}"
        # The cluster's ordinary user (an older testcluster had none: root).
        self.user = env.get("RV_TESTCLUSTER_USER", "root")
        self.ssh = [
            "ssh", "-p", self.port, "-i", self.key, "-o", f"UserKnownHostsFile={self.known}",
            "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", f"{self.user}@127.0.0.1",
        ]  # fmt: skip
        target = resolve_target(
            "127.0.0.1", port=int(self.port), user=self.user, identity_file=self.key, known_hosts=self.known,
            ssh_config_path="/nonexistent",
        )  # fmt: skip
        self.transport = SSHTransport(target).connect()
        self.rv_env = self._rv_config()
        self.generation = 0
        self.last_api = None

    def _rv_config(self) -> dict[str, str]:
        home = self.workdir / "home"
        home.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RV_")}
        env.update(HOME=str(home), RV_CONFIG=str(home / "rv.toml"), NO_COLOR="1")
        init = subprocess.run(
            [
                sys.executable, "-m", "rv", "init", "--profile", "bench", "--host", "127.0.0.1",
                "--port", self.port, "--user", self.user, "--identity-file", self.key,
                "--known-hosts", self.known, "--remote-root", f"{self.base}/rv-cli", "--yes",
            ],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        if init.returncode != 0:
            raise SystemExit(f"rv init failed: {init.stderr}")
        return env

    def remote(self, command: str) -> None:
        self.transport.run(command).check(command[:60])

    def fresh(self) -> None:
        """Empty every destination (for a first-sync measurement)."""
        self.generation += 1
        q = shlex.quote(self.base)
        self.remote(f"if [ -d {q} ]; then chmod -R u+w {q} && rm -rf {q}; fi; mkdir -p {q}/tar {q}/rsync")
        shutil.rmtree(Path(self.rv_env["HOME"]) / "cache", ignore_errors=True)
        shutil.rmtree(self.workdir / "api-cache", ignore_errors=True)

    def rsync(self) -> None:
        ssh = " ".join(shlex.quote(a) for a in self.ssh[:-1])
        subprocess.run(
            [
                "rsync",
                "-a",
                "--delete",
                "--exclude=.git",
                "-e",
                ssh,
                f"{self.repo}/",
                f"{self.user}@127.0.0.1:{self.base}/rsync/",
            ],
            check=True,
        )

    def tar(self) -> None:
        ref = subprocess.run(
            ["git", "stash", "create"], cwd=self.repo, capture_output=True, text=True, check=True
        )
        tree = ref.stdout.strip() or "HEAD"
        archive = subprocess.Popen(
            ["git", "archive", "--format=tar", tree], cwd=self.repo, stdout=subprocess.PIPE
        )
        subprocess.run(
            [*self.ssh, f"tar -x -C {shlex.quote(self.base + '/tar')}"], stdin=archive.stdout, check=True
        )
        archive.stdout.close()
        if archive.wait() != 0:
            raise SystemExit("git archive failed")

    def rv_cli(self) -> None:
        r = subprocess.run(
            [sys.executable, "-m", "rv", "sync", "snapshot"],
            cwd=self.repo,
            env=self.rv_env,
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise SystemExit(f"rv sync snapshot failed: {r.stderr}")

    def rv_api(self) -> None:
        self.last_api = make_snapshot(
            self.transport,
            RemoteLayout(f"{self.base}/rv-api"),
            self.repo,
            cache_dir=self.workdir / "api-cache",
        )


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def edit(files: list[Path], rng: random.Random, n: int) -> int:
    changed = 0
    for f in rng.sample(files, n):
        with open(f, "ab") as fh:
            line = f"# edited {rng.random()}\n".encode()
            fh.write(line)
        changed += f.stat().st_size
    return changed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=5000)
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--cluster-env", default=os.environ.get("RV_TESTCLUSTER_DIR", "/tmp/rv-testcluster") + "/env"
    )
    args = ap.parse_args()
    env_file = Path(args.cluster_env)
    if not env_file.exists():
        raise SystemExit(f"{env_file} missing: run scripts/testcluster up")
    env = read_env(env_file)
    for tool in ("rsync", "ssh", "git"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed")

    with tempfile.TemporaryDirectory(prefix="rv-bench-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        size, text_files = make_repo(work / "repo", args.files, args.mb)
        print(
            f"repo: {args.files:,} files, {size / 1e6:.0f} MB ({time.perf_counter() - t0:.1f} s to make)",
            flush=True,
        )
        bench = Bench(env, work / "repo", work)
        methods = {"rsync": bench.rsync, "tar": bench.tar, "rv cli": bench.rv_cli, "rv api": bench.rv_api}
        results: dict[str, dict[str, list[float]]] = {p: {m: [] for m in methods} for p in "abcd"}
        sent: dict[str, list[tuple[int, int, int]]] = {"c": [], "d": []}
        rng = random.Random(99)
        try:
            for rep in range(args.repeat):
                bench.fresh()
                for name, fn in methods.items():
                    results["a"][name].append(timed(fn))
                for _ in range(3):  # (b) is short: more samples
                    for name, fn in methods.items():
                        results["b"][name].append(timed(fn))
                for phase, n in (("c", 1), ("d", max(1, args.files // 100))):
                    changed_bytes = edit(text_files, rng, n)
                    for name, fn in methods.items():
                        results[phase][name].append(timed(fn))
                    api = bench.last_api
                    sent[phase].append((changed_bytes, api.new_bytes, api.sent_bytes))
                print(f"  round {rep + 1}/{args.repeat} done", flush=True)
        finally:
            bench.remote(f"chmod -R u+w {shlex.quote(bench.base)} && rm -rf {shlex.quote(bench.base)}")
            bench.transport.close()

    med = {p: {m: statistics.median(v) for m, v in r.items()} for p, r in results.items()}
    titles = {
        "a": "(a) first sync",
        "b": "(b) resync, nothing changed",
        "c": "(c) one file changed",
        "d": f"(d) 1% changed ({max(1, args.files // 100)} files)",
    }
    print(f"\nmedian seconds ({args.repeat} rounds; (b) {3 * args.repeat} samples)\n")
    print(f"{'':32}{'rsync':>9}{'tar':>9}{'rv cli':>9}{'rv api':>9}   rv api/rsync  rv api/tar  rv cli/rsync")
    for p in "abcd":
        m = med[p]
        api_rsync, api_tar, cli_rsync = (
            m["rv api"] / m["rsync"],
            m["rv api"] / m["tar"],
            m["rv cli"] / m["rsync"],
        )
        ratios = f"{api_rsync:12.2f}  {api_tar:10.2f}  {cli_rsync:12.2f}"
        print(
            f"{titles[p]:32}{m['rsync']:9.3f}{m['tar']:9.3f}{m['rv cli']:9.3f}{m['rv api']:9.3f}   {ratios}"
        )
    for phase in "cd":
        changed, objects, wire = sent[phase][-1]
        print(
            f"{titles[phase]}: changed files hold {changed:,} B; "
            f"rv sent {objects:,} B of objects, {wire:,} B in all"
        )
    print("\ntargets:")
    b = med["b"]["rv api"] / med["b"]["rsync"]
    a = med["a"]["rv api"] / med["a"]["tar"]
    c_changed, c_objects, _ = sent["c"][-1]
    print(f"  (b) rv api <= 0.5x rsync: {b:.2f}x  {'met' if b <= 0.5 else 'NOT met'}")
    cli = med["b"]["rv cli"] / med["b"]["rsync"]
    print(f"  (b) rv cli <= 0.5x rsync: {cli:.2f}x (a whole rv process, for reference)")
    print(f"  (a) rv api <= 1.3x tar:   {a:.2f}x  {'met' if a <= 1.3 else 'NOT met'}")
    print(f"  (c) only that file's bytes: {c_objects:,} B of objects for a {c_changed:,} B file  "
          f"{'met' if c_objects == c_changed else 'NOT met'}")  # fmt: skip


if __name__ == "__main__":
    main()
