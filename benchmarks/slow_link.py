"""The sync over a slow link: rv's packs made for the link it measured, beside rsync, through a relay
that gives the loopback cluster's sshd the link of a laptop away from the cluster.

    scripts/testcluster up
    .venv/bin/python benchmarks/slow_link.py [--mbit 50] [--rtt-ms 30] [--files 2000] [--mb 40]
                                             [--rounds 3]

The relay (tests/integration/slowlink.py, on a thread of this process) passes the bytes of each
connection at --mbit each way and holds each chunk --rtt-ms / 2, with 128 kB of buffer each way (a
router's), so TCP and SSH windows push back as on a real link. It is not a real slow link: no loss,
no jitter, nobody else's traffic. It counts the bytes it carries, which are what each case put on the
link, SSH's own included.

One synthetic repo (benchmarks/sync.py's, by default 2,000 files, ~40 MB), all through the relay:

  first sync   `rv sync snapshot` into an empty store (an upload this large measures the link and
               keeps its rate: rv/files/link.py) and `rsync -az` into an empty folder
  1% edited    files // 100 text files edited (uncommitted), then in turns:
               rv           as it chooses for the rate it measured (below ~41 MB/s the edited files
                            go as deltas of the versions the cluster holds, below ~36 MB/s packed
                            at zlib level 1)
               rv whole     RV_PACK_COMPRESSION=0: the edited files whole and stored, what rv sends
                            on a fast link
               rsync -a, rsync -az

rv is the `rv` program beside this Python, as a user types it (command server, warm connection);
each rv case has a store and a cache folder of its own. Prints the medians, each case's ratio to
`rsync -az` (what a user on a slow link types), the bytes each put on the link, and the rate rv
measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from loopback import read_env, stop_warm  # benchmarks/, this script's folder
from sync import edit, make_repo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from slowlink import Relay, known_hosts_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mbit", type=float, default=50.0, help="the link's rate each way, Mbit/s")
    ap.add_argument("--rtt-ms", type=float, default=30.0, help="the link's round trip, ms")
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--mb", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3, help="edits timed per case")
    o = ap.parse_args()
    cluster = read_env(Path(os.environ.get("RV_TESTCLUSTER_DIR", "/tmp/rv-testcluster")) / "env")
    relay = Relay(int(cluster["RV_TESTCLUSTER_SSH_PORT"]), o.mbit * 1e6 / 8, o.rtt_ms / 2000)
    work = Path(tempfile.mkdtemp(prefix="rv-slow-link-"))
    repo = work / "repo"
    size, text_files = make_repo(repo, o.files, o.mb)
    user, key = cluster.get("RV_TESTCLUSTER_USER", "root"), cluster["RV_TESTCLUSTER_KEY"]
    known = known_hosts_for(relay.port, cluster["RV_TESTCLUSTER_KNOWN_HOSTS"], work / "known_hosts")
    base = f"{cluster['RV_TESTCLUSTER_REMOTE_ROOT']}/slow-link-{os.getpid()}"
    ssh = f"ssh -p {relay.port} -i {key} -o UserKnownHostsFile={known} -o BatchMode=yes"
    home = work / "home"
    home.mkdir()
    (work / "run").mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RV_", "XDG_"))}
    env.update(
        HOME=str(home), RV_CONFIG=str(home / "rv.toml"), NO_COLOR="1", RV_RUNTIME_DIR=str(work / "run")
    )
    script = Path(sys.executable).parent / "rv"
    rv = [str(script)] if script.exists() else [sys.executable, "-m", "rv"]
    envs: dict[str, dict[str, str]] = {}
    for name in ("rv", "rv whole"):
        profile = name.replace(" ", "-")
        init = subprocess.run(
            [*rv, "init", "--profile", profile, "--host", "127.0.0.1", "--port", str(relay.port),
             "--user", user, "--identity-file", key, "--known-hosts", str(known),
             "--remote-root", f"{base}/{profile}", "--yes"],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        if init.returncode != 0:
            raise SystemExit(f"rv init failed: {init.stderr}")
        envs[name] = dict(env, RV_PROFILE=profile, RV_CACHE_DIR=str(work / "cache" / profile))
    envs["rv whole"]["RV_PACK_COMPRESSION"] = "0"

    def rv_sync(name: str) -> Callable[[], None]:
        def go() -> None:
            r = subprocess.run(
                [*rv, "sync", "snapshot"], cwd=repo, env=envs[name], capture_output=True, text=True
            )
            if r.returncode != 0:
                raise SystemExit(f"{name}: rv sync snapshot failed: {r.stderr[-2000:]}")

        return go

    def rsync(*flags: str) -> Callable[[], None]:
        def go() -> None:
            subprocess.run(
                ["rsync", *flags, "--delete", "--exclude=.git", "-e", ssh, f"{repo}/",
                 f"{user}@127.0.0.1:{base}/rsync/"],
                check=True, capture_output=True,
            )  # fmt: skip

        return go

    def timed(fn: Callable[[], None]) -> tuple[float, int]:
        carried, start = relay.carried, time.perf_counter()
        fn()
        return time.perf_counter() - start, relay.carried - carried

    subprocess.run([*ssh.split(), f"{user}@127.0.0.1", f"mkdir -p {base}/rsync"], check=True)
    try:
        first = {
            "rv": timed(rv_sync("rv")),
            "rv whole": timed(rv_sync("rv whole")),
            "rsync -az": timed(rsync("-az")),
        }
        cases = {"rv": rv_sync("rv"), "rv whole": rv_sync("rv whole"), "rsync -a": rsync("-a"),
                 "rsync -az": rsync("-az")}  # fmt: skip
        edits: dict[str, list[tuple[float, int]]] = {name: [] for name in cases}
        rng = random.Random(7)
        n = max(1, o.files // 100)
        for i in range(o.rounds):
            edit(text_files, rng, n)
            order = list(cases)[i % len(cases) :] + list(cases)[: i % len(cases)]  # each case first in turn
            for name in order:
                edits[name].append(timed(cases[name]))
    finally:
        subprocess.run([*ssh.split(), f"{user}@127.0.0.1", f"chmod -R u+w {base}; rm -rf {base}"])
        stop_warm(work / "run", server=True)
    rates = {}
    for name in envs:
        for path in (work / "cache" / name.replace(" ", "-") / "links").glob("*"):
            rates[name] = float(json.loads(path.read_text())["bytes_per_s"])
    print(
        f"{o.files:,} files, {size / 1e6:.0f} MB; a relay of {o.mbit:g} Mbit/s each way and {o.rtt_ms:g} ms "
        f"round trip; {o.rounds} edits of {n} files; load average {os.getloadavg()[0]:.2f}"
    )
    for name, rate in rates.items():
        print(f"  {name}: rate measured {rate / 1e6:.2f} MB/s (the relay's {o.mbit / 8:.2f} MB/s)")
    print("first sync:")
    for name, (secs, sent) in first.items():
        print(f"  {name:10} {secs:7.2f} s  {sent / 1e6:8.2f} MB on the link")
    print(f"{n} files edited (median of {o.rounds}; ratio to rsync -az):")
    ref = statistics.median(t for t, _ in edits["rsync -az"])
    for name, samples in edits.items():
        secs = statistics.median(t for t, _ in samples)
        sent = statistics.median(b for _, b in samples)
        shown = " ".join(f"{t:.2f}" for t, _ in samples)
        print(
            f"  {name:10} {secs:7.2f} s ({shown})  {sent / 1e6:7.3f} MB on the link  "
            f"{secs / ref:5.2f}x rsync -az"
        )


if __name__ == "__main__":
    main()
