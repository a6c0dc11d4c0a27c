"""`rv jupyter`: JupyterLab in a live `rv up` session, forwarded to this machine until Ctrl-C."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from rv.cli.common import note, run_store, session, warn
from rv.cli.upsession import SessionCommand, check_container, live_or_new

if TYPE_CHECKING:
    import socket

    from rv.job.records import RunRecord


@click.command(cls=SessionCommand)
@click.option(
    "--port",
    "local_port",
    type=click.IntRange(0, 65535),
    default=None,
    help="The local port (default: the session's last one if free, else any free one).",
)
@click.option("--no-browser", is_flag=True, help="Print the URL only; do not open a browser.")
@click.option("--new", is_flag=True, help="Start a new session even when one is live.")
@click.option("--restart", is_flag=True, help="Start JupyterLab afresh in the session.")
@click.pass_context
def jupyter(
    ctx: click.Context, /, local_port: int | None, no_browser: bool, new: bool, restart: bool, **_: object
) -> None:
    """JupyterLab on a node of a live session, its kernel in the job's environment, at a local URL.

    Reuses the newest live session that rv jupyter or rv code started (--name: that one), or starts
    one as `rv up --detach` would, with rv up's options (-g, -t, --time, placement, ...). JupyterLab
    comes from the job's environment when it has it, else from a tools environment rv builds once
    per cluster; the kernel runs the job's Python and sees its GPUs, RV_PRECISION and secrets.
    With --container IMAGE (rv up's) JupyterLab and its kernels run inside the image.
    Prints (and opens) http://127.0.0.1:PORT/lab?token=...; Ctrl-C stops the forward, while the
    session and JupyterLab stay until `rv stop NAME` or the time limit (rv jupyter again reconnects).

    \b
      rv jupyter -g 1 -t a6000 --time 4h
      rv jupyter --name jupyter-3f9a1b --port 8888
    """
    from rv.cli.forwarding import serve_forward
    from rv.cli.launchview import TerminalLaunch
    from rv.job import notebook
    from rv.job.inside import node_address
    from rv.job.launch import environment
    from rv.job.serve import remember
    from rv.pyenv.plan import EnvPlan
    from rv.remote.tunnel import bind_local

    check_container(ctx, "jupyter")
    # A port asked for and taken fails here, before anything is started.
    listener = bind_local(local_port) if local_port is not None else None
    store = run_store()
    try:
        # The forward needs a connection of this command's own (the warm one carries no tunnel).
        with session(ctx, direct=True) as s:
            rj = live_or_new(ctx, s, base="jupyter", new=new)
            found = notebook.status(s.transport, rj)
            server = None if restart else found.running
            address = node_address(s.transport, rj.nodes[0]).reach
            if server is None:
                tools = None
                if not found.has_lab:
                    # In an image, on the image's Python (built there as a run's environment is).
                    image = rj.container[0] if rj.container is not None else None
                    note(
                        "JupyterLab is not in the job's environment: it runs from rv's tools environment "
                        f"(jupyterlab {notebook.JUPYTERLAB_VERSION}, built once per "
                        + ("image)" if image else "cluster and Python)")
                    )
                    setup = (*s.profile.setup, *ctx.params.get("setup", ()))
                    python = None if image else (ctx.params.get("python_") or s.profile.python)
                    plan = EnvPlan(spec=notebook.tools_spec(python))
                    env = environment(s, plan, setup, TerminalLaunch(), container=image)
                    assert env is not None, "a plan with a spec always has an environment"
                    tools = env.path
                note(f"starting JupyterLab in session {rj.name} on {rj.nodes[0]}")
                server = notebook.start(s.transport, rj, address=address, tools=tools)
            if listener is None:
                listener = _local_listener(store.resolve(rj.run.run_id, s.profile.name))
            url = server.url(listener.getsockname()[1])
            remember(store, rj, s.profile.name, notebook_url=url, notebook_port=server.port)
            click.echo(url)
            sys.stdout.flush()
            note(
                f"JupyterLab of session {rj.name} (job {rj.job_id} on {rj.nodes[0]}) at the URL above; "
                f"Ctrl-C stops forwarding, the session stays until rv stop {rj.name}"
            )
            if not no_browser:
                _open(url)
            serve_forward(s, rj, listener, address, server.port)
    finally:
        if listener is not None:
            listener.close()


def _local_listener(record: RunRecord | None) -> socket.socket:
    """The session's last local port when it is free (its URL stays the same), else any free one."""
    from urllib.parse import urlsplit

    from rv.errors import UsageError
    from rv.remote.tunnel import bind_local

    last = urlsplit((record.serves if record else {}).get("notebook_url") or "").port
    if last:
        try:
            return bind_local(last)
        except UsageError:
            pass  # taken meanwhile: another port, and so another URL
    return bind_local(0)


def _open(url: str) -> None:
    import webbrowser

    try:
        opened = webbrowser.open(url)
    except webbrowser.Error:
        opened = False
    if not opened:
        warn("no browser could be opened here: open the URL above yourself")
