"""Sync benchmark: rv snapshots side by side with `rsync -a` over ssh and `git archive | ssh tar -x`.

    scripts/testcluster up
    .venv/bin/python benchmarks/sync.py [--files 5000] [--mb 200] [--rounds 10] [--first-rounds 3]
                                        [--repo-dir DIR] [--json OUT]

One synthetic repo (default 5,000 files, ~200 MB: many small text files, some medium ones, a few
large incompressible binaries), against the loopback cluster, in four situations:

  (a) first sync            every method starts from an empty destination (and rv from empty caches)
  (b) resync, no change     the same tree again
  (c) one file changed      one text file edited (uncommitted)
  (d) 1% of files changed   files // 100 files edited (uncommitted)
  (e) 1% right after (a)    the same, timed right after each round of (a), before any other sync:
                            what the first edit pays for caches a first sync could leave warm

Methods, interleaved within each round so that load on this shared machine hits them alike:

  rsync      rsync -a --delete --exclude=.git -e ssh  (OpenSSH, a new connection per run)
  tar        git archive $(git stash create || echo HEAD) | ssh HOST 'tar -x -C DEST'  (all, every
             time; timed in (a) only, unless --tar-everywhere)
  rv warm    `rv sync snapshot` as a user types it: the whole `rv` program (its front end, the
             command server's fork, listing, the round trips), with the command server and the warm
             connection of an earlier command
  rv cold    the same with RV_WARM_SECONDS=0: in-process (Python start-up, every import) and a fresh
             SSH connection inside the process
  rv dry     `rv run --dry-run -g 1 -t a6000 -- python train.py`: the whole local half of a
             resubmit (listing, id, script), no network
  rv api     make_snapshot() on an open connection: what `rv run` pays inside its own process

Before each method of (a) the page cache's dirty data is written back (``sync``, untimed; the loopback
disk writes tens of MB/s, and what one method left to write slowed the next one's writes), and a
round's destinations are moved aside, not deleted, until the end (see Bench.fresh).

Each rv method has its own remote root and its own local cache folder (RV_CACHE_DIR), so each sees
the edit of a round for the first time, as a user would. Printed per situation: the median and the
spread (min-max) of wall seconds, and the ratios to rsync (and to tar for (a)) as the median of the
per-round ratios with their min-max. Targets (issue 35): (a) every rv method <= 0.8x the tar
stream, and files created on the cluster by a first sync <= 1% of the repo's; (b), (c) rv warm
<= 0.35x rsync, (d) <= 0.5x; (c) and (d) rv sends the changed files' bytes plus framing (blob bytes
are reported apart from the packs' framing, the trees, the provenance and the frames). The page cache
is warm for everyone: the repo was just written or read.

``--code DIR`` measures the rv of another checkout (say main, as a git worktree) with this same
benchmark: its `rv` program and its make_snapshot, through PYTHONPATH. ``--compare DIR`` adds that
checkout's whole `rv sync snapshot` ("main warm", its own command server and connection) to every
round, interleaved with the others, so a change is measured against main under the same load. A
connection the loopback cluster drops under the rv api (other tests share the machine) is opened
again and that sample taken again; the count is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from loopback import read_env, stop_warm

REPO_ROOT = Path(__file__).resolve().parents[1]
# --code DIR: the rv to measure comes from DIR (read before anything of rv is imported).
CODE = Path(sys.argv[sys.argv.index("--code") + 1]).resolve() if "--code" in sys.argv[:-1] else REPO_ROOT
sys.path.insert(0, str(CODE))

from rv.errors import ConnectError  # noqa: E402
from rv.files.snapshot import make_snapshot  # noqa: E402
from rv.layout import RemoteLayout  # noqa: E402
from rv.remote.ssh import SSHTransport  # noqa: E402
from rv.remote.sshconfig import resolve_target  # noqa: E402

WORDS = [
    "import", "torch", "model", "data", "loss", "step", "batch", "rank", "world", "size", "grad", "optimizer",
    "lr", "schedule", "warmup", "eval", "def", "return", "self", "config", "path", "tokens", "logits",
    "reward", "policy", "value", "advantage", "clip", "ratio", "kl", "beta",
]  # fmt: skip
REPO_FORMAT = 2  # bump when make_repo changes, so a kept --repo-dir is rebuilt


class TextMaker:
    """Text files made of a few thousand random code-like lines: fast to write, as compressible as code."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.lines = [
            (" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + "\n").encode()
            for _ in range(4096)
        ]

    def blob(self, size: int) -> bytes:
        out = bytearray()
        while len(out) < size:
            out += b"".join(self.rng.choices(self.lines, k=64))
        return bytes(out[:size])


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
    text = TextMaker(rng)
    written, text_files = 0, []
    for i, size in enumerate(small_sizes + medium_sizes):
        f = path / f"pkg{i % 40:02d}" / f"mod{i % 13}" / f"file{i:05d}.py"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(text.blob(size))
        written += size
        text_files.append(f)
    for i in range(n_large):
        f = path / "assets" / f"blob{i:03d}.bin"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(rng.randbytes(large_each))
        written += large_each
    (path / "train.py").write_text("print('train')\n")
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@example.org"]
    subprocess.run([*git, "init", "-q", "-b", "main"], cwd=path, check=True)
    subprocess.run([*git, "add", "-A"], cwd=path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "synthetic"], cwd=path, check=True)
    return written, text_files


