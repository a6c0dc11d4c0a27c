"""The run pipeline: options and the profile -> a frozen, validated :class:`Plan` -> launch.

`rv run`, `rv run --sweep` and `rv up` are each options -> plan (:func:`plan_run`, :func:`plan_up`)
-> launch (:func:`launch`, :func:`launch_sweep`, :func:`start_up`) -> render (rv.cli). The steps are
written here once:

1. validate: the request, over each GPU type the run may take (rv.request, rv.placement); the sweep;
   ``--from``;
2. place: Slurm's placement options (rv.placement.build_placement);
3. secrets: the profile's and the global ones, read on this machine;
4. prepare: the snapshot (listed, hashed, size-checked) and the environment plan (rv.job.prepare).
   Everything so far is local: any refusal happens before the first network call;
5. check: one round trip (a live run of the name is refused; what resumes; sbatch's word on each
   candidate, the ones it refuses left out);
6. environment: found on the cluster, or built now (in the foreground, with its progress);
7. upload: what the cluster lacks of the snapshot;
8. script context: built in one place, :meth:`Plan.context`;
9. submit (one round trip), and
10. record: this machine's runs.json, with the repository's facts (rv.files.repo).

What the user should hear comes through a :class:`LaunchView` as words; the CLI decides how they
look (nothing here imports click or rich).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rv.agent.container import is_reference
from rv.errors import PLACEMENT_HINT, UsageError
from rv.job import submit
from rv.job.container import ContainerSpec, Pulled, dry_run_container, parse_container, pull
from rv.job.prepare import job_umask
from rv.layout import RemoteLayout
from rv.placement import Estimate
from rv.request import JobRequest
from rv.slurm.container import DROP_HOST_VENV, Container
from rv.slurm.script import ScriptContext
from rv.slurmoptions import Placement, PlacementOptions
from rv.timespec import IDLE_GPU_DEFAULT, parse_idle_gpu

if TYPE_CHECKING:
    from rv.config import Profile
    from rv.files.listing import Soon
    from rv.files.progress import Progress
    from rv.files.snapshot import LocalSnapshot, SnapshotResult
    from rv.files.treecache import StoreCache
    from rv.job.interrupt import SubmitStage
    from rv.job.records import RunRecord, RunStore
    from rv.job.up import Watchdog
    from rv.pyenv.client import Environment
    from rv.pyenv.plan import EnvPlan
    from rv.remote.transport import Transport
    from rv.slurm.parse import QueuedJob
    from rv.sweep import ArrayPart, Sweep

# Where a dry run's script says the environment will be: its key is known only to the cluster.
DRY_RUN_ENV = "<key, found on the cluster>"


class LaunchView(Protocol):
    """What the user hears while a job starts: notes and warnings, the environment's build, the upload."""

    def note(self, message: str) -> None: ...

    def warn(self, message: str) -> None: ...

    def building(self) -> AbstractContextManager[Callable[[str], None]]:
        """While the environment is found or built: a callback for each line the cluster says."""
        ...

    def uploading(self) -> AbstractContextManager[Progress | None]:
        """While the snapshot is uploaded: a progress callback (None: no progress is shown)."""
        ...


class StartUpView(LaunchView, Protocol):
    """`rv up`'s view: a launch's, and what its watchdog says (rv.job.up.UpView)."""

    def submitted(self, record: RunRecord) -> None: ...

    def state(self, job: QueuedJob) -> None: ...

    def warning(self, message: str) -> None: ...


class Remote(Protocol):
    """One connection to the cluster (the CLI's session): opened on first use of ``transport``."""

    @property
    def transport(self) -> Transport: ...

    @property
    def layout(self) -> RemoteLayout: ...


# --- options ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvOptions:
    """How the job's Python environment is chosen (``--env`` and its companions)."""

    choice: str = "auto"
    requirements: str | None = None
    extras: tuple[str, ...] = ()
    python: str | None = None
    system_site_packages: bool | None = None


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """What any job was told (`rv up` takes exactly these): its size, where it may run, its
    environment, the snapshot's size guard. Unchecked; defaults filled from the project and profile."""

    gpus: int | None = None
    gpu_type: str | None = None
    mig: bool = False
    time: str | None = None
    mem: str | None = None
    cpus: int | None = None
    nodes: int | None = None
    setup: tuple[str, ...] = ()
    name: str | None = None
    placement: PlacementOptions = field(default_factory=PlacementOptions)
    env: EnvOptions = EnvOptions()
    allow_large: bool = False
    max_file_size: str = "100MB"
    container: str | None = None  # --container IMAGE (none: no container), unchecked
    container_runtime: str | None = None  # --container-runtime


