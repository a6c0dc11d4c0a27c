"""`rv init`: connect to a cluster, learn what it has, save a profile."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from rv.cli.common import err_console, escape, note, print_json, warn
from rv.errors import UsageError

if TYPE_CHECKING:
    from rv.config import Profile

RIVANNA_HOST = "login.hpc.virginia.edu"


def _default_profile_name(host: str) -> str:
    from rv.probe import is_rivanna

    return "rivanna" if is_rivanna(host) else host.split(".")[0] or "default"


@click.command()
@click.option("--profile", "profile_name", help="Name of the profile to write (default: from the host).")
@click.option("--host", help=f"Login node, or a Host alias from ~/.ssh/config (e.g. {RIVANNA_HOST}).")
@click.option("--port", type=click.IntRange(1, 65535), help="SSH port (default: ~/.ssh/config, else 22).")
@click.option("--user", help="User on the cluster (default: ~/.ssh/config, else your local user).")
@click.option(
    "--identity-file", type=click.Path(dir_okay=False), help="Private key (default: agent and ~/.ssh)."
)
@click.option(
    "--known-hosts", type=click.Path(dir_okay=False), help="known_hosts file (default ~/.ssh/known_hosts)."
)
@click.option("--account", help="Slurm account to charge (default: found with sacctmgr/allocations).")
@click.option(
    "--remote-root", help="Where rv keeps snapshots, logs and checkpoints (default /scratch/$USER/rv)."
)
@click.option(
    "--setup", "setup", multiple=True, help="Shell line run at the start of every job (repeatable)."
)
@click.option(
    "--catalog",
    type=click.Choice(["auto", "rivanna", "discovered"]),
    default="auto",
    show_default=True,
    help="GPU catalog: built-in Rivanna, or discovered from sinfo.",
)
@click.option(
    "--default/--no-default",
    "make_default",
    default=None,
    help="Make this the default profile (default: yes if it is the first).",
)
@click.option(
    "--share-with-group/--private",
    default=None,
    help="Let your Unix group read what rv writes on the cluster (default: --private, only you can).",
)
@click.option(
    "--system-site-packages/--no-system-site-packages",
    default=None,
    help="Build job environments on top of the setup's interpreter and its packages (a site's torch "
    "module), so they are not downloaded again (default: no).",
)
@click.option("--yes", "-y", is_flag=True, help="Non-interactive: accept the host key, ask nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the saved profile as JSON.")
def init(
    profile_name: str | None,
    host: str | None,
    port: int | None,
    user: str | None,
    identity_file: str | None,
    known_hosts: str | None,
    account: str | None,
    remote_root: str | None,
    setup: tuple[str, ...],
    catalog: str,
    make_default: bool | None,
    share_with_group: bool | None,
    system_site_packages: bool | None,
    yes: bool,
    as_json: bool,
) -> None:
    """Connect rv to a Slurm cluster and save a profile.

    Interactive by default; fully non-interactive with --yes:

    \b
      rv init --profile mylab --host login.example.edu --user me --yes
    """
    from rv.config import load_config, save_config
    from rv.probe import build_profile, check_remote_root, prepare_remote_root, probe
    from rv.remote.sshconfig import check_host, resolve_target
    from rv.remote.transport import GROUP_MASK, PRIVATE_MASK

    interactive = not yes and sys.stdin.isatty()
    if host is None:
        if not interactive:
            raise UsageError(
                "--host is required with --yes (or without a terminal)",
                hint=f"rv init --host {RIVANNA_HOST} --yes",
            )
        host = click.prompt("Cluster login host", default=RIVANNA_HOST, err=True)
        user = user or click.prompt("User on the cluster", default="", show_default=False, err=True) or None
    assert host is not None
    check_host(host)
    if remote_root is not None:
        check_remote_root(remote_root)
    name = profile_name or _default_profile_name(host)
    config = load_config(missing_ok=True)  # a broken config fails here, before we connect
    if share_with_group is None:  # rerunning init keeps what the profile said
        previous = config.profiles.get(name)
        share_with_group = bool(previous and previous.share_with_group)
    if system_site_packages is None:
        previous = config.profiles.get(name)
        system_site_packages = bool(previous and previous.system_site_packages)
    _check_key_files(identity_file, known_hosts)

    def confirm(host_name: str, key_type: str, fp: str) -> bool:
        err_console.print(f"Host key of [bold]{escape(host_name)}[/]: {escape(key_type)} {fp}")
        if yes:
            note("accepted (--yes) and saved to known_hosts")
            return True
        return interactive and click.confirm("Trust this host key?", default=False, err=True)

    target = resolve_target(host, port=port, user=user, identity_file=identity_file, known_hosts=known_hosts)
    started = time.monotonic()
    from rv.remote.ssh import SSHTransport

    mask = GROUP_MASK if share_with_group else PRIVATE_MASK
    with SSHTransport(target, confirm, mask=mask).connect() as transport:
        latency_ms = (time.monotonic() - started) * 1000
        with err_console.status("Asking the cluster what it has..."):
            facts = probe(transport)
        if interactive and not account and len(facts.accounts) > 1:
            account = click.prompt(
                "Slurm account", type=click.Choice(list(facts.accounts)), default=facts.account, err=True
            )
        profile = build_profile(
            name=name,
            host=host,
            port=port,
            user=user,
            identity_file=identity_file,
            known_hosts=known_hosts,
            account=account,
            remote_root=remote_root,
            setup=setup,
            catalog=catalog,
            facts=facts,
            share_with_group=share_with_group,
            system_site_packages=system_site_packages,
        )
        prepare_remote_root(transport, profile.require_remote_root(), share_with_group)
    if facts.git_problem:
        warn(facts.git_problem)
    first = not config.profiles
    save_config(config.with_profile(profile, make_default if make_default is not None else first))

    if as_json:
        print_json(_profile_json(profile, config.path, host, facts.user))
        return
    for line in _profile_lines(profile, config.path, facts, target, remote_root, latency_ms):
        click.echo(line)


def _check_key_files(identity_file: str | None, known_hosts: str | None) -> None:
    """The key and known_hosts files named: their folders exist, and the key itself does."""
    for path in (identity_file, known_hosts):
        if path and not Path(path).expanduser().parent.exists():
            raise UsageError(f"folder of {path} does not exist")
    if identity_file and not Path(identity_file).expanduser().is_file():
        raise UsageError(
            f"identity file {identity_file} does not exist",
            hint="pass the path of your private key, e.g. ~/.ssh/id_ed25519",
        )


def _profile_json(profile: Profile, config_path: Path, host: str, user: str | None) -> dict[str, Any]:
    """`rv init --json`: the saved profile."""
    return {
        "profile": profile.name,
        "config": str(config_path),
        "host": host,
        "user": user,
        "account": profile.account,
        "remote_root": profile.remote_root,
        "share_with_group": profile.share_with_group,
        "system_site_packages": profile.system_site_packages,
        "catalog": profile.catalog,
        "gpus": {n: g.to_dict() for n, g in profile.gpu_catalog().items()},
        "partitions": {n: p.to_dict() for n, p in profile.partitions.items()},
    }


def _profile_lines(
    profile: Profile, config_path: Path, facts: Any, target: Any, remote_root: str | None, latency_ms: float
) -> list[str]:
    """`rv init`'s report of the saved profile: what rv found, and what to type next."""
    from rv.probe import usable_lines

    gpus = profile.gpu_catalog()
    gpu_line = (
        ", ".join(f"{n} ({g.gpus_per_node}/node, {g.partition})" for n, g in gpus.items()) or "none found"
    )
    lines = [
        f"Saved profile {profile.name!r} to {config_path}",
        f"  host         {facts.user}@{target.hostname}:{target.port} ({latency_ms:.0f} ms to connect)",
        f"  account      {profile.account or '(none found: pass --account)'}",
    ]
    for label, text in usable_lines(facts.accounts, facts.associations, {}):  # partitions: below
        lines.append(f"  {label:<12} {text}")
    expanded = f" (from {remote_root})" if remote_root and remote_root != profile.remote_root else ""
    access = "you and your group can read it" if profile.share_with_group else "only you can read it"
    lines.append(f"  remote root  {profile.remote_root}{expanded}; {access}")
    lines.append(f"  catalog      {profile.catalog}: {gpu_line}")
    if profile.partitions:
        # What rv refuses before sending: a job over its partition's time limit or node count.
        parts = [
            f"{p.name}{' (default, CPU jobs)' if p.default else ''}: "
            f"{p.max_time or 'no time limit'}, {p.nodes if p.nodes is not None else '?'} node(s)"
            + (f", at most {p.max_nodes} per job" if p.max_nodes is not None else "")
            + (f", QOS {p.qos} {p.qos_max_time}" if p.qos_max_time else "")
            for p in profile.partitions.values()
        ]
        lines.append(f"  partitions   {'; '.join(parts)}")
    runtimes = ", ".join(facts.container_runtimes) or "none on the login PATH (a module may load one)"
    lines.append(f"  containers   {runtimes}")
    if profile.setup:
        lines.append(f"  setup        {'; '.join(profile.setup)}")
    if profile.system_site_packages:
        lines.append("  envs         built on top of the setup's interpreter and its packages")
    lines.append("Next: rv exec sinfo    rv run -g 1 -- python train.py")
    return lines
