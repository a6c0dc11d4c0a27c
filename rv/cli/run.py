"""`rv run [OPTIONS] -- CMD...`: options -> plan -> launch -> render, and optionally follow.

The pipeline is rv.job.launch's (validate, place, secrets, prepare; check, environment, upload,
submit, record); this module turns the options into its :class:`~rv.job.launch.RunOptions` and
what it returns into output: the run record or job id on stdout, the rest on stderr.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from rv.cli.common import note, print_json, run_store, session, warn
from rv.cli.launchview import TerminalLaunch
from rv.cli.layered import (
    NOT_DEFAULTS,
    LayeredCommand,
    container_options,
    env_of,
    env_options,
    placement_of,
    placement_options,
)

if TYPE_CHECKING:
    from rv.job.launch import Launched, Plan, RunOptions, SweepLaunched


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
@placement_options()
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
    "value; the program also sees it as RV_SWEEP_<NAME> (upper case: lr in RV_SWEEP_LR).",
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
@container_options
@click.option(
    "--idle-gpu",
    metavar="DURATION",
    help="When every GPU of a node stays under 5% this long, say so once in the run's stderr log (and "
    "to --notify): e.g. 15m (the default), 1h, off.",
)
@click.option("-f", "--follow", is_flag=True, help="Follow the run, segment by segment; exit with its code.")
@click.option(
    "--on", "on", metavar="SESSION",
    help="Start the command as a step of SESSION's job (a session of rv up --detach, rv code or rv "
    "jupyter) instead of a job of its own: within what it holds, ended by its time limit (no chains).",
)  # fmt: skip
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
    /,
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
    max_fault_retries: int | None,
    each_node: bool,
    allow_single_process: bool,
    sweep_options: tuple[str, ...],
    sweep_file: Path | None,
    parallel: int | None,
    notify: tuple[str, ...],
    work_dir: str | None,
    container: str | None,
    container_runtime: str | None,
    idle_gpu: str | None,
    follow: bool,
    on: str | None,
    dry_run: bool,
    allow_large: bool,
    max_file_size: str,
    as_json: bool,
    command: tuple[str, ...],
    **slurm: Any,  # Slurm's options (rv.slurmoptions.TABLE): placement_of(ctx.params) reads them
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
    from rv.cli.defaults import COMMAND_LINE
    from rv.job import launch as pipeline

    _, profile = load_profile(ctx)
    sources = ctx.meta.get("rv.sources", {})
    options = pipeline.RunOptions(
        command=command, gpus=gpus, gpu_type=gpu_type, vram=vram, mig=mig, time=time_, time_min=time_min,
        mem=mem, cpus=cpus, name=name, nodes=nodes, setup=setup, outputs=outputs, signal=signal,
        max_segments=max_segments, from_run=from_, max_fault_retries=max_fault_retries,
        each_node=each_node, allow_single_process=allow_single_process, sweep=sweep_options,
        sweep_file=sweep_file, parallel=parallel, parallel_typed=sources.get("parallel") == COMMAND_LINE,
        notify=notify, work_dir=work_dir, idle_gpu=idle_gpu, follow=follow,
        placement=placement_of(ctx.params), env=env_of(ctx.params), container=container,
        container_runtime=container_runtime,
        allow_large=allow_large, max_file_size=max_file_size,
        follow_from=None if sources.get("follow") == COMMAND_LINE else sources.get("follow"),
        # With an explicit `--` the user said the flags after the command are the program's: no check.
        rv_flags=None if _after_separator(command) else option_words(ctx.command),
    )  # fmt: skip
    view = TerminalLaunch()
    if on is not None:
        run_on(ctx, options, on, view, as_json=as_json)
        return
    # Everything is validated here, before the first network call.
    plan = pipeline.plan_run(options, profile, here=Path.cwd(), view=view)
    if dry_run:
        show_dry_run(ctx, plan, sources, as_json=as_json)
        return
    if plan.sweep is not None:
        from rv.job.interrupt import SubmitStage, said_on_interrupt

        # A Ctrl-C says whether the sweep was sent, was not, or may have been.
        with said_on_interrupt(SubmitStage("sweep", plan.request.name)) as stage:
            with session(ctx) as s:
                swept = pipeline.launch_sweep(plan, s, run_store(), view, stage=stage)
            show_sweep(plan, swept, as_json=as_json)
        return
    with session(ctx) as s:
        launched = pipeline.launch(plan, s, run_store(), view)
        show_submitted(launched, as_json=as_json, follow=follow)
        if follow:
            req, record = launched.request, launched.submitted.record
            ctx.exit(
                follow_to_end(
                    s, record.run_id, req.name, req.max_segments, output_to_stderr=as_json,
                    desktop="desktop" in plan.notify,
                )
            )  # fmt: skip


def run_on(ctx: click.Context, options: RunOptions, on: str, view: TerminalLaunch, *, as_json: bool) -> None:
    """``rv run --on SESSION``: the session's shape asked first (squeue), then the run as ever, started
    as a step of the session's job."""
    from rv.job import launch as pipeline
    from rv.job import onsession
    from rv.job.inside import running_job

    onsession.refuse_alone(options)
    # The session's shape fills what was left out, so the plan waits for it: squeue, nothing sent.
    with session(ctx) as s:
        held = running_job(s.transport, run_store(), s.profile.name, s.layout.root, on)
        fitted, where = onsession.fit(options, held)
        plan = pipeline.plan_run(fitted, s.profile, here=Path.cwd(), view=view)
        launched = pipeline.launch(plan, s, run_store(), view, on=where)
        show_submitted(launched, as_json=as_json, follow=options.follow)
        if options.follow:
            req, record = launched.request, launched.submitted.record
            ctx.exit(follow_to_end(s, record.run_id, req.name, 1, output_to_stderr=as_json))


