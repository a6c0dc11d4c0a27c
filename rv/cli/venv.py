"""`rv venv ls|rm|build`: the Python environments rv builds on the cluster, one per set of dependencies.

`rv venv build` finds or builds one as `rv run` does (rv.job.launch.environment), with the same live
display (rv.cli.launchview)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from rv.cli.common import note, print_json, session


@click.group()
def venv() -> None:
    """Python environments rv builds on the cluster (shared by every run with the same dependencies)."""


@venv.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@click.pass_context
def ls(ctx: click.Context, as_json: bool) -> None:
    """List environments: key, size, built at, last used, what they were built from."""
    from rv.pyenv.client import list_envs
    from rv.units import human_size

    with session(ctx) as s:
        envs = list_envs(s.transport, s.layout)
    if as_json:
        print_json(envs)
        return
    if not envs:
        note("no environments yet: `rv run` builds one from requirements.txt or pyproject.toml")
        return
    click.echo(f"{'KEY':<17} {'SIZE':>9}  {'BUILT':<16}  {'LAST USED':<16}  {'PYTHON':<8} FROM")
    for env in envs:
        meta = env["meta"]
        built = time.strftime("%Y-%m-%d %H:%M", time.localtime(meta.get("built_at", 0)))
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(env["last_used"]))
        live = "  (in use)" if env.get("in_use") else ""
        extras = f" [{','.join(meta['extras'])}]" if meta.get("extras") else ""
        click.echo(
            f"{env['key']:<17} {human_size(env['bytes']):>9}  {built:<16}  {used:<16}  "
            f"{meta.get('python_version', '?'):<8} {meta.get('files')}{extras}{live}"
        )


@venv.command("rm")
@click.argument("key")
@click.option("--force", is_flag=True, help="Remove it even while a live run uses it.")
@click.pass_context
def rm(ctx: click.Context, key: str, force: bool) -> None:
    """Remove environment KEY (a prefix of it is enough); the next run that needs it rebuilds it."""
    from rv.pyenv.client import remove_env
    from rv.units import human_size

    with session(ctx) as s:
        reply = remove_env(s.transport, s.layout, key, force=force)
    note(f"removed environment {reply['key']} ({human_size(reply['bytes_freed'])})")


@venv.command("build")
@click.option("--requirements", metavar="FILE", help="Build from FILE (default: requirements.txt).")
@click.option(
    "--extra", "extras", multiple=True, help="A pyproject.toml optional-dependencies group (repeatable)."
)
@click.option(
    "--system-site-packages/--no-system-site-packages",
    default=None,
    help="On top of the interpreter's packages.",
)
@click.option("--python", "python_", metavar="VERSION|PATH", help="Interpreter to build on.")
@click.option(
    "--setup", multiple=True, help="Extra shell line run before finding the interpreter (repeatable)."
)
@click.option(
    "--force", is_flag=True, help="Remove an existing environment of the same key and build it again."
)
@click.pass_context
def build(
    ctx: click.Context,
    requirements: str | None,
    extras: tuple[str, ...],
    system_site_packages: bool | None,
    python_: str | None,
    setup: tuple[str, ...],
    force: bool,
) -> None:
    """Build this project's environment now, as `rv run` would, without submitting anything."""
    from rv.cli.common import load_profile
    from rv.config import cache_dir
    from rv.errors import UsageError
    from rv.files.snapshot import prepare_snapshot
    from rv.pyenv.plan import plan

    _, profile = load_profile(ctx)
    snap = prepare_snapshot(Path.cwd(), allow_large=True, cache_dir=cache_dir())
    ssp = profile.system_site_packages if system_site_packages is None else system_site_packages
    env_plan = plan(snap, "auto", requirements=requirements, extras=extras, python=python_ or profile.python,
                    system_site_packages=ssp)  # fmt: skip
    if env_plan.spec is None:
        raise UsageError(
            "no dependency files here: rv builds from uv.lock + pyproject.toml, requirements.txt, or "
            "pyproject.toml [project] dependencies",
            hint="add a requirements.txt (git add it), or name one with --requirements",
        )
    for message in env_plan.notes:
        note(message)
    from rv.cli.launchview import TerminalLaunch
    from rv.job.launch import environment

    with session(ctx) as s:
        env = environment(s, env_plan, (*profile.setup, *setup), TerminalLaunch(), force=force)
    assert env is not None, "a plan with a spec always has an environment"
    click.echo(env.path)
