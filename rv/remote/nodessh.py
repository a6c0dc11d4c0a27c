"""Plain OpenSSH to a node of a running job, through the login node and inside the job (`rv code`).

A compute node is reached through Slurm, never by SSH to the node (rv.job.inside says why). For
``ssh HOST``, ``scp`` and VS Code's Remote-SSH, which know nothing of Slurm, rv writes an entry in
a file of its own (``~/.ssh/rv/config``) whose ``ProxyCommand`` logs in to the login node, as the
profile does, and runs there::

    srun --jobid J --overlap --nodelist NODE ... bash <run>/node-ssh/launch.sh

On the node, ``launch.sh`` starts ``sshd -i``: sshd in inetd mode, as the user (no root, no port:
the connection is its stdin and stdout), with a config, host key and authorized keys of the
session's own, in a step of the job (its cgroup, GPUs and memory). Every connection is one such
step and one sshd, gone with the connection. Nothing of rv's runs between the two OpenSSH ends.

Trust, both ways: the login node is checked against the known_hosts file the profile uses (rv init
wrote the key there), ``StrictHostKeyChecking yes``. The node's sshd presents a host key rv made for
the session (a fresh Ed25519 key each `rv code`; its private half goes to the cluster 0600, over the
profile's verified connection); its public half goes into rv's own known_hosts file under the
entry's name (``HostKeyAlias``). The node's sshd accepts the public halves of the profile's
identity (or, where the profile names none, of the user's default keys and agent keys).

sshd starts each session with a fresh environment, so the step's Slurm variables (``launch.sh``
saves them) and the job's environment file (what the program got: setup lines, the project's
environment, secrets, RV_*) reach the session through ``login.sh``, sshd's ``ForceCommand``.
"""

from __future__ import annotations

import os
import posixpath
import re
import shlex
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rv.agent import layout
from rv.errors import RvError, UsageError

ALIAS_SUFFIX = ".rv"
SESSION_DIR = layout.NODE_SSH  # under the run's folder on the cluster

# Where sftp-server lives on the common distributions (Debian, RHEL, Arch, others): the sshd config
# names it, since internal-sftp cannot run under a ForceCommand.
SFTP_SERVERS = (
    "/usr/lib/openssh/sftp-server",
    "/usr/libexec/openssh/sftp-server",
    "/usr/lib/ssh/sftp-server",
    "/usr/libexec/sftp-server",
    "/usr/lib/sftp-server",
)

# Run on the node by srun, for each connection: `bash launch.sh` (sshd on stdin/stdout) or
# `bash launch.sh --check` (is sshd there, and does it accept the config?). $1 of the -c form: the folder.
LAUNCH = r"""d=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
umask 077
PATH=$PATH:/usr/sbin:/usr/local/sbin:/sbin
if ! sshd=$(command -v sshd); then
    echo "rv: no sshd on node ${SLURMD_NODENAME:-$(hostname)}: plain ssh cannot reach it." \
        "rv ssh RUN gives a shell there, and rv forward PORT RUN a port" >&2
    exit 127
fi
sftp=""
for p in SFTP_SERVERS; do
    if [ -x "$p" ]; then sftp=$p; break; fi
done
extra=()
[ -z "$sftp" ] || extra=(-o "Subsystem sftp $sftp")
if [ "${1-}" = --check ]; then
    echo "sshd=$sshd sftp=$sftp"
    exec "$sshd" -t -f "$d/sshd_config" "${extra[@]}"
fi
# sshd gives each session a fresh environment: the step's Slurm variables (the job's id, its nodes
# and GPUs) go to login.sh through a file. Every connection is a step of the same job on this node.
{
    for v in $(compgen -e); do
        case "$v" in
            SLURM_* | SLURMD_* | CUDA_VISIBLE_DEVICES | GPU_DEVICE_ORDINAL | ROCR_VISIBLE_DEVICES)
                printf 'export %s=%q\n' "$v" "${!v}" ;;
        esac
    done
} >"$d/step.sh.$$" && mv -f -- "$d/step.sh.$$" "$d/step.sh"
exec "$sshd" -i -e -f "$d/sshd_config" "${extra[@]}"
""".replace("SFTP_SERVERS", " ".join(SFTP_SERVERS))

# sshd's ForceCommand: every session starts here, with $SSH_ORIGINAL_COMMAND what the client asked
# for (a command line, a subsystem's program such as sftp-server, or nothing: a shell).
LOGIN = r"""d=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
env_file=ENV_FILE
work=WORK_DIR
[ ! -r "$d/step.sh" ] || . "$d/step.sh"
cmd=${SSH_ORIGINAL_COMMAND-}
# A session in an image (rv up --container) left how to enter it beside its environment file: every
# connection lands inside (VS Code's server, its terminals and extensions), this script run again
# there; not sftp's server, which is the node's (the files are the same: the remote root is bound).
c=${env_file%/*}/container.sh
if [ -r "$c" ] && [ -r "$env_file" ] && [ -z "${RV_IN_CONTAINER-}" ]; then
    case $cmd in
        */sftp-server* | internal-sftp*) ;;
        *)
            . "$c"
            cd -- "$work" 2>/dev/null || true
            export RV_IN_CONTAINER=1
            rv_in_container bash "${BASH_SOURCE[0]}"
            ;;
    esac
fi
if [ -r "$env_file" ]; then
    if [ -z "$cmd" ] && [ -t 0 ]; then exec bash --rcfile "$env_file" -i; fi
    . "$env_file" >/dev/null  # stdout is the client's: sftp's protocol, VS Code's installer
else
    echo "rv: job ${SLURM_JOB_ID:-?} saved no environment (still starting): a plain shell in its work dir" >&2
    cd -- "$work" 2>/dev/null || true
fi
[ -n "$cmd" ] || exec bash -s
exec bash -c "$cmd"
"""


def host_alias(profile: str, name: str) -> str:
    """The ``Host`` name of a session's entry: ``NAME.PROFILE.rv`` (never a real host's name)."""
    alias = f"{name}.{profile}{ALIAS_SUFFIX}"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", alias):
        raise UsageError(f"cannot make an SSH host name of session {name!r} of profile {profile!r}")
    return alias


@dataclass(frozen=True)
class LoginHop:
    """How OpenSSH reaches the login node as the profile does: its values over the user's SSH config
    (which OpenSSH reads itself: HostName, ProxyJump, ControlMaster and the rest)."""

    host: str
    port: int | None = None
    user: str | None = None
    identity_file: str | None = None
    known_hosts: str | None = None  # the profile's file; None: what the SSH config says
    ssh_config: str | None = None  # $RV_SSH_CONFIG: the SSH config rv itself reads

    def argv(self) -> list[str]:
        """``ssh`` and its options, up to and including the host: the remote command follows."""
        words = ["ssh"]
        if self.ssh_config:
            words += ["-F", self.ssh_config]
        if self.port:
            words += ["-p", str(self.port)]
        if self.user:
            words += ["-l", self.user]
        if self.identity_file:
            words += ["-i", self.identity_file]
        if self.known_hosts:
            words += ["-o", f"UserKnownHostsFile={self.known_hosts}"]
        # The login node's key is one rv has verified (it is in that file): never ask, never accept a
        # new one here. No terminal, no agent or X11 forwarding, none of the host's own forwards.
        words += ["-o", "StrictHostKeyChecking=yes", "-o", "ClearAllForwardings=yes", "-T", "-a", "-x"]
        return [*words, "--", self.host]


@dataclass(frozen=True)
class NodeEntry:
    """One session's ``Host`` block in rv's SSH config."""

    alias: str
    node: str
    user: str | None
    job_id: str
    run_name: str
    identity_files: tuple[str, ...]
    known_hosts: str  # rv's own file, holding the session's host key under ``alias``
    proxy_command: str

    def render(self) -> str:
        lines = [
            f"# rv: {self.alias} (session {self.run_name}, job {self.job_id} on {self.node}); "
            "rewritten by rv code",
            f"Host {self.alias}",
            f"    HostName {self.node}",
        ]
        if self.user:
            lines.append(f"    User {self.user}")
        lines += [f"    IdentityFile {_config_word(f)}" for f in self.identity_files]
        if self.identity_files:
            lines.append("    IdentitiesOnly yes")
        lines += [
            f"    HostKeyAlias {self.alias}",
            f"    UserKnownHostsFile {_config_word(self.known_hosts)}",
            "    StrictHostKeyChecking yes",
            "    CheckHostIP no",
            f"    ProxyCommand {self.proxy_command}",
        ]
        return "\n".join(lines) + "\n"


def _config_word(text: str) -> str:
    """A path as one word of an ssh_config line (double quotes where it has spaces)."""
    if '"' in text or "\n" in text:
        raise UsageError(f"rv cannot write the path {text!r} into an SSH config")
    return f'"{text}"' if " " in text else text


def proxy_command(hop: LoginHop, remote: Sequence[str]) -> str:
    """The ``ProxyCommand`` value: ssh to the login node running ``remote`` (argv) there.

    OpenSSH runs it with ``/bin/sh -c``, after expanding ``%`` tokens: ``%`` is doubled. The remote
    line is quoted once for the login node's shell, then the whole as one word for the local one.
    """
    line = " ".join(shlex.quote(w) for w in [*hop.argv(), " ".join(shlex.quote(w) for w in remote)])
    return line.replace("%", "%%")


def sshd_config(folder: str, *, run_name: str, job_id: str) -> str:
    """The session's sshd config (``folder`` holds its keys and scripts, on the cluster)."""
    q = shlex.quote
    return (
        f"# rv code: sshd of session {run_name} (job {job_id}), run as you in inetd mode (-i) by\n"
        "# launch.sh for each connection: it never listens on a port.\n"
        f"HostKey {posixpath.join(folder, 'host_key')}\n"
        f"AuthorizedKeysFile {posixpath.join(folder, 'authorized_keys')}\n"
        "AuthenticationMethods publickey\n"
        "PubkeyAuthentication yes\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "# Not root, sshd serves only its own user; the key files sit in rv's private run folder\n"
        "# (0700), whose parents (scratch, /tmp) are often world-writable, which StrictModes refuses.\n"
        "StrictModes no\n"
        "UsePAM no\n"
        "PidFile none\n"
        "PrintMotd no\n"
        "PermitUserEnvironment no\n"
        "X11Forwarding no\n"
        "# VS Code's Remote-SSH reaches the server it starts on the node through a forwarded port.\n"
        "AllowTcpForwarding yes\n"
        "AllowStreamLocalForwarding yes\n"
        "LogLevel ERROR\n"
        f"ForceCommand exec bash {q(posixpath.join(folder, 'login.sh'))}\n"
    )


def login_script(env_file: str, work_dir: str) -> str:
    return LOGIN.replace("ENV_FILE", shlex.quote(env_file)).replace("WORK_DIR", shlex.quote(work_dir))


