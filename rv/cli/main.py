"""The `rv` command group. Subcommands load lazily so `rv --help` never imports paramiko or rich."""

from __future__ import annotations

import importlib
import os
import sys

import click

from rv import __version__
from rv.errors import EXIT_INTERRUPTED, RvError

# name -> (module, attribute, one-line help). The help lives here so `rv --help` needs no imports.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "init": ("rv.cli.init", "init", "Connect rv to a cluster and save a profile."),
    "exec": ("rv.cli.exec", "exec_", "Run a command on the login node."),
    "run": ("rv.cli.run", "run", "Snapshot this repo and start a run (continued across jobs)."),
    "ps": ("rv.cli.ps", "ps", "List your runs and jobs."),
    "logs": ("rv.cli.logs", "logs", "Show or follow a run's output, every segment."),
    "stop": ("rv.cli.stop", "stop", "Stop runs."),
    "sweep": ("rv.cli.sweep", "sweep", "A sweep's results table, and a retry of its failed points."),
    "metrics": ("rv.cli.sweep", "metrics", "A run's metrics ($RV_METRICS): last, best and trend."),
    "up": ("rv.cli.up", "up", "A shell on a new allocation, released when the shell exits."),
    "ssh": ("rv.cli.ssh", "ssh", "A shell, or a command, on a node of a running job."),
    "gpu": ("rv.cli.gpu", "gpu", "What the GPUs of a running job are doing."),
    "forward": ("rv.cli.forward", "forward", "Forward a port of a running job's node to this machine."),
    "status": ("rv.cli.status", "status", "Connection, account, storage by kind, jobs and free GPUs."),
    "ckpt": ("rv.cli.ckpt", "ckpt", "List and download a run's checkpoints."),
    "gc": ("rv.cli.gc", "gc", "Remove what finished runs left on the cluster."),
    "cost": ("rv.cli.cost", "cost", "Estimate the SU cost of a job."),
    "env": ("rv.cli.env", "env", "Manage secrets passed to jobs."),
    "venv": ("rv.cli.envs", "venv", "List, build and remove the Python environments jobs run in."),
    "sync": ("rv.cli.sync", "sync", "Push, pull and watch files."),
}
ALIASES = {"ls": "ps", "cancel": "stop"}
# Commands that only ever talk to the cluster (no local checks that could refuse first): their warm
# connection is started as soon as the profile is known, so its start overlaps with their imports.
PREWARM = frozenset({"ps", "status", "logs", "exec", "gpu"})


def report_error(exc: RvError) -> None:
    # Plain writes, not rich: this runs on every failed invocation and must not cost an import.
    click.echo(f"rv: error: {exc.message}", err=True)
    if exc.hint:
        click.echo(f"  next: {exc.hint}", err=True)


class RvGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        name = ALIASES.get(cmd_name, cmd_name)
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        try:
            command: click.Command = getattr(importlib.import_module(module), attr)
            return command
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            return None  # a command whose module is not written yet simply does not exist

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, help_) for name, (_, _, help_) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> object:
        args = [*ctx.protected_args, *ctx.args]
        if args and ALIASES.get(args[0], args[0]) in PREWARM and not {"-h", "--help"} & set(args[1:]):
            from rv.cli.common import prewarm

            prewarm(ctx.params.get("profile"))
        try:
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