@dataclass(frozen=True, kw_only=True)
class RunOptions(JobOptions):
    """What `rv run` was told besides: the command, and how the run goes on and is continued."""

    command: tuple[str, ...]
    vram: float | None = None
    time_min: str | None = None
    outputs: tuple[str, ...] = ()
    signal: str | None = None
    max_segments: int | None = None
    from_run: str | None = None  # --from RUN[@STEP]
    max_fault_retries: int | None = None
    each_node: bool = False
    allow_single_process: bool = False
    sweep: tuple[str, ...] = ()  # --sweep NAME=V1,V2 ...
    sweep_file: Path | None = None
    parallel: int | None = None
    parallel_typed: bool = False  # --parallel came from the command line (not a project's default)
    notify: tuple[str, ...] = ()  # --notify WHERE: who is told of the run's end (rv.notify)
    work_dir: str | None = None  # --work-dir shared|node (rv.job.workdir)
    idle_gpu: str | None = None  # --idle-gpu DURATION|off (rv.timespec.parse_idle_gpu)
    follow: bool = False
    # Where a follow not typed came from (a project's defaults, e.g. "pyproject.toml [tool.rv]"); None
    # when -f was typed. A sweep refuses a typed -f and leaves a project's `follow = true` alone.
    follow_from: str | None = None
    # rv run's option words (each -> whether it takes a value), for the check that none of them went
    # to the program; None when the user wrote `--` before the command and so said they are its own.
    rv_flags: Mapping[str, bool] | None = None


# --- the plan ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """A job checked in every way that needs no network: ready to launch, or to print (--dry-run)."""

    run_id: str
    profile: Profile
    candidates: tuple[JobRequest, ...]  # one per GPU type the run may take, the preferred first
    placement: Placement
    secrets: Mapping[str, str]
    snapshot: LocalSnapshot
    env_plan: EnvPlan
    env_setup: tuple[str, ...]  # the lines the environment is found or built after (profile's, --setup)
    command: tuple[str, ...]  # as typed (a sweep's with its {NAME} placeholders)
    from_run: submit.FromRun | None = None
    notify: tuple[str, ...] = ()  # who is told of the run's end, checked (rv.notify.parse_targets)
    sweep: Sweep | None = None
    points: Mapping[int, JobRequest] = field(default_factory=dict)  # a sweep's point requests by index
    work: submit.WorkDir = field(default_factory=submit.WorkDir)  # where the work dir is (--work-dir)
    container: ContainerSpec | None = None  # --container, checked on the laptop (the cluster resolves it)
    idle_gpu: int = IDLE_GPU_DEFAULT  # --idle-gpu in seconds; 0: off

    @property
    def request(self) -> JobRequest:
        return self.candidates[0]

    def context(
        self,
        layout: RemoteLayout,
        *,
        run_id: str | None = None,
        uploaded: SnapshotResult | None = None,
        env_build: tuple[str, ...] = (),
        sweep_env: Mapping[str, str] | None = None,
        container: Container | None = None,
    ) -> ScriptContext:
        """The job script's context: before the upload the local snapshot's, after it the uploaded one's."""
        snapshot_id, project = (
            (uploaded.id, uploaded.project) if uploaded else (self.snapshot.id, self.snapshot.project)
        )
        return submit.script_context(
            layout, run_id=run_id or self.run_id, snapshot_id=snapshot_id, project=project,
            account=self.profile.account, has_secrets=bool(self.secrets), umask=job_umask(self.profile),
            env_build=env_build, placement=self.placement, sweep_env=sweep_env, notify=self.notify,
            work=self.work, container=container, idle_gpu=self.idle_gpu,
        )  # fmt: skip

    @property
    def container_check(self) -> tuple[ContainerSpec, tuple[str, ...]] | None:
        """What run-check is asked of the container: the image, the runtime, after these setup lines."""
        return (self.container, self.env_setup) if self.container is not None else None


