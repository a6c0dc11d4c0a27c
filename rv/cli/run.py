"""`rv run [OPTIONS] -- CMD...`: validate, snapshot and sync, submit, record, and optionally follow."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click

from rv.cli.common import note, prepare_local, print_json, progress_renderer, run_store, session, warn
from rv.cli.layered import NOT_DEFAULTS, LayeredCommand, placement_options
from rv.cli.venv import ensure_environment, env_options
from rv.job.prepare import job_umask


@click.command(
    cls=LayeredCommand,
    context_settings={"allow_interspersed_args": False},
)
@click.option("-g", "--gpu", "gpus", type=int, default=None, help="GPUs in total (default 1; 0: CPU only).")
@click.option(
    "-t",
    "--type",
    "gpu_type",
    help="GPU type from the profile's catalog (`rv status` lists them); several, in order of preference "
    "(a100,a6000), or any: the run starts on the first that can (default, on a cluster of several types).",
)
@click.option("--vram", type=float, help="Only GPU types with at least this many GB per GPU.")
@click.option("--mig", is_flag=True, help="A free MIG slice (1 GPU, 1 CPU).")
@click.option("--time", "time_", help="Wall time: 30m, 2h, 1d12h, 2:59:00, 1-12:00:00 (default 2:59:00).")
@click.option(
    "--time-min",
    help="Let Slurm start a segment in a shorter gap, at least this long (backfill); only for programs "
    "that follow the stop protocol (save on the stop signal), which rv then continues.",
)
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
    "rv run in, where the program starts; it keeps its place in the repo under $RV_OUTPUT_DIR. A pattern "
    "(quoted: -o 'out/*.pt', ** for any depth) copies every match.",
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
@placement_options
@click.option(
    "--max-fault-retries",
    type=int,
    help="Continue a run whose segment ended on a GPU or node fault, on another node, up to N times "
    "(default 2; 0: never).",
)
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
@click.option(
    "--sweep",
    "sweep_options",
    multiple=True,
    metavar="NAME=V1,V2",
    help="Run COMMAND at every combination of these values (repeatable; A..B: the integers from A to B), "
    "as one job array: each point a run of its own, named SWEEP/INDEX; {NAME} in COMMAND is the point's "
    "value, $RV_SWEEP_NAME too.",
)
@click.option(
    "--sweep-file",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE",
    help='A sweep\'s points, one per line: JSON lines ({"lr": 1e-4}) or CSV with a header.',
)
@click.option(
    "--parallel",
    type=click.IntRange(min=1),
    metavar="K",
    help="A sweep: at most K of its points running at once (a point's later segments, after a time "
    "limit, run beside them).",
)
@click.option(
    "--notify",
    multiple=True,
    metavar="WHERE",
    help="Tell of the run's end (once, from the cluster; and of a start after a wait in the queue): "
    "mail:ADDRESS (Slurm's mail), secret:NAME (a webhook URL kept with `rv env set NAME`), desktop "
    "(while -f or rv wait follows), none (repeatable).",
)
@click.option(
    "--work-dir",
    type=click.Choice(["shared", "node"]),
    help="Where the program's work dir is: shared (default; the run's folder on the cluster's shared "
    "filesystem) or node (each node's local disk; what the program changes there is kept in the run's "
    "folder at each segment's end and put back at the next).",
)
@click.option("-f", "--follow", is_flag=True, help="Follow the run, segment by segment; exit with its code.")
@click.option("--dry-run", is_flag=True, help="Print the job script; send nothing.")
@click.option("--allow-large", is_flag=True, help="Send files over --max-file-size anyway.")
@click.option(
    "--max-file-size", default="100MB", show_default=True, metavar="SIZE",
    help="The size guard: refuse files bigger than this (e.g. 500MB, 2GB).",
)  # fmt: skip
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
    vram: float | None,
    mig: bool,
    time_: str | None,
    time_min: str | None,
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
    partition: str | None,
    qos: str | None,
    constraint: str | None,
    exclude: str | None,
    nodelist: str | None,
    reservation: str | None,
    account: str | None,
    sbatch_options: tuple[str, ...],
    max_fault_retries: int | None,
    each_node: bool,
    allow_single_process: bool,
    sweep_options: tuple[str, ...],
    sweep_file: Path | None,
    parallel: int | None,
    notify: tuple[str, ...],
    work_dir: str | None,
    follow: bool,
    dry_run: bool,
    allow_large: bool,
    max_file_size: str,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    """Snapshot this repo, sync it, and run COMMAND on the cluster as a run of one or more jobs.

    A program that saves into $RV_CHECKPOINT_DIR and writes PREEMPTED there when it gets the stop
    signal is continued in a new job, from its checkpoint, until it finishes (see the README).

    \b
      rv run -g 2 -t a6000 -- torchrun train.py --lr 3e-4
      rv run --mig -f -- python eval.py
      rv run --sweep lr=1e-4,3e-4 --sweep seed=0..2 --parallel 2 -- python train.py --lr {lr}
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
    from rv.cli.defaults import COMMAND_LINE

    sources = ctx.meta.get("rv.sources", {})
    sweep = read_sweep(
        sweep_options, sweep_file, parallel, command, name=run_name or "", follow=follow, from_=from_,
        parallel_typed=sources.get("parallel") == COMMAND_LINE,
    )  # fmt: skip
    from rv.placement import build_placement, plan_requests, type_words

    def build(type_name: str | None, cmd: tuple[str, ...] = command):  # type: ignore[no-untyped-def]
        return build_request(
            catalog, command=cmd, gpus=gpus, gpu_type=type_name, mig=mig, time=time_, mem=mem, cpus=cpus,
            name=run_name, nodes=nodes, setup=(*profile.setup, *setup), outputs=outputs, start_dir=start_dir,
            signal=signal, max_segments=max_segments, each_node=each_node,
            allow_single_process=allow_single_process, partitions=profile.partitions, partition=partition,
        )  # fmt: skip

    # One request per GPU type the run may take (one, unless -t names several, any, or none on a
    # cluster of several types), each validated against its type's limits.
    reqs, notes = plan_requests(catalog, type_words(gpu_type), gpus=gpus, mig=mig, vram_gb=vram, build=build)
    if sweep is not None and len(reqs) > 1:
        from rv.errors import UsageError

        raise UsageError(
            f"a sweep runs on one GPU type, and this one could take {', '.join(map(_type_name, reqs))}: "
            "a point claimed on one type would still hold an array task of the others, so --parallel could "
            "not hold",
            hint=f"name one with -t, e.g. -t {_type_name(reqs[0])}",
        )
    req, alternatives = reqs[0], reqs[1:]
    place = build_placement(
        partition=partition, qos=qos, constraint=constraint, exclude=exclude, nodelist=nodelist,
        reservation=reservation, account=account, sbatch=sbatch_options, time_min=time_min,
        time_seconds=req.time_seconds, max_fault_retries=max_fault_retries,
    )  # fmt: skip
    for message in dict.fromkeys([*notes, *(w for r in reqs for w in r.warnings)]):
        warn(message)
    if place.time_min_seconds is not None:
        note(
            "--time-min: Slurm may start each segment with as little as "
            f"{time_min}; the program must follow the stop protocol (save on ${{RV_STOP_SIGNAL}} and write "
            "PREEMPTED), or a short segment ends it"
        )
    from rv.secrets import job_secrets

    secrets = job_secrets(profile.name, notice=warn)  # this profile's and the global ones
    from rv.notify import parse_targets

    told = parse_targets(notify, secrets).targets
    from rv.config import cache_dir
    from rv.files.snapshot import upload_snapshot
    from rv.files.treecache import StoreCache

    # The file list, hashes and size guard are local: a refused file fails before we connect.
    req, snap, env_plan = prepare_local(
        req, profile, allow_large=allow_large, max_file_size=max_file_size, env_choice=env_choice,
        requirements=requirements, extras=extras, python=python_, system_site_packages=system_site_packages,
    )  # fmt: skip
    alternatives = [dataclasses.replace(r, setup=req.setup) for r in alternatives]
    reqs = [req, *alternatives]  # each with the folder the program starts in
    from rv.job.workdir import check_work_dir, many_files_warning

    work = job.WorkDir(check_work_dir(work_dir), profile.node_work_dir)
    many = many_files_warning(snap.tree.files, len(sweep) if sweep is not None else 1, work.where)
    if many:
        warn(many)
    if sweep is not None:
        ctx.exit(
            run_sweep(
                ctx, profile, sweep, command, req, build, snap=snap, env_plan=env_plan, place=place,
                secrets=secrets, setup=setup, dry_run=dry_run, as_json=as_json, sources=sources,
                probes_for=lambda context: placement_probes(reqs, context, place), notify=told, work=work,
            )
        )  # fmt: skip
    if dry_run:
        from rv.layout import RemoteLayout
        from rv.slurm.script import render_script

        layout = RemoteLayout(profile.require_remote_root())
        context = job.script_context(
            layout, run_id=run_id, snapshot_id=snap.id, project=snap.project, account=profile.account,
            has_secrets=bool(secrets), umask=job_umask(profile),
            env_build=env_plan.lines(f"{layout.root}/envs/<key, found on the cluster>"), placement=place,
            notify=told, work=work,
        )  # fmt: skip
        script = render_script(req, context)
        if as_json:
            print_json(
                {"dry_run": True, "run_id": run_id, "name": req.name, "snapshot": snap.id,
                 "files": snap.tree.files, "script": script,
                 "scripts": {_type_name(r): render_script(r, context) for r in reqs},
                 "settings": settings_of(ctx, sources)}
            )  # fmt: skip
        else:
            sys.stdout.write(script)
        for line in settings_lines(ctx, sources):
            note(line)
        if alternatives:
            note(
                f"types: {', '.join(_type_name(r) for r in reqs)} in order: one job each, the same script "
                "but for its #SBATCH lines and GPU values; the first to start takes the run"
            )
        note(resources_line(req))
        note(f"dry run: nothing was sent (run {req.name}, snapshot {snap.id[:12]}, {snap.tree.files} files)")
        return

    with session(ctx) as s:
        context = job.script_context(
            s.layout, run_id=run_id, snapshot_id=snap.id, project=snap.project, account=profile.account,
            has_secrets=bool(secrets), umask=job_umask(profile), placement=place,
        )  # fmt: skip
        probes = placement_probes(reqs, context, place)
        # Before anything is sent: a live run of this name is refused; a finished one is resumed; sbatch
        # judges each candidate (when it would start, or why it refuses it).
        check = job.check(
            s.transport, s.layout, project=snap.project, name=req.name, from_run=from_run, probes=probes,
            new_files=work.new_files(snap.tree.files),
        )  # fmt: skip
        if check.quota_warning:
            warn(check.quota_warning)
        reqs = choose_candidates(reqs, check.estimates)
        req, alternatives = reqs[0], reqs[1:]
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
            env_build=env_plan.lines(env.path) if env else (), placement=place, notify=told, work=work,
        )  # fmt: skip
        submitted = job.submit(
            s.transport, s.layout, req, context, profile=profile.name, secrets=secrets,
            provenance={"branch": uploaded.branch, "commit": uploaded.commit, "dirty": uploaded.dirty,
                        "env": env.key if env else None},
            from_run=check if from_run is not None else None,
            from_step=from_run.step if from_run is not None else None,
            alternatives=alternatives,
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
        elif not sys.stdout.isatty():
            # The job id is data for a script (`job=$(rv run ...)`, a pipe). On a terminal the line on
            # stderr below has it, and a number alone between two of rv's lines read as a stray print.
            click.echo(record.job_id)
            sys.stdout.flush()
        continues = f", up to {req.max_segments} segments" if req.max_segments > 1 else ""
        if submitted.candidates:
            jobs = ", ".join(f"{j} ({t})" for j, t in submitted.candidates)
            note(
                f"submitted run {req.name}: jobs {jobs} ({req.gpus} GPU(s), {req.nodes} node(s){continues}): "
                f"the first to start takes the run and cancels the others\n  from {record.short_commit}\n"
                f"  rv logs -f {req.name}    rv ps    rv stop {req.name}"
            )
        else:
            where = f"{req.gpus}x {req.type.name}" if req.type else "CPU"
            note(
                f"submitted run {req.name}: job {record.job_id} ({where}, {req.nodes} node(s){continues}) "
                f"from {record.short_commit}\n  {resources_line(req)}\n"
                f"  rv logs -f {req.name}    rv ps    rv stop {req.name}"
            )
        if follow:
            ctx.exit(
                follow_to_end(
                    s, record.run_id, req.name, req.max_segments, output_to_stderr=as_json,
                    desktop="desktop" in told,
                )
            )  # fmt: skip


def read_sweep(  # type: ignore[no-untyped-def]
    options: tuple[str, ...], file: Path | None, parallel: int | None, command: tuple[str, ...], *,
    name: str, follow: bool, from_: str | None, parallel_typed: bool,
):  # fmt: skip
    """The sweep the options describe (None: not a sweep), checked against the command, before
    anything else: a bad value, a {NAME} no --sweep gives, options a sweep cannot take."""
    from rv.errors import UsageError

    if not options and file is None:
        if parallel is not None and parallel_typed:
            raise UsageError(
                "--parallel caps how many points of a sweep run at once: it needs --sweep or --sweep-file",
                hint="rv run --sweep lr=1e-4,3e-4 --parallel 2 -- python train.py --lr {lr}",
            )
        return None
    from rv.sweep import build_sweep, check_command, read_sweep_file

    text, file_name = read_sweep_file(file) if file is not None else (None, None)
    sweep = build_sweep(options, file_text=text, file_name=file_name, parallel=parallel)
    for message in check_command(sweep, command):
        warn(message)
    if follow:
        raise UsageError(
            "-f follows one run, and each point of a sweep is a run of its own",
            hint=f"drop -f; then rv ps {name}   rv logs -f {name}/0   rv sweep results {name}",
        )
    if from_ is not None:
        raise UsageError(
            "--from cannot start a sweep: every point would start from the same checkpoint",
            hint="run the sweep from scratch, or give each point its start with a --sweep value the "
            "program reads",
        )
    return sweep


def run_sweep(  # type: ignore[no-untyped-def]
    ctx: click.Context, profile, sweep, command: tuple[str, ...], req, build, *, snap, env_plan, place,
    secrets, setup: tuple[str, ...], dry_run: bool, as_json: bool, sources: dict[str, str], probes_for,
    notify: tuple[str, ...] = (), work,
) -> int:  # fmt: skip
    """`rv run --sweep`: every point a run of its own (SWEEP/INDEX), one snapshot, one environment,
    one job array (or several, where MaxArraySize splits them), sent in one round trip."""
    from rv.job import submit as job
    from rv.names import point_name
    from rv.request import resources_line
    from rv.sweep import SLURM_DEFAULT_MAX_ARRAY_SIZE, check_limits, dry_run_text, plan_arrays

    name = req.name
    points = {p.index: p for p in sweep.points}
    type_name = req.type.name if req.type is not None else None
    # Each point's request: the command with its values, validated like any run's.
    point_reqs = {
        p.index: dataclasses.replace(
            build(type_name, p.command(command)), name=point_name(name, p.index), setup=req.setup
        )
        for p in sweep.points
    }
    if dry_run:
        from rv.layout import RemoteLayout
        from rv.slurm.script import render_script

        parts = plan_arrays(len(sweep), parallel=sweep.parallel, max_array_size=SLURM_DEFAULT_MAX_ARRAY_SIZE)
        layout = RemoteLayout(profile.require_remote_root())
        first = sweep.points[0]
        context = job.script_context(
            layout, run_id=job.new_run_id() + "-0", snapshot_id=snap.id, project=snap.project,
            account=profile.account, has_secrets=bool(secrets), umask=job_umask(profile),
            env_build=env_plan.lines(f"{layout.root}/envs/<key, found on the cluster>"), placement=place,
            sweep_env=first.env(), notify=notify, work=work,
        )  # fmt: skip
        script = render_script(point_reqs[first.index], context)
        if as_json:
            print_json(
                {"dry_run": True, "sweep": name, "snapshot": snap.id, "files": snap.tree.files,
                 "points": [{"index": p.index, "name": point_name(name, p.index), "params": p.values,
                             "command": list(p.command(command))} for p in sweep.points],
                 "arrays": [{"array": part.spec, "points": list(part.points),
                             "after_previous": part.after_previous} for part in parts],
                 "script": script, "settings": settings_of(ctx, sources)}
            )  # fmt: skip
        else:
            sys.stdout.write(dry_run_text(sweep, command, parts))
        for line in settings_lines(ctx, sources):
            note(line)
        note(resources_line(req) + " (each point)")
        note(
            f"dry run: nothing was sent (sweep {name}, {len(sweep)} point(s), snapshot {snap.id[:12]}; "
            f"arrays split at MaxArraySize {SLURM_DEFAULT_MAX_ARRAY_SIZE}, Slurm's default: the cluster's "
            "own is asked at submission)"
        )
        return 0

    with session(ctx) as s:
        probe_ctx = job.script_context(
            s.layout, run_id="probe", snapshot_id=snap.id, project=snap.project, account=profile.account,
            has_secrets=bool(secrets), umask=job_umask(profile), placement=place,
        )  # fmt: skip
        # One round trip before anything is sent: the name, points of a sweep of this name that exist
        # (resumed, if they are the same points), MaxArraySize, the user's queue and its limit.
        check = job.check_sweep(
            s.transport, s.layout, project=snap.project, name=name, probes=probes_for(probe_ctx),
            account=place.account or profile.account, qos=place.qos,
            new_files=work.new_files(snap.tree.files, len(sweep)),
        )  # fmt: skip
        if check.quota_warning:
            warn(check.quota_warning)
        choose_candidates([req], check.estimates)
        resumed = job.check_existing_points(name, check, sweep.points)
        limit = check.limit
        check_limits(
            len(sweep), max_jobs=limit.jobs if limit else None, queued=check.queued,
            limit=limit.what if limit else "MaxSubmitJobs",
        )  # fmt: skip
        parts = plan_arrays(
            len(sweep), parallel=sweep.parallel, max_array_size=check.arrays.max_array_size,
            max_array_tasks=check.arrays.max_array_tasks,
        )  # fmt: skip
        if resumed:
            note(f"sweep {name} exists: point(s) {_indexes(resumed)} resume from their checkpoints")
        env = ensure_environment(s, env_plan, (*profile.setup, *setup))
        from rv.config import cache_dir
        from rv.files.snapshot import upload_snapshot
        from rv.files.treecache import StoreCache

        cache = StoreCache(cache_dir(), f"{profile.name}:{s.layout.root}")
        with progress_renderer("uploading") as bar:
            uploaded = upload_snapshot(
                s.transport, s.layout, snap, cache=cache, on_summary=note, on_progress=bar
            )
        sweep_id = job.new_run_id()
        provenance = {"branch": uploaded.branch, "commit": uploaded.commit, "dirty": uploaded.dirty,
                      "env": env.key if env else None}  # fmt: skip

        def make(index: int, run_id: str) -> job.PointRun:
            point = points[index]
            context = job.script_context(
                s.layout, run_id=run_id, snapshot_id=uploaded.id, project=uploaded.project,
                account=profile.account, has_secrets=bool(secrets), umask=job_umask(profile),
                env_build=env_plan.lines(env.path) if env else (), placement=place, sweep_env=point.env(),
                notify=notify, work=work,
            )  # fmt: skip
            args = job.submit_args(
                s.layout, point_reqs[index], context, provenance=provenance, has_secrets=bool(secrets)
            )
            args["meta"]["sweep"] = job.sweep_meta(sweep, name, point, sweep_id)
            return job.PointRun(index, point_reqs[index], context, args)

        payload, runs = job.sweep_payload(s.layout, parts, make)
        sent = job.submit_sweep(
            s.transport, s.layout, project=uploaded.project, name=name, parts=payload, secrets=secrets or None
        )
        records = [
            job.run_record(
                s.layout, pr.req, pr.ctx, pr.args, profile=profile.name, job_id=f"{part['array']}_{task}"
            )
            for part, made in zip(sent, runs, strict=True)
            for task, pr in enumerate(made)
        ]
        run_store().add_many(records)
    arrays = [str(part["array"]) for part in sent]
    if as_json:
        print_json(
            {"sweep": name, "arrays": arrays,
             "points": [{"index": pr.index, "name": pr.req.name, "params": points[pr.index].values,
                         "run_id": r.run_id, "job_id": r.job_id}
                        for pr, r in zip([pr for made in runs for pr in made], records, strict=True)]}
        )  # fmt: skip
    elif not sys.stdout.isatty():
        # Data for a script, as a plain run's job id is; on a terminal the line below has them.
        for array in arrays:
            click.echo(array)
    at_once = f", at most {sweep.parallel} at once" if sweep.parallel else ""
    how = (
        f"job array {arrays[0]}"
        if len(arrays) == 1
        else f"{len(arrays)} job arrays ({', '.join(arrays)}; MaxArraySize {check.arrays.max_array_size})"
    )
    note(
        f"submitted sweep {name}: {len(sweep)} point(s) over {', '.join(sweep.names)} as {how}{at_once}, "
        f"from {records[0].short_commit}\n  {resources_line(req)} (each point)\n"
        f"  rv ps {name}    rv sweep results {name}    rv logs -f {name}/0    rv stop {name}"
    )
    return 0


def _indexes(indexes: list[int]) -> str:
    shown = ", ".join(str(i) for i in indexes[:10])
    return shown + (f" and {len(indexes) - 10} more" if len(indexes) > 10 else "")


def _type_name(req) -> str:  # type: ignore[no-untyped-def]
    return req.type.name if req.type is not None else "cpu"


def placement_probes(reqs, context, place) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    """What sbatch --test-only is asked before anything is sent: every candidate of a run over several
    GPU types, and a one-type run's job when it carries Slurm options sbatch alone can judge."""
    from rv.placement import probe_script
    from rv.slurm.script import probe_directives

    asks = place.qos or place.reservation or place.sbatch or place.constraint or place.nodelist
    if len(reqs) == 1 and not (asks or place.partition or place.account or place.time_min_seconds):
        return []
    return [(_type_name(r), probe_script(probe_directives(r, context))) for r in reqs]


def choose_candidates(reqs, estimates):  # type: ignore[no-untyped-def]
    """The candidates sbatch would take, preferred first; says when each would start. None: an error."""
    if not estimates:
        return reqs
    by_type = {e.gpu_type: e for e in estimates}
    kept, refused = [], []
    for r in reqs:
        e = by_type.get(_type_name(r))
        if e is None or e.error is None:
            kept.append(r)
            if e is not None and len(reqs) > 1:
                where = f" on {e.nodes}" if e.nodes else ""
                note(f"{_type_name(r)}: would start {e.start}{where}")
        else:
            refused.append(f"{_type_name(r)}: {e.error}" if len(reqs) > 1 else e.error)
    if not kept:
        from rv.errors import UsageError

        raise UsageError(
            "sbatch refuses this job: " + "; ".join(refused) + " (nothing was sent)",
            hint="check --partition, --qos, --account, --constraint, --sbatch (rv status lists yours)",
        )
    for reason in refused:
        warn(f"left out {reason} (sbatch refuses it)")
    return kept


def settings_of(ctx: click.Context, sources: dict[str, str]) -> dict[str, dict[str, object]]:
    """Each setting that is not rv's own default: its value and where it came from."""
    from rv.cli.defaults import BUILT_IN

    out: dict[str, dict[str, object]] = {}
    for param in ctx.command.params:
        name = param.name or ""
        if (
            not isinstance(param, click.Option)
            or name in NOT_DEFAULTS
            or sources.get(name, BUILT_IN) == BUILT_IN
        ):
            continue
        value = ctx.params.get(name)
        out[param.opts[-1]] = {
            "value": list(value) if isinstance(value, tuple) else value,
            "from": sources[name],
        }
    return out


def settings_lines(ctx: click.Context, sources: dict[str, str]) -> list[str]:
    settings = settings_of(ctx, sources)
    if not settings:
        return []
    parts = [f"{flag} {_shown(v['value'])} ({v['from']})" for flag, v in settings.items()]
    return ["settings: " + "; ".join(parts)]


def _shown(value: object) -> str:
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return "on" if value is True else str(value)


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


def follow_to_end(s, run_id: str, name: str, max_segments: int, *, output_to_stderr: bool = False,  # type: ignore[no-untyped-def]
                  desktop: bool = False) -> int:  # fmt: skip
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
    if desktop:
        from rv.cli.common import tell_desktop

        tell_desktop(name, followed.ended, end_state(reason))
    return code


def _start_dir(here: Path) -> str:
    """The folder the program will start in, relative to the repo top ("" at the top or outside a repo)."""
    from rv.files.listing import Git, find_repo_top

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
