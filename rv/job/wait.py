"""`rv wait RUN...`: block until runs end (or run), for scripts; the laptop may sleep in between.

The cluster is asked every few seconds (more seldom the longer the wait, at most every
:data:`MAX_POLL_S`), one round trip for all the runs. A dropped connection (a laptop that slept, a
network that went away) is met with a fresh one, after a growing pause: never a traceback, and
never an end that was not recorded on the cluster. Each call also asks the cluster to record the end
of a run no job of which is alive any more (rv.agent.runs.sweep_secrets), so a run killed too hard
to write its own end still ends the wait.

Exit codes (errors.py lists them with the others): the run's own code (the program's; 1 for a run
that ended without the program failing: stopped, cancelled, time limit); several runs: 0 when all
finished, else the code of the first (in the order given) that did not. ``--until running``: 0 once
every run has started (an ended run has), else as above for a run that ended without finishing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rv.errors import ConnectError, RemoteError
from rv.job.records import ClusterRun, RunView, run_exit_code, run_views

if TYPE_CHECKING:
    from rv.job.query import RunsListing

FIRST_POLL_S = 2.0
MAX_POLL_S = 15.0
MAX_BACKOFF_S = 60.0
UNTIL = ("end", "running")


@dataclass(frozen=True)
class Waited:
    """A run as the wait left it."""

    run: ClusterRun
    view: RunView

    @property
    def ended(self) -> bool:
        return self.run.ended is not None

    @property
    def started(self) -> bool:
        return (
            self.ended
            or self.view.state in ("RUNNING", "COMPLETING")
            or any(s.state in ("running", "requeued", "ended") for s in self.run.segments)
        )

    @property
    def exit_code(self) -> int:
        return run_exit_code(self.run.ended) if self.ended else 0


def states(listing: RunsListing, run_ids: Sequence[str]) -> dict[str, Waited]:
    """Each run of ``run_ids`` found in ``listing``, with its `rv ps` view."""
    runs = {r.run_id: r for r in listing.runs if r.run_id in run_ids}
    views = {v.run_id: v for v in run_views(list(runs.values()), listing.queued, now=listing.now) if v.run_id}
    return {run_id: Waited(run, views[run_id]) for run_id, run in runs.items() if run_id in views}


def reached(waited: Waited, until: str) -> bool:
    return waited.ended if until == "end" else waited.started


def exit_code(order: Sequence[str], waited: dict[str, Waited], until: str) -> int:
    """0 when every run did what was waited for; else the code of the first run that ended without
    finishing (in the order given)."""
    for run_id in order:
        w = waited[run_id]
        if w.ended and w.exit_code != 0:
            return w.exit_code
    return 0


def wait(
    fetch: Callable[[], RunsListing],
    reconnect: Callable[[], object],
    run_ids: Sequence[str],
    *,
    until: str = "end",
    on_change: Callable[[Waited], None] = lambda w: None,
    on_trouble: Callable[[str, float], None] = lambda why, wait: None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Waited]:
    """Ask ``fetch()`` until every run has reached ``until``; the runs as they were then.

    ``on_change`` sees a run each time its state changes; ``on_trouble`` each failed call (why, and
    how long until the next try, on a fresh connection from ``reconnect()``).
    """
    if until not in UNTIL:
        raise ValueError(f"until must be one of {UNTIL}")
    poll, backoff = FIRST_POLL_S, 1.0
    seen: dict[str, Waited] = {}
    shown: dict[str, str] = {}
    while True:
        try:
            listing = fetch()
        except (ConnectError, RemoteError, OSError, EOFError) as exc:
            on_trouble(getattr(exc, "message", None) or str(exc) or type(exc).__name__, backoff)
            sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
            try:
                reconnect()
            except (ConnectError, RemoteError, OSError, EOFError) as again:
                on_trouble(f"reconnecting: {getattr(again, 'message', None) or again}", backoff)
            continue
        backoff = 1.0
        seen.update(states(listing, run_ids))
        for run_id, w in seen.items():
            if shown.get(run_id) != w.view.state:
                shown[run_id] = w.view.state
                on_change(w)
        if len(seen) == len(run_ids) and all(reached(seen[r], until) for r in run_ids):
            return seen
        sleep(poll)
        poll = min(poll * 1.5, MAX_POLL_S)
