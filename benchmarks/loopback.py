"""What the benchmarks share about the loopback clusters (scripts/testcluster) and rv's background
processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def read_env(path: Path) -> dict[str, str]:
    """A testcluster's state file (``<state>/env``: ``export NAME='value'`` lines) as a dict."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.removeprefix("export ").strip()
        if "=" in line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k] = v.strip("'\"")
    return out


def stop_warm(runtime: Path, *, server: bool) -> None:
    """Stop the background connections rv started from ``runtime`` (by their pid files), and with
    ``server`` the command server too; wait up to 2 s for each to be gone."""
    for f in runtime.glob("*.pid"):
        if f.name.startswith("cmd-") and not server:
            continue
        try:
            pid = int(f.read_text())
            os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError):
            continue
        for _ in range(200):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.01)
