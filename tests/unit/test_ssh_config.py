"""~/.ssh/config as OpenSSH reads it (`ssh -G`), and paramiko's parser where no ssh is installed.

Both backends must agree on what matters: aliases, Include, Match, every ProxyJump hop, and the
profile's explicit values winning.
"""

from __future__ import annotations

import getpass
import shutil

import pytest

from rv.errors import ConfigError, UsageError
from rv.remote.sshconfig import parse_ssh_g, resolve_target

SSH_CONFIG = """
Host uva
    HostName login.hpc.virginia.edu
    User abc1de
    Port 2200
    IdentityFile ~/.ssh/uva_key
    ProxyJump jumpuser@bastion.example.edu:2022

Host bastion.example.edu
    IdentityFile ~/.ssh/bastion_key

Host *.lab.edu
    User labuser
"""

BACKENDS = [
    pytest.param(
        True, id="openssh", marks=pytest.mark.skipif(not shutil.which("ssh"), reason="no ssh binary")
    ),
    pytest.param(False, id="paramiko"),
]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RV_SSH_CONFIG", raising=False)
    return tmp_path


@pytest.mark.parametrize("openssh", BACKENDS)
def test_alias_resolution(home, openssh):
    cfg = home / "config"
    cfg.write_text(SSH_CONFIG)
    t = resolve_target("uva", ssh_config_path=cfg, use_openssh=openssh)
    assert (t.hostname, t.port, t.user) == ("login.hpc.virginia.edu", 2200, "abc1de")
    assert t.identity_files == (str(home / ".ssh/uva_key"),)
    assert t.host_key_name == "[login.hpc.virginia.edu]:2200"
    assert t.proxy_jump is not None
    assert (t.proxy_jump.hostname, t.proxy_jump.port, t.proxy_jump.user) == (
        "bastion.example.edu",
        2022,
        "jumpuser",
    )
    assert t.proxy_jump.identity_files == (str(home / ".ssh/bastion_key"),)


@pytest.mark.parametrize("openssh", BACKENDS)
def test_profile_values_win(home, openssh):
    cfg = home / "config"
    cfg.write_text(SSH_CONFIG)
    t = resolve_target(
        "uva", port=22, user="other", identity_file="/k", ssh_config_path=cfg, use_openssh=openssh
    )
    assert (t.port, t.user, t.identity_files) == (22, "other", ("/k",))
    assert t.host_key_name == "login.hpc.virginia.edu"


@pytest.mark.parametrize("openssh", BACKENDS)
def test_wildcards_and_no_config(home, openssh):
    cfg = home / "config"
    cfg.write_text(SSH_CONFIG)
    t = resolve_target("gpu1.lab.edu", ssh_config_path=cfg, use_openssh=openssh)
    assert (t.hostname, t.user, t.port, t.proxy_jump) == ("gpu1.lab.edu", "labuser", 22, None)
    # No config at all: the local user, port 22, no identity file named (agent and ~/.ssh are tried).
    t = resolve_target("h.example", ssh_config_path=home / "missing", use_openssh=openssh)
    assert (t.hostname, t.user, t.port, t.identity_files) == ("h.example", getpass.getuser(), 22, ())


@pytest.mark.parametrize("openssh", BACKENDS)
def test_include_is_followed(home, openssh):
    # paramiko's own parser ignores Include: the alias lives only in an included file.
    (home / "conf.d").mkdir()
    (home / "conf.d" / "cluster.conf").write_text("Host hpc\n  HostName login.example.edu\n  Port 2022\n")
    cfg = home / "config"
    cfg.write_text(f"Include {home}/conf.d/*.conf\n\nHost *\n  User me\n")
    t = resolve_target("hpc", ssh_config_path=cfg, use_openssh=openssh)
    assert (t.hostname, t.port, t.user) == ("login.example.edu", 2022, "me")


@pytest.mark.parametrize("openssh", BACKENDS)
def test_match_blocks_apply(home, openssh):
    cfg = home / "config"
    cfg.write_text("Match host *.campus.edu\n  User campususer\n  Port 2200\n")
    t = resolve_target("login.campus.edu", ssh_config_path=cfg, use_openssh=openssh)
    assert (t.user, t.port) == ("campususer", 2200)
    t = resolve_target("login.other.edu", ssh_config_path=cfg, use_openssh=openssh)
    assert t.port == 22


@pytest.mark.parametrize("openssh", BACKENDS)
def test_every_proxyjump_hop_is_kept(home, openssh):
    # `ProxyJump a,b`: reach b through a, then the target through b (OpenSSH's order). rv used to keep
    # only the first hop and connect to the target straight from it.
    cfg = home / "config"
    cfg.write_text(
        "Host target\n  HostName target.internal\n  ProxyJump first.example.edu,me@second.internal:2200\n"
        "Host first.example.edu\n  User firstuser\n  Port 2201\n"
    )
    t = resolve_target("target", ssh_config_path=cfg, use_openssh=openssh)
    second = t.proxy_jump
    assert second is not None and (second.hostname, second.user, second.port) == (
        "second.internal",
        "me",
        2200,
    )
    first = second.proxy_jump
    assert first is not None and (first.hostname, first.user, first.port) == (
        "first.example.edu",
        "firstuser",
        2201,
    )
    assert first.proxy_jump is None
    assert [h.hostname for h in t.hops()] == ["first.example.edu", "second.internal", "target.internal"]


@pytest.mark.parametrize("openssh", BACKENDS)
def test_a_proxyjump_loop_is_an_error(home, openssh):
    cfg = home / "config"
    cfg.write_text("Host a\n  ProxyJump b\nHost b\n  ProxyJump a\n")
    with pytest.raises(ConfigError, match="more than 8 hops"):
        resolve_target("a", ssh_config_path=cfg, use_openssh=openssh)


def test_a_host_that_looks_like_an_option_is_refused_before_ssh_runs(home):
    with pytest.raises(UsageError, match="cannot start with '-'"):
        resolve_target("-oProxyCommand=touch /tmp/pwned", ssh_config_path=home / "none")
    with pytest.raises(UsageError, match="no spaces"):
        resolve_target("login node", ssh_config_path=home / "none")


@pytest.mark.skipif(not shutil.which("ssh"), reason="no ssh binary")
def test_a_broken_config_names_the_problem(home):
    cfg = home / "config"
    cfg.write_text("Host x\n  NotAnOption yes\n")
    with pytest.raises(ConfigError, match="OpenSSH cannot read the SSH config for x"):
        resolve_target("x", ssh_config_path=cfg, use_openssh=True)


def test_parse_ssh_g_collects_repeated_keys():
    out = parse_ssh_g("user me\nidentityfile ~/.ssh/a\nidentityfile ~/.ssh/b\nPort 22\n")
    assert out == {"user": ["me"], "identityfile": ["~/.ssh/a", "~/.ssh/b"], "port": ["22"]}
