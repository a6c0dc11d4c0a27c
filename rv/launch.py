"""Submitting a job: snapshot → script → secrets → sbatch → local record. And following it.

The CLI validates the request (rv.request) before calling anything here; everything here talks to
the cluster through the session's one connection.
"""

from __future__ import annotations

import shlex
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

from rv.errors import RemoteError
from rv.follow import exit_code_command, job_state_command, parse_exit_code, parse_job_state, tail_command
from rv.jobs import JobRecord
from rv.layout import RemoteLayout
from rv.request import JobRequest
from rv.secrets import render_env_file
from rv.slurm.script import ScriptContext
from rv.transport import Transport


@dataclass(frozen=True)
class Prepared:
    """Everything about a job that is known before submitting it."""

    request: JobRequest
    script: str
    snapshot_id: str
    project: str
    branch: str | None
    commit: str | None
    dirty: bool
    secrets_path: str | None


def script_context(
    *,
    layout: RemoteLayout,
    account: str | None,
    snapshot_id: str,
    project: str,
    secrets_path: str | None,
) -> ScriptContext:
    return ScriptContext(
        remote_root=layout.root,
        account=account,
        snapshot_id=snapshot_id,
        project=project,
        secrets_file=secrets_path,
    )


def submit(
    transport: Transport,
    layout: RemoteLayout,
    prepared: Prepared,
    *,
    profile: str,
    secrets: dict[str, str],
) -> JobRecord:
    """Upload the secrets (first, mode 0600) and the script, submit, record where the snapshot is used."""
    if prepared.secrets_path is not None:
        transport.run(f"mkdir -p -m 700 {shlex.quote(layout.secrets)}").check("creating the secrets folder")
        # Written before sbatch: a job that starts at once must find it (the old tool raced here).
        transport.put_bytes(render_env_file(secrets).encode(), prepared.secrets_path, mode=0o600)
    script_path = f"{layout.root}/scripts/{prepared.request.name}-{uuid.uuid4().hex[:8]}.sbatch"
    q_script = shlex.quote(script_path)
    # One round trip: store the script, submit it, note which snapshot the job uses (gc must keep it).
    command = (
        f"set -e; mkdir -p {shlex.quote(layout.root)}/scripts {shlex.quote(layout.logs)}; cat > {q_script}; "
        f"id=$(sbatch --parsable {q_script}); id=${{id%%;*}}; "
        f'mkdir -p {shlex.quote(layout.jobs)}/"$id"; '
        f'printf %s {shlex.quote(prepared.snapshot_id)} > {shlex.quote(layout.jobs)}/"$id"/snapshot; '
        f'echo "$id"'
    )
    result = transport.run(command, stdin=prepared.script.encode())
    if not result.ok:
        if prepared.secrets_path is not None:
            transport.run(f"rm -f {shlex.quote(prepared.secrets_path)}")
        tail = " / ".join(result.err.strip().splitlines()[-3:])
        raise RemoteError(
            f"sbatch rejected the job: {tail or 'exit ' + str(result.exit_code)}",
            hint="`rv run --dry-run ...` prints the script; check the account, partition and limits",
        )
    job_id = result.out.strip().splitlines()[-1]
    req = prepared.request
    return JobRecord(
        job_id=job_id,
        name=req.name,
        profile=profile,
        remote_root=layout.root,
        snapshot=prepared.snapshot_id,
        project=prepared.project,
        branch=prepared.branch,
        commit=prepared.commit,
        dirty=prepared.dirty,
        command=list(req.command),
        request=request_summary(req),
        submitted_at=time.time(),
        nodes=req.nodes,
        outputs=list(req.outputs),
    )


def request_summary(req: JobRequest) -> dict[str, object]:
    return {
        "gpus": req.gpus,
        "type": req.type.name if req.type is not None else None,
        "nodes": req.nodes,
        "gpus_per_node": req.gpus_per_node,
        "time_seconds": req.time_seconds,
        "mem": req.mem,
        "cpus_per_task": req.cpus_per_task,
        "setup": list(req.setup),
        "mig": req.mig,
        "signal": f"{req.signal}@{req.signal_lead_seconds}",
        "torchrun": asdict(req.torchrun) if req.torchrun is not None else None,
    }


def log_paths(layout: RemoteLayout, record: JobRecord, stream: str, node: int | None) -> list[str]:
    """The batch log, plus per-node logs of a multi-node (srun) job, or just one node's."""
    if node is not None:
        return [layout.log(record.name, record.job_id, stream, node=node)]
    paths = [layout.log(record.name, record.job_id, stream)]
    if record.request.get("torchrun") or record.nodes > 1:
        paths += [layout.log(record.name, record.job_id, stream, node=i) for i in range(record.nodes)]
    return paths


def wait_until_started(
    transport: Transport, job_id: str, on_state: Callable[[str, str, str], None], poll: float = 2.0
) -> str | None:
    """Poll squeue until the job leaves PENDING; report each state. Returns the last state seen."""
    last = None
    while True:
        state = parse_job_state(transport.run(job_state_command(job_id)).out)
        if state is None:
            return last
        on_state(*state)
        last = state[0]
        if state[0] not in ("PENDING", "CONFIGURING"):
            return last
        time.sleep(poll)


def stream_logs(
    transport: Transport,
    layout: RemoteLayout,
    record: JobRecord,
    *,
    on_stdout: Callable[[bytes], None],
    on_stderr: Callable[[bytes], None],
    follow: bool,
    lines: int | None = None,
    node: int | None = None,
    which: tuple[str, ...] = ("out", "err"),
) -> int:
    out = log_paths(layout, record, "out", node) if "out" in which else []
    err = log_paths(layout, record, "err", node) if "err" in which else []
    cmd = tail_command(out, err, job_id=record.job_id, follow=follow, lines=lines)
    return transport.stream(cmd, on_stdout=on_stdout, on_stderr=on_stderr, keep_stdin_open=follow)


def job_exit_code(transport: Transport, job_id: str, attempts: int = 20) -> tuple[int, str] | None:
    """(exit code, final state). scontrol answers at once while it remembers the job; sacct lags."""
    for _ in range(attempts):
        result = parse_exit_code(transport.run(exit_code_command(job_id)).out)
        if result is not None:
            return result
        time.sleep(1.5)
    return None
