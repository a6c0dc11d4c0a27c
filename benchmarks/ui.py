"""`rv ui`'s runs page with 200 runs listed: how long until a browser shows them, beside `rv ps -a`.

    scripts/testcluster up
    .venv/bin/python benchmarks/ui.py [--runs 200] [--rounds 5]

On the default loopback layout, as the cluster user. The remote root holds ``--runs`` ended runs, each
written in the records' own format (run.json, seg/1.job, seg/1.json, ENDED: what a job leaves) straight
into the cluster's filesystem, which on loopback is this machine: submitting 200 real jobs on two
shared cores would measure Slurm, not the page. Everything after that is real: `rv ui` as installed,
its agent call over SSH (the warm connection, as by default), Debian's headless chromium.

Measured, each a median of --rounds (the first round apart: it opens the connection):
  page            a fresh load of the page's URL until its table holds every run (the browser's
                  clock from the start of the navigation: performance.now())
  /api/runs       the page's one request for a cluster's runs, alone (urllib)
  rv ps -a        the command a user would type instead, a process each time (--json, and the table)
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from loopback import read_env, stop_warm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rv.agent.segment import ended_record, segment_record  # noqa: E402
from rv.config import Config, Profile, save_config  # noqa: E402
from tests.integration.browser import chromium  # noqa: E402

RV = Path(sys.executable).parent / "rv"
# Waits in the page until its table holds ``n`` rows, then answers the page's clock (ms since the
# navigation began).
UNTIL_ROWS = """
const [n, done] = arguments;
const look = () => document.querySelectorAll('#runs-body tr').length >= n
    ? done(performance.now()) : requestAnimationFrame(look);
look();
"""


def write_runs(root: Path, count: int, user: str) -> None:
    """``count`` ended runs of the last hours, in the cluster's record format, owned by ``user``."""
    now = time.time()
    for i in range(count):
        run_id = f"bench{i:04d}"
        rdir = root / "runs" / run_id
        (rdir / "seg").mkdir(parents=True)
        start, end = now - 3600 - 60 * i, now - 3000 - 60 * i
        meta = {
            "project": "bench", "name": f"run-{i:03d}", "run_id": run_id, "created": start - 5,
            "max_segments": 10, "gpus": 1, "gpu_type": "a6000", "nodes": 1, "command": ["python", "train.py"],
        }  # fmt: skip
        (rdir / "run.json").write_text(json.dumps(meta))
        job = str(9_000_000 + i)
        (rdir / "seg" / "1.job").write_text(job + "\n")
        record = segment_record(1, job, "ended", "finished", int(end), 0, start=int(start), nodes="node1")
        (rdir / "seg" / "1.json").write_text(json.dumps(record))
        (rdir / "ENDED").write_text(json.dumps(ended_record("finished", 0, 1, int(end))))
    uid, gid = pwd.getpwnam(user).pw_uid, pwd.getpwnam(user).pw_gid
    for folder, dirs, files in os.walk(root):
        for name in [folder, *(os.path.join(folder, n) for n in dirs + files)]:
            os.chown(name, uid, gid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tc = read_env(Path(os.environ.get("RV_TESTCLUSTER_DIR", "/tmp/rv-testcluster")) / "env")
    user = tc["RV_TESTCLUSTER_USER"]
    work = Path(tempfile.mkdtemp(prefix="rv-bench-ui-"))
    root = Path(tc["RV_TESTCLUSTER_REMOTE_ROOT"]) / f"bench-ui-{os.getpid()}"
    root.mkdir()
    write_runs(root, args.runs, user)
    profile = Profile(
        name=tc["RV_TESTCLUSTER_PROFILE"], host="127.0.0.1", port=int(tc["RV_TESTCLUSTER_SSH_PORT"]),
        user=user, identity_file=tc["RV_TESTCLUSTER_KEY"], known_hosts=tc["RV_TESTCLUSTER_KNOWN_HOSTS"],
        remote_root=str(root),
    )  # fmt: skip
    config = Config(path=work / "rv.toml", default=profile.name, profiles={profile.name: profile})
    save_config(config)
    runtime = work / "rt"
    runtime.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RV_", "XDG_"))}
    env.update(HOME=str(work), RV_CONFIG=str(config.path), RV_RUNTIME_DIR=str(runtime), NO_COLOR="1")
    ui = subprocess.Popen(
        [str(RV), "ui", "--no-browser"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        url = ui.stdout.readline().strip()
        if not re.match(r"http://127\.0\.0\.1:\d+/\?token=", url):
            raise SystemExit(
                f"rv ui did not start: {url!r} {ui.stderr.read() if ui.poll() is not None else ''}"
            )
        base, token = url.split("/?token=")
        api = f"{base}/api/runs?profile={profile.name}"

        def ask_api() -> float:
            start = time.perf_counter()
            with urllib.request.urlopen(urllib.request.Request(api, headers={"X-RV-Token": token})) as r:
                rows = json.loads(r.read())["rows"]
            took = time.perf_counter() - start
            assert sum(1 for row in rows if row["run_id"]) == args.runs, len(rows)
            return took

        page: list[float] = []
        with chromium() as browser:
            for _ in range(args.rounds + 1):
                browser.get("about:blank")
                browser.get(url)
                page.append(browser.execute_async_script(UNTIL_ROWS, args.runs) / 1000)
        api_walls = [ask_api() for _ in range(args.rounds)]

        def ps(*extra: str) -> float:
            start = time.perf_counter()
            r = subprocess.run(
                [str(RV), "ps", "-a", *extra], env=env, capture_output=True, text=True, timeout=120
            )
            took = time.perf_counter() - start
            if r.returncode != 0:
                raise SystemExit(f"rv ps failed: {r.stderr}")
            return took

        ps("--json")  # the command server and the warm connection up, as for a user's second command
        ps_json = [ps("--json") for _ in range(args.rounds)]
        ps_table = [ps() for _ in range(args.rounds)]
    finally:
        ui.send_signal(signal.SIGINT)
        ui.wait(timeout=30)
        stop_warm(runtime, server=True)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    def row(label: str, walls: list[float], base: float) -> str:
        med = statistics.median(walls)
        return f"{label:<34} {med:8.3f} {min(walls):8.3f} {max(walls):8.3f} {med / base:8.2f}x"

    warm = statistics.median(page[1:])
    print(f"\n{args.runs} runs on the default loopback layout (medians of {args.rounds}; seconds):")
    print(f"{'':<34} {'median':>8} {'min':>8} {'max':>8} {'vs page':>9}")
    print(row("rv ui: page load, all rows shown", page[1:], warm))
    print(f"{'  (first load: a new connection)':<34} {page[0]:8.3f}")
    print(row("rv ui: /api/runs alone", api_walls, warm))
    print(row("rv ps -a --json", ps_json, warm))
    print(row("rv ps -a (the table)", ps_table, warm))


if __name__ == "__main__":
    main()
