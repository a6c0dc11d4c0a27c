"""Partition limits: learned by `rv init` from sinfo, kept in the profile, and enforced before a job is
sent, CPU-only jobs included (issue 28, item 6)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rv.catalog import Partition
from rv.config import load_config, parse_config, render_config, save_config
from rv.errors import ConfigError, UsageError
from rv.probe import build_profile, facts_from_probe, parse_partitions
from rv.request import build_request

# sinfo as a site with a 3-day CPU partition prints it: one row per partition and node state (so
# `standard` comes twice), '*' on the default, the job size as MIN-MAX nodes.
PARTITIONS = """\
standard*|3-00:00:00|1-1
standard*|3-00:00:00|1-1
parallel|3-00:00:00|2-16
gpu-a6000|3-00:00:00|1-infinite
interactive|12:00:00|1-infinite
debug|infinite|1-infinite
"""
NODES = """\
c001|standard*|idle|(null)|(null)|40|384000|3-00:00:00|
c002|standard*|mixed|(null)|(null)|40|384000|3-00:00:00|
c003|standard*|mixed|(null)|(null)|40|384000|3-00:00:00|
c001|parallel|idle|(null)|(null)|40|384000|3-00:00:00|
g001|gpu-a6000|idle|gpu:a6000:8|gpu:a6000:0|32|256000|3-00:00:00|
g002|gpu-a6000|idle|gpu:a6000:8|gpu:a6000:0|32|256000|3-00:00:00|
"""
PROBE = f"""\
@@user
me
@@home
/home/me
@@commands
sbatch
squeue
sacct
sinfo
@@scratch
@@allocations
@@assoc
@@sinfo
{NODES}@@partitions
{PARTITIONS}@@qos
mylab||normal|long,normal
mylab|gpu-a6000|gpu|gpu
other||||
@@qoswall
normal|2-00:00:00
gpu|1-00:00:00
long|
@@end
"""


def test_init_learns_each_partitions_limits_and_the_default_from_sinfo():
    parts = parse_partitions(PARTITIONS, NODES)
    assert parts["standard"] == Partition("standard", "3-00:00:00", nodes=3, max_nodes=1, default=True)
    assert parts["parallel"] == Partition("parallel", "3-00:00:00", nodes=1, max_nodes=16)
    assert parts["interactive"] == Partition("interactive", "12:00:00")  # no nodes listed: unknown
    assert parts["debug"].max_time is None and parts["gpu-a6000"].max_nodes is None
    facts = facts_from_probe(PROBE)
    assert facts.partitions == parts
    assert facts.qos_max_wall == {"normal": "2-00:00:00", "gpu": "1-00:00:00"}
    profile = build_profile(
        name="site", host="login.site.edu", port=None, user=None, identity_file=None, known_hosts=None,
        account=None, remote_root=None, setup=(), catalog="discovered", facts=facts,
    )  # fmt: skip
    assert profile.partitions == parts and profile.default_partition == parts["standard"]
    assert profile.gpu_catalog()["a6000"].max_time == "3-00:00:00"


def test_init_learns_the_qos_a_job_of_the_account_gets_and_its_max_wall():
    profile = build_profile(
        name="site", host="login.site.edu", port=None, user=None, identity_file=None, known_hosts=None,
        account="mylab", remote_root=None, setup=(), catalog="discovered", facts=facts_from_probe(PROBE),
    )  # fmt: skip
    parts = profile.partitions
    assert (parts["standard"].qos, parts["standard"].qos_max_time) == ("normal", "2-00:00:00")
    assert (parts["gpu-a6000"].qos, parts["gpu-a6000"].qos_max_time) == ("gpu", "1-00:00:00")
    # The tightest limit wins, and the refusal says whose it is.
    with pytest.raises(UsageError) as err:
        build_request(
            profile.gpu_catalog(), command=["python", "x.py"], gpus=0, time="2d12h", partitions=parts
        )
    assert "over the limit of QOS normal (your account's there), 2-00:00:00" in err.value.message
    assert err.value.hint == "use --time 2-00:00:00 or less"
    with pytest.raises(UsageError, match="QOS gpu"):
        build_request(profile.gpu_catalog(), command=["python", "x.py"], gpus=1, time="2d", partitions=parts)
    # Another account's jobs: its association names no QOS, so rv knows no QOS limit for them.
    other = build_profile(
        name="site", host="login.site.edu", port=None, user=None, identity_file=None, known_hosts=None,
        account="other", remote_root=None, setup=(), catalog="discovered", facts=facts_from_probe(PROBE),
    )  # fmt: skip
    assert all(p.qos_max_time is None for p in other.partitions.values())


def test_the_profile_keeps_its_partitions_through_save_and_load(tmp_path):
    facts = facts_from_probe(PROBE)
    profile = build_profile(
        name="site", host="login.site.edu", port=None, user=None, identity_file=None, known_hosts=None,
        account=None, remote_root="/scratch/me/rv", setup=(), catalog="discovered", facts=facts,
    )  # fmt: skip
    path = tmp_path / "config.toml"
    save_config(load_config(path, missing_ok=True).with_profile(profile, make_default=True))
    text = path.read_text()
    assert '[profiles.site.partitions.standard]\nmax_time = "3-00:00:00"\nnodes = 3\nmax_nodes = 1\n' in text
    assert "default = true" in text
    assert load_config(path).profile("site").partitions == profile.partitions
    assert render_config(load_config(path), text) == text


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ('max_time = "soon"', "max_time 'soon' is not a Slurm time"),
        ("nodes = true", "nodes must be an integer"),
        ('limit = "1"', "unknown key 'limit'"),
    ],
)
def test_a_partition_table_is_checked_when_the_config_is_read(table, problem):
    text = f'[profiles.a]\nhost = "h"\n[profiles.a.partitions.p]\n{table}\n'
    with pytest.raises(ConfigError) as err:
        parse_config(text, Path("/c.toml"))
    assert problem in err.value.message
    two = '[profiles.a]\nhost = "h"\n[profiles.a.partitions.p]\ndefault = true\n'
    two += "[profiles.a.partitions.q]\ndefault = true\n"
    with pytest.raises(ConfigError, match="more than one partition has default = true"):
        parse_config(two, Path("/c.toml"))


CONFIG = """
[profiles.site]
host = "nowhere.invalid"
remote_root = "/scratch/me/rv"

[profiles.site.partitions.standard]
max_time = "3-00:00:00"
nodes = 3
max_nodes = 1
default = true
"""


def test_rv_run_refuses_a_cpu_job_over_its_partitions_limits_before_connecting(tmp_path):
    (tmp_path / "rv.toml").write_text(CONFIG)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "x.py").write_text("print(1)\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RV_", "XDG_"))}
    env.update(RV_CONFIG=str(tmp_path / "rv.toml"), HOME=str(tmp_path), NO_COLOR="1", RV_CONNECT_TIMEOUT="1")

    def rv(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "rv", *args], cwd=repo, env=env, capture_output=True, text=True
        )

    r = rv("run", "-g", "0", "--time", "4d", "--", "python", "x.py")
    assert r.returncode == 2 and "over the limit of partition standard" in r.stderr
    assert "next: use --time 3-00:00:00 or less" in r.stderr and "cannot connect" not in r.stderr
    r = rv("run", "-g", "0", "--nodes", "2", "--each-node", "--", "python", "x.py")
    assert r.returncode == 2 and "allows 1 node(s) per job" in r.stderr and "next: use --nodes 1" in r.stderr
    ok = rv("run", "-g", "0", "--time", "3d", "--dry-run", "--", "python", "x.py")
    assert ok.returncode == 0, ok.stderr
