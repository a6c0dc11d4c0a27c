"""The `rv` command group. Subcommands load lazily so `rv --help` never imports paramiko or rich."""

from __future__ import annotations

import os
import sys
import warnings

import click

from rv import __version__
from rv.commands import COMMANDS, load, lookup
from rv.errors import EXIT_INTERRUPTED, RvError


def _remaining_args(ctx: click.Context) -> list[str]:
    """The command's name and its words. Click 8 keeps the name apart in ``protected_args`` (which it
    deprecates: Click 9 drops it and keeps every word in ``args``); read it only where it exists."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        protected = getattr(ctx, "protected_args", None) or []
    return [*protected, *ctx.args]


def report_error(exc: RvError) -> None:
    # Plain writes, not rich: this runs on every failed invocation and must not cost an import.
    click.echo(f"rv: error: {exc.message}", err=True)
    if exc.hint:
        click.echo(f"  next: {exc.hint}", err=True)


class RvGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = load(cmd_name)
        return command if isinstance(command, click.Command) else None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, command.help) for name, command in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except KeyboardInterrupt:  # Ctrl-C as the command starts: an interrupt (130), as later on
            click.echo("rv: interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)

    def invoke(self, ctx: click.Context) -> object:
        args = _remaining_args(ctx)
        found = lookup(args[0]) if args else None
        try:
            if found is not None and found.prewarm and not {"-h", "--help"} & set(args[1:]):
                from rv.remote.connect import prewarm

                prewarm(ctx.params.get("profile"))  # inside: a Ctrl-C here is an interrupt (130)
            return super().invoke(ctx)
        except RvError as exc:
            if os.environ.get("RV_DEBUG") == "1":
                raise
            report_error(exc)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("rv: interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except BrokenPipeError:
            # `rv ps | head`: the reader left. Point stdout at /dev/null so the final flush is quiet.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            ctx.exit(0)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as exc:
            if os.environ.get("RV_DEBUG") == "1":
                raise
            click.echo(f"rv: unexpected error: {type(exc).__name__}: {exc}", err=True)
            click.echo("  next: rerun with RV_DEBUG=1 to see the traceback, and report it", err=True)
            ctx.exit(1)
        return None


@click.group(cls=RvGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--profile", "-p", envvar="RV_PROFILE", help="Profile to use (default: the config's default).")
@click.version_option(__version__, prog_name="rv")
@click.pass_context
def cli(ctx: click.Context, profile: str | None) -> None:
    """Run GPU jobs on a Slurm cluster over SSH, in one command.

    \b
      rv init                          connect to a cluster (once)
      rv run -g 2 -t a6000 -- torchrun train.py
      rv logs --err    rv ps    rv status    rv sync pull REMOTE LOCAL
    """
    ctx.ensure_object(dict)
    ctx.obj["profile"] = profile


def main() -> None:
    cli.main(prog_name="rv")


if __name__ == "__main__":
    main()
