"""Working inside a running job: which job and nodes a run has now, and the ways in.

`rv ssh`, `rv gpu` and `rv forward` start from :func:`running_job`: the run as the user named it
(rv.job.query.resolve: one round trip for its records and squeue), its current segment's job, which
must be running, and its nodes in Slurm's order (``--node 0`` is the first: the batch script's node,
where rank 0 runs).

A node is reached through Slurm, never by SSH to the node (compute nodes often refuse that, and a
shell there would be outside the job's cgroup): a step of the job itself, ``srun --jobid J --overlap
--nodelist NODE``, which shares the job's CPUs, memory and GPUs with the program. The shell starts
from the job's environment file (rv.slurm.script writes it: what the program got, secrets included).
A tunnel (``rv forward``) goes to the node's address as Slurm knows it (``NodeAddr``): node names
need not resolve on the login node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rv.agent import layout as remote_layout
from rv.errors import RemoteError, UsageError
from rv.gpustat import NODE_SCRIPT, NodeGpus, parse_report
from rv.job import query
from rv.job.records import ClusterRun, RunStore
from rv.layout import RemoteLayout
from rv.slurm import commands
from rv.slurm.container import Container, attach_options, from_meta
from rv.slurm.parse import NodeAddress, QueuedJob, parse_node_addresses, parse_squeue

if TYPE_CHECKING:
    from rv.remote.transport import Transport

# Run on the node by the step (bash -c ATTACH rv-ssh ENV_FILE WORK_DIR [COMMAND]): a shell, or one
# command line, in the job's environment; a plain one in its work dir when the job saved none.
ATTACH = r"""f=$1 d=$2
shift 2
# A job in a container (rv run --container) left how to enter its image beside its environment file.
c="${f%/*}/container.sh"
if [ -r "$c" ] && [ -r "$f" ]; then
    . "$c"
    cd -- "$d" 2>/dev/null || true
    [ $# -gt 0 ] || rv_in_container bash --rcfile "$f" -i
    rv_in_container bash -c '. "$1"; exec bash -c "$2"' rv-ssh "$f" "$1"
fi
if [ -r "$f" ]; then
    [ $# -gt 0 ] || exec bash --rcfile "$f" -i
    . "$f"
else
    echo "rv: job ${SLURM_JOB_ID:-?} saved no environment (still starting): a plain shell in its work dir" >&2
    cd -- "$d" 2>/dev/null || true
    [ $# -gt 0 ] || exec bash -i
fi
exec bash -c "$1"
"""


@dataclass(frozen=True)
class JobPlace:
    """Where one job of a run keeps its things on the cluster."""

    root: str
    run_id: str
    job_id: str
    # srun's options that put a step of the job in its image (Pyxis: rv.slurm.container.attach_options).
    enter: tuple[str, ...] = ()

    @property
    def run_dir(self) -> str:
        return RemoteLayout(self.root).run_dir(self.run_id)

    @property
    def env_file(self) -> str:
        return RemoteLayout(self.root).in_run(self.run_id, remote_layout.job_env(self.job_id))

    @property
    def work_dir(self) -> str:
        return RemoteLayout(self.root).in_run(self.run_id, remote_layout.WORK)


@dataclass(frozen=True)
class RunningJob:
    """A run whose current segment's job is running: on which nodes, and where its things are."""

    run: ClusterRun
    job: QueuedJob
    root: str

    @property
    def name(self) -> str:
        return self.run.name

    @property
    def job_id(self) -> str:
        return self.job.job_id

    @property
    def nodes(self) -> tuple[str, ...]:
        return self.job.node_list

    def node(self, index: int) -> str:
        if index < 0 or index >= len(self.nodes):
            raise UsageError(
                f"--node {index}: run {self.name} runs on {len(self.nodes)} node(s) "
                f"(0..{len(self.nodes) - 1}: {', '.join(self.nodes)})",
                hint="--node 0 is the first node, where the batch script and rank 0 run",
            )
        return self.nodes[index]

    @property
    def container(self) -> tuple[Container, list[str]] | None:
        """The image the job runs in and its binds, as its record keeps them (None: no container)."""
        return from_meta(self.run.meta.get("container"))

    @property
    def place(self) -> JobPlace:
        found = self.container
        enter: list[str] = []
        if found is not None:
            run_dir = RemoteLayout(self.root).run_dir(self.run.run_id)
            enter = attach_options(found[0], folders=found[1], job_id=self.job_id, workdir=run_dir)
        return JobPlace(self.root, self.run.run_id, self.job_id, tuple(enter))


def running_job(
    transport: Transport, store: RunStore, profile: str, root: str, ref: str | None
) -> RunningJob:
    """RUN (a name, run id, job id, or None: the latest) with its running job; a clear error when
    the run is pending or over."""
    found = query.resolve(transport, store, profile, root, ref)
    run = found.run
    if found.listing.squeue_error:
        raise RemoteError(
            f"squeue failed, so run {run.name}'s job cannot be found: {found.listing.squeue_error}"
        )
    seg = run.current
    job = next((j for j in found.listing.queued if seg is not None and j.job_id == seg.job_id), None)
    if job is None:
        why = (run.ended or {}).get("reason") or (seg.reason if seg else "") or "no record of why"
        raise UsageError(
            f"run {run.name} is not running: it ended ({why})",
            hint=f"rv logs {run.name} shows its output; rv up gives an interactive allocation",
        )
    if job.state != "RUNNING":
        start = f", expected to start {job.start}" if job.start else ""
        raise UsageError(
            f"run {run.name} is not running yet: job {job.job_id} is {job.state} "
            f"({job.reason or 'no reason given'}){start}",
            hint=f"wait until it starts (rv ps shows it), or follow it: rv logs -f {run.name}",
        )
    record_root = found.record.remote_root if found.record is not None else root
    return RunningJob(run=run, job=job, root=record_root)


def attach_command(place: JobPlace, node: str, command: str | None, *, pty: bool) -> str:
    """The login node's shell line for a shell (``command`` None) or one command line on ``node``,
    in the job's environment and directory."""
    words = ["bash", "-c", ATTACH, "rv-ssh", place.env_file, place.work_dir]
    if command is not None:
        words.append(command)
    return commands.shell(commands.srun_attach(place.job_id, node, words, pty=pty, options=place.enter))


def node_address(transport: Transport, node: str) -> NodeAddress:
    """Where ``node`` is reached, as Slurm says (``NodeAddr``, else ``NodeHostName``)."""
    result = transport.run(commands.shell(commands.scontrol_show_nodes([node])), timeout=60)
    result.check(f"asking Slurm for the address of node {node}")
    found = parse_node_addresses(result.out).get(node)
    if found is None or not found.reach:
        raise RemoteError(f"Slurm gave no address for node {node} (scontrol show node {node})")
    return found


def gpu_report(transport: Transport, rj: RunningJob) -> list[NodeGpus]:
    """nvidia-smi on every node of the job, in one step (one round trip)."""
    argv = commands.srun_each_node(rj.job_id, len(rj.nodes), ["bash", "-c", NODE_SCRIPT])
    result = transport.run(commands.shell(argv), timeout=120)
    report = parse_report(result.out)
    if result.exit_code != 0 or len(report) != len(rj.nodes):
        tail = " / ".join(result.err.strip().splitlines()[-3:])
        raise RemoteError(
            f"asking the GPUs of job {rj.job_id} failed (srun exit {result.exit_code}): "
            f"{tail or 'no message'}"
        )
    return report


def job_state(transport: Transport, job_id: str) -> QueuedJob | None:
    """The job as squeue sees it now; None once it has left the queue."""
    result = transport.run(commands.shell(commands.squeue_job(job_id)), timeout=60)
    if result.exit_code != 0:
        if "invalid job id" in result.err.lower():
            return None  # Slurm has forgotten it: long over
        result.check(f"squeue for job {job_id}")
    jobs = [j for j in parse_squeue(result.out) if j.job_id == job_id]
    return jobs[0] if jobs else None
