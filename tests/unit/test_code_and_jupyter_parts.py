"""rv code's and rv jupyter's parts that need no cluster: the SSH config entry and its quoting, the one
Include line, rv's own SSH files, the public keys offered, rv ps's lines, and the pinned JupyterLab."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from rv.errors import RemoteError, UsageError
from rv.remote import nodessh

REPO = Path(__file__).resolve().parents[2]


def _entry(alias: str = "ed.prof.rv", job: str = "12") -> nodessh.NodeEntry:
    hop = nodessh.LoginHop(
        "login.example.org", port=2222, user="me", identity_file="/k/id", known_hosts="/k/kh"
    )
    return nodessh.NodeEntry(
        alias=alias, node="gpu-01", user="me", job_id=job, run_name="ed", identity_files=("/k/id",),
        known_hosts="/h/.ssh/rv/known_hosts",
        proxy_command=nodessh.proxy_command(hop, ["srun", f"--jobid={job}", "bash", "/r/50% done/launch.sh"]),
    )  # fmt: skip


def test_the_proxy_command_quotes_once_per_shell_and_doubles_percent_signs():
    command = _entry().proxy_command
    assert "50%% done" in command  # OpenSSH expands %-tokens in a ProxyCommand first
    local = shlex.split(command.replace("%%", "%"))  # what /bin/sh -c runs
    assert local[:3] == ["ssh", "-p", "2222"] and local[-3:-1] == ["--", "login.example.org"]
    assert "StrictHostKeyChecking=yes" in local and "UserKnownHostsFile=/k/kh" in local
    assert not any(w.endswith("=no") and "StrictHostKeyChecking" in w for w in local)
    # The last word is the login node's shell line: srun and its words, each back as it was.
    assert shlex.split(local[-1]) == ["srun", "--jobid=12", "bash", "/r/50% done/launch.sh"]


def test_the_login_hop_uses_only_what_the_profile_sets():
    bare = nodessh.LoginHop("cluster").argv()
    assert bare[0] == "ssh" and bare[-2:] == ["--", "cluster"]
    assert "-p" not in bare and "-i" not in bare and "-F" not in bare  # the SSH config says the rest
    assert nodessh.LoginHop("c", ssh_config="/cfg").argv()[1:3] == ["-F", "/cfg"]


def test_the_entry_pins_the_host_key_to_rvs_file_under_its_alias():
    text = _entry().render()
    lines = [line.strip() for line in text.splitlines()]
    assert lines[1] == "Host ed.prof.rv"
    for line in (
        "HostKeyAlias ed.prof.rv", "UserKnownHostsFile /h/.ssh/rv/known_hosts", "StrictHostKeyChecking yes",
        "IdentityFile /k/id", "IdentitiesOnly yes", "User me",
    ):  # fmt: skip
        assert line in lines


def test_host_alias_refuses_what_is_no_host_name():
    assert nodessh.host_alias("mila", "code-3f9a1b") == "code-3f9a1b.mila.rv"
    with pytest.raises(UsageError):
        nodessh.host_alias("mila", "a b")


@pytest.mark.parametrize(
    "line",
    [
        "Include {abs}",
        "include ~/.ssh/rv/config",
        "Include rv/config",
        'Include "{abs}"',
        "Include other {abs}",
        "Include=~/.ssh/rv/config",
        "  Include = ~/.ssh/rv/*",
        "Include ~/.ssh/r?/conf*",
    ],
)
def test_an_include_of_rvs_file_is_found_however_spelled(tmp_path, line):
    ssh_dir = tmp_path / ".ssh"
    text = "# top\n" + line.format(abs=ssh_dir / "rv" / "config") + "\nHost a\n  User b\n"
    assert nodessh.includes(text, ssh_dir / "rv" / "config", ssh_dir)


@pytest.mark.parametrize("block", ["Host a", "Match host a", "Host *", "host=a"])
def test_an_include_inside_a_host_or_match_block_is_not_at_the_top(tmp_path, block):
    # ssh reads it for that block's hosts alone: rv's line must still go to the top.
    files = nodessh.SshFiles(tmp_path / ".ssh")
    files.ssh_dir.mkdir()
    files.user_config.write_text(f"{block}\n    User b\n    Include ~/.ssh/rv/config\n")
    assert not files.has_include()
    files.add_include()
    assert files.has_include() and files.user_config.read_text().splitlines()[1] == files.include_line


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ('Include "~/my keys/rv config" other', ["Include", "~/my keys/rv config", "other"]),
        ("User b\\ c # comment", ["User", "b c"]),
        ("  # 'a comment with a quote", []),
        ("IdentityFile 'a\"b'", ["IdentityFile", 'a"b']),
        ("ProxyCommand ssh -W %h:%p 'jump host'", ["ProxyCommand", "ssh", "-W", "%h:%p", "jump host"]),
        ("User me#not-a-comment", ["User", "me#not-a-comment"]),
    ],
)
def test_config_lines_are_split_as_ssh_splits_them(line, words):
    assert nodessh.ssh_words(line) == words


def test_a_config_that_is_not_utf8_is_read_and_kept_byte_for_byte(tmp_path):
    files = nodessh.SshFiles(tmp_path / ".ssh")
    files.ssh_dir.mkdir()
    original = b"# caf\xe9 (latin-1, which ssh takes)\nHost a\n    User b\xe9b\n"
    files.user_config.write_bytes(original)
    files.check()
    assert not files.has_include()
    files.add_include()
    data = files.user_config.read_bytes()
    assert data.endswith(original) and files.has_include()


def test_a_config_ssh_refuses_is_refused_with_its_file_and_line(tmp_path):
    files = nodessh.SshFiles(tmp_path / ".ssh")
    files.ssh_dir.mkdir()
    files.user_config.write_text('Host a\n    User b\nHost c\n    IdentityFile "~/.ssh/id\n')
    with pytest.raises(UsageError) as info:
        files.check()
    assert f"{files.user_config} line 4: a quote is not closed" in info.value.message
    assert "nothing was started" in info.value.message
    # Where ssh reads them all, so does rv: a quote left open anywhere in the file (ssh -G says so too).
    done = subprocess.run(["ssh", "-F", str(files.user_config), "-G", "x"], capture_output=True, text=True)
    assert done.returncode != 0 and "line 4: invalid quotes" in done.stderr


def test_a_commented_or_other_include_is_not_rvs(tmp_path):
    ssh_dir = tmp_path / ".ssh"
    target = ssh_dir / "rv" / "config"
    assert not nodessh.includes(f"# Include {target}\nInclude ~/.ssh/other\n", target, ssh_dir)


def test_the_include_goes_at_the_top_once_keeping_the_file_and_its_mode(tmp_path):
    files = nodessh.SshFiles(tmp_path / ".ssh")
    files.ssh_dir.mkdir()
    original = "Host *\n    ServerAliveInterval 60\nHost work\n    User me\n"
    files.user_config.write_text(original)
    files.user_config.chmod(0o644)
    assert not files.has_include()
    files.add_include()
    files.add_include()
    text = files.user_config.read_text()
    assert text.count("Include ") == 1 and files.has_include()
    # Above every Host line: an Include below `Host work` would count for `work` alone.
    assert text.index(files.include_line) < text.index("Host *")
    assert text.endswith(original)
    assert files.user_config.stat().st_mode & 0o777 == 0o644


def test_the_include_goes_through_a_linked_config(tmp_path):
    files = nodessh.SshFiles(tmp_path / ".ssh")
    files.ssh_dir.mkdir()
    real = tmp_path / "dotfiles" / "ssh_config"
    real.parent.mkdir()
    real.write_text("Host a\n")
    files.user_config.symlink_to(real)
    assert files.add_include() == real
    assert files.user_config.is_symlink() and real.read_text().count("Include ") == 1


def test_a_missing_user_config_is_made_private(tmp_path):
    files = nodessh.SshFiles(tmp_path / ".ssh")
    files.add_include()
    assert files.user_config.stat().st_mode & 0o777 == 0o600
    assert files.ssh_dir.stat().st_mode & 0o777 == 0o700


def test_rvs_files_keep_one_entry_and_key_per_session(tmp_path):
    files = nodessh.SshFiles(tmp_path / ".ssh")
    files.write_entry(_entry("a.p.rv", "1"), "ssh-ed25519 AAAA1")
    files.write_entry(_entry("b.p.rv", "2"), "ssh-ed25519 AAAA2")
    files.write_entry(_entry("a.p.rv", "3"), "ssh-ed25519 AAAA3")  # a's session again: replaced
    assert files.aliases() == ["b.p.rv", "a.p.rv"]
    assert "job 3 on" in files.config.read_text() and "job 1 on" not in files.config.read_text()
    assert files.known_hosts.read_text() == "b.p.rv ssh-ed25519 AAAA2\na.p.rv ssh-ed25519 AAAA3\n"
    files.write_entry(_entry("c.p.rv", "4"), "ssh-ed25519 AAAA4", drop=["b.p.rv"])  # b's session ended
    assert files.aliases() == ["a.p.rv", "c.p.rv"]
    assert "b.p.rv" not in files.known_hosts.read_text()
    for path in (files.config, files.known_hosts):
        assert path.stat().st_mode & 0o777 == 0o600
    # OpenSSH reads the file as written: each Host with its values.
    seen = subprocess.run(["ssh", "-G", "-F", str(files.config), "c.p.rv"], capture_output=True, text=True)
    assert seen.returncode == 0, seen.stderr
    assert "hostkeyalias c.p.rv" in seen.stdout and "stricthostkeychecking true" in seen.stdout


def test_a_new_host_key_is_an_openssh_ed25519_pair(tmp_path):
    private, public = nodessh.new_host_key()
    key = tmp_path / "key"
    key.write_bytes(private)
    key.chmod(0o600)
    derived = subprocess.run(["ssh-keygen", "-y", "-f", str(key)], capture_output=True, text=True)
    assert derived.returncode == 0 and derived.stdout.split()[:2] == public.split()[:2]
    assert public.startswith("ssh-ed25519 ")


def test_public_keys_of_the_identity_or_the_defaults(tmp_path, monkeypatch):
    ident = tmp_path / "id_test"
    (tmp_path / "id_test.pub").write_text("ssh-ed25519 AAAAid comment\n")
    assert nodessh.public_keys([str(ident)]) == ["ssh-ed25519 AAAAid comment"]

    def derive(argv):
        return subprocess.CompletedProcess(argv, 0, "ssh-rsa AAAAderived\n", "")

    assert nodessh.public_keys([str(tmp_path / "other")], run=derive) == ["ssh-rsa AAAAderived"]

    def protected(argv):
        return subprocess.CompletedProcess(argv, 1, "", "incorrect passphrase")

    with pytest.raises(UsageError, match="is missing and the key is protected") as caught:
        nodessh.public_keys([str(tmp_path / "other")], run=protected)
    assert caught.value.hint.startswith("write it once: ssh-keygen -y -f ")
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519.pub").write_text("ssh-ed25519 AAAAdefault\n")
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)  # no agent's keys: the default files alone
    assert nodessh.public_keys([], home=home) == ["ssh-ed25519 AAAAdefault"]
    with pytest.raises(UsageError, match="no SSH public key"):
        nodessh.public_keys([], home=tmp_path / "nobody")


class _Transport:
    """The one seam faked: what the cluster answered to rv code's one call."""

    def __init__(self, code: int, out: str, err: str) -> None:
        self.result = SimpleNamespace(exit_code=code, out=out, err=err)
        self.lines: list[str] = []

    def run(self, line, *, stdin=None, timeout=None):
        self.lines.append(line)
        return self.result


