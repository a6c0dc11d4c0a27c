"""`rv cost` through the real CLI, without a network: it says why a type has no price, and refuses
what the type or the cluster cannot give, as `rv run` would (issue 24, item 8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CONFIG = """
default = "lab"

[profiles.lab]
host = "nowhere.invalid"
user = "me"
remote_root = "/scratch/me/rv"

[profiles.lab.gpus.a6000]
partition = "gpu-a6000"
gres = "a6000"
gpus_per_node = 2
compute_capability = 8.6
nodes = 2

[profiles.riv]
host = "nowhere.invalid"
user = "me"
remote_root = "/scratch/me/rv"
catalog = "rivanna"
"""


@pytest.fixture
def rv(tmp_path):
    (tmp_path / "rv.toml").write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RV_", "XDG_"))}
    env.update(RV_CONFIG=str(tmp_path / "rv.toml"), HOME=str(tmp_path), NO_COLOR="1", RV_CONNECT_TIMEOUT="1")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "rv", *args], cwd=tmp_path, env=env, capture_output=True, text=True
        )

    return run


def test_a_type_without_a_rate_says_why(rv):
    r = rv("cost", "-g", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1].split() == ["a6000", "?", "unknown"]
    assert (
        "a6000: no SU rate in the profile's catalog (set su_per_gpu_hour under [profiles.lab.gpus.a6000])"
        in (r.stderr)
    )
    (row,) = json.loads(rv("cost", "--json").stdout)
    assert row["su"] is None and row["possible"] and row["why"].startswith("no SU rate")


@pytest.mark.parametrize(
    ("args", "message", "hint"),
    [
        (("-p", "riv", "cost", "-g", "16", "-t", "h200", "--time", "3d"),
         "-g 16: h200 allows at most 4 GPU(s) per job", "use -g 4 (1 node)"),
        (("-p", "riv", "cost", "-t", "h200", "--time", "4d"),
         "--time 4d is over the h200 limit of 3-00:00:00", "use --time 3-00:00:00 or less"),
        (("-p", "riv", "cost", "-g", "2", "-t", "mig"),
         "a MIG slice is one GPU", "drop -g, or pick a full GPU type"),
        (("cost", "-g", "16"),
         "-g 16: the cluster has 2 a6000 node(s) of 2, 4 GPUs in all", "use -g 4 (2 nodes of 2)"),
    ],
)  # fmt: skip
def test_what_the_type_or_the_cluster_cannot_give_is_refused_with_the_limit(rv, args, message, hint):
    r = rv(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == "" and message in r.stderr and f"next: {hint}" in r.stderr


def test_a_mig_slice_at_two_gpus_is_not_priced_free(rv):
    r = rv("-p", "riv", "cost", "-g", "2")
    assert r.returncode == 0, r.stderr
    (mig,) = [line for line in r.stdout.splitlines() if line.startswith("mig ")]
    assert "free" not in mig and "not possible: a MIG slice is one GPU" in mig
    rows = {row["type"]: row for row in json.loads(rv("-p", "riv", "cost", "-g", "2", "--json").stdout)}
    assert rows["mig"]["su"] is None and rows["mig"]["possible"] is False
    assert rows["h200"]["su"] == round(816.67 * 2 * 10740 / 3600, 2)  # the default 2:59:00
    assert rv("-p", "riv", "cost", "-t", "mig").stdout.splitlines()[1].split()[-1] == "free"
