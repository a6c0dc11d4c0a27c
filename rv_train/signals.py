"""Catch the stop signals; the handler only records which one came.

Python runs a handler in the main thread between bytecodes, so a rank blocked in a collective or in
generation sees the flag when that call returns. The loop all-reduces the flag (MAX) at each step
boundary, so every rank stops at the same step, saves together and exits 0.

Under torchrun the agent must forward the signal: launch with
``torchrun --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2`` (torch ≥ 2.9). Plain
torchrun dies on SIGUSR1 (exit 138) and leaves the workers running, never told. NCCL 2.12 swallowed
SIGUSR1 (nccl#704): if it reaches no worker, send SIGUSR2 instead (``#SBATCH --signal=USR2@180``).
"""

from __future__ import annotations

import signal
from types import FrameType

DEFAULT_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM")


def parse_signals(spec: str) -> tuple[signal.Signals, ...]:
    out = []
    for name in filter(None, (s.strip().upper() for s in spec.split(","))):
        name = name if name.startswith("SIG") else "SIG" + name
        try:
            out.append(signal.Signals[name])
        except KeyError:
            raise ValueError(f"unknown signal {name!r}") from None
    return tuple(out)


class StopSignals:
    """Context manager: installs the handlers, restores the previous ones on exit."""

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        self.signals = signals
        self.received = 0  # the signal number, 0 while none came
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum  # no I/O and no collectives in a handler

    def __enter__(self) -> StopSignals:
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
