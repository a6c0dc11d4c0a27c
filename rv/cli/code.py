"""`rv code [PATH]`: VS Code (or another editor) on a node of a live `rv up` session, by plain SSH."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from typing import TYPE_CHECKING

import click

from rv.cli.common import note, run_store, session, warn
from rv.cli.upsession import SessionCommand, check_container, held_session

if TYPE_CHECKING:
    from rv.remote.nodessh import SshFiles


@click.command(cls=SessionCommand)
@click.argument("path", required=False)
@click.option(
    "--editor",
    default="code",
    show_default=True,
    help="The editor's command: code, cursor, windsurf, codium, ... (one taking --remote ssh-remote+HOST).",
)
@click.option("--yes", is_flag=True, help="Add the Include line to ~/.ssh/config without asking.")
@click.option("--new", is_flag=True, help="Start a new session even when one is live.")
@click.pass_context
def code(ctx: click.Context, /, path: str | None, editor: str, yes: bool, new: bool, **_: object) -> None:
    """Open an editor on a node of a live session, through plain SSH (VS Code's Remote-SSH).

    Reuses the newest live session that rv code or rv jupyter started (--name: that one), or starts
    one as `rv up --detach` would, with rv up's options (-g, -t, --time, placement, ...). rv writes
    an entry for the session's node in ~/.ssh/rv/config (the first time it asks to add one
    `Include` line for it at the top of ~/.ssh/config), so `ssh HOST`, scp and Remote-SSH reach the
    node through the login node, inside the job: what they run sees its GPUs and its environment.
    PATH: where the editor opens on the node (default: the run's work dir; relative: inside it).
    With --container IMAGE (rv up's) every connection lands inside the image, in the job's environment.
    The session lasts until `rv stop NAME` or its time limit.

    \b
      rv code                         VS Code on a new (or the live) session's node
      rv code -g 1 -t a6000 --time 4h
      rv code --editor cursor
    """
    from rv.errors import UsageError
    from rv.job import editor as core
    from rv.job.serve import remember
    from rv.remote import nodessh
    from rv.remote.connect import target_for

    if not editor or any(c.isspace() for c in editor):
        raise UsageError(f"--editor {editor!r}: one command name", hint="e.g. --editor cursor")
    check_container(ctx, "code")
    files = nodessh.SshFiles.for_home()
    files.check()  # ~/.ssh/config read as ssh reads it, before anything is started
    store = run_store()
    with session(ctx) as s:
        profile = s.profile
        target = target_for(profile, s.config.path)
        keys = nodessh.public_keys(target.identity_files)  # before anything is started: a clear error
        hop = nodessh.LoginHop(
            host=profile.host, port=profile.port, user=profile.user, identity_file=profile.identity_file,
            known_hosts=profile.known_hosts, ssh_config=os.environ.get("RV_SSH_CONFIG"),
        )  # fmt: skip
        # From here a session may be running: one this command started is stopped on any failure.
        with held_session(ctx, s, base="code", new=new) as rj:
            ended = [
                nodessh.host_alias(profile.name, r.name)
                for r in store.all(profile.name)
                if r.ended is not None and r.serves.get("editor_host")
            ]
            host = core.node_ssh(
                s.transport, rj, profile=profile.name, hop=hop, user=target.user,
                identity_files=target.identity_files, public_keys=keys, files=files, drop=ended,
            )  # fmt: skip
            where = (
                host.work_dir if not path else (path if path.startswith("/") else f"{host.work_dir}/{path}")
            )
            remember(store, rj, profile.name, editor_host=host.alias, editor_path=where)
            if not host.sftp:
                warn(f"node {host.entry.node} has no sftp-server: scp needs -O (the old protocol) there")
            _include(files, yes=yes)
    click.echo(host.alias)
    line = [editor, "--remote", f"ssh-remote+{host.alias}", where]
    found = shutil.which(editor)
    if found is None:
        note(
            f"{editor} is not on PATH. The session's node is the SSH host {host.alias}:\n"
            f"  ssh {host.alias}\n  {shlex.join(line)}"
        )
        return
    note(f"opening {editor} on {host.alias}:{where} (ssh {host.alias} reaches the node too)")
    sys.stdout.flush()
    ctx.exit(subprocess.run([found, *line[1:]], check=False).returncode)


def _include(files: SshFiles, *, yes: bool) -> None:
    """One Include line for rv's file at the top of ~/.ssh/config: asked for once (or --yes)."""
    if files.has_include():
        return
    line = files.include_line
    if not yes:
        if not sys.stdin.isatty():
            warn(
                f"~/.ssh/config does not include rv's SSH config: add this line at its top\n  {line}\n"
                "(or run rv code --yes); until then: ssh -F ~/.ssh/rv/config HOST"
            )
            return
        if not click.confirm(
            f"Add `{line}` at the top of {files.user_config}, so that ssh and VS Code find rv's sessions?",
            default=True,
            err=True,
        ):
            warn(f"not added; ssh -F {files.config} HOST reaches the session meanwhile")
            return
    changed = files.add_include()
    note(f"added `{line}` at the top of {changed}")
