"""`rv init` and `rv exec` against the real cluster: exit codes and streams, host keys, and the
errors of authentication and connection."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

from conftest import base_env, run_cli


def edit_config(rv_env, pattern: str, replacement: str) -> None:
    """Change this test's profile in place (the config is a temp file of its own)."""
    path = Path(rv_env["RV_CONFIG"])
    path.write_text(re.sub(pattern, replacement, path.read_text(), count=1))


def init_args(cluster, known_hosts, *extra):
    return [
        "init", "--profile", "tc", "--host", "127.0.0.1", "--port", cluster["RV_TESTCLUSTER_SSH_PORT"],
        "--user", cluster["RV_TESTCLUSTER_USER"], "--identity-file", cluster["RV_TESTCLUSTER_KEY"],
        "--known-hosts", str(known_hosts),
        "--remote-root", cluster["RV_TESTCLUSTER_REMOTE_ROOT"] + "/tests/init", *extra,
    ]  # fmt: skip


def test_init_yes_then_exec_sinfo_lists_both_nodes(cluster, tmp_path):
    env = base_env(tmp_path, tmp_path / "rv.toml")
    known = tmp_path / "known_hosts"  # empty: init must show the key and accept it only with --yes
    refused = run_cli(init_args(cluster, known), env)
    assert refused.returncode == 6, refused.stderr
    assert "is not known" in refused.stderr and "SHA256:" in refused.stderr
    assert not (tmp_path / "rv.toml").exists()

    ok = run_cli([*init_args(cluster, known), "--yes", "--json"], env)
    assert ok.returncode == 0, ok.stderr
    assert "[127.0.0.1]:" in known.read_text()
    saved = json.loads(ok.stdout)
    assert saved["account"] == "rv"
    assert set(saved["gpus"]) == {"a6000", "v100"}
    assert saved["gpus"]["a6000"]["partition"] == "gpu-a6000" and saved["gpus"]["a6000"]["gpus_per_node"] == 2
    assert saved["gpus"]["v100"]["compute_capability"] == 7.0

    out = run_cli(["exec", "sinfo", "-N", "-h", "-o", "%N"], env)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) == {"node1", "node2"}


def test_exec_exit_code_and_streams(run_rv):
    r = run_rv("exec", "exit 7")
    assert r.returncode == 7
    r = run_rv("exec", "echo out; echo err >&2; exit 3")
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")


def test_exec_timeout(run_rv):
    start = time.monotonic()
    r = run_rv("exec", "--timeout", "1", "sleep 30")
    assert r.returncode == 8 and "timed out" in r.stderr
    assert time.monotonic() - start < 20


def test_changed_host_key_is_refused(run_rv, rv_env, tmp_path, cluster):
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    fake_pub = (tmp_path / "other_key.pub").read_text().split()[1]
    known = tmp_path / "known_changed"
    known.write_text(f"[127.0.0.1]:{cluster['RV_TESTCLUSTER_SSH_PORT']} ssh-ed25519 {fake_pub}\n")
    edit_config(rv_env, re.escape(cluster["RV_TESTCLUSTER_KNOWN_HOSTS"]), str(known))
    r = run_rv("exec", "true")
    assert r.returncode == 6
    assert "has CHANGED" in r.stderr and "refusing to connect" in r.stderr
    assert "Traceback" not in r.stderr
    assert known.read_text().count("\n") == 1  # nothing was added or replaced


def test_wrong_key_gives_auth_error(run_rv, rv_env, tmp_path, cluster):
    wrong = tmp_path / "wrong_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(wrong)], check=True)
    edit_config(rv_env, re.escape(cluster["RV_TESTCLUSTER_KEY"]), str(wrong))
    r = run_rv("exec", "true")
    assert r.returncode == 5, r.stderr
    assert r.stderr.startswith(
        f"rv: error: authentication refused by {cluster['RV_TESTCLUSTER_USER']}@127.0.0.1:"
    )
    assert "next:" in r.stderr and "Traceback" not in r.stderr


def test_closed_port_gives_connection_error(run_rv, rv_env, cluster):
    with socket.socket() as s:  # a port nothing listens on: bind, read its number, close
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    edit_config(rv_env, r"port = \d+", f"port = {port}")
    r = run_rv("exec", "true")
    assert r.returncode == 4, r.stderr
    assert f"cannot connect to {cluster['RV_TESTCLUSTER_USER']}@127.0.0.1:{port}" in r.stderr


def test_silent_server_times_out_within_limit(run_rv, rv_env):
    # A server that accepts and never speaks: the SSH banner never comes.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    held = []
    threading.Thread(target=lambda: held.append(server.accept()), daemon=True).start()
    edit_config(rv_env, r"port = \d+", f"port = {port}")
    start = time.monotonic()
    r = run_rv("exec", "true", env_extra={"RV_CONNECT_TIMEOUT": "2"})
    elapsed = time.monotonic() - start
    server.close()
    assert r.returncode == 4, r.stderr
    assert "127.0.0.1" in r.stderr
    assert elapsed < 15  # bounded by the 2 s connect timeout, not by a hang


def test_no_config_yet(tmp_path):
    env = dict(base_env(tmp_path, tmp_path / "none.toml"), RV_TESTCLUSTER_DIR=str(tmp_path / "no-demo"))
    r = run_cli(["exec", "true"], env)
    assert r.returncode == 3
    assert r.stderr == (
        f"rv: error: no rv config yet ({tmp_path / 'none.toml'} (RV_CONFIG names it))\n"
        "  next: run `rv init` to connect rv to your cluster, or point RV_CONFIG at the config you have\n"
    )


def test_after_the_demo_no_config_names_the_demos_own(tmp_path):
    # Issue 41: the README said the demo saved its profile as your default one; `rv ps -a` after
    # activating said "no rv config yet" without a word of where the demo's config is.
    demo = tmp_path / "cluster-state"
    demo.mkdir()
    (demo / "rv-config.toml").write_text('default = "testcluster"\n')  # what the demo's `rv init` wrote
    env = {k: v for k, v in base_env(tmp_path / "home", tmp_path / "x.toml").items() if k != "RV_CONFIG"}
    (tmp_path / "home").mkdir()
    env["RV_TESTCLUSTER_DIR"] = str(demo)
    r = run_cli(["ps", "-a"], env)
    assert r.returncode == 3, r.stderr
    said = " ".join(r.stderr.split())
    assert f"no rv config yet ({tmp_path / 'home' / '.config' / 'rv' / 'config.toml'})" in said, r.stderr
    assert f"the demo's (bash scripts/demo): export RV_CONFIG={demo / 'rv-config.toml'}" in said, r.stderr
    # Following it works: the same command with the variable set reads the demo's config.
    shown = run_cli(["ps", "-a"], dict(env, RV_CONFIG=str(demo / "rv-config.toml")))
    assert "no rv config yet" not in shown.stderr, shown.stderr


def test_exec_of_a_missing_program_passes_the_shell_code(run_rv):
    r = run_rv("exec", "definitely-not-a-command-rv")
    assert r.returncode == 127 and "not found" in r.stderr