def _running_job():
    from rv.job.inside import RunningJob

    run = SimpleNamespace(name="ed", run_id="abc123", meta={})
    job = SimpleNamespace(job_id="77", node_list=("gpu-01",))
    return RunningJob(run=run, job=job, root="/scratch/me/rv")  # type: ignore[arg-type]


def test_a_node_without_sshd_is_a_clear_error_with_the_way_around(tmp_path):
    from rv.job.editor import node_ssh

    said = "rv: no sshd on node gpu-01: plain ssh cannot reach it. rv ssh RUN gives a shell there"
    transport = _Transport(127, "", said + "\n")
    with pytest.raises(RemoteError) as caught:
        node_ssh(
            transport, _running_job(), profile="p", hop=nodessh.LoginHop("login"), user="me",
            identity_files=(), public_keys=["ssh-ed25519 AAAA"], files=nodessh.SshFiles(tmp_path / ".ssh"),
        )  # fmt: skip
    assert "plain ssh cannot reach node gpu-01 of session ed (job 77)" in caught.value.message
    assert said in caught.value.message and caught.value.hint.startswith("rv ssh ed ")
    assert not (tmp_path / ".ssh").exists()  # no entry for a node ssh cannot reach
    # The one call wrote the session's files and checked sshd in a step of the job, on its node.
    assert "srun --jobid=77 --overlap" in transport.lines[0] and "--nodelist=gpu-01" in transport.lines[0]