def plan_run(options: RunOptions, profile: Profile, *, here: Path, view: LaunchView) -> Plan:
    """`rv run`'s plan: every option validated against the profile, the snapshot and environment
    prepared; warnings and notes said through ``view``. Sends nothing."""
    from rv.job.workdir import check_work_dir, many_files_warning, node_work_dir_warning
    from rv.misplaced import detect_misplaced_flags
    from rv.placement import build_placement, plan_requests, type_words
    from rv.request import build_request, default_name

    o = options
    catalog = profile.gpu_catalog()
    if o.rv_flags is not None:
        # `rv run python train.py -g 4`: the -g went to the program. Stop before anything is sent.
        misplaced = detect_misplaced_flags(o.command, catalog, flags=o.rv_flags)
        if misplaced:
            raise UsageError(
                "; ".join(misplaced),
                hint="put rv's options before the command, or write `--` before the command if those "
                "flags really are the program's",
            )
    container = parse_container(o.container, o.container_runtime)
    run_id = submit.new_run_id()
    from_run = submit.FromRun.parse(o.from_run) if o.from_run is not None else None
    # A run without --name gets one of its own: two runs of one command must never share a
    # checkpoint folder. The program starts where `rv run` was typed; -o paths are relative to it.
    run_name = o.name
    start_dir = start_folder(here)
    if o.name is None and o.command:
        run_name = submit.default_run_name(default_name(o.command), run_id)
    sweep = read_sweep(o, name=run_name or "", view=view)
    setup = (*profile.setup, *o.setup)
    work = submit.WorkDir(check_work_dir(o.work_dir), profile.node_work_dir)
    idle_gpu = parse_idle_gpu(o.idle_gpu) if o.idle_gpu is not None else IDLE_GPU_DEFAULT

    def build(gpu_type: str | None, command: tuple[str, ...] = o.command) -> JobRequest:
        return build_request(
            catalog, command=command, gpus=o.gpus, gpu_type=gpu_type, mig=o.mig, time=o.time, mem=o.mem,
            cpus=o.cpus, name=run_name, nodes=o.nodes, setup=setup, outputs=o.outputs, start_dir=start_dir,
            signal=o.signal, max_segments=o.max_segments, each_node=o.each_node,
            allow_single_process=o.allow_single_process, partitions=profile.partitions,
            partition=o.placement.partition,
        )  # fmt: skip

    # One request per GPU type the run may take (one, unless -t names several, any, or none on a
    # cluster of several types), each validated against its type's limits.
    reqs, notes = plan_requests(
        catalog, type_words(o.gpu_type), gpus=o.gpus, mig=o.mig, vram_gb=o.vram, build=build
    )
    if sweep is not None and len(reqs) > 1:
        from rv.sweep import one_type_note

        # Each type can serve every point (they all ask for the same): the sweep takes the first.
        view.note(one_type_note([type_name(r) for r in reqs]))
        reqs = reqs[:1]
    place = build_placement(
        o.placement, time_min=o.time_min, time_seconds=reqs[0].time_seconds,
        time_typed=o.time is not None, max_fault_retries=o.max_fault_retries,
    )  # fmt: skip
    node_dirs = node_work_dir_warning(reqs[0].nodes, work.where)
    for message in dict.fromkeys(
        [*notes, *(w for r in reqs for w in r.warnings), *filter(None, [node_dirs])]
    ):
        view.warn(message)
    if place.time_min_seconds is not None:
        view.note(
            "--time-min: Slurm may start each segment with as little as "
            f"{o.time_min}; the program must follow the stop protocol (save on ${{RV_STOP_SIGNAL}} and write "
            "PREEMPTED), or a short segment ends it"
        )
    ready = _prepare(
        profile, reqs, env=o.env, allow_large=o.allow_large, max_file_size=o.max_file_size,
        notify=o.notify, here=here, view=view,
    )  # fmt: skip
    check_container_env(container, ready.env_plan)
    many = many_files_warning(ready.snapshot.tree.files, len(sweep) if sweep is not None else 1, work.where)
    if many:
        view.warn(many)
    points: dict[int, JobRequest] = {}
    if sweep is not None:
        from rv.names import point_name

        req = ready.candidates[0]
        # Each point's request: the command with its values, validated like any run's.
        points = {
            p.index: dataclasses.replace(
                build(req.type.name if req.type is not None else None, p.command(o.command)),
                name=point_name(req.name, p.index), setup=req.setup,
            )
            for p in sweep.points
        }  # fmt: skip
    return Plan(
        run_id=run_id, profile=profile, candidates=ready.candidates, placement=place, secrets=ready.secrets,
        snapshot=ready.snapshot, env_plan=ready.env_plan, env_setup=setup, command=o.command,
        from_run=from_run, notify=ready.notify, sweep=sweep, points=points, work=work, container=container,
        idle_gpu=idle_gpu,
    )  # fmt: skip


