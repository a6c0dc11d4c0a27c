"""Where rv keeps things under a profile's remote root, as absolute paths on the cluster.

A typed view over :mod:`rv.agent.layout`, the one place the layout is spelled (the agent and the
job's runtime read the same names; the tree is drawn there).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from rv.agent import layout as remote_layout


@dataclass(frozen=True)
class RemoteLayout:
    root: str
    share_with_group: bool = False

    @property
    def umask(self) -> int:
        """The umask every remote step runs under: 077 (private), or 027 (group may read)."""
        return 0o027 if self.share_with_group else 0o077

    def agent_args(self, **extra: object) -> dict[str, object]:
        """Arguments for an agent mode: the root, the umask, and the mode's own."""
        return {"root": self.root, "umask": self.umask, **extra}

    def _join(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    @property
    def store(self) -> str:
        return self._join(remote_layout.STORE)

    def snapshot_ref(self, snapshot_id: str) -> str:
        """The ref in :attr:`store` holding the snapshot's commit (a name in the store, not a path)."""
        return str(remote_layout.snapshot_ref(snapshot_id))

    def snapshot_meta(self, snapshot_id: str) -> str:
        """The git store's meta file of the snapshot (its mtime: when it was last used)."""
        return self._join(remote_layout.snapshot_meta(snapshot_id))

    # The store of earlier rv versions (rv.agent.oldstore); snapshots/ holds the git store's meta too.
    @property
    def objects(self) -> str:
        return self._join(remote_layout.OBJECTS)

    def object(self, oid: str) -> str:
        return self._join(remote_layout.object_file(oid))

    @property
    def snapshots(self) -> str:
        return self._join(remote_layout.SNAPSHOTS)

    def snapshot(self, snapshot_id: str) -> str:
        return self._join(remote_layout.snapshot(snapshot_id))

    def snapshot_layer(self, snapshot_id: str) -> str:
        return self._join(remote_layout.snapshot_layer(snapshot_id))

    def workspace(self, project: str, branch: str) -> str:
        return self._join(remote_layout.workspace(project, branch))

    @property
    def runs(self) -> str:
        return self._join(remote_layout.RUNS)

    def run_dir(self, run_id: str) -> str:
        return self._join(remote_layout.run_dir(run_id))

    def in_run(self, run_id: str, relpath: str) -> str:
        """A path of :mod:`rv.agent.layout` in the run's folder (``SCRIPT``, ``job_env(job)``, ...)."""
        return self._join(remote_layout.run_dir(run_id), relpath)

    def name_index(self, project: str, name: str) -> str:
        return self._join(remote_layout.name_index(project, name))

    def checkpoint_dir(self, project: str, name: str) -> str:
        return self._join(remote_layout.checkpoint_dir(project, name))

    def output_dir(self, project: str, name: str) -> str:
        return self._join(remote_layout.output_dir(project, name))

    def log(self, run_id: str, job_id: str, stream: str = "out", node: int | None = None) -> str:
        return self.in_run(run_id, remote_layout.log_file(job_id, stream, node))

    @property
    def cache(self) -> str:
        return self._join(remote_layout.CACHE)

    @property
    def tmp(self) -> str:
        return self._join(remote_layout.TMP)

    @property
    def runtime(self) -> str:
        return self._join(remote_layout.RUNTIME)

    def runtime_file(self, name: str) -> str:
        return self._join(remote_layout.runtime_file(name))
