"""`rv venv ls|rm|build`: the Python environments rv builds on the cluster, one per set of dependencies.

Also the build's live display for `rv run`: rv's own lines are kept, uv's lines pass through a
status line (package being fetched or built, elapsed time) on a terminal, and only uv's summary
lines stay on the screen.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from rv.cli.common import err_console, note, print_json, session

_SUMMARY = ("Resolved ", "Prepared ", "Installed ", "Uninstalled ", "Audited ")


class BuildDisplay:
    """Lines from the cluster while an environment is found or built."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.status: Any = None

    def __call__(self, line: str) -> None:
        if line.startswith("rv: "):
            self._print(line[4:])
            if line.startswith("rv: building") and err_console.is_terminal and self.status is None:
                self.status = err_console.status("building the environment")
                self.status.start()
            return
        text = line[2:] if line.startswith("| ") else line
        if text.startswith(_SUMMARY):
            self._print(f"  {text.strip()}")
        if self.status is not None:
            from rich.markup import escape

            elapsed = time.monotonic() - self.started
            self.status.update(f"building the environment ({elapsed:.0f} s): {escape(text.strip()[:100])}")

    def _print(self, text: str) -> None:
        if self.status is not None:
            self.status.console.print(text, markup=False, highlight=False)
        else:
            note(text)

    def close(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


def build_with_progress(s, env_plan, setup: tuple[str, ...], *, force: bool = False):  # type: ignore[no-untyped-def]
    """The plan's environment on the cluster: found (one round trip) or built now, with progress."""
    from rv.pyenv.client import ensure

    display = BuildDisplay()
    try:
        env = ensure(
            s.transport, s.layout, setup=setup, spec=env_plan.spec, use=env_plan.use, on_line=display,
            force=force,
        )  # fmt: skip
    finally:
        display.close()
    if env.key is None:
        note(f"environment: {env.path} (as is)")
    elif env.built:
        seconds = env.meta.get("build_seconds")
        note(f"environment {env.key} built in {seconds} s from {env_plan.spec.main_file}: {env.path}")
    elif env.waited:
        note(f"environment {env.key}: built meanwhile by another rv, reused")
    elif env.meta:
        note(f"environment {env.key} ({env.meta.get('files')})")
    return env


def ensure_environment(s, env_plan, setup: tuple[str, ...]):  # type: ignore[no-untyped-def]
    """The environment on the cluster, built now (in the foreground, with progress) if it must be;
    None when the plan needs none (`rv run`, `rv up`)."""
    if env_plan.spec is None and env_plan.use is None:
        return None
    return build_with_progress(s, env_plan, setup)


def env_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The options that choose a job's Python environment (`rv run`, `rv up`)."""
    options = [
        click.option(
            "--env", "env_choice", metavar="auto|none|PATH", default="auto", show_default=True,
            help="The job's Python environment: built from the project's dependency files (auto), only "
            "the setup lines (none), or an existing venv/conda prefix on the cluster (PATH).",
        ),
        click.option(
            "--requirements", metavar="FILE",
            help="Build the environment from FILE (default: requirements.txt).",
        ),
        click.option(
            "--extra", "extras", multiple=True,
            help="A pyproject.toml optional-dependencies group (repeatable).",
        ),
        click.option(
            "--system-site-packages/--no-system-site-packages", default=None,
            help="Build on top of the interpreter's own packages (a site's torch module), not "
            "downloading them.",
        ),
        click.option(
            "--python", "python_", metavar="VERSION|PATH", help="Interpreter to build the environment on."
        ),
    ]  # fmt: skip
    for option in reversed(options):
        f = option(f)
    return f


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
    lines = (*profile.setup, *setup)
    with session(ctx) as s:
        env = build_with_progress(s, env_plan, lines, force=force)
    click.echo(env.path)
