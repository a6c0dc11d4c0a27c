"""The secrets a killed job could not remove, swept by the next command that talks to the cluster.

A command's session holds one :class:`SecretsSweep` (the CLI's ``rv.cli.common.Session``). A command
whose one call to the cluster can carry the sweep (`rv ps`, `rv status`, `rv logs`) asks
:meth:`SecretsSweep.along` for the run ids and hands the reply to :meth:`SecretsSweep.swept`: no
second round trip. Otherwise :meth:`SecretsSweep.at_end` sweeps on a call of its own when the command
is done, and only when this machine's records name a run whose secrets may be left: a first look that
loads none of the run machinery (~50 ms of imports), so the common case costs nothing.
:mod:`rv.job.cleanup` does the sweeping.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rv.job.records import RunRecord, RunStore
    from rv.remote.transport import Transport

COULD_NOT = "could not check for leftover secrets of ended runs"


class SecretsSweep:
    """The sweep of one command's session: for runs of ``profile`` under ``root`` recorded in
    ``records`` (runs.json); ``note`` says what it removed, ``warn`` what it could not check."""

    def __init__(
        self,
        records: Path,
        profile: str,
        root: str,
        *,
        note: Callable[[str], None],
        warn: Callable[[str], None],
    ) -> None:
        self.records, self.profile, self.root = records, profile, root
        self.note, self.warn = note, warn
        self.done = False  # swept already (or known to have nothing to sweep): at_end does nothing
        self._pending: list[RunRecord] = []
        self._asked = False

    def store(self) -> RunStore:
        from rv.job.records import RunStore

        return RunStore(self.records)

    def along(self) -> list[str]:
        """Run ids whose leftover secrets the command's own call to the cluster should sweep."""
        from rv.job.cleanup import pending_secrets

        self._pending = pending_secrets(self.store(), self.profile, self.root)
        self._asked = True
        return [r.run_id for r in self._pending]

    def swept(self, reply: dict[str, Any] | None) -> None:
        """The reply of a sweep that rode along (None: none was asked for, or the call did not take it)."""
        if not self._asked:
            return  # at_end sweeps on its own call
        if not self._pending:
            self.done = True
            return
        if reply is None:
            return  # at_end sweeps on its own call
        self.done = True
        if "error" in reply:
            self.warn(f"{COULD_NOT}: {reply['error']}")
            return
        from rv.job.cleanup import apply_sweep

        apply_sweep(self.store(), self.profile, self._pending, reply, self.note)

    def at_end(self, transport: Transport) -> None:
        """The command is done and talked to the cluster: sweep on a call of its own, unless a sweep
        rode along or no run can have secrets left."""
        if self.done or not may_have_secrets_left(self.records, self.profile, self.root):
            return
        from rv.errors import RvError
        from rv.job.cleanup import sweep_secrets

        self.done = True
        try:
            sweep_secrets(transport, self.store(), self.profile, self.root, self.note)
        except RvError as exc:
            self.warn(f"{COULD_NOT}: {exc.message}")


def may_have_secrets_left(records: Path, profile: str, root: str) -> bool:
    """A first look at the run records, without loading the run machinery.

    True when a run of this profile and root was sent with secrets not yet seen removed, or when the
    records cannot be read here (the real reader then reports it).
    """
    try:
        data = json.loads(records.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True
    runs = data.get("runs", []) if isinstance(data, dict) else None
    if not isinstance(runs, list):
        return True
    return any(
        not isinstance(r, dict)
        or (r.get("has_secrets") and not r.get("secrets_cleared") and r.get("profile") == profile
            and r.get("remote_root") == root)
        for r in runs
    )  # fmt: skip