def plan_up(options: JobOptions, profile: Profile, *, here: Path, view: LaunchView) -> Plan:
    """`rv up`'s plan: a session is a run whose program holds the allocation (rv.job.up.HOLDER)."""
    from rv.job import up
    from rv.placement import build_placement, one_type
    from rv.request import build_request

    o = options
    container = parse_container(o.container, o.container_runtime)
    run_id = submit.new_run_id()
    # The holder is one plain process per node on purpose (each holds its node), whatever the GPUs:
    # --each-node. A session is one job: nothing continues it, after a fault either.
    req = build_request(
        profile.gpu_catalog(), command=up.holder_command(), gpus=o.gpus,
        gpu_type=one_type(o.gpu_type, "rv up"), mig=o.mig, time=o.time, mem=o.mem, cpus=o.cpus,
        name=o.name or submit.default_run_name("up", run_id),
        nodes=o.nodes, setup=(*profile.setup, *o.setup), max_segments=1, each_node=True,
        partitions=profile.partitions, partition=o.placement.partition,
    )  # fmt: skip
    place = build_placement(o.placement, max_fault_retries=0)
    for message in req.warnings:
        view.warn(message)
    # The shell starts in the folder rv up was typed in, as a run's program would.
    ready = _prepare(
        profile, [req], env=o.env, allow_large=o.allow_large, max_file_size=o.max_file_size, here=here,
        view=view,
    )  # fmt: skip
    check_container_env(container, ready.env_plan)
    return Plan(
        run_id=run_id, profile=profile, candidates=ready.candidates, placement=place, secrets=ready.secrets,
        snapshot=ready.snapshot, env_plan=ready.env_plan, env_setup=(*profile.setup, *o.setup),
        command=req.command, container=container,
    )  # fmt: skip


def check_container_env(container: ContainerSpec | None, env_plan: EnvPlan) -> None:
    """A container runs the image's Python: an environment rv would build on the cluster's Python
    (and activate outside the image) is not one the image can use yet."""
    if container is not None and env_plan.use is not None:
        raise UsageError(
            f"--env {env_plan.use}: an existing environment is the cluster's Python's, not the image's",
            hint="leave --env out (rv builds the project's environment on the image's Python) or "
            "use --env none (the image's own Python and packages)",
        )
    if container is not None and container.runtime == "pyxis" and env_plan.spec is not None:
        raise UsageError(
            "--container-runtime pyxis: rv cannot build the project's environment in a Pyxis image "
            "(it runs images only inside a job)",
            hint="use --env none, or install the dependencies into the image",
        )


@dataclass(frozen=True)
class _Ready:
    """What a plan takes from the laptop's preparation: the requests as they run (the first's setup,
    with the `cd` into where the command was typed, is every candidate's), the secrets, who is told,
    the snapshot and the environment plan."""

    candidates: tuple[JobRequest, ...]
    secrets: Mapping[str, str]
    notify: tuple[str, ...]
    snapshot: LocalSnapshot
    env_plan: EnvPlan


def _prepare(
    profile: Profile,
    reqs: Sequence[JobRequest],
    *,
    env: EnvOptions,
    allow_large: bool,
    max_file_size: str,
    notify: tuple[str, ...] | None = None,
    here: Path,
    view: LaunchView,
) -> _Ready:
    """The secrets, the snapshot and the environment plan of requests already validated."""
    from rv.config import cache_dir
    from rv.job.prepare import prepare_local
    from rv.secrets import job_secrets
    from rv.units import parse_size

    secrets = job_secrets(profile.name, notice=view.warn)  # this profile's and the global ones
    told: tuple[str, ...] = ()
    if notify is not None:  # `rv run` (a session of `rv up` tells no one)
        from rv.notify import parse_targets

        told = tuple(parse_targets(notify, secrets).targets)
    # The file list, hashes and size guard are local: a refused file fails before we connect.
    prepared = prepare_local(
        reqs[0], profile, allow_large=allow_large, max_file_size=parse_size(max_file_size),
        env_choice=env.choice, requirements=env.requirements, extras=env.extras, python=env.python,
        system_site_packages=env.system_site_packages, cache_dir=cache_dir(), here=here,
    )  # fmt: skip
    for message in prepared.warnings:
        view.warn(message)
    for message in prepared.notes:
        view.note(message)
    req = prepared.request  # with the `cd` into the folder the command was typed in
    return _Ready(
        candidates=(req, *(dataclasses.replace(r, setup=req.setup) for r in reqs[1:])), secrets=secrets,
        notify=told, snapshot=prepared.snapshot, env_plan=prepared.env_plan,
    )  # fmt: skip


