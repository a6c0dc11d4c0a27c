"""`rv up [-g N -t TYPE --time T ...] [--detach]`: a shell on a fresh allocation, released with it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from rv.cli.common import note, run_store, session, warn
from rv.cli.launchview import TerminalLaunch
from rv.cli.layered import (
    UP_DEFAULTS,
    LayeredCommand,
    container_options,
    env_of,
    env_options,
    placement_of,
    placement_options,
)

if TYPE_CHECKING:
    from rv.job.launch import Plan
    from rv.job.records import RunRecord
    from rv.job.up import Watchdog
    from rv.slurm.parse import QueuedJob


class _View(TerminalLaunch):
    """What the session says while it starts: on stderr, one line per change. The snapshot's upload
    shows no progress bar."""

    def __init__(self) -> None:
        super().__init__(upload_bar=False)
        self.shown: tuple[str, str | None, str | None] | None = None
        self.job_id = "?"

    def submitted(self, record: RunRecord) -> None:
        self.job_id = record.job_id
        note(f"rv up session {record.name}: job {record.job_id}")

    def state(self, job: QueuedJob) -> None:
        key = (job.state, job.reason, job.start)
        if key == self.shown:
            return
        self.shown = key
        if job.state == "PENDING":
            # Right after sbatch Slurm has neither a reason nor a start time yet: said once known.
            why = f" ({job.reason})" if job.reason else ""
            start = f", expected to start {job.start}" if job.start else ""
            note(f"job {job.job_id} is pending{why}{start}")
        elif job.state == "RUNNING":
            note(
                f"job {job.job_id} is running on {','.join(job.node_list)}: preparing its work dir and setup"
            )
        else:
            note(f"job {job.job_id} is {job.state}")

    def warning(self, message: str) -> None:
        warn(message)


class _UpCommand(LayeredCommand):
    only = UP_DEFAULTS

    def invoke(self, ctx: click.Context) -> object:
        # Before the defaults are read: no profile or project makes a shell work without a terminal.
        _require_terminal(detach=bool(ctx.params.get("detach")))
        return super().invoke(ctx)


def _require_terminal(*, detach: bool) -> None:
    from rv.errors import UsageError

    if not detach and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError(
            "rv up needs a terminal for its shell, and this is not one",
            hint="run it in a terminal, or: rv up --detach, then rv ssh NAME -- COMMAND",
        )


@click.command(cls=_UpCommand)
@click.option("-g", "--gpu", "gpus", type=int, default=None, help="GPUs in total (default 1; 0: CPU only).")
@click.option(
    "-t", "--type", "gpu_type", help="GPU type from the profile's catalog (`rv status` lists them)."
)
@click.option("--mig", is_flag=True, help="A free MIG slice (1 GPU, 1 CPU).")
@click.option("--time", "time_", help="Longest the allocation may live: 30m, 2h, 2:59:00 (default 2:59:00).")
@click.option("--mem", help="Memory per node, e.g. 64G.")
@click.option("--cpus", type=int, help="CPUs per node.")
@click.option(
    "--nodes", type=int, help="Nodes (default: as few as hold the GPUs); the shell is on the first."
)
@click.option("--setup", multiple=True, help="Extra shell line run before the shell starts (repeatable).")
@click.option("--name", help="Session name (default: up-XXXX).")
@click.option(
    "--detach",
    is_flag=True,
    help="Keep the allocation when rv exits: attach with rv ssh, end it with rv stop.",
)
@env_options
@container_options
@placement_options(up=True)
@click.option("--allow-large", is_flag=True, help="Send files over --max-file-size anyway.")
@click.option(
    "--max-file-size", default="100MB", show_default=True, metavar="SIZE",
    help="The size guard: refuse files bigger than this (e.g. 500MB, 2GB).",
)  # fmt: skip
@click.pass_context
def up(
    ctx: click.Context,
    /,
    gpus: int | None,
    gpu_type: str | None,
    mig: bool,
    time_: str | None,
    mem: str | None,
    cpus: int | None,
    nodes: int | None,
    setup: tuple[str, ...],
    name: str | None,
    detach: bool,
    env_choice: str,
    requirements: str | None,
    extras: tuple[str, ...],
    system_site_packages: bool | None,
    python_: str | None,
    container: str | None,
    container_runtime: str | None,
    allow_large: bool,
    max_file_size: str,
    **slurm: Any,  # Slurm's options (rv.slurmoptions.TABLE): placement_of(ctx.params) reads them
) -> None:
    """A shell on a new allocation, in the job's environment, in a snapshot of this repo.

    The shell has what a job's program has: setup lines, the project's Python environment (built as
    `rv run` builds it), secrets (rv env), RV_* variables, caches, and the synced snapshot as its work
    dir. The allocation is released when the shell exits, on
    Ctrl-C while it waits, and when rv or its connection goes away; --detach keeps it until
    `rv stop NAME` or its time limit. Placement (--qos, --constraint, ...), setup lines and the
    environment options default to the project's and the profile's, as for rv run.

    \b
      rv up -g 1 -t a6000 --time 1h
      rv up --mig --detach    then: rv ssh up-3f9a    and: rv stop up-3f9a
    """

    from rv.cli.common import load_profile
    from rv.job import launch as pipeline

    _, profile = load_profile(ctx)
    options = pipeline.JobOptions(
        gpus=gpus, gpu_type=gpu_type, mig=mig, time=time_, mem=mem, cpus=cpus, nodes=nodes, setup=setup,
        name=name, placement=placement_of(ctx.params), env=env_of(ctx.params), allow_large=allow_large,
        max_file_size=max_file_size, container=container, container_runtime=container_runtime,
    )  # fmt: skip
    view = _View()
    # Validated here, before the first network call, as rv run validates.
    plan = pipeline.plan_up(options, profile, here=Path.cwd(), view=view)
    # The watchdog and the shell share one connection of this command's own (the warm connection
    # carries no terminal): when rv goes, however it goes, the connection closes and the watchdog
    # on the login node cancels the job.
    with session(ctx, direct=True) as s:
        dog, record = pipeline.start_up(plan, s, run_store(), view)
        code = _attend(s, dog, record, plan, detach=detach, view=view)
        if code is not None:
            ctx.exit(code)


def _attend(s: Any, dog: Watchdog, record: RunRecord, plan: Plan, *, detach: bool, view: _View) -> int | None:
    """Wait until the session's job is ready; then leave it be (--detach: None) or hold a shell in it
    and release the allocation when the shell exits (its exit code; 130 on Ctrl-C while waiting)."""
    from rv.job import up as session_up

    req, run_id = plan.request, plan.run_id
    # Whatever is left when this returns without settling the allocation is released (rv.job.up.held).
    with session_up.held(dog) as hold:
        try:
            ready = session_up.wait_ready(dog, view)
            if detach:
                hold.detach()
                note(
                    f"rv up session {req.name} is ready: job {record.job_id} on {','.join(ready.node_list)}, "
                    f"kept until `rv stop {req.name}` or its time limit ({req.time_slurm})\n"
                    f"  rv ssh {req.name}        a shell on its first node\n"
                    f"  rv ssh {req.name} -- CMD run CMD there\n"
                    f"  rv stop {req.name}       release it"
                )
                return None
            from rv.job.inside import JobPlace, attach_command
            from rv.remote.terminal import relay, term_name, terminal_size

            node = ready.node_list[0]
            note(
                f"job {record.job_id} is ready on {node}: a shell in its work dir (exit it to release the "
                "allocation)"
            )
            place = JobPlace(s.layout.root, run_id, record.job_id)
            if plan.container is not None:
                from rv.job.inside import running_job

                # The way into its image, as its record keeps it (Pyxis: srun's options).
                place = running_job(s.transport, run_store(), s.profile.name, s.layout.root, run_id).place
            line = attach_command(place, node, None, pty=True)
            cols, rows = terminal_size()
            code = relay(s.connection.open_pty(line, term=term_name(), cols=cols, rows=rows))
            _said_released(record.job_id, *hold.release())
            return code
        except KeyboardInterrupt:
            _said_released(record.job_id, *hold.release())
            return 130


def _said_released(job_id: str, gone: bool, why: str | None) -> None:
    if gone:
        note(f"released the allocation (job {job_id})")
    else:
        warn(f"job {job_id} was cancelled but is not gone from the queue yet ({why}): check with rv ps")
