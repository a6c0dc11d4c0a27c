"""A port of a job's node joined to a local one until Ctrl-C or the job's end: `rv forward` and
`rv jupyter` share it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rv.cli.common import Session, note, warn

if TYPE_CHECKING:
    import socket

    from rv.job.inside import RunningJob


def serve_forward(s: Session, rj: RunningJob, listener: socket.socket, host: str, port: int) -> None:
    """Join connections to ``listener`` to ``host:port`` through the session's own connection, until
    Ctrl-C (said, not raised) or the job's end."""
    from rv.job.inside import job_state
    from rv.remote.tunnel import Forwarder

    def still_running() -> bool:
        job = job_state(s.transport, rj.job_id)
        return job is not None and job.state == "RUNNING"

    connection = s.connection
    fwd = Forwarder(listener, lambda: connection.open_tunnel(host, port), on_error=warn)
    try:
        fwd.serve(still_wanted=still_running)
    except KeyboardInterrupt:
        note(f"stopped forwarding ({fwd.connections} connection(s))")
        return
    note(f"job {rj.job_id} of run {rj.name} is no longer running: stopped forwarding")