def read_sweep(o: RunOptions, *, name: str, view: LaunchView) -> Sweep | None:
    """The sweep the options describe (None: not a sweep), checked against the command, before
    anything else: a bad value, a {NAME} no --sweep gives, options a sweep cannot take."""
    if not o.sweep and o.sweep_file is None:
        if o.parallel is not None and o.parallel_typed:
            raise UsageError(
                "--parallel caps how many points of a sweep run at once: it needs --sweep or --sweep-file",
                hint="rv run --sweep lr=1e-4,3e-4 --parallel 2 -- python train.py --lr {lr}",
            )
        return None
    from rv.sweep import build_sweep, check_command, read_sweep_file

    text, file_name = read_sweep_file(o.sweep_file) if o.sweep_file is not None else (None, None)
    sweep = build_sweep(o.sweep, file_text=text, file_name=file_name, parallel=o.parallel)
    for message in check_command(sweep, o.command):
        view.warn(message)
    if o.follow and o.follow_from is None:  # typed: a project's `follow = true` is for its runs
        raise UsageError(
            "-f follows one run, and each point of a sweep is a run of its own",
            hint=f"drop -f; then rv ps {name}   rv logs -f {name}/0   rv sweep results {name}",
        )
    if o.from_run is not None:
        raise UsageError(
            "--from cannot start a sweep: every point would start from the same checkpoint",
            hint="run the sweep from scratch, or give each point its start with a --sweep value the "
            "program reads",
        )
    if o.follow:
        view.note(f"follow = true ({o.follow_from}) is for single runs: a sweep's points are not followed")
    return sweep


def start_folder(here: Path) -> str:
    """The folder the program will start in, relative to the repo top ("" at the top or outside a repo)."""
    from rv.files.listing import Git, find_repo_top

    top = find_repo_top(here, Git())
    if top is None:
        return ""
    rel = here.resolve().relative_to(top.resolve()).as_posix()
    return "" if rel == "." else rel


def type_name(req: JobRequest) -> str:
    return req.type.name if req.type is not None else "cpu"


# --- a dry run --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DryRun:
    """What a launch would send, rendered without sending anything."""

    script: str  # the preferred candidate's (a sweep: its first point's)
    scripts: Mapping[str, str]  # each candidate's, by GPU type (a run; empty for a sweep)
    parts: tuple[ArrayPart, ...] = ()  # a sweep's job arrays, split at Slurm's default MaxArraySize


def dry_run(plan: Plan) -> DryRun:
    from rv.slurm.script import render_script

    layout = RemoteLayout(plan.profile.require_remote_root())
    env_build = plan.env_plan.lines(f"{layout.root}/envs/{DRY_RUN_ENV}", in_image=plan.container is not None)
    if env_build and plan.container is not None:
        env_build = (DROP_HOST_VENV, *env_build)
    # The image as typed and the runtime its format needs: the cluster expands one and may choose the
    # other (apptainer or singularity).
    shown = dry_run_container(plan.container, layout.root) if plan.container is not None else None
    if plan.sweep is None:
        context = plan.context(layout, env_build=env_build, container=shown)
        scripts = {type_name(r): render_script(r, context) for r in plan.candidates}
        return DryRun(render_script(plan.request, context), scripts)
    from rv.sweep import SLURM_DEFAULT_MAX_ARRAY_SIZE, plan_arrays

    sweep = plan.sweep
    parts = plan_arrays(len(sweep), parallel=sweep.parallel, max_array_size=SLURM_DEFAULT_MAX_ARRAY_SIZE)
    first = sweep.points[0]
    context = plan.context(
        layout, run_id=submit.new_run_id() + "-0", env_build=env_build, sweep_env=first.env(), container=shown
    )
    return DryRun(render_script(plan.points[first.index], context), {}, tuple(parts))


# --- launching --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Launched:
    submitted: submit.Submitted
    request: JobRequest  # the preferred of the candidates sbatch takes


