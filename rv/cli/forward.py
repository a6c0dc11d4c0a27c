"""`rv forward PORT[:LOCALPORT] [RUN] [--node I]`: a port of a job's node on this machine."""

from __future__ import annotations

import sys

import click

from rv.cli.common import node_option, note, run_store, session
from rv.cli.forwarding import serve_forward


@click.command()
@click.argument("ports", metavar="PORT[:LOCALPORT]")
@click.argument("run", required=False)
@node_option("Which node of the job: 0 is the first.")
@click.pass_context
def forward(ctx: click.Context, ports: str, run: str | None, node: int) -> None:
    """Forward PORT on a node of RUN's running job to LOCALPORT here (default: the same; 0: any
    free one), until Ctrl-C. Prints the local URL.

    The connection goes through rv's SSH connection to the login node, then to the node's address
    as Slurm knows it: no second login. The program in the job must listen on that address (or on
    all, 0.0.0.0), not only on 127.0.0.1. Stops by itself when the job ends.

    \b
      rv forward 6006 train-3f9a          TensorBoard at http://127.0.0.1:6006
      rv forward 8888:18888               Jupyter of the latest run at http://127.0.0.1:18888
    """
    from rv.job.inside import node_address, running_job
    from rv.remote.tunnel import bind_local, parse_ports

    remote_port, local_port = parse_ports(ports)
    listener = bind_local(local_port)  # a busy port fails here, before any connection
    try:
        # Tunnels cannot travel over the warm connection: a connection of this command's own.
        with session(ctx, direct=True) as s:
            rj = running_job(s.transport, run_store(), s.profile.name, s.layout.root, run)
            name = rj.node(node)
            addr = node_address(s.transport, name)
            url = f"http://127.0.0.1:{listener.getsockname()[1]}"
            click.echo(url)
            sys.stdout.flush()
            note(
                f"forwarding {url} to port {remote_port} of {name} ({addr.reach}), job {rj.job_id} of run "
                f"{rj.name}; Ctrl-C to stop"
            )
            serve_forward(s, rj, listener, addr.reach, remote_port)
    finally:
        listener.close()
