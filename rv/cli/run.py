"""`rv run [OPTIONS] -- CMD...`: validate, snapshot and sync, submit, record, and optionally follow."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from rv.cli.common import err_console, note, print_json, session, warn


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-g", "--gpu", "gpus", type=int, default=None, help="GPUs in total (default 1; 0: CPU only).")
@click.option(
    "-t", "--type", "gpu_type", help="GPU type from the profile's catalog (`rv status` lists them)."
)
@click.option("--mig", is_flag=True, help="A free MIG slice (1 GPU, 1 CPU).")
@click.option("--time", "time_", help="Wall time: 30m, 2h, 1d12h, 2:59:00, 1-12:00:00 (default 2:59:00).")
@click.option("--mem", help="Memory per node, e.g. 64G.")
@click.option("--cpus", type=int, help="CPUs per node.")
@click.option("--name", help="Job name (default: from the command).")
@click.option("--nodes", type=int, help="Nodes (default: as few as hold the GPUs).")
@click.option("--setup", multiple=True, help="Extra shell line run before the program (repeatable).")
@click.option(
    "-o", "--output", "outputs", multiple=True, help="Copy PATH to the job's output dir at the end."
)
@click.option("--signal", help="Signal before the time limit: NAME[@SECONDS] (default USR1@300).")
@click.option("-f", "--follow", is_flag=True, help="Wait for the job, stream its output, exit with its code.")
@click.option("--dry-run", is_flag=True, help="Print the job script; send nothing.")
@click.option("--allow-large", is_flag=True, help="Send files over the size guard (default 100 MB).")
@click.option("--json", "as_json", is_flag=True, help="Print the job record as JSON.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run(
    ctx: click.Context,
    gpus: int | None,
    gpu_type: str | None,
    mig: bool,
    time_: str | None,
    mem: str | None,
    cpus: int | None,
    name: str | None,
    nodes: int | None,
    setup: tuple[str, ...],
    outputs: tuple[str, ...],
    signal: str | None,
    follow: bool,
    dry_run: bool,
    allow_large: bool,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    """Snapshot this repo, sync it, and submit COMMAND as a Slurm job.

    \b
      rv run -g 2 -t a6000 -- torchrun train.py --lr 3e-4
      rv run --mig -f -- python eval.py
    """
    from rv.cli.common import load_profile
    from rv.request import build_request, detect_misplaced_flags

    _, profile = load_profile(ctx)
    catalog = profile.gpu_catalog()
    if not _after_separator(command):
        # `rv run python train.py -g 4`: the -g went to the program. Stop before anything is sent;
        # with an explicit `--` the user said the flags are the program's, and we stay quiet.
        misplaced = detect_misplaced_flags(command, catalog)
        if misplaced:
            from rv.errors import UsageError

            raise UsageError(
                "; ".join(misplaced),
                hint="put rv's options before the command, or write `--` before the command if those "
                "flags really are the program's",
            )
    # Everything is validated here, before the first network call.
    req = build_request(
        catalog, command=command, gpus=gpus, gpu_type=gpu_type, mig=mig, time=time_, mem=mem, cpus=cpus,
        name=name, nodes=nodes, setup=(*profile.setup, *setup), outputs=outputs, signal=signal,
    )  # fmt: skip
    for message in req.warnings:
        warn(message)
    from rv.config import state_dir
    from rv.jobs import JobStore
    from rv.secrets import SecretStore

    secrets = SecretStore(state_dir() / "secrets.json").load()
    from rv import launch
    from rv.snapshot import ManifestCache, prepare_snapshot, upload_snapshot

    # The file list, hashes and size guard are local: a refused file fails before we connect.
    snap = prepare_snapshot(Path.cwd(), allow_large=allow_large)
    if snap.subdir:
        # Typed in a subfolder: the snapshot is the whole repo, the program starts where the user was.
        import dataclasses
        import shlex

        req = dataclasses.replace(req, setup=(*req.setup, f"cd {shlex.quote(snap.subdir)}"))
    if dry_run:
        from rv.layout import RemoteLayout

        layout = RemoteLayout(profile.require_remote_root())
        secrets_path = f"{layout.secrets}/{req.name}-{snap.id[:8]}-DRYRUN.env" if secrets else None
        sys.stdout.write(_render(req, layout, profile.account, snap, secrets_path))
        note(f"dry run: nothing was sent (snapshot {snap.id[:12]}, {len(snap.tree.entries)} files)")
        return

    with session(ctx) as s:
        # The cached manifest lets the cluster receive only a delta of the file list.
        cache = ManifestCache(state_dir() / "cache", f"{profile.name}:{s.layout.root}")
        uploaded = upload_snapshot(s.transport, s.layout, snap, cache=cache, on_summary=note)
        secrets_path = f"{s.layout.secrets}/{req.name}-{snap.id[:8]}-{_nonce()}.env" if secrets else None
        prepared = launch.Prepared(
            request=req, script=_render(req, s.layout, profile.account, snap, secrets_path),
            snapshot_id=uploaded.id, project=uploaded.project, branch=uploaded.branch,
            commit=uploaded.commit, dirty=uploaded.dirty, secrets_path=secrets_path,
        )  # fmt: skip
        record = launch.submit(s.transport, s.layout, prepared, profile=profile.name, secrets=secrets)
        JobStore(state_dir() / "jobs.json").add(record)
        if as_json:
            from dataclasses import asdict

            print_json(asdict(record))
        else:
            click.echo(record.job_id)
        where = f"{req.gpus}x {req.type.name}" if req.type else "CPU"
        note(
            f"submitted job {record.job_id} ({req.name}, {where}, {req.nodes} node(s)) "
            f"from {record.short_commit}\n  rv logs -f {record.job_id}    rv ps    rv stop {record.job_id}"
        )
        if follow:
            ctx.exit(_follow(s, record))


def _after_separator(command: tuple[str, ...]) -> bool:
    """True when the user typed `--` right before the command (click swallows it, argv keeps it)."""
    argv = sys.argv[1:]
    start = len(argv) - len(command)
    return bool(command) and start > 0 and argv[start:] == list(command) and argv[start - 1] == "--"


def _nonce() -> str:
    import uuid

    return uuid.uuid4().hex[:8]


def _render(req, layout, account, snap, secrets_path) -> str:  # type: ignore[no-untyped-def]
    from rv import launch
    from rv.slurm.script import render_script

    context = launch.script_context(
        layout=layout, account=account, snapshot_id=snap.id, project=snap.project, secrets_path=secrets_path
    )
    return render_script(req, context)


def _follow(s, record) -> int:  # type: ignore[no-untyped-def]
    """Wait (showing state, reason, expected start), stream output, return the job's exit code."""
    from rv import launch
    from rv.logview import LineCollapser

    out_c, err_c = LineCollapser(), LineCollapser()

    def write(stream, collapser):  # type: ignore[no-untyped-def]
        def _w(data: bytes) -> None:
            stream.write(collapser.feed(data.decode("utf-8", errors="replace")))
            stream.flush()

        return _w

    try:
        with err_console.status(f"job {record.job_id}: submitted") as status:

            def on_state(state: str, reason: str, start: str) -> None:
                extra = f" ({reason})" if reason and reason != "None" else ""
                when = f", expected start {start}" if start and start not in ("N/A", "Unknown") else ""
                status.update(f"job {record.job_id}: {state}{extra}{when}")

            launch.wait_until_started(s.transport, record.job_id, on_state)
        launch.stream_logs(
            s.transport, s.layout, record, follow=True,
            on_stdout=write(sys.stdout, out_c), on_stderr=write(sys.stderr, err_c),
        )  # fmt: skip
        sys.stdout.write(out_c.flush())
        sys.stderr.write(err_c.flush())
    except KeyboardInterrupt:
        note(f"\ndetached; job {record.job_id} keeps running: rv logs -f {record.job_id}")
        return 130
    ended = launch.job_exit_code(s.transport, record.job_id)
    if ended is None:
        warn(f"could not read the exit code of job {record.job_id}; `rv ps -a` will show it")
        return 1
    code, state = ended
    if state and state != "COMPLETED":
        warn(f"job {record.job_id} ended {state} (exit code {code})")
    return code