def launch(
    plan: Plan, remote: Remote, store: RunStore, view: LaunchView, on: submit.OnSession | None = None
) -> Launched:
    """Check, build the environment, upload, submit and record one run. ``on``: a step of that
    session's job (``rv run --on``): no sbatch, so nothing to ask it."""
    layout = remote.layout
    facts = _facts(plan)
    reqs = list(plan.candidates)
    # Before anything is sent: a live run of this name is refused; a finished one is resumed; sbatch
    # judges each candidate (when it would start, or why it refuses it).
    probes = placement_probes(reqs, plan.context(layout), plan.placement) if on is None else []
    cache = store_cache(plan.profile, layout)
    check = submit.check(
        remote.transport, layout, project=plan.snapshot.project, name=plan.request.name,
        from_run=plan.from_run, probes=probes,
        new_files=plan.work.new_files(plan.snapshot.tree.files), container=plan.container_check,
        snapshot=cache.held(plan.snapshot.project, plan.snapshot.id, plan.snapshot.tree.files),
    )  # fmt: skip
    if check.quota_warning:
        view.warn(check.quota_warning)
    reqs = choose_candidates(reqs, check.estimates, view)
    req = reqs[0]
    if plan.from_run is None and check.resume_step is not None:
        view.note(f"resuming {req.name} from step {check.resume_step}")
    elif plan.from_run is None and check.resume_files:
        view.note(f"resuming {req.name}: its checkpoint folder holds what an earlier run saved")
    # Before the upload: a requirement that cannot be resolved fails here, and nothing is queued.
    pulled = image(remote, plan, check.container, view)
    container = pulled.container if pulled is not None else None
    env = environment(remote, plan.env_plan, plan.env_setup, view, container=container)
    uploaded = upload(remote, plan, view, cache, held=check.snapshot_held)
    context = plan.context(layout, uploaded=uploaded, env_build=_env_lines(plan, env), container=container)
    submitted = submit.submit(
        remote.transport, layout, req, context, profile=plan.profile.name, secrets=plan.secrets,
        provenance=_provenance(uploaded, env, facts, view, pulled),
        from_run=check if plan.from_run is not None else None,
        from_step=plan.from_run.step if plan.from_run is not None else None, alternatives=reqs[1:],
        on=on,
    )  # fmt: skip
    store.add(submitted.record)
    if submitted.from_step is not None or plan.from_run is not None:
        how = "/".join(submitted.from_how) or "nothing to bring"
        at = f"step {submitted.from_step}" if submitted.from_step is not None else "its checkpoints"
        source = plan.from_run.run if plan.from_run else "?"
        view.note(f"{req.name} starts from {source} at {at} ({how}; that run is untouched)")
    return Launched(submitted, req)


@dataclass(frozen=True)
class SweepLaunched:
    name: str
    arrays: tuple[str, ...]  # the job arrays, in order
    points: tuple[submit.PointRun, ...]  # every point as sent, in the arrays' order
    records: tuple[RunRecord, ...]  # each point's record, in the same order
    max_array_size: int  # the cluster's MaxArraySize, which split the arrays


def launch_sweep(
    plan: Plan, remote: Remote, store: RunStore, view: LaunchView, *, stage: SubmitStage | None = None
) -> SweepLaunched:
    """`rv run --sweep`: every point a run of its own (SWEEP/INDEX), one snapshot, one environment,
    one job array (or several, where MaxArraySize splits them), sent in one round trip.

    ``stage`` follows where the submission stands (rv.job.interrupt): a Ctrl-C under the caller's
    ``said_on_interrupt`` says whether the sweep was sent, was not, or may have been."""
    from rv.job.interrupt import SubmitStage, held_interrupts
    from rv.sweep import check_limits, plan_arrays

    assert plan.sweep is not None, "launch_sweep needs a sweep's plan"
    sweep, req, layout = plan.sweep, plan.request, remote.layout
    name = req.name
    stage = stage if stage is not None else SubmitStage("sweep", name)
    facts = _facts(plan)
    # One round trip before anything is sent: the name, points of a sweep of this name that exist
    # (resumed, if they are the same points), MaxArraySize, the user's queue and its limit.
    check = submit.check_sweep(
        remote.transport, layout, project=plan.snapshot.project, name=name,
        probes=placement_probes([req], plan.context(layout, run_id="probe"), plan.placement),
        account=plan.placement.account or plan.profile.account, qos=plan.placement.qos,
        new_files=plan.work.new_files(plan.snapshot.tree.files, len(sweep)), container=plan.container_check,
    )  # fmt: skip
    if check.quota_warning:
        view.warn(check.quota_warning)
    choose_candidates([req], check.estimates, view)
    resumed = submit.check_existing_points(name, check, sweep.points)
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
        view.note(f"sweep {name} exists: point(s) {_indexes(resumed)} resume from their checkpoints")
    pulled = image(remote, plan, check.container, view)
    container = pulled.container if pulled is not None else None
    env = environment(remote, plan.env_plan, plan.env_setup, view, container=container)
    uploaded = upload(remote, plan, view)
    sweep_id = submit.new_run_id()
    provenance = _provenance(uploaded, env, facts, view, pulled)
    points = {p.index: p for p in sweep.points}

    def make(index: int, run_id: str) -> submit.PointRun:
        point = points[index]
        context = plan.context(
            layout, run_id=run_id, uploaded=uploaded, env_build=_env_lines(plan, env), sweep_env=point.env(),
            container=container,
        )  # fmt: skip
        args = submit.submit_args(
            layout, plan.points[index], context, provenance=provenance, has_secrets=bool(plan.secrets)
        )
        args["meta"]["sweep"] = submit.sweep_meta(sweep, name, point, sweep_id)
        return submit.PointRun(index, plan.points[index], context, args)

    payload, runs = submit.sweep_payload(layout, parts, make)
    stage.sending()  # from here on, a Ctrl-C cannot know whether the cluster queued the arrays
    sent = submit.submit_sweep(
        remote.transport, layout, project=uploaded.project, name=name, parts=payload,
        secrets=plan.secrets or None,
    )  # fmt: skip
    with held_interrupts():  # the cluster's answer is here: what was sent is recorded whole
        records = [
            submit.run_record(
                layout, pr.req, pr.ctx, pr.args, profile=plan.profile.name, job_id=f"{part['array']}_{task}"
            )
            for part, made in zip(sent, runs, strict=True)
            for task, pr in enumerate(made)
        ]
        store.add_many(records)
        stage.sent("job array " + ", ".join(str(part["array"]) for part in sent))
    return SweepLaunched(
        name, tuple(str(part["array"]) for part in sent), tuple(pr for made in runs for pr in made),
        tuple(records), check.arrays.max_array_size,
    )  # fmt: skip


