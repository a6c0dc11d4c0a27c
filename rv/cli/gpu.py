"""`rv gpu [RUN] [--watch] [--json]`: what each GPU of a running job is doing, on every node."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import click

from rv.cli.common import note, print_json, run_store, session, warn

if TYPE_CHECKING:
    from rv.gpustat import NodeGpus


def _num(value: float | None, fmt: str = "{:,.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def render_table(report: Sequence[NodeGpus]) -> list[str]:  # pure: rows in, lines out
    lines = [
        f"{'NODE':<14} {'GPU':>3}  {'NAME':<22} {'UTIL':>5} {'MEMORY (MiB)':>17} {'TEMP':>5} "
        f"{'POWER (W)':>11}  PROCESSES"
    ]
    for node in report:
        for gpu in node.gpus:
            util = "-" if gpu.utilization is None else f"{gpu.utilization}%"
            memory = f"{_num(gpu.memory_used_mib)} / {_num(gpu.memory_total_mib)}"
            temp = "-" if gpu.temperature_c is None else f"{gpu.temperature_c}C"
            power = f"{_num(gpu.power_w)} / {_num(gpu.power_limit_w)}"
            procs = [
                f"{p.pid} {p.name.rsplit('/', 1)[-1]} ({_num(p.used_mib)} MiB)" for p in gpu.processes
            ] or ["-"]
            lines.append(
                f"{node.node[:14]:<14} {gpu.index:>3}  {gpu.name[:22]:<22} {util:>5} {memory:>17} {temp:>5} "
                f"{power:>11}  {procs[0]}"
            )
            for more in procs[1:]:
                lines.append(f"{'':<14} {'':>3}  {'':<22} {'':>5} {'':>17} {'':>5} {'':>11}  {more}")
    return lines


@click.command()
@click.argument("run", required=False)
@click.option("-w", "--watch", is_flag=True, help="Refresh until Ctrl-C.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.5),
    default=2.0,
    show_default=True,
    help="Seconds between refreshes.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the nodes and their GPUs as JSON.")
@click.pass_context
def gpu(ctx: click.Context, run: str | None, watch: bool, interval: float, as_json: bool) -> None:
    """Each GPU of RUN's running job (every node): utilisation, memory, temperature, power, processes.

    RUN is a run name, run id or job id (default: the latest run). Asked with nvidia-smi in a step of
    the job on each node (`srun --overlap`), so it sees exactly the job's GPUs.
    """
    from rv.errors import RemoteCommandMissing, UsageError
    from rv.job.inside import gpu_report, running_job

    with session(ctx) as s:
        rj = running_job(s.transport, run_store(), s.profile.name, s.layout.root, run)
        if not int(rj.run.meta.get("gpus") or 0):
            raise UsageError(f"run {rj.name} asked for no GPUs (a CPU-only job)", hint="rv ssh RUN -- top")
        try:
            while True:
                report = gpu_report(s.transport, rj)
                missing = [n.node for n in report if n.missing]
                if len(missing) == len(report):
                    raise RemoteCommandMissing(
                        f"no nvidia-smi on {', '.join(missing)} (job {rj.job_id}): no GPU statistics to show"
                    )
                for n in report:
                    if n.missing:
                        warn(f"no nvidia-smi on {n.node}: its GPUs are not shown")
                    for error in n.errors:
                        warn(f"nvidia-smi on {n.node}: {error}")
                if as_json:
                    print_json([n.to_json() for n in report])
                else:
                    if watch:
                        if sys.stdout.isatty():
                            click.echo("\x1b[H\x1b[2J", nl=False)  # clear the screen, cursor home
                        click.echo(f"run {rj.name}, job {rj.job_id}   {time.strftime('%H:%M:%S')}")
                    for line in render_table(report):
                        click.echo(line)
                if not watch:
                    return
                time.sleep(interval)
        except KeyboardInterrupt:
            note("stopped")
