"""`rv env set|list|rm|import`: secrets for jobs, stored on this machine with mode 0600."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from rv.cli.common import note, print_json

if TYPE_CHECKING:
    from rv.secrets import SecretStore


def _store() -> SecretStore:
    from rv.config import state_dir
    from rv.secrets import SecretStore

    return SecretStore(state_dir() / "secrets.json")


@click.group()
def env() -> None:
    """Secrets passed to every job as environment variables (never in scripts, argv or logs)."""


@env.command("set")
@click.argument("assignment")
@click.argument("value", required=False)
def env_set(assignment: str, value: str | None) -> None:
    """Set KEY=VALUE (or KEY VALUE; with only KEY, the value is read without echo)."""
    key, sep, inline = assignment.partition("=")
    if sep:
        value = inline
    elif value is None:
        value = click.prompt(f"Value for {key}", hide_input=True, err=True)
    _store().set(key, value)
    note(f"set {key}")


@env.command("list")
@click.option("--json", "as_json", is_flag=True)
def env_list(as_json: bool) -> None:
    """List the variables, values masked."""
    from rv.secrets import mask

    values = {k: mask(v) for k, v in sorted(_store().load().items())}
    if as_json:
        print_json(values)
        return
    if not values:
        note("no variables set: rv env set KEY=VALUE")
    for key, masked in values.items():
        click.echo(f"{key}={masked}")


@env.command("rm")
@click.argument("keys", nargs=-1, required=True)
def env_rm(keys: tuple[str, ...]) -> None:
    """Remove variables."""
    from rv.errors import NotFound

    store = _store()
    missing = [k for k in keys if k not in store.load()]
    if missing:
        raise NotFound(f"not set: {', '.join(missing)}", hint="`rv env list` shows what is set")
    for key in keys:
        store.remove(key)
    note(f"removed {', '.join(keys)}")


@env.command("import")
@click.argument("path", default=".env", type=click.Path(dir_okay=False))
def env_import(path: str) -> None:
    """Import KEY=VALUE lines from a .env file (default ./.env)."""
    from rv.errors import NotFound
    from rv.secrets import parse_dotenv

    p = Path(path)
    if not p.exists():
        raise NotFound(f"{path} does not exist")
    values = parse_dotenv(p.read_text(encoding="utf-8"))
    store = _store()
    merged = store.load()
    merged.update(values)
    store.save(merged)
    note(f"imported {len(values)} variable(s) from {path}: {', '.join(sorted(values))}")
