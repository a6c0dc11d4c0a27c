"""`rv up [-g N -t TYPE --time T ...] [--detach]`: a shell on a fresh allocation, released with it."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from rv.cli.common import note, run_store, session, warn
from rv.cli.layered import UP_DEFAULTS, LayeredCommand, placement_options
from rv.cli.venv import env_options

if TYPE_CHECKING:
    from rv.job.records import RunRecord
    from rv.slurm.parse import QueuedJob


class _View:
    """What the session says while it starts: on stderr, one line per change."""

    def __init__(self) -> None:
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
@placement_options
@click.option("--allow-large", is_flag=True, help="Send files over --max-file-size anyway.")
@click.option(
    "--max-file-size", default="100MB", show_default=True, metavar="SIZE",
    help="The size guard: refuse files bigger than this (e.g. 500MB, 2GB).",
)  # fmt: skip
@click.pass_context
def up(
    ctx: click.Context,
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
    partition: str | None,
    qos: str | None,
    constraint: str | None,
    exclude: str | None,
    nodelist: str | None,
    reservation: str | None,
    account: str | None,
    sbatch_options: tuple[str, ...],
    allow_large: bool,
    max_file_size: str,
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
    from rv.config import cache_dir
    from rv.files.snapshot import upload_snapshot
    from rv.files.treecache import StoreCache
    from rv.job import submit as job
    from rv.job import up as session_up
    from rv.placement import one_type
    from rv.request import build_request
    from rv.secrets import job_secrets

    _, profile = load_profile(ctx)
    gpu_type = one_type(gpu_type, "rv up")
    run_id = job.new_run_id()
    # Validated here, before the first network call, as rv run validates. The holder is one plain
    # process per node on purpose (each holds its node), whatever the GPUs: --each-node.
    req = build_request(
        profile.gpu_catalog(), command=session_up.holder_command(), gpus=gpus, gpu_type=gpu_type, mig=mig,
        time=time_, mem=mem, cpus=cpus, name=name or job.default_run_name("up", run_id), nodes=nodes,
        setup=(*profile.setup, *setup), max_segments=1, each_node=True, partitions=profile.partitions,
        partition=partition,
    )  # fmt: skip
    from rv.placement import build_placement

    # A session is one job: nothing continues it, after a fault either (max_fault_retries=0).
    place = build_placement(
        partition=partition, qos=qos, constraint=constraint, exclude=exclude, nodelist=nodelist,
        reservation=reservation, account=account, sbatch=sbatch_options, max_fault_retries=0,
    )  # fmt: skip
    for message in req.warnings:
        warn(message)
    secrets = job_secrets(profile.name, notice=warn)  # this profile's and the global ones
    from rv.cli.common import prepare_local
    from rv.cli.venv import ensure_environment
    from rv.job.prepare import job_umask

    # The shell starts in the folder rv up was typed in, as a run's program would.
    req, snap, env_plan = prepare_local(
        req, profile, allow_large=allow_large, max_file_size=max_file_size, env_choice=env_choice,
        requirements=requirements, extras=extras, python=python_, system_site_packages=system_site_packages,
    )  # fmt: skip

    # The watchdog and the shell share one connection of this command's own (the warm connection
    # carries no terminal): when rv goes, however it goes, the connection closes and the watchdog
    # on the login node cancels the job.
    with session(ctx, direct=True) as s:
        # sbatch judges what only it can (a QoS, nodes to leave out) before anything is sent.
        probe_ctx = job.script_context(
            s.layout, run_id=run_id, snapshot_id=snap.id, project=snap.project, account=profile.account,
            has_secrets=bool(secrets), umask=job_umask(profile), placement=place,
        )  # fmt: skip
        check = job.check(
            s.transport, s.layout, project=snap.project, name=req.name, from_run=None,
            probes=job.placement_probes([req], probe_ctx, place),
        )  # fmt: skip
        refused = [e.error for e in check.estimates if e.error is not None]
        if refused:
            raise job.sbatch_refuses(refused)
        # The project's environment, as rv run has it: built (or found) before anything is queued.
        env = ensure_environment(s, env_plan, (*profile.setup, *setup))
        cache = StoreCache(cache_dir(), f"{profile.name}:{s.layout.root}")
        uploaded = upload_snapshot(s.transport, s.layout, snap, cache=cache, on_summary=note)
        context = job.script_context(
            s.layout, run_id=run_id, snapshot_id=uploaded.id, project=uploaded.project,
            account=profile.account, has_secrets=bool(secrets), umask=job_umask(profile),
            env_build=env_plan.lines(env.path) if env else (), placement=place,
        )  # fmt: skip
        view = _View()
        dog, record = session_up.start(
            s.transport, s.layout, req, context, profile=profile.name, secrets=secrets, view=view,
            provenance={"branch": uploaded.branch, "commit": uploaded.commit, "dirty": uploaded.dirty,
                        "env": env.key if env else None},
        )  # fmt: skip
        run_store().add(record)
        released = False
        try:
            ready = session_up.wait_ready(dog, view)
            if detach:
                session_up.detach(dog)
                released = True  # nothing to release: the job is the user's to end
                note(
                    f"rv up session {req.name} is ready: job {record.job_id} on {','.join(ready.node_list)}, "
                    f"kept until `rv stop {req.name}` or its time limit ({req.time_slurm})\n"
                    f"  rv ssh {req.name}        a shell on its first node\n"
                    f"  rv ssh {req.name} -- CMD run CMD there\n"
                    f"  rv stop {req.name}       release it"
                )
                return
            from rv.job.inside import JobPlace, attach_command
            from rv.remote.terminal import relay, term_name, terminal_size

            node = ready.node_list[0]
            note(
                f"job {record.job_id} is ready on {node}: a shell in its work dir (exit it to release the "
                "allocation)"
            )
            line = attach_command(JobPlace(s.layout.root, run_id, record.job_id), node, None, pty=True)
            cols, rows = terminal_size()
            code = relay(s.connection.open_pty(line, term=term_name(), cols=cols, rows=rows))
            gone, why = session_up.release(dog)
            released = True
            _said_released(record.job_id, gone, why)
            ctx.exit(code)
        except KeyboardInterrupt:
            gone, why = session_up.release(dog)
            released = True
            _said_released(record.job_id, gone, why)
            ctx.exit(130)
        finally:
            if not released:
                # An error on the way (the job ended, the connection failed): whatever is left goes.
                session_up.release(dog, timeout=30)


def _said_released(job_id: str, gone: bool, why: str | None) -> None:
    if gone:
        note(f"released the allocation (job {job_id})")
    else:
        warn(f"job {job_id} was cancelled but is not gone from the queue yet ({why}): check with rv ps")
