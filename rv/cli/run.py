"""`rv run [OPTIONS] -- CMD...`: validate, snapshot and sync, submit, record, and optionally follow."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from rv.cli.common import note, prepare_local, print_json, progress_renderer, run_store, session, warn
from rv.cli.envs import ensure_environment, env_options
from rv.job.prepare import job_umask


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-g", "--gpu", "gpus", type=int, default=None, help="GPUs in total (default 1; 0: CPU only).")
@click.option(
    "-t", "--type", "gpu_type", help="GPU type from the profile's catalog (`rv status` lists them)."
)
@click.option("--mig", is_flag=True, help="A free MIG slice (1 GPU, 1 CPU).")
@click.option("--time", "time_", help="Wall time: 30m, 2h, 1d12h, 2:59:00, 1-12:00:00 (default 2:59:00).")
@click.option("--mem", help="Memory per node, e.g. 64G.")
@click.option("--cpus", type=int, help="CPUs per node.")
@click.option(
    "--name",
    help="Run name; a finished run of that name is resumed (default: from the command, made unique).",
)
@click.option("--nodes", type=int, help="Nodes (default: as few as hold the GPUs).")
@click.option("--setup", multiple=True, help="Extra shell line run before the program (repeatable).")
@click.option(
    "-o",
    "--output",
    "outputs",
    multiple=True,
    metavar="PATH",
    help="Copy PATH to $RV_OUTPUT_DIR at the end (repeatable). PATH is relative to the folder you type "
    "rv run in, where the program starts; it keeps its place in the repo under $RV_OUTPUT_DIR.",
)
@click.option(
    "--signal",
    help="Stop signal and its lead: NAME[@SECONDS] (default USR1@300); sent only to processes handling it.",
)
@click.option(
    "--max-segments",
    type=int,
    help="Continue a run that stops cleanly in up to N jobs in all (default 10; 1: never continue).",
)
@click.option(
    "--from",
    "from_",
    metavar="RUN[@STEP]",
    help="Start from RUN's newest complete checkpoint at or before STEP; RUN itself is untouched.",
)
@env_options
@click.option(
    "--each-node",
    is_flag=True,
    help="Run a command without a launcher once on every node (default: refused on several nodes).",
)
@click.option(
    "--allow-single-process",
    is_flag=True,
    help="Run a command without a launcher as one process on several GPUs (default: refused).",
)
@click.option("-f", "--follow", is_flag=True, help="Follow the run, segment by segment; exit with its code.")
@click.option("--dry-run", is_flag=True, help="Print the job script; send nothing.")
@click.option("--allow-large", is_flag=True, help="Send files over the size guard (default 100 MB).")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the run record as JSON, and nothing else on stdout: with -f the program's output goes "
    "to stderr; with --dry-run the script is in the JSON.",
)
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
    max_segments: int | None,
    from_: str | None,
    env_choice: str,
    requirements: str | None,
    extras: tuple[str, ...],
    system_site_packages: bool | None,
    python_: str | None,
    each_node: bool,
    allow_single_process: bool,
    follow: bool,
    dry_run: bool,
    allow_large: bool,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    """Snapshot this repo, sync it, and run COMMAND on the cluster as a run of one or more jobs.

    A program that saves into $RV_CHECKPOINT_DIR and writes PREEMPTED there when it gets the stop
    signal is continued in a new job, from its checkpoint, until it finishes (see the README).

    \b
      rv run -g 2 -t a6000 -- torchrun train.py --lr 3e-4
      rv run --mig -f -- python eval.py
    """
    from rv.cli.common import load_profile
    from rv.job import submit as job
    from rv.request import build_request, default_name, detect_misplaced_flags, resources_line

    _, profile = load_profile(ctx)
    catalog = profile.gpu_catalog()
    if not _after_separator(command):
        # `rv run python train.py -g 4`: the -g went to the program. Stop before anything is sent;
        # with an explicit `--` the user said the flags are the program's, and we stay quiet.
        misplaced = detect_misplaced_flags(command, catalog, flags=option_words(ctx.command))
        if misplaced:
            from rv.errors import UsageError

            raise UsageError(
                "; ".join(misplaced),
                hint="put rv's options before the command, or write `--` before the command if those "
                "flags really are the program's",
            )
    run_id = job.new_run_id()
    from_run = job.FromRun.parse(from_) if from_ is not None else None
    # Everything is validated here, before the first network call. A run without --name gets one of
    # its own: two runs of one command must never share a checkpoint folder.
    run_name = name
    # The program starts where `rv run` was typed; -o paths are relative to that folder.
    start_dir = _start_dir(Path.cwd())
    if name is None and command:
        run_name = job.default_run_name(default_name(command), run_id)
    req = build_request(
        catalog, command=command, gpus=gpus, gpu_type=gpu_type, mig=mig, time=time_, mem=mem, cpus=cpus,
        name=run_name, nodes=nodes, setup=(*profile.setup, *setup), outputs=outputs, start_dir=start_dir,
        signal=signal, max_segments=max_segments, each_node=each_node,
        allow_single_process=allow_single_process,
    )  # fmt: skip
    for message in req.warnings:
        warn(message)
    from rv.config import state_dir
    from rv.secrets import SecretStore

    secrets = SecretStore(state_dir() / "secrets.json").load()
    from rv.config import cache_dir
    from rv.snapshot import upload_snapshot
    from rv.treecache import StoreCache

    # The file list, hashes and size guard are local: a refused file fails before we connect.
    req, snap, env_plan = prepare_local(
        req, profile, allow_large=allow_large, env_choice=env_choice, requirements=requirements,
        extras=extras, python=python_, system_site_packages=system_site_packages,
    )  # fmt: skip
    if dry_run:
        from rv.layout import RemoteLayout
        from rv.slurm.script import render_script

        layout = RemoteLayout(profile.require_remote_root())
        context = job.script_context(
            layout, run_id=run_id, snapshot_id=snap.id, project=snap.project, account=profile.account,
            has_secrets=bool(secrets), umask=job_umask(profile),
            env_build=env_plan.lines(f"{layout.root}/envs/<key, found on the cluster>"),
        )  # fmt: skip
        script = render_script(req, context)
        if as_json:
            print_json(
                {"dry_run": True, "run_id": run_id, "name": req.name, "snapshot": snap.id,
                 "files": snap.tree.files, "script": script}
            )  # fmt: skip
        else:
            sys.stdout.write(script)
        note(resources_line(req))
        note(f"dry run: nothing was sent (run {req.name}, snapshot {snap.id[:12]}, {snap.tree.files} files)")
        return

    with session(ctx) as s:
        # Before anything is sent: a live run of this name is refused; a finished one is resumed.
        check = job.check(s.transport, s.layout, project=snap.project, name=req.name, from_run=from_run)
        if from_run is None and check.resume_step is not None:
            note(f"resuming {req.name} from step {check.resume_step}")
        elif from_run is None and check.resume_files:
            note(f"resuming {req.name}: its checkpoint folder holds what an earlier run saved")
        # Before the upload: a requirement that cannot be resolved fails here, and nothing is queued.
        env = ensure_environment(s, env_plan, (*profile.setup, *setup))
        # What this machine knows the store holds lets the file list travel as a delta.
        cache = StoreCache(cache_dir(), f"{profile.name}:{s.layout.root}")
        with progress_renderer("uploading") as bar:
            uploaded = upload_snapshot(
                s.transport, s.layout, snap, cache=cache, on_summary=note, on_progress=bar
            )
        context = job.script_context(
            s.layout, run_id=run_id, snapshot_id=uploaded.id, project=uploaded.project,
            account=profile.account, has_secrets=bool(secrets), umask=job_umask(profile),
            env_build=env_plan.lines(env.path) if env else (),
        )  # fmt: skip
        submitted = job.submit(
            s.transport, s.layout, req, context, profile=profile.name, secrets=secrets,
            provenance={"branch": uploaded.branch, "commit": uploaded.commit, "dirty": uploaded.dirty,
                        "env": env.key if env else None},
            from_run=check if from_run is not None else None,
            from_step=from_run.step if from_run is not None else None,
        )  # fmt: skip
        record = submitted.record
        run_store().add(record)
        if submitted.from_step is not None or from_run is not None:
            how = "/".join(submitted.from_how) or "nothing to bring"
            at = f"step {submitted.from_step}" if submitted.from_step is not None else "its checkpoints"
            note(
                f"{req.name} starts from {from_run.run if from_run else '?'} at {at} "
                f"({how}; that run is untouched)"
            )
        if as_json:
            from dataclasses import asdict

            print_json(asdict(record))
            sys.stdout.flush()  # the record is all stdout gets: a reader may act on it while the run goes
        else:
            click.echo(record.job_id)
        where = f"{req.gpus}x {req.type.name}" if req.type else "CPU"
        continues = f", up to {req.max_segments} segments" if req.max_segments > 1 else ""
        note(
            f"submitted run {req.name}: job {record.job_id} ({where}, {req.nodes} node(s){continues}) "
            f"from {record.short_commit}\n  {resources_line(req)}\n"
            f"  rv logs -f {req.name}    rv ps    rv stop {req.name}"
        )
        if follow:
            ctx.exit(follow_to_end(s, record.run_id, req.name, req.max_segments, output_to_stderr=as_json))


def option_words(command: click.Command) -> dict[str, bool]:
    """Every option word of ``command`` (``-g``, ``--gpu``, ``--no-x``) -> whether it takes a value.

    Read from the click command itself, so the misplaced-flag check knows each option the moment it
    is added. The help option is not among ``params`` (click adds it per context): a program's own
    ``--help`` is never taken for rv's.
    """
    words: dict[str, bool] = {}
    for param in command.params:
        if isinstance(param, click.Option):
            takes_value = not (param.is_flag or param.count)
            for word in (*param.opts, *param.secondary_opts):
                words[word] = takes_value
    return words


def follow_to_end(s, run_id: str, name: str, max_segments: int, *, output_to_stderr: bool = False) -> int:  # type: ignore[no-untyped-def]
    """Follow a run until it ends; the run's exit code (0 when it finished), 130 on Ctrl-C.

    ``output_to_stderr`` (``-f --json``): the program's output, both streams, goes to stderr, so
    stdout holds nothing but the JSON record.
    """
    from rv.cli.following import TerminalView
    from rv.job.records import end_state, run_exit_code
    from rv.job.watch import follow_run

    view = TerminalView(
        max_segments=max_segments, separators=False, out=sys.stderr if output_to_stderr else None
    )
    try:
        followed = follow_run(lambda: s.transport, s.reconnect, s.layout.root, run_id, view)
    except KeyboardInterrupt:
        view.flush()
        note(f"\ndetached; run {name} keeps going: rv logs -f {name}")
        return 130
    view.flush()
    ended = followed.ended or {}
    code = run_exit_code(followed.ended)
    reason = str(ended.get("reason") or "")
    if end_state(reason) != "COMPLETED":
        warn(
            f"run {name} ended after segment {followed.last_segment}: {reason or 'no record'} "
            f"(exit code {code})"
        )
    return code


def _start_dir(here: Path) -> str:
    """The folder the program will start in, relative to the repo top ("" at the top or outside a repo)."""
    from rv.listing import Git, find_repo_top

    top = find_repo_top(here, Git())
    if top is None:
        return ""
    rel = here.resolve().relative_to(top.resolve()).as_posix()
    return "" if rel == "." else rel


def _after_separator(command: tuple[str, ...]) -> bool:
    """True when the user typed `--` right before the command (click swallows it, argv keeps it)."""
    argv = sys.argv[1:]
    start = len(argv) - len(command)
    return bool(command) and start > 0 and argv[start:] == list(command) and argv[start - 1] == "--"
