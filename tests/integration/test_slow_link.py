"""The sync over a slow link, through the `rv` program on both layouts: a relay (slowlink.py) gives
the loopback sshd the link of a laptop away from the cluster, and rv must find it slow by measuring
it. A first sync then goes deflated once its first packs have measured the link; an edit as deltas
of the versions the cluster holds. Every byte counted on the relay; the store checked by git."""

from __future__ import annotations

import json
import random
import shlex
from dataclasses import replace
from pathlib import Path

from projects import git_project
from slowlink import Relay, known_hosts_for

from rv.config import load_config, save_config

RATE = 8e6  # bytes/s each way: 64 Mbit/s, slower than the ~36 MB/s below which rv compresses


def test_a_first_sync_deflates_once_the_link_is_measured_and_an_edit_goes_as_deltas(layout, tmp_path):
    relay = Relay(int(layout.cluster["RV_TESTCLUSTER_SSH_PORT"]), RATE, 0.005)
    try:
        home = Path(layout.rv_env["HOME"])
        config = load_config(Path(layout.rv_env["RV_CONFIG"]))
        known = known_hosts_for(
            relay.port, layout.cluster["RV_TESTCLUSTER_KNOWN_HOSTS"], home / "relay_hosts"
        )
        profile = config.profile(None)
        slow = replace(profile, name="slow", port=relay.port, known_hosts=str(known))
        path = home / "slow.toml"
        save_config(replace(config.with_profile(slow, make_default=True), path=path))
        env = {"RV_CONFIG": str(path), "RV_CACHE_DIR": str(tmp_path / "cache")}

        # 32 MB of numbered lines (compress 4-6x at level 1) in 160 files of 200 kB.
        rng = random.Random(11)
        files = {
            f"data/{i:03d}.txt": "".join(f"row {i} {j} {rng.randrange(10**6)}\n" for j in range(10_000))
            for i in range(160)
        }
        total = sum(len(t) for t in files.values())
        proj = git_project(tmp_path / "p", {**files, "main.py": "print(open('data/007.txt').read()[:12])\n"})

        def sync() -> int:
            before = relay.carried
            r = layout.run_rv("sync", "snapshot", cwd=proj, env_extra=env, timeout=300)
            assert r.returncode == 0, r.stderr[-2000:]
            return relay.carried - before

        first = sync()
        (rates,) = (tmp_path / "cache" / "links").glob("*")
        measured = json.loads(rates.read_text())["bytes_per_s"]
        assert measured < 36e6, measured  # the link measured slow, not the loopback behind it
        # The first packs went as they are (nothing measured yet), the rest deflated.
        assert first < 0.75 * total, (first, total)

        for i in range(5):
            (proj / f"data/{i:03d}.txt").write_text(files[f"data/{i:03d}.txt"] + f"edited {i}\n")
        edited = sync()
        # Five 200 kB files as deltas, not as themselves (what else crosses: the call, and the
        # warm connection starting its next agents, ~60 kB of program each).
        assert edited < sum(len(files[f"data/{i:03d}.txt"]) for i in range(5)) / 3, edited

        store = shlex.quote(str(Path(layout.remote_root, "store.git")))
        res = layout.ssh.run(f"git --git-dir={store} fsck --full --strict --no-progress")
        assert res.exit_code == 0, res.stdout + res.stderr
        r = layout.run_rv("run", "-g", "0", "--mem", "200M", "-f", "--", "python3", "main.py", cwd=proj,
                          env_extra=env, timeout=300)  # fmt: skip
        assert r.returncode == 0 and "row 7 0 " in r.stdout, r.stderr[-2000:]
    finally:
        relay.close()
