"""What a Ctrl-C during a submission says: whether the jobs were sent, were not, or may have been.

A Ctrl-C after the request has left the laptop is "maybe sent", never "not sent": the cluster goes
on with what it was asked (the array is queued) while this side stops waiting. So a submission
marks where it stands (:class:`SubmitStage`), a Ctrl-C becomes an :class:`~rv.errors.Interrupted`
that says so (:func:`said_on_interrupt`), and the few steps that record what was sent run whole
(:func:`held_interrupts`): once the cluster's answer is here, it is kept.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from rv.errors import Interrupted


class SubmitStage:
    """Where one submission stands: before anything is sent, sending, or sent (and recorded)."""

    def __init__(self, what: str, name: str) -> None:
        self.what = what  # "sweep"
        self.name = name
        self.state = "before"
        self.detail = ""

    def sending(self) -> None:
        self.state = "sending"

    def sent(self, detail: str) -> None:
        self.state = "sent"
        self.detail = detail

    def error(self) -> Interrupted:
        what = f"{self.what} {self.name}"
        if self.state == "before":
            return Interrupted(f"interrupted before {what} was sent: nothing was queued", hint="run it again")
        if self.state == "sending":
            return Interrupted(
                f"interrupted while {what} was being sent: it may have been sent",
                hint=f"rv ps {self.name}   (rv stop {self.name} if it was and you do not want it)",
            )
        return Interrupted(
            f"interrupted after {what} was sent ({self.detail}); it is queued and recorded",
            hint=f"rv ps {self.name}",
        )


@contextmanager
def said_on_interrupt(stage: SubmitStage) -> Iterator[SubmitStage]:
    """A Ctrl-C inside the block is raised as what ``stage`` knows (exit 130)."""
    try:
        yield stage
    except KeyboardInterrupt:
        raise stage.error() from None


@contextmanager
def held_interrupts() -> Iterator[None]:
    """Run the block whole: a Ctrl-C in it is raised when it ends. The main thread only (where Python
    delivers signals); elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt
