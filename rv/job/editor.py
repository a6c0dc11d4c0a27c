"""`rv code`'s core: make a running session's node reachable by plain OpenSSH (rv.remote.nodessh).

One round trip to the cluster: the session's sshd files (config, a fresh host key, the authorized
public keys, the two scripts) go to ``<run>/node-ssh/`` as one tar stream, and in the same call a
step of the job checks that the node has an sshd that accepts them (``sshd -t``). Then rv's SSH
config and known_hosts get the session's entry; the user's ``~/.ssh/config`` is the CLI's to touch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rv.errors import RemoteError
from rv.job.inside import RunningJob
from rv.job.serve import put_folder, session_folder
from rv.remote import nodessh
from rv.slurm import commands

if TYPE_CHECKING:
    from rv.remote.transport import Transport

CHECK_OK = "rv-node-ssh-ok"


@dataclass(frozen=True)
class NodeHost:
    """A session's node as plain OpenSSH reaches it."""

    entry: nodessh.NodeEntry
    work_dir: str  # where the editor opens by default: the run's work dir on the node
    sftp: bool  # an sftp-server was found on the node (scp and sftp work)

    @property
    def alias(self) -> str:
        return self.entry.alias


def node_ssh(
    transport: Transport,
    rj: RunningJob,
    *,
    profile: str,
    hop: nodessh.LoginHop,
    user: str | None,
    identity_files: Sequence[str],
    public_keys: Sequence[str],
    files: nodessh.SshFiles,
    drop: Sequence[str] = (),
) -> NodeHost:
    """Set up the session's sshd on the cluster and its entry in rv's SSH files (``drop``: entries
    of ended sessions to remove meanwhile)."""
    node = rj.nodes[0]
    folder = session_folder(rj, nodessh.SESSION_DIR)
    private, public = nodessh.new_host_key()
    place = rj.place
    config = nodessh.sshd_config(folder, run_name=rj.name, job_id=rj.job_id)
    launch = f"{folder}/launch.sh"
    check = commands.shell(commands.srun_attach(rj.job_id, node, ["bash", launch, "--check"]))
    result = put_folder(
        transport,
        folder,
        {
            "sshd_config": (config.encode(), 0o600),
            "host_key": (private, 0o600),
            "host_key.pub": (public.encode() + b"\n", 0o600),
            "authorized_keys": ("".join(k + "\n" for k in public_keys).encode(), 0o600),
            "launch.sh": (nodessh.LAUNCH.encode(), 0o600),
            "login.sh": (nodessh.login_script(place.env_file, place.work_dir).encode(), 0o600),
        },
        then=f"{check} && echo {CHECK_OK}",
    )
    if result.exit_code != 0 or CHECK_OK not in result.out:
        detail = " / ".join(result.err.strip().splitlines()[-3:]) or "no message"
        raise RemoteError(
            f"plain ssh cannot reach node {node} of session {rj.name} (job {rj.job_id}): {detail}",
            hint=f"rv ssh {rj.name} gives a shell there, and rv forward PORT {rj.name} a port",
        )
    said = dict(w.split("=", 1) for w in result.out.split() if "=" in w)
    remote = commands.srun_attach(rj.job_id, node, ["bash", launch])
    # srun's output is a pipe carrying the SSH protocol: no line buffering, nothing of srun's own.
    remote[1:1] = ["--unbuffered", "--quiet"]
    entry = nodessh.NodeEntry(
        alias=nodessh.host_alias(profile, rj.name),
        node=node,
        user=user,
        job_id=rj.job_id,
        run_name=rj.name,
        identity_files=tuple(identity_files),
        known_hosts=str(files.known_hosts),
        proxy_command=nodessh.proxy_command(hop, remote),
    )
    files.write_entry(entry, public, drop=drop)
    return NodeHost(entry=entry, work_dir=place.work_dir, sftp=bool(said.get("sftp")))
