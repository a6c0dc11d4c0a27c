"""`rv wait RUN... [--until running] [--json]`: block until the runs end; exit with their code."""

from __future__ import annotations

import click

from rv.cli.common import note, print_json, run_store, session, tell_desktop, warn


@click.command()
@click.argument("runs", nargs=-1, required=True)
@click.option(
    "--until",
    type=click.Choice(["end", "running"]),
    default="end",
    show_default=True,
    help="What to wait for: every run's end, or every run's start.",
)
@click.option("--json", "as_json", is_flag=True, help="Print each run's end (or state) as JSON when done.")
@click.pass_context
def wait(ctx: click.Context, runs: tuple[str, ...], until: str, as_json: bool) -> None:
    """Wait until RUNs (names, run ids, job ids; a sweep's name: all its points) end, and exit with
    the run's exit code (several: 0 when all finished, else the first one's that did not). A dropped
    connection is retried; --notify desktop runs are told on this machine when they end."""
    from rv.agent.segment import end_state
    from rv.job import query
    from rv.job import wait as core

    store = run_store()
    with session(ctx) as s:
        order: list[str] = []
        names: dict[str, str] = {}
        for ref in runs:
            found, _ = query.resolve_or_sweep(s.transport, store, s.profile.name, s.layout.root, ref)
            for r in found:
                if r.run_id not in names:
                    order.append(r.run_id)
                    names[r.run_id] = r.name
        transport = [s.transport]

        def fetch():  # type: ignore[no-untyped-def]
            # The ids ride along as a secrets sweep too: a run no job of which is alive is ended.
            return query.fetch(transport[0], s.layout.root, ids=order, sweep=order)

        def reconnect() -> None:
            transport[0] = s.reconnect()

        def changed(w: core.Waited) -> None:
            if not as_json:
                note(f"{w.run.name}: {w.view.state.lower()}" + (f" ({w.view.why})" if w.view.why else ""))

        def trouble(why: str, pause: float) -> None:
            warn(f"lost the cluster ({why}); trying again in {pause:g} s")

        try:
            done = core.wait(fetch, reconnect, order, until=until, on_change=changed, on_trouble=trouble)
        except KeyboardInterrupt:
            note("\nstopped waiting; the runs go on")
            ctx.exit(130)
    for run_id in order:
        w = done[run_id]
        if w.ended and "desktop" in (w.run.meta.get("notify") or ()):
            tell_desktop(w.run.name, w.run.ended, end_state(str(w.run.ended.get("reason") or "")))  # type: ignore[union-attr]
    if as_json:
        print_json(
            [{"run_id": r, "name": names[r], "state": done[r].view.state, "ended": done[r].run.ended,
              "exit_code": done[r].exit_code if done[r].ended else None} for r in order]
        )  # fmt: skip
    code = core.exit_code(order, done, until)
    ctx.exit(code)