def start_up(plan: Plan, remote: Remote, store: RunStore, view: StartUpView) -> tuple[Watchdog, RunRecord]:
    """`rv up`: check, build the environment, upload, and submit the session's job through its
    watchdog (rv.job.up); the watchdog, and the record once the job id is known."""
    from rv.job import up

    layout, req = remote.layout, plan.request
    facts = _facts(plan)
    # sbatch judges what only it can (a QoS, nodes to leave out) before anything is sent.
    check = submit.check(
        remote.transport, layout, project=plan.snapshot.project, name=req.name, from_run=None,
        probes=placement_probes([req], plan.context(layout), plan.placement), container=plan.container_check,
    )  # fmt: skip
    refused = [e.error for e in check.estimates if e.error is not None]
    if refused:
        raise sbatch_refuses(refused)
    # The project's environment, as rv run has it: built (or found) before anything is queued.
    pulled = image(remote, plan, check.container, view)
    container = pulled.container if pulled is not None else None
    env = environment(remote, plan.env_plan, plan.env_setup, view, container=container)
    uploaded = upload(remote, plan, view)
    context = plan.context(layout, uploaded=uploaded, env_build=_env_lines(plan, env), container=container)
    dog, record = up.start(
        remote.transport, layout, req, context, profile=plan.profile.name, secrets=dict(plan.secrets),
        view=view, provenance=_provenance(uploaded, env, facts, view, pulled),
    )  # fmt: skip
    store.add(record)
    return dog, record


def image(remote: Remote, plan: Plan, chosen: Container | None, view: LaunchView) -> Pulled | None:
    """The run's image as its job runs it: a path as the cluster found it, or a registry reference
    pulled once into the cluster's cache (before anything is submitted: a failed pull sends nothing),
    the pull's own output said through ``view``."""
    if chosen is None:
        return None
    if not is_reference(chosen.image):
        return Pulled(chosen)
    with view.building() as on_line:
        got = pull(remote.transport, remote.layout.agent_args(), chosen, plan.env_setup, on_line)
    if not got.pulled:
        view.note(f"image {got.reference}: pulled before, reused from the cluster's cache ({got.key})")
    return got


def environment(
    remote: Remote,
    env_plan: EnvPlan,
    setup: Sequence[str],
    view: LaunchView,
    *,
    force: bool = False,
    container: Container | None = None,
) -> Environment | None:
    """The plan's environment on the cluster: found (one round trip) or built now, its progress said
    through ``view``; None when the plan needs none (``--env none``)."""
    if env_plan.spec is None and env_plan.use is None:
        return None
    from rv.pyenv.client import ensure

    with view.building() as on_line:
        env = ensure(
            remote.transport, remote.layout, setup=setup, spec=env_plan.spec, use=env_plan.use,
            on_line=on_line, force=force,
            image={"runtime": container.runtime, "image": container.image} if container is not None else None,
        )  # fmt: skip
    said = environment_line(env, env_plan)
    if said is not None:
        view.note(said)
    return env


def environment_line(env: Environment, env_plan: EnvPlan) -> str | None:
    """What to say of the environment a run got (None: nothing worth saying)."""
    if env.key is None:
        return f"environment: {env.path} (as is)"
    if env.built:
        seconds, main_file = env.meta.get("build_seconds"), env_plan.spec.main_file if env_plan.spec else None
        return f"environment {env.key} built in {seconds} s from {main_file}: {env.path}"
    if env.waited:
        return f"environment {env.key}: built meanwhile by another rv, reused"
    if env.meta:
        return f"environment {env.key} ({env.meta.get('files')})"
    return None


