"""`rv env set|list|rm|import|move`: secrets for jobs, stored on this machine with mode 0600.

A secret belongs to one profile (the one `--profile`, `rv -p` or the config's default names), or to
every profile with ``--global``. A job gets its profile's secrets and the global ones.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from rv.cli.common import note, print_json, warn

if TYPE_CHECKING:
    from rv.secrets import SecretStore


def _store() -> SecretStore:
    from rv.config import state_dir
    from rv.secrets import SecretStore

    return SecretStore(state_dir() / "secrets.json", notice=warn)


def _scope_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option(
        "--global",
        "is_global",
        is_flag=True,
        help="For jobs on every profile (default: only the current profile's jobs).",
    )(f)
    return click.option(
        "--profile",
        "-p",
        "profile_name",
        help="The profile (cluster) the secrets belong to (default: rv's --profile, else the config's "
        "default).",
    )(f)


def _profile(ctx: click.Context, explicit: str | None, store: SecretStore, *, required: bool) -> str | None:
    """The profile a command is about: --profile here, else `rv -p`/$RV_PROFILE, else the default.

    A profile that is gone from the config but still holds secrets can be named, to list or remove
    them. None (only when not ``required``) when there is no config at all.
    """
    from rv.config import load_config
    from rv.errors import ConfigError

    name = explicit or (ctx.find_root().obj or {}).get("profile")
    config = load_config(missing_ok=True)
    if name is not None and name not in config.profiles and name in store.profiles():
        return name
    if not config.profiles and name is None:
        if not required:
            return None
        raise ConfigError(
            "no profile to keep this secret for: secrets belong to a profile (a cluster)",
            hint="run `rv init` first, or pass --global to send it to jobs on every profile",
        )
    return config.profile(name).name


def _scope(ctx: click.Context, is_global: bool, profile_name: str | None, store: SecretStore) -> str | None:
    """The scope a change goes to: None for --global, else the profile."""
    if is_global:
        if profile_name is not None:
            from rv.errors import UsageError

            raise UsageError("--global and --profile name two different scopes", hint="give one of them")
        return None
    return _profile(ctx, profile_name, store, required=True)


def _where(profile: str | None) -> str:
    return "global (every profile)" if profile is None else f"profile {profile}"


@click.group()
def env() -> None:
    """Secrets passed to jobs as environment variables (never in scripts, argv or logs).

    Each belongs to one profile (cluster), or with --global to all of them; a job gets its profile's
    secrets and the global ones, its profile's winning when both set one name.
    """


@env.command("set")
@click.argument("assignment")
@click.argument("value", required=False)
@_scope_options
@click.pass_context
def env_set(
    ctx: click.Context, assignment: str, value: str | None, is_global: bool, profile_name: str | None
) -> None:
    """Set NAME=VALUE, or NAME VALUE, for the current profile's jobs (--global: every profile's).

    With only NAME the value is read from standard input when it is piped in, all of it, less one
    final newline (a multi-line PEM key keeps its lines); in a terminal it is typed without echo.
    Names rv or Slurm set in a job (RV_*, SLURM_*, MASTER_PORT, ...) and names that decide how the
    job runs (PATH, HOME, LD_*, PYTHON*, ...) are refused.
    """
    from rv.secrets import check_name, check_value, read_piped_value

    store = _store()
    key, sep, inline = assignment.partition("=")
    # Name, scope and size first: nothing is asked for or read when it would be refused anyway.
    check_name(key)
    scope = _scope(ctx, is_global, profile_name, store)
    if sep:
        value = inline
    elif value is None:
        if sys.stdin.isatty():
            value = click.prompt(f"Value for {key}", hide_input=True, err=True)
        else:
            # Read here, not with a prompt: getpass reads one line and warns that input may echo.
            value = read_piped_value(sys.stdin.buffer.read(), key)
    check_value(key, value)
    shadowed = scope is not None and key in store.scope(None)
    store.set(key, value, scope)
    note(f"set {key} for {_where(scope)}" + (" (over the global one)" if shadowed else ""))


@env.command("list")
@_scope_options
@click.option("--all", "show_all", is_flag=True, help="Every secret of every profile, and the global ones.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def env_list(
    ctx: click.Context, is_global: bool, profile_name: str | None, show_all: bool, as_json: bool
) -> None:
    """List what a job on the current profile gets, values masked, and where each comes from."""
    from rv.secrets import Secret, mask

    store = _store()
    profile: str | None = None
    if show_all:
        secrets = store.entries()
    elif is_global:
        _scope(ctx, is_global, profile_name, store)
        secrets = [Secret(k, v, None) for k, v in sorted(store.scope(None).items())]
    else:
        profile = _profile(ctx, profile_name, store, required=False)
        secrets = store.entries() if profile is None else list(store.for_profile(profile).values())
    glob = store.scope(None)
    rows = [
        {
            "name": s.name,
            "value": mask(s.value),
            "scope": "global" if s.profile is None else "profile",
            "profile": s.profile,
            "over_global": s.profile is not None and s.name in glob,
        }
        for s in secrets
    ]
    if as_json:
        print_json(rows)
        return
    if not rows:
        where = f" for profile {profile}" if profile else ""
        note(f"no secrets{where}: rv env set NAME=VALUE (or --global for every profile)")
    for row in rows:
        scope = "global" if row["profile"] is None else f"profile {row['profile']}"
        over = ", over the global one" if row["over_global"] else ""
        click.echo(f"{row['name']}={row['value']}  ({scope}{over})")


@env.command("rm")
@click.argument("keys", nargs=-1, required=True)
@_scope_options
@click.pass_context
def env_rm(ctx: click.Context, keys: tuple[str, ...], is_global: bool, profile_name: str | None) -> None:
    """Remove secrets of the current profile (--global: the global ones)."""
    from rv.errors import NotFound

    store = _store()
    scope = _scope(ctx, is_global, profile_name, store)
    missing = store.remove(list(keys), scope)
    if missing:
        glob = store.scope(None)
        elsewhere = [k for k in missing if scope is not None and k in glob]
        hint = (
            f"{', '.join(elsewhere)} {'is' if len(elsewhere) == 1 else 'are'} global: "
            f"rv env rm --global {' '.join(elsewhere)}"
            if elsewhere
            else "`rv env list --all` shows what is set, and where"
        )
        raise NotFound(f"not set for {_where(scope)}: {', '.join(missing)}; nothing removed", hint=hint)
    note(f"removed {', '.join(keys)} from {_where(scope)}")


@env.command("import")
@click.argument("path", default=".env", type=click.Path(dir_okay=False))
@_scope_options
@click.pass_context
def env_import(ctx: click.Context, path: str, is_global: bool, profile_name: str | None) -> None:
    """Import NAME=VALUE lines from a .env file (default ./.env) for the current profile's jobs.

    A line that is not UTF-8 text is skipped and named by its number; the others are imported.
    """
    from rv.errors import NotFound, UsageError
    from rv.secrets import DotenvLine, parse_dotenv, reserved_reason

    p = Path(path)
    if not p.exists():
        raise NotFound(f"{path} does not exist")
    store = _store()
    scope = _scope(ctx, is_global, profile_name, store)
    skipped: list[DotenvLine] = []
    values = parse_dotenv(p.read_bytes(), skipped=skipped)
    refused = [(k, reason) for k in values if (reason := reserved_reason(k)) is not None]
    if refused:
        raise UsageError(
            f"{path}: nothing imported; these cannot be secrets: "
            + "; ".join(f"{k}: {reason}" for k, reason in refused),
            hint="remove those lines (set such variables with `rv run --setup 'export NAME=...'` if you "
            "mean to) and import again",
        )
    for line in skipped:
        warn(f"{path} line {line.number} is {line.problem}: skipped (save the file as UTF-8 to import it)")
    store.update(values, scope)
    note(f"imported {len(values)} variable(s) from {path} for {_where(scope)}: {', '.join(sorted(values))}")


@env.command("move")
@click.argument("keys", nargs=-1, required=True)
@_scope_options
@click.pass_context
def env_move(ctx: click.Context, keys: tuple[str, ...], is_global: bool, profile_name: str | None) -> None:
    """Give global secrets to the current profile only (--global: make its secrets global).

    \b
      rv env move HF_TOKEN -p rivanna     HF_TOKEN goes to rivanna's jobs only
      rv env move HF_TOKEN --global       the current profile's HF_TOKEN goes to every profile
    """
    from rv.errors import NotFound

    store = _store()
    profile = _profile(ctx, profile_name, store, required=True)
    source, target = (profile, None) if is_global else (None, profile)
    missing = store.move(list(keys), source, target)
    if missing:
        raise NotFound(
            f"not set for {_where(source)}: {', '.join(missing)}; nothing moved",
            hint="`rv env list --all` shows what is set, and where",
        )
    note(f"moved {', '.join(keys)} from {_where(source)} to {_where(target)}")