def prepared_repo(repo_dir: Path | None, work: Path, files: int, mb: int) -> tuple[Path, int, list[Path]]:
    """The synthetic repo: made afresh, or reused from --repo-dir (reset to its commit) when it matches."""
    if repo_dir is None:
        size, text_files = make_repo(work / "repo", files, mb)
        return work / "repo", size, text_files
    repo = repo_dir / f"repo-{files}-{mb}"
    stamp = repo / ".git" / "rv-bench"
    want = f"{REPO_FORMAT} {files} {mb}"
    if stamp.exists() and stamp.read_text().split(" ", 3)[:3] == want.split():
        subprocess.run(["git", "reset", "-q", "--hard"], cwd=repo, check=True)
        subprocess.run(["git", "clean", "-q", "-fdx"], cwd=repo, check=True)
        size = int(stamp.read_text().split()[3])
        text_files = sorted(p for p in repo.glob("pkg*/mod*/file*.py"))
        return repo, size, text_files
    shutil.rmtree(repo, ignore_errors=True)
    size, text_files = make_repo(repo, files, mb)
    stamp.write_text(f"{want} {size}")
    return repo, size, text_files


class Bench:
    RV_METHODS = ("rv warm", "rv cold", "rv dry")

    def __init__(self, env: dict[str, str], repo: Path, workdir: Path, compare: Path | None = None) -> None:
        self.env = env
        self.compare = compare
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
        self.target = resolve_target(
            "127.0.0.1", port=int(self.port), user=self.user, identity_file=self.key, known_hosts=self.known,
            ssh_config_path="/nonexistent",
        )  # fmt: skip
        self.transport = SSHTransport(self.target).connect()
        self.reconnects = 0
        self.rounds_aside = 0
        self.runtime = workdir / "run"
        self.runtime.mkdir(mode=0o700)
        self.rv_envs = self._rv_config()
        self.last_api = None
        # What a user types: the console script next to this interpreter, else `python -m rv`.
        script = Path(sys.executable).parent / "rv"
        self.rv = [str(script)] if script.exists() else [sys.executable, "-m", "rv"]

    def _rv_config(self) -> dict[str, dict[str, str]]:
        home = self.workdir / "home"
        home.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RV_", "XDG_"))}
        env.update(
            HOME=str(home), RV_CONFIG=str(home / "rv.toml"), NO_COLOR="1", RV_RUNTIME_DIR=str(self.runtime)
        )
        if CODE != REPO_ROOT:
            env["PYTHONPATH"] = str(CODE)
        envs = {}
        for method in (*self.RV_METHODS, *(("main warm",) if self.compare else ())):
            name = method.replace(" ", "-")
            if method == "main warm":
                # The other checkout's rv, with a command server and warm connection of its own.
                (self.workdir / "run-main").mkdir(mode=0o700)
                env = dict(env, PYTHONPATH=str(self.compare), RV_RUNTIME_DIR=str(self.workdir / "run-main"))
            init = subprocess.run(
                [
                    sys.executable, "-m", "rv", "init", "--profile", name, "--host", "127.0.0.1",
                    "--port", self.port, "--user", self.user, "--identity-file", self.key,
                    "--known-hosts", self.known, "--remote-root", f"{self.base}/{name}", "--yes",
                ],
                env=env, capture_output=True, text=True,
            )  # fmt: skip
            if init.returncode != 0:
                raise SystemExit(f"rv init failed: {init.stderr}")
            envs[method] = dict(env, RV_PROFILE=name, RV_CACHE_DIR=str(self.workdir / "cache" / name))
        envs["rv cold"]["RV_WARM_SECONDS"] = "0"
        return envs

    def remote(self, command: str) -> None:
        try:
            self.transport.run(command).check(command[:60])
        except ConnectError:
            self.reconnects += 1
            self.transport.close()
            self.transport = SSHTransport(self.target).connect()
            self.transport.run(command).check(command[:60])

    def files_created(self) -> dict[str, int]:
        """Files (and symlinks) under each method's destination (loopback: the cluster's disk is here)."""
        out = {}
        folders = {
            "rsync": "rsync",
            "tar": "tar",
            "rv warm": "rv-warm",
            "rv cold": "rv-cold",
            "rv api": "rv-api",
        }
        for name, folder in folders.items():
            path = Path(self.base) / folder
            if path.exists():
                out[name] = sum(len(files) for _d, _dirs, files in os.walk(path))
        return out

    def fresh(self) -> None:
        """Empty every destination and every rv cache (for a first-sync measurement).

        The destinations of the last round are moved aside, not deleted, until the end: right after
        deleting tens of thousands of files, ext4 spends most of each file creation skipping the
        recently freed inodes (``recently_deleted`` in perf; one creation took 0.3 ms instead of
        0.03 ms on this machine), which then measured the allocator more than the methods.
        """
        q, aside = shlex.quote(self.base), shlex.quote(f"{self.base}.aside")
        self.rounds_aside += 1
        self.remote(
            f"mkdir -p {aside} && if [ -d {q} ]; then mv {q} {aside}/{self.rounds_aside}; fi; "
            f"mkdir -p {q}/tar {q}/rsync"
        )
        shutil.rmtree(self.workdir / "cache", ignore_errors=True)
        shutil.rmtree(self.workdir / "api-cache", ignore_errors=True)

    def rsync(self) -> None:
        ssh = " ".join(shlex.quote(a) for a in self.ssh[:-1])
        subprocess.run(
            ["rsync", "-a", "--delete", "--exclude=.git", "-e", ssh, f"{self.repo}/",
             f"{self.user}@127.0.0.1:{self.base}/rsync/"],
            check=True,
        )  # fmt: skip

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

    def _rv(self, method: str, args: list[str]) -> None:
        r = subprocess.run(
            [*self.rv, *args], cwd=self.repo, env=self.rv_envs[method], capture_output=True, text=True
        )
        if r.returncode != 0:
            raise SystemExit(f"{method}: rv {' '.join(args)} failed: {r.stderr}")

    def rv_warm(self) -> None:
        self._rv("rv warm", ["sync", "snapshot"])

    def rv_cold(self) -> None:
        self._rv("rv cold", ["sync", "snapshot"])

    def main_warm(self) -> None:
        self._rv("main warm", ["sync", "snapshot"])

    def rv_dry(self) -> None:
        self._rv("rv dry", ["run", "--dry-run", "-g", "1", "-t", "a6000", "--", "python", "train.py"])

    def rv_api(self) -> None:
        try:
            self._rv_api()
        except ConnectError:
            # The loopback cluster is shared with other tests, which may cut connections: take the
            # sample again on a new one (the store is whole: an upload never leaves half an object).
            self.reconnects += 1
            self.transport.close()
            self.transport = SSHTransport(self.target).connect()
            self._rv_api()

    def _rv_api(self) -> None:
        self.last_api = make_snapshot(
            self.transport,
            RemoteLayout(f"{self.base}/rv-api"),
            self.repo,
            cache_dir=self.workdir / "api-cache",
        )

    def close(self) -> None:
        stop_warm(self.runtime, server=True)
        if self.compare:
            stop_warm(self.workdir / "run-main", server=True)
        for folder in (self.base, f"{self.base}.aside"):
            q = shlex.quote(folder)
            self.remote(f"if [ -d {q} ]; then chmod -R u+w {q} && rm -rf {q}; fi")
        self.transport.close()


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def edit(files: list[Path], rng: random.Random, n: int) -> int:
    changed = 0
    for f in rng.sample(files, n):
        with open(f, "ab") as fh:
            fh.write(f"# edited {rng.random()}\n".encode())
        changed += f.stat().st_size
    return changed