def new_host_key() -> tuple[bytes, str]:
    """A fresh Ed25519 host key: (private key in OpenSSH's format, public key line ``ssh-ed25519 AAAA``).

    cryptography (paramiko's own dependency) writes both formats; no ssh-keygen is needed here or on
    the cluster."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return private, public.decode()


# --------------------------------------------------------------------------------------------------
# The user's public keys (what the node's sshd accepts)

_DEFAULT_KEYS = ("id_ed25519", "id_ecdsa", "id_rsa", "id_ed25519_sk", "id_ecdsa_sk")
_KEY_LINE = re.compile(r"^(ssh-|ecdsa-|sk-)\S+ [A-Za-z0-9+/=]+")


def public_keys(
    identity_files: Sequence[str],
    *,
    home: Path | None = None,
    run: Callable[[list[str]], subprocess.CompletedProcess[str]] | None = None,
) -> list[str]:
    """The public halves of the keys ssh will offer the node: those of ``identity_files`` (each
    ``FILE.pub``, else what ``ssh-keygen -y`` derives); with none, the default keys' and the agent's."""
    runner = run or _run
    found: list[str] = []
    if identity_files:
        for path in identity_files:
            pub = Path(path + ".pub")
            if pub.is_file():
                found += _key_lines(pub.read_text(encoding="utf-8", errors="replace"))
                continue
            derived = runner(["ssh-keygen", "-y", "-P", "", "-f", path])
            lines = _key_lines(derived.stdout) if derived.returncode == 0 else []
            if not lines:
                raise UsageError(
                    f"no public key for the identity {path}: {pub} is missing and the key is protected",
                    hint=f"write it once: ssh-keygen -y -f {shlex.quote(path)} > {shlex.quote(str(pub))}",
                )
            found += lines
    else:
        ssh_dir = (home or Path.home()) / ".ssh"
        for name in _DEFAULT_KEYS:
            pub = ssh_dir / f"{name}.pub"
            if pub.is_file():
                found += _key_lines(pub.read_text(encoding="utf-8", errors="replace"))
        if os.environ.get("SSH_AUTH_SOCK"):
            agent = runner(["ssh-add", "-L"])
            if agent.returncode == 0:
                found += _key_lines(agent.stdout)
    unique = list(dict.fromkeys(found))
    if not unique:
        raise UsageError(
            "no SSH public key found to log in to the node with",
            hint="name your key in the profile: rv init --identity-file ~/.ssh/id_ed25519",
        )
    return unique


def _key_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if _KEY_LINE.match(line.strip())]


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(argv, 1, "", str(exc))


# --------------------------------------------------------------------------------------------------
# rv's own files under ~/.ssh/rv, and the one Include line in ~/.ssh/config


@dataclass(frozen=True)
class SshFiles:
    """``~/.ssh/rv/config`` (the sessions' entries) and ``~/.ssh/rv/known_hosts`` (their host keys),
    both rv's alone, and the user's ``~/.ssh/config``, which gets one ``Include`` line for the first."""

    ssh_dir: Path

    @classmethod
    def for_home(cls, home: Path | None = None) -> SshFiles:
        return cls((home or Path.home()) / ".ssh")

    @property
    def folder(self) -> Path:
        return self.ssh_dir / "rv"

    @property
    def config(self) -> Path:
        return self.folder / "config"

    @property
    def known_hosts(self) -> Path:
        return self.folder / "known_hosts"

    @property
    def user_config(self) -> Path:
        return self.ssh_dir / "config"

    @property
    def include_line(self) -> str:
        return f"Include {_config_word(str(self.config))}"

    def write_entry(self, entry: NodeEntry, host_key: str, *, drop: Iterable[str] = ()) -> None:
        """Add (or replace) ``entry`` and its host key; remove the entries named in ``drop``."""
        gone = {entry.alias, *drop}
        try:
            kept = "".join(block for alias, block in split_entries(_read(self.config)) if alias not in gone)
            _write_private(self.config, CONFIG_HEADER + kept + entry.render() + "\n")
            keys = [
                line
                for line in _read(self.known_hosts).splitlines(keepends=True)
                if line.split(" ", 1)[0] not in gone
            ]
            _write_private(self.known_hosts, "".join(keys) + f"{entry.alias} {host_key}\n")
        except OSError as exc:
            raise RvError(
                f"cannot write rv's SSH files in {self.folder}: {exc.strerror or exc}",
                hint=f"{self.folder} must be a folder of yours (rv keeps its sessions' SSH entries there)",
            ) from exc

    def aliases(self) -> list[str]:
        return [alias for alias, _ in split_entries(_read(self.config))]

    def check(self) -> None:
        """Before anything is started: both configs read as ssh reads them (bytes, quotes), and rv's
        paths writable into a config. A UsageError names the file, the line and what to do."""
        for path in (self.user_config, self.config):
            try:
                config_lines(_read(path))
            except OSError as exc:
                raise UsageError(
                    f"cannot read {path}: {exc.strerror or exc}; nothing was started",
                    hint=f"{path} must be a file you can read (or not be there at all)",
                ) from None
            except ConfigSyntaxError as exc:
                raise UsageError(
                    f"{path} line {exc.line}: {exc.reason}: ssh refuses this file too, so rv code would "
                    "start a session nothing can reach; nothing was started",
                    hint="fix that line (ssh -G HOST says the same), then run rv code again",
                ) from None
        _config_word(str(self.known_hosts))
        _config_word(str(self.config))

    def has_include(self) -> bool:
        """Does the user's ``~/.ssh/config`` include rv's file already (in any spelling), at its top
        level (before any ``Host``/``Match`` line)?"""
        return includes(_read(self.user_config), self.config, self.ssh_dir)

    def add_include(self) -> Path:
        """Put the ``Include`` line at the top of the user's config (the file it links to, if a
        link), keeping the rest and its mode. Nothing when the line is there. Returns the file."""
        path = self.user_config.resolve() if self.user_config.is_symlink() else self.user_config
        text = _read(path)
        if includes(text, self.config, self.ssh_dir):
            return path
        mode = path.stat().st_mode & 0o777 if path.exists() else 0o600
        _write_private(path, with_include(text, self.include_line), mode=mode)
        return path


CONFIG_HEADER = "# Written by rv (rv code): one Host block per session; rv rewrites it, edits are lost.\n\n"
_MARK = re.compile(r"^# rv: (\S+) ", re.MULTILINE)


def split_entries(text: str) -> list[tuple[str, str]]:
    """rv's config as (alias, block) pairs, each block from its ``# rv: ALIAS`` line to the next."""
    marks = list(_MARK.finditer(text))
    return [
        (m.group(1), text[m.start() : marks[i + 1].start() if i + 1 < len(marks) else len(text)])
        for i, m in enumerate(marks)
    ]