def show_dry_run(ctx: click.Context, plan: Plan, sources: dict[str, str], *, as_json: bool) -> None:
    """What --dry-run prints: the job script (a sweep: its points and arrays) on stdout, the rest on
    stderr."""
    from rv.job.launch import dry_run, type_name
    from rv.names import point_name
    from rv.request import resources_line
    from rv.sweep import SLURM_DEFAULT_MAX_ARRAY_SIZE, dry_run_text

    shown, req, snap = dry_run(plan), plan.request, plan.snapshot
    if plan.sweep is not None:
        sweep, name = plan.sweep, req.name
        if as_json:
            print_json(
                {"dry_run": True, "sweep": name, "snapshot": snap.id, "files": snap.tree.files,
                 "points": [{"index": p.index, "name": point_name(name, p.index), "params": p.values,
                             "command": list(p.command(plan.command))} for p in sweep.points],
                 "arrays": [{"array": part.spec, "points": list(part.points),
                             "after_previous": part.after_previous} for part in shown.parts],
                 "script": shown.script, "settings": settings_of(ctx, sources)}
            )  # fmt: skip
        else:
            sys.stdout.write(dry_run_text(sweep, plan.command, shown.parts))
        for line in settings_lines(ctx, sources):
            note(line)
        note(resources_line(req) + " (each point)")
        _show_pull(plan)
        note(
            f"dry run: nothing was sent (sweep {name}, {len(sweep)} point(s), snapshot {snap.id[:12]}; "
            f"arrays split at MaxArraySize {SLURM_DEFAULT_MAX_ARRAY_SIZE}, Slurm's default: the cluster's "
            "own is asked at submission)"
        )
        return
    if as_json:
        print_json(
            {"dry_run": True, "run_id": plan.run_id, "name": req.name, "snapshot": snap.id,
             "files": snap.tree.files, "script": shown.script, "scripts": dict(shown.scripts),
             "settings": settings_of(ctx, sources)}
        )  # fmt: skip
    else:
        sys.stdout.write(shown.script)
    for line in settings_lines(ctx, sources):
        note(line)
    if len(plan.candidates) > 1:
        note(
            f"types: {', '.join(type_name(r) for r in plan.candidates)} in order: one job each, the same "
            "script but for its #SBATCH lines and GPU values; the first to start takes the run"
        )
    note(resources_line(req))
    _show_pull(plan)
    note(f"dry run: nothing was sent (run {req.name}, snapshot {snap.id[:12]}, {snap.tree.files} files)")


