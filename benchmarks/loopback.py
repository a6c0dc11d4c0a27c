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


# `rv` in-process with every agent call counted: its modes are printed at exit on stderr, in a line
# `AGENT_CALLS mode,mode,...` (each call is one round trip to the cluster).
COUNTED_RV = """
import atexit, sys
import rv.remote.agent_client as agent_client
calls = []
real = agent_client.call_agent
def counted(transport, mode, *a, **kw):
    calls.append(mode)
    return real(transport, mode, *a, **kw)
agent_client.call_agent = counted
for name in ("rv.job.submit", "rv.job.query", "rv.job.cleanup", "rv.files.snapshot", "rv.pyenv.client"):
    module = __import__(name, fromlist=["x"])
    if hasattr(module, "call_agent"):
        module.call_agent = counted
atexit.register(lambda: sys.stderr.write("AGENT_CALLS " + ",".join(calls) + "\\n"))
from rv.cli.main import main
sys.argv[0] = "rv"
main()
"""
