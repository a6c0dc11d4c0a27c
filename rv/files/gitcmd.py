"""git, the one local seam: every git command rv runs on this machine goes through :class:`Git`."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rv.agent import manifest
from rv.errors import RvError, UsageError

# --------------------------------------------------------------------------------------------------
# git, the one local seam


class GitError(RvError):
    """A git command failed unexpectedly (exit 1: not something the user typed wrong)."""

    exit_code = 1


_GIT_LOCATION_VARS = frozenset(
    {
        "GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_COMMON_DIR",
        "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_NAMESPACE", "GIT_PREFIX", "GIT_QUARANTINE_PATH",
    }
)  # fmt: skip


@dataclass(frozen=True)
class Git:
    """Runs git. Injected so tests (and odd installs) can point at another binary."""

    executable: str = "git"

    def run(
        self,
        args: Sequence[str],
        cwd: str | Path,
        *,
        input: bytes | None = None,
        env: dict[str, str] | None = None,
        ok_codes: tuple[int, ...] = (0,),
    ) -> subprocess.CompletedProcess[bytes]:
        # Variables that would point git at another repository or index (set inside a git hook,
        # say) must not leak in; the rest (GIT_CONFIG_*, GIT_CEILING_DIRECTORIES...) the user meant.
        base = {k: v for k, v in os.environ.items() if k not in _GIT_LOCATION_VARS}
        # Never take optional locks (git status would rewrite the user's index while they work).
        base["GIT_OPTIONAL_LOCKS"] = "0"
        base.update(env or {})
        try:
            proc = subprocess.run(
                [self.executable, *args], cwd=cwd, input=input, capture_output=True, env=base
            )
        except FileNotFoundError as exc:
            raise UsageError(
                f"git is not installed here ({self.executable})", hint="install git; rv uses it to list files"
            ) from exc
        if proc.returncode not in ok_codes:
            tail = proc.stderr.decode("utf-8", "replace").strip()[-400:]
            raise GitError(f"git {' '.join(args[:3])} failed in {cwd}: {tail}")
        return proc

    def out(self, args: Sequence[str], cwd: str | Path, **kw: Any) -> bytes:
        return self.run(args, cwd, **kw).stdout


class Soon:
    """A call running on a thread of its own; ``result()`` waits for it and re-raises its error."""

    def __init__(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
        self._out: list[Any] = []
        self._thread = threading.Thread(target=self._run, args=(fn, args, kw), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        try:
            self._out.append((True, fn(*args, **kw)))
        except BaseException as exc:  # handed to whoever asks for the result, never dropped
            self._out.append((False, exc))

    def result(self) -> Any:
        self._thread.join()
        ok, value = self._out[0]
        if not ok:
            raise value
        return value


def _map(fn: Callable[[Any], Any], items: list[Any], workers: int) -> list[Any]:
    """``[fn(x) for x in items]`` on up to ``workers`` threads."""
    results: list[Any] = [None] * len(items)
    todo = iter(range(len(items)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            results[i] = fn(items[i])

    for task in [Soon(work) for _ in range(max(1, min(workers, len(items))))]:
        task.result()
    return results


def _split_z(data: bytes) -> list[str]:
    return [manifest.dec(p) for p in data.split(b"\0") if p]