def test_a_node_with_sshd_gets_an_entry(tmp_path):
    from rv.job.editor import node_ssh

    files = nodessh.SshFiles(tmp_path / ".ssh")
    transport = _Transport(0, "sshd=/usr/sbin/sshd sftp=/usr/lib/openssh/sftp-server\nrv-node-ssh-ok\n", "")
    host = node_ssh(
        transport, _running_job(), profile="p", hop=nodessh.LoginHop("login"), user="me",
        identity_files=(), public_keys=["ssh-ed25519 AAAA"], files=files,
    )  # fmt: skip
    assert host.alias == "ed.p.rv" and host.sftp and host.work_dir == "/scratch/me/rv/runs/abc123/work"
    assert files.aliases() == ["ed.p.rv"]
    proxy = shlex.split(host.entry.proxy_command.replace("%%", "%"))
    assert shlex.split(proxy[-1])[:4] == ["srun", "--unbuffered", "--quiet", "--jobid=77"]
    assert shlex.split(proxy[-1])[-2:] == ["bash", "/scratch/me/rv/runs/abc123/node-ssh/launch.sh"]


def test_rv_ps_says_what_each_running_session_serves():
    from rv.cli.ps import served_lines

    views = [
        SimpleNamespace(name="code-1", run_id="r1", live=True, state="RUNNING"),
        SimpleNamespace(name="old", run_id="r2", live=False, state="COMPLETED"),
        SimpleNamespace(name="plain", run_id="r3", live=True, state="RUNNING"),
    ]
    serves = {
        "r1": {
            "kind": "code",
            "editor_host": "code-1.p.rv",
            "notebook_url": "http://127.0.0.1:9/lab?token=t",
        },
        "r2": {"editor_host": "old.p.rv"},
    }
    assert served_lines(views, serves) == [
        "",
        "code-1: editor  ssh code-1.p.rv  (rv code --name code-1)",
        "code-1: notebook http://127.0.0.1:9/lab?token=t  (rv jupyter --name code-1)",
    ]
    assert served_lines(views[2:], serves) == []


def test_the_tools_environment_pins_the_jupyterlab_of_constraints():
    from rv.job.notebook import JUPYTERLAB_VERSION, tools_spec

    pins = dict(
        line.split("==", 1) for line in (REPO / "constraints.txt").read_text().splitlines() if "==" in line
    )
    assert pins["jupyterlab"] == JUPYTERLAB_VERSION
    assert tools_spec().files == (("requirements.txt", f"jupyterlab=={JUPYTERLAB_VERSION}\n".encode()),)
