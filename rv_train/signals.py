"""Catch the stop signals; the handler only records which one came.

Python runs a handler in the main thread between bytecodes, so a rank blocked in a collective or in
generation sees the flag when that call returns. The loop all-reduces the flag (MAX) at each step
boundary, so every rank stops at the same step, saves together and exits 0.

Which signals: ``RV_STOP_SIGNAL`` (set by rv's job script; see :mod:`rv.contract` for the stop
protocol), plus USR1, USR2 and TERM. Under rv the stop signal goes straight to the worker processes
that handle it, never to the torchrun agent, so a stop ends with every rank saving and exiting 0. Run
by hand under plain torchrun, send the signal to the workers, not the agent (the agent dies on USR1).
"""

from __future__ import annotations

import signal
from types import FrameType

from rv.contract import signals_to_catch


def default_signals() -> tuple[str, ...]:
    """``SIG``-prefixed names: the job's ``RV_STOP_SIGNAL`` first, then USR1, USR2 and TERM."""
    return tuple("SIG" + name for name in signals_to_catch())


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