def spread(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=5000)
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=10, help="samples of (b), (c) and (d) per method")
    ap.add_argument("--first-rounds", type=int, default=3, help="samples of (a) per method")
    ap.add_argument("--phases", default="abcde", help="which situations to measure (default abcde)")
    ap.add_argument("--tar-everywhere", action="store_true", help="time the tar stream in (b)-(d) too")
    ap.add_argument("--no-flush", action="store_true", help="(a), (e): no sync before each method")
    ap.add_argument("--repo-dir", type=Path, help="keep the synthetic repo here and reuse it next time")
    ap.add_argument("--json", type=Path, help="also write every sample to this file")
    ap.add_argument("--code", type=Path, help="measure the rv of this checkout instead (see above)")
    ap.add_argument(
        "--compare", type=Path, help="also time `rv sync snapshot` of this checkout (say main), interleaved"
    )
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
    # An installed rv has its bytecode compiled (pip does it); compile once so no run pays for it.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(CODE / "rv")], check=True)
    print(f"rv from {CODE}", flush=True)

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rv-bench-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        repo, size, text_files = prepared_repo(args.repo_dir, work, args.files, args.mb)
        n_files = int(
            subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True).stdout.count("\n")
        )
        print(
            f"repo: {n_files:,} files, {size / 1e6:.0f} MB ({time.perf_counter() - t0:.1f} s to prepare)",
            flush=True,
        )
        bench = Bench(env, repo, work, args.compare.resolve() if args.compare else None)
        methods = {
            "rsync": bench.rsync, "tar": bench.tar, "rv warm": bench.rv_warm, "rv cold": bench.rv_cold,
            "rv dry": bench.rv_dry, "rv api": bench.rv_api,
        }  # fmt: skip
        if args.compare:
            methods["main warm"] = bench.main_warm
        n_changed = max(1, args.files // 100)
        phases = [p for p in "abcde" if p in args.phases]
        if "e" in phases and "a" not in phases:
            raise SystemExit("(e) is timed right after (a): --phases needs a too")
        results: dict[str, dict[str, list[float]]] = {p: {} for p in phases}
        sent: dict[str, list[tuple[int, int, int]]] = {"c": [], "d": [], "e": []}
        created: list[dict[str, int]] = []
        rng = random.Random(99)

        turn = [0]

        def one_round(phase: str) -> None:
            order = list(methods)
            turn[0] += 1
            if args.compare and turn[0] % 2 == 0:
                # Every other round main goes just before rv warm instead of last: a method's place
                # in the round (after rsync's connection, after a big delete) weighs on it.
                order.remove("main warm")
                order.insert(order.index("rv warm"), "main warm")
            for name in order:
                fn = methods[name]
                if name == "tar" and phase != "a" and not args.tar_everywhere:
                    continue
                if phase in "ae" and not args.no_flush:
                    # The last method's hundreds of MB still being written back would slow this
                    # one's writes (the loopback disk writes at tens of MB/s): start every first
                    # sync, and every edit right after one, with nothing dirty, untimed.
                    subprocess.run(["sync"], check=True)
                results[phase].setdefault(name, []).append(timed(fn))

        failure = None
        try:
            bench.fresh()
            bench.rv_warm()  # starts the warm connection; its store is emptied again below
            if "a" in phases:
                for rep in range(args.first_rounds):
                    bench.fresh()
                    one_round("a")
                    created.append(bench.files_created())
                    if "e" in phases:
                        changed_bytes = edit(text_files, rng, n_changed)
                        one_round("e")
                        api = bench.last_api
                        sent["e"].append((changed_bytes, api.new_bytes, api.sent_bytes))
                    print(f"  (a) round {rep + 1}/{args.first_rounds} done", flush=True)
            else:
                bench.fresh()
                for fn in methods.values():
                    fn()  # every destination holds the tree before (b)-(d)
            for rep in range(args.rounds):
                for phase in (p for p in phases if p != "e"):
                    if phase == "b":
                        one_round("b")
                    elif phase in "cd":
                        changed_bytes = edit(text_files, rng, 1 if phase == "c" else n_changed)
                        one_round(phase)
                        api = bench.last_api
                        sent[phase].append((changed_bytes, api.new_bytes, api.sent_bytes))
                print(f"  round {rep + 1}/{args.rounds} done, load {os.getloadavg()[0]:.2f}", flush=True)
        except (Exception, SystemExit) as exc:  # its traceback is printed below, with what was measured
            failure = exc
        finally:
            bench.close()
            if args.repo_dir is not None:
                subprocess.run(["git", "reset", "-q", "--hard"], cwd=repo, check=True)
    load_after = os.getloadavg()
    if failure is not None:
        traceback.print_exception(failure)
        print(f"\nSTOPPED EARLY: {type(failure).__name__}: {failure}; what was measured before:")
    # A stop mid-round leaves that round's samples incomplete: only whole rounds are compared.
    for rows in results.values():
        n = min((len(v) for v in rows.values()), default=0)
        for name in rows:
            del rows[name][n:]

    titles = {
        "a": "(a) first sync",
        "b": "(b) resync, nothing changed",
        "c": "(c) one file changed",
        "d": f"(d) 1% changed ({n_changed} files)",
        "e": f"(e) 1% changed right after (a) ({n_changed} files)",
    }
    print(
        f"\n{n_files:,} files, {size / 1e6:.0f} MB; {args.first_rounds} rounds of (a), "
        f"{args.rounds} of the rest; "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; rv from {CODE}"
        + (f"; the rv api's connection opened again {bench.reconnects} time(s)" if bench.reconnects else "")
    )
    print("median seconds (min-max); ratios: median of per-round ratios (min-max)\n")
    report: dict[str, object] = {
        "files": n_files, "bytes": size, "load": [load_before[0], load_after[0]], "phases": {},
    }  # fmt: skip
    for p in phases:
        print(titles[p])
        rows = results[p]
        ref = "tar" if p == "a" else "rsync"
        for name, values in rows.items():
            line = f"  {name:9} {statistics.median(values):8.3f} s  ({spread(values)})"
            for yard in ("rsync", *(("tar",) if p == "a" else ())):
                if name != yard and yard in rows:
                    r = [v / w for v, w in zip(values, rows[yard], strict=True)]
                    line += f"   {statistics.median(r):5.2f}x {yard} ({min(r):.2f}-{max(r):.2f})"
            print(line)
        report["phases"][p] = {"title": titles[p], "reference": ref, "samples": rows}  # type: ignore[index]
    for phase in "cde":
        if phase in phases and sent[phase]:
            changed, objects, wire = sent[phase][-1]
            n = 1 if phase == "c" else n_changed
            head = (
                f"{titles[phase]} (rv api, last round): the changed files hold {changed:,} B; rv sent "
                f"{objects:,} B of new objects as {wire:,} B in all: "
            )
            if wire >= objects:
                extra = wire - objects
                tail = f"{extra:,} B of trees, provenance and framing ({extra / n:,.0f} B per changed file)"
            else:  # a thin pack: the edits went as deltas against the files' earlier versions
                share = wire / max(objects, 1)
                tail = f"deltas against the files' earlier versions, {share:.0%} of their bytes"
            print(head + tail)
        report.setdefault("sent", {})[phase] = sent[phase]  # type: ignore[index]

    def ratio(phase: str, name: str, yard: str) -> float:
        r = [v / w for v, w in zip(results[phase][name], results[phase][yard], strict=True)]
        return statistics.median(r)

    def verdict(got: float, limit: float) -> str:
        return f"{got:.2f}x  {'met' if got <= limit else 'NOT met'}"

    if created:
        print(f"\n(a) files created on the cluster by a first sync (of a {n_files:,}-file repo), last round:")
        for name, n in created[-1].items():
            print(f"  {name:<10} {n:>8,}  ({100 * n / n_files:.2f}% of the repo's files)")
        report["files_created"] = created
    print("\ntargets (issue 35):")
    if "a" in phases and results["a"].get("tar"):
        for name in ("rv warm", "rv cold", "rv api"):
            print(f"  (a) {name} <= 0.8x tar: {verdict(ratio('a', name, 'tar'), 0.8)}")
    if created:
        rv_files = max(n for name, n in created[-1].items() if name.startswith("rv"))
        share = rv_files / n_files * 100
        met = "met" if share <= 1.0 else "NOT met"
        print(f"  (a) files created <= 1% of the repo's: {share:.2f}%  {met}")
    for p, limit in (("b", 0.35), ("c", 0.35), ("d", 0.5), ("e", 0.5)):
        if p in phases and results[p].get("rsync"):
            print(f"  {titles[p]}: rv warm <= {limit}x rsync: {verdict(ratio(p, 'rv warm', 'rsync'), limit)}")
    for phase in "cde":
        if phase in phases and sent[phase]:
            changed, objects, _ = sent[phase][-1]
            print(
                f"  {titles[phase]}: the changed files' bytes and no more: {objects:,} B of objects for "
                f"{changed:,} B of changed files  {'met' if objects == changed else 'NOT met'}"
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if failure is not None:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