class ConfigSyntaxError(ValueError):
    """A line ssh itself refuses (``invalid quotes``)."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line, self.reason = line, reason


def ssh_words(line: str) -> list[str]:
    """One ssh_config line's words as OpenSSH splits them (misc.c ``argv_split``, comments ending
    the line): spaces and tabs separate, single or double quotes group, a backslash escapes a quote,
    a backslash or (unquoted) a space; a word beginning with ``#`` ends the line. ValueError for a
    quote left open (ssh: "invalid quotes"). Not shlex: its escapes and comments are a shell's."""
    words: list[str] = []
    i, n = 0, len(line)
    while i < n:
        if line[i] in " \t\r\n\f":
            i += 1
            continue
        if line[i] == "#":
            break
        quote, word = "", []
        while i < n:
            c = line[i]
            if c == "\\" and i + 1 < n and (line[i + 1] in "'\"\\" or (not quote and line[i + 1] == " ")):
                word.append(line[i + 1])
                i += 2
                continue
            if not quote and c in " \t\r\n\f":
                break
            if not quote and c in "'\"":
                quote = c
            elif quote and c == quote:
                quote = ""
            else:
                word.append(c)
            i += 1
        if quote:
            raise ValueError("a quote is not closed")
        words.append("".join(word))
    return words


def config_lines(text: str) -> list[tuple[int, str, list[str]]]:
    """(line number, keyword in lower case, its arguments) of each line of an ssh_config that says
    something (``Keyword=value`` too). ConfigSyntaxError for a line ssh refuses."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            words = ssh_words(line)
        except ValueError as exc:
            raise ConfigSyntaxError(number, str(exc)) from None
        if not words:
            continue
        keyword, sep, rest = words[0].partition("=")
        args = ([rest] if rest else []) + words[1:]
        if not sep and args and args[0].startswith("="):  # `Keyword = value`, `Keyword =value`
            args = ([args[0][1:]] if args[0] != "=" else []) + args[1:]
        found.append((number, keyword.lower(), args))
    return found


def includes(text: str, target: Path, ssh_dir: Path) -> bool:
    """Is there an ``Include`` of ``target`` in ``text`` (absolute, ``~/``, relative to ~/.ssh, or a
    glob matching it) at the top level, before any ``Host`` or ``Match`` line? One inside a block
    counts only for that block's hosts (ssh reads it there alone): not rv's line. A line ssh would
    refuse is not read here (SshFiles.check says so before anything starts)."""
    import fnmatch

    home = str(ssh_dir.parent)
    try:
        lines = config_lines(text)
    except ConfigSyntaxError:
        return False
    for _, keyword, args in lines:
        if keyword in ("host", "match"):
            return False
        if keyword != "include":
            continue
        for word in args:
            path = word.replace("~", home, 1) if word.startswith("~") else word
            full = os.path.normpath(Path(path) if os.path.isabs(path) else ssh_dir / path)
            if full == os.path.normpath(target) or fnmatch.fnmatchcase(os.path.normpath(target), full):
                return True
    return False


def with_include(text: str, line: str) -> str:
    """``text`` with ``line`` at its very top.

    At the top, not the end: OpenSSH applies an ``Include`` where it stands, so one below a ``Host``
    or ``Match`` line would count only for the hosts that line matches; and for each option the
    first value found wins, so a ``Host *`` block above rv's entries would override them."""
    comment = "# rv code's sessions (rv writes this file; remove both lines to stop using it)\n"
    return comment + line + "\n" + ("\n" + text if text.strip() else "")


def _read(path: Path) -> str:
    """A config's text as ssh reads it, bytes: those that are not UTF-8 (a latin-1 comment, which ssh
    takes) kept as surrogates, and written back as they were (:func:`_write_private`)."""
    try:
        return path.read_bytes().decode("utf-8", "surrogateescape")
    except FileNotFoundError:
        return ""


def _write_private(path: Path, text: str, *, mode: int = 0o600) -> None:
    """Write atomically, ``mode`` from the first byte; folders made 0700 (ssh refuses config files
    others may write)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.rv-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as fh:
            fh.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