def _show_pull(plan: Plan) -> None:
    """A registry reference: the pull `rv run` would do on the login node before submitting."""
    from rv.job.container import dry_run_pull

    if plan.container is None:
        return
    lines = dry_run_pull(plan.container, plan.profile.require_remote_root())
    if lines:
        note(
            f"would pull {plan.container.image} on the cluster before submitting, once (reused while "
            "the registry's digest is the same), with auto's first runtime (the cluster may pick another):"
        )
        for line in lines:
            note(f"  $ {line}")


def show_submitted(launched: Launched, *, as_json: bool, follow: bool = False) -> None:
    """The run record (--json) or its job id on stdout (not with -f: stdout is then the program's
    output alone); what was submitted, and what to type next, on stderr."""
    from rv.request import resources_line

    req, submitted = launched.request, launched.submitted
    record = submitted.record
    if as_json:
        print_json(asdict(record))
        sys.stdout.flush()  # the record is all stdout gets: a reader may act on it while the run goes
    elif not sys.stdout.isatty() and not follow:
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
        where = f"{req.gpus}× {req.type.name}" if req.type else "CPU"
        note(
            f"submitted run {req.name}: job {record.job_id} ({where}, {req.nodes} node(s){continues}) "
            f"from {record.short_commit}\n  {resources_line(req)}\n"
            f"  rv logs -f {req.name}    rv ps    rv stop {req.name}"
        )


def show_sweep(plan: Plan, swept: SweepLaunched, *, as_json: bool) -> None:
    """The sweep's arrays (and with --json every point's run) on stdout; the summary on stderr."""
    from rv.request import resources_line

    assert plan.sweep is not None
    sweep, name, arrays = plan.sweep, swept.name, list(swept.arrays)
    points = {p.index: p for p in sweep.points}
    if as_json:
        print_json(
            {"sweep": name, "arrays": arrays,
             "points": [{"index": pr.index, "name": pr.req.name, "params": points[pr.index].values,
                         "run_id": r.run_id, "job_id": r.job_id}
                        for pr, r in zip(swept.points, swept.records, strict=True)]}
        )  # fmt: skip
    elif not sys.stdout.isatty():
        # Data for a script, as a plain run's job id is; on a terminal the line below has them.
        for array in arrays:
            click.echo(array)
    at_once = f", at most {sweep.parallel} at once" if sweep.parallel else ""
    how = (
        f"job array {arrays[0]}"
        if len(arrays) == 1
        else f"{len(arrays)} job arrays ({', '.join(arrays)}; MaxArraySize {swept.max_array_size})"
    )
    note(
        f"submitted sweep {name}: {len(sweep)} point(s) over {', '.join(sweep.names)} as {how}{at_once}, "
        f"from {swept.records[0].short_commit}\n  {resources_line(plan.request)} (each point)\n"
        f"  rv ps {name}    rv sweep results {name}    rv logs -f {name}/0    rv stop {name}"
    )


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
    if isinstance(value, float):
        return f"{value:g}"  # --vram 40, as typed, not 40.0
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


def follow_to_end(
    s: Any,
    run_id: str,
    name: str,
    max_segments: int,
    *,
    output_to_stderr: bool = False,
    desktop: bool = False,
) -> int:
    """Follow a run until it ends; the run's exit code (0 when it finished), 130 on Ctrl-C.

    ``output_to_stderr`` (``-f --json``): the program's output, both streams, goes to stderr, so
    stdout holds nothing but the JSON record.
    """
    from rv.agent.segment import end_state
    from rv.cli.following import TerminalView
    from rv.job.records import run_exit_code
    from rv.job.watch import follow_run

    # stdout is the program's output alone (`out=$(rv run -f ...)`): rv's lines go to stderr.
    view = TerminalView(
        max_segments=max_segments, separators=False, out=sys.stderr if output_to_stderr else None,
        own=sys.stderr,
    )  # fmt: skip
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


def _after_separator(command: tuple[str, ...]) -> bool:
    """True when the user typed `--` right before the command (click swallows it, argv keeps it)."""
    argv = sys.argv[1:]
    start = len(argv) - len(command)
    return bool(command) and start > 0 and argv[start:] == list(command) and argv[start - 1] == "--"
