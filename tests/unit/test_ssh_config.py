"""~/.ssh/config is honoured through paramiko's parser; the profile's explicit values win."""

from __future__ import annotations

from rv.transport import resolve_target

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


def test_alias_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = tmp_path / "config"
    cfg.write_text(SSH_CONFIG)
    t = resolve_target("uva", ssh_config_path=cfg)
    assert (t.hostname, t.port, t.user) == ("login.hpc.virginia.edu", 2200, "abc1de")
    assert t.identity_files == (str(tmp_path / ".ssh/uva_key"),)
    assert t.host_key_name == "[login.hpc.virginia.edu]:2200"
    assert t.proxy_jump is not None
    assert (t.proxy_jump.hostname, t.proxy_jump.port, t.proxy_jump.user) == (
        "bastion.example.edu",
        2022,
        "jumpuser",
    )
    assert t.proxy_jump.identity_files == (str(tmp_path / ".ssh/bastion_key"),)


def test_profile_values_win(tmp_path):
    cfg = tmp_path / "config"
    cfg.write_text(SSH_CONFIG)
    t = resolve_target("uva", port=22, user="other", identity_file="/k", ssh_config_path=cfg)
    assert (t.port, t.user, t.identity_files) == (22, "other", ("/k",))
    assert t.host_key_name == "login.hpc.virginia.edu"


def test_wildcards_and_no_config(tmp_path):
    cfg = tmp_path / "config"
    cfg.write_text(SSH_CONFIG)
    t = resolve_target("gpu1.lab.edu", ssh_config_path=cfg)
    assert (t.hostname, t.user, t.port, t.proxy_jump) == ("gpu1.lab.edu", "labuser", 22, None)
    t = resolve_target("h.example", ssh_config_path=tmp_path / "missing")
    assert (t.hostname, t.user, t.port) == ("h.example", None, 22)