def store_cache(profile: Profile, layout: RemoteLayout) -> StoreCache:
    """What this machine knows the cluster's store holds: it lets a snapshot travel as a delta."""
    from rv.config import cache_dir
    from rv.files.treecache import StoreCache

    return StoreCache(cache_dir(), f"{profile.name}:{layout.root}")


def upload(
    remote: Remote, plan: Plan, view: LaunchView, cache: StoreCache | None = None, held: str | None = None
) -> SnapshotResult:
    """The snapshot on the cluster: only what its store lacks is sent. ``held``: the commit the run's
    check found the store holding whole (nothing is asked again)."""
    from rv.files.snapshot import upload_snapshot

    with view.uploading() as progress:
        return upload_snapshot(
            remote.transport, remote.layout, plan.snapshot,
            cache=cache or store_cache(plan.profile, remote.layout), on_summary=view.note,
            on_progress=progress, held=held,
        )  # fmt: skip


def placement_probes(
    reqs: Sequence[JobRequest], context: ScriptContext, place: Placement
) -> list[tuple[str, str]]:
    """What sbatch --test-only is asked before anything is sent: every candidate of a run over several
    GPU types, and a one-type job (a run, a sweep, rv up's session) when it carries Slurm options
    sbatch alone can judge (Placement.sbatch_judges: --exclude alone among them)."""
    from rv.placement import probe_script
    from rv.slurm.script import probe_directives

    if len(reqs) == 1 and not place.sbatch_judges():
        return []
    return [(type_name(r), probe_script(probe_directives(r, context))) for r in reqs]


def sbatch_refuses(reasons: Sequence[str]) -> UsageError:
    """The error for a job sbatch --test-only refused (every candidate, in sbatch's words)."""
    return UsageError(
        "sbatch refuses this job: " + "; ".join(reasons) + " (nothing was sent)", hint=PLACEMENT_HINT
    )


def choose_candidates(
    reqs: Sequence[JobRequest], estimates: Sequence[Estimate], view: LaunchView
) -> list[JobRequest]:
    """The candidates sbatch would take, preferred first; says when each would start. None: an error."""
    if not estimates:
        return list(reqs)
    by_type = {e.gpu_type: e for e in estimates}
    kept, refused = [], []
    for r in reqs:
        e = by_type.get(type_name(r))
        if e is None or e.error is None:
            kept.append(r)
            if e is not None and len(reqs) > 1:
                where = f" on {e.nodes}" if e.nodes else ""
                view.note(f"{type_name(r)}: would start {e.start}{where}")
        else:
            refused.append(f"{type_name(r)}: {e.error}" if len(reqs) > 1 else e.error)
    if not kept:
        raise sbatch_refuses(refused)
    for reason in refused:
        view.warn(f"left out {reason} (sbatch refuses it)")
    return kept


def _facts(plan: Plan) -> Soon:
    """The repository's facts, read on a thread of their own while the cluster answers the check."""
    from rv.files.repo import facts_soon

    repo = plan.snapshot.tree.repo
    return facts_soon(repo.top if repo is not None else None, dirty=plan.snapshot.dirty)


def _provenance(
    uploaded: SnapshotResult,
    env: Environment | None,
    facts: Soon,
    view: LaunchView,
    pulled: Pulled | None = None,
) -> dict[str, Any]:
    """Where the run came from, as run.json and this machine's record keep it."""
    from rv.files.repo import FactsUnreadable

    try:
        found = facts.result()
    except FactsUnreadable as exc:
        # The snapshot's own branch, commit and dirty state are recorded all the same.
        view.warn(f"the repository's facts could not be read, so the run is recorded without them: {exc}")
        found = None
    return {
        "branch": uploaded.branch, "commit": uploaded.commit, "dirty": uploaded.dirty,
        "env": env.key if env else None, "git": found.to_json() if found is not None else None,
        "image": pulled.key if pulled is not None else None,
    }  # fmt: skip


def _env_lines(plan: Plan, env: Environment | None) -> tuple[str, ...]:
    if env is None:
        return ()
    if plan.container is not None:
        # Built in the image: the job's own venv of the setup lines steps aside for it.
        return (DROP_HOST_VENV, *plan.env_plan.lines(env.path, in_image=True))
    return plan.env_plan.lines(env.path)


def _indexes(indexes: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in indexes[:10])
    return shown + (f" and {len(indexes) - 10} more" if len(indexes) > 10 else "")
