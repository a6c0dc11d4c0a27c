"""`rv up`: an interactive allocation that never outlives the shell it was asked for.

An up session is a run like any other (same script, records, snapshot, secrets; `rv ps`, `rv logs`,
`rv ssh`, `rv stop` know it) whose program is :data:`HOLDER`, which holds the allocation while
the user works in a shell beside it (rv.job.inside.attach_command, ``srun --overlap --pty``). What
ends it, so that nothing keeps burning allocation time after the shell:

1. The watchdog, on the login node (the agent's ``up`` mode), started by rv over its own SSH
   connection. It submits the job, reports its state, and cancels it when rv says ``release`` (the
   shell exited; Ctrl-C while pending), when its stdin ends (rv exited or was killed: the SSH
   connection closes, and sshd closes the channel), when rv has said nothing for
   :data:`SILENCE_S` (a connection that died without closing: a laptop that lost its network; rv
   says ``hb`` every :data:`HEARTBEAT_S`), and however it ends itself (SIGHUP, SIGTERM).
2. The holder in the job: it ends the job by itself when the watchdog's heartbeat (a counter it
   rewrites every 10 s in the run's folder) has not moved for :data:`ALIVE_LIMIT_S` by the
   holder's own clock: a watchdog gone without a word (its login node rebooted).

``--detach`` tells the watchdog to leave the job be: the holder then keeps the allocation until
``rv stop`` or the time limit, and ``rv ssh`` attaches to it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rv.errors import PLACEMENT_HINT, ConnectError, RemoteError
from rv.job.records import RunRecord
from rv.job.submit import run_record, submit_args
from rv.job.watch import FollowerFrameReader
from rv.layout import RemoteLayout
from rv.remote.agent_client import agent_command
from rv.request import JobRequest
from rv.secrets import render_env_file
from rv.slurm import commands
from rv.slurm.parse import QueuedJob, parse_squeue
from rv.slurm.script import ScriptContext

if TYPE_CHECKING:
    from rv.remote.transport import Transport

HEARTBEAT_S = 5.0  # rv -> watchdog
SILENCE_S = 60.0  # the watchdog cancels after this long without a word from rv
ALIVE_LIMIT_S = 120  # the holder ends the job after this long without the watchdog's heartbeat
NO_WORD_S = 120.0  # rv gives up on a watchdog silent this long (longer than a slow squeue may take)

# The session's program, one per node: holds the allocation while someone is attached. $1: seconds
# without the watchdog's heartbeat after which it gives the allocation back. Never signalled by rv's
# stop watcher (it handles no signal); scancel and the time limit end it as any program.
HOLDER = r"""alive="$RV_RUN_DIR/up.alive" limit="$1" last="" seen=$(date +%s)
echo "rv up: holding the allocation on $(hostname) while rv up is attached"
while :; do
    now=$(date +%s)
    if [ -e "$RV_RUN_DIR/up.detached" ]; then
        seen=$now
    else
        cur=$(cat -- "$alive" 2>/dev/null) || cur=""
        if [ "$cur" != "$last" ]; then last=$cur seen=$now; fi
        if [ $((now - seen)) -gt "$limit" ]; then
            echo "rv up: no heartbeat from the watchdog for over $limit s: giving the allocation back" >&2
            exit 0
        fi
    fi
    sleep 2 &
    wait $!
done
"""


def holder_command(limit_s: int = ALIVE_LIMIT_S) -> list[str]:
    """The program of an up session's job (see :data:`HOLDER`)."""
    return ["bash", "-c", HOLDER, "rv-up", str(int(limit_s))]


class UpView(Protocol):
    """What the CLI shows while the session starts."""

    def submitted(self, record: RunRecord) -> None: ...
    def state(self, job: QueuedJob) -> None: ...
    def warning(self, message: str) -> None: ...


class SessionEnded(RemoteError):
    """The session's job ended before (or while) anyone was attached."""


@dataclass
class Watchdog:
    """rv's end of the watchdog: a channel to the agent's ``up`` mode, its frames, and our lines."""

    transport: Transport
    args: dict[str, Any]
    secrets: bytes

    def __post_init__(self) -> None:
        self.lines: queue.Queue[bytes | None] = queue.Queue()
        self.frames: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.errors: list[bytes] = []
        self.stopped = threading.Event()
        self.job_id: str | None = None
        self.last: QueuedJob | None = None
        self._reader = FollowerFrameReader()
        self._worker = threading.Thread(target=self._pump, daemon=True)
        self._beater = threading.Thread(target=self._beat, daemon=True)

    def start(self) -> Watchdog:
        self._worker.start()
        self._beater.start()
        return self

    def _stdin(self) -> Iterator[bytes]:
        yield b"%d\n" % len(self.secrets) + self.secrets
        while True:
            line = self.lines.get()
            if line is None:
                return  # the end of the watchdog's stdin: it cancels unless told otherwise before
            yield line

    def _pump(self) -> None:
        def on_stdout(chunk: bytes) -> None:
            for frame in self._reader.feed(chunk):
                self.frames.put(("frame", frame))

        try:
            code = self.transport.stream(
                agent_command("up", self.args),
                on_stdout=on_stdout,
                on_stderr=self.errors.append,
                stdin=self._stdin(),
            )
            self.frames.put(("exit", code))
        except BaseException as exc:  # handed to the main thread, which raises it there
            self.frames.put(("error", exc))
        finally:
            self.stopped.set()

    def _beat(self) -> None:
        while not self.stopped.wait(HEARTBEAT_S):
            self.lines.put(b"hb\n")

    def send(self, line: str) -> None:
        self.lines.put(line.encode() + b"\n")

    def close(self) -> None:
        """End the watchdog's stdin: unless it was told ``detach``, it cancels the job."""
        self.stopped.set()
        self.lines.put(None)

    def next(self, timeout: float) -> dict[str, Any] | None:
        """The next frame (beats skipped); None after ``timeout`` s of nothing."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                kind, item = self.frames.get(timeout=min(left, NO_WORD_S))
            except queue.Empty:
                if left > NO_WORD_S:
                    raise ConnectError(f"no word from the cluster for {NO_WORD_S:.0f} s") from None
                return None
            if kind == "error":
                raise item
            if kind == "exit":
                detail = b"".join(self.errors).decode("utf-8", "replace").strip().splitlines()[-3:]
                raise RemoteError(
                    f"the watchdog of the rv up session ended (exit {item})"
                    + (f": {' / '.join(detail)}" if detail else "")
                )
            head, _ = item
            if head.get("t") == "beat":
                continue
            if head.get("squeue"):
                jobs = parse_squeue(head["squeue"])
                if jobs:
                    self.last = jobs[0]
            return dict(head)


def start(
    transport: Transport,
    layout: RemoteLayout,
    req: JobRequest,
    ctx: ScriptContext,
    *,
    profile: str,
    provenance: dict[str, Any],
    secrets: dict[str, str],
    view: UpView,
) -> tuple[Watchdog, RunRecord]:
    """Submit the session's job through its watchdog; the record once the job id is known."""
    args = submit_args(layout, req, ctx, provenance=provenance, has_secrets=bool(secrets))
    args.update(scancel=commands.scancel([]), silence=SILENCE_S)
    data = render_env_file(dict(secrets)).encode() if secrets else b""
    dog = Watchdog(transport, args, data).start()
    while True:
        frame = dog.next(300.0)
        if frame is None:
            dog.close()
            raise RemoteError("the cluster did not say whether the rv up session's job was submitted")
        if frame["t"] == "submitted":
            dog.job_id = str(frame["job_id"])
            record = run_record(layout, req, ctx, args, profile=profile, job_id=dog.job_id)
            view.submitted(record)
            return dog, record
        if frame["t"] == "refused":
            dog.close()
            raise RemoteError(
                f"the rv up session's job was not queued: {frame.get('error')}",
                hint=PLACEMENT_HINT,
            )
        if frame["t"] == "warn":
            view.warning(str(frame.get("msg")))


def wait_ready(dog: Watchdog, view: UpView) -> QueuedJob:
    """Until the job runs and has written its environment (a shell may start); its squeue line."""
    while True:
        frame = dog.next(3600.0)
        if frame is None:
            continue
        kind = frame["t"]
        if kind == "state" and dog.last is not None:
            view.state(dog.last)
        elif kind == "warn":
            view.warning(str(frame.get("msg")))
        elif kind == "ready":
            assert dog.last is not None, "the watchdog sends the job's squeue line with ready"
            return dog.last
        elif kind == "ended":
            reason = (frame.get("ended") or {}).get("reason") or (frame.get("record") or {}).get("reason")
            raise SessionEnded(
                f"job {dog.job_id} ended before a shell could start: {reason or 'no record of why'}",
                hint=f"rv logs --err {dog.args['name']} shows what it said",
            )
        elif kind == "lost":
            raise ConnectError("the cluster heard nothing from rv for a minute and released the allocation")


def _ask(dog: Watchdog, request: str, settles: tuple[str, ...], timeout: float) -> dict[str, Any] | None:
    """Send ``request`` to the watchdog and return the first frame of a kind in ``settles``, or None
    when none came in ``timeout``; the watchdog is closed after either way."""
    dog.send(request)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            frame = dog.next(deadline - time.monotonic())
            if frame is None:
                return None
            if frame["t"] in settles:
                return frame
        return None
    finally:
        dog.close()


def release(dog: Watchdog, timeout: float = 90.0) -> tuple[bool, str | None]:
    """Cancel the job and wait until its allocation is gone: (gone, why not)."""
    try:
        frame = _ask(dog, "release", ("released", "ended", "lost"), timeout)
    except (RemoteError, ConnectError) as exc:
        return False, exc.message
    if frame is None:
        return False, f"no answer from the watchdog in {timeout:.0f} s"
    if frame["t"] == "released":
        return bool(frame.get("gone")), frame.get("error")
    return True, None  # it ended (or was lost) on its own: nothing left to release


def detach(dog: Watchdog, timeout: float = 60.0) -> None:
    """Leave the job running without a watchdog: the holder keeps it until rv stop or the limit."""
    frame = _ask(dog, "detach", ("detached", "ended"), timeout)
    if frame is not None and frame["t"] == "detached":
        return
    if frame is not None and frame["t"] == "ended":
        raise SessionEnded(f"job {dog.job_id} ended before it could be detached")
    raise RemoteError("the watchdog did not confirm --detach; the session's job may have been cancelled")


class Holding:
    """The allocation while a command attends it (:func:`held`): settled once handed over to the user
    (:meth:`detach`) or released (:meth:`release`)."""

    def __init__(self, dog: Watchdog) -> None:
        self.dog, self.settled = dog, False

    def detach(self) -> None:
        detach(self.dog)
        self.settled = True  # nothing to release: the job is the user's to end

    def release(self) -> tuple[bool, str | None]:
        gone = release(self.dog)
        self.settled = True
        return gone


@contextmanager
def held(dog: Watchdog) -> Iterator[Holding]:
    """The session's allocation while the command waits for it and holds a shell in it: any way out
    that did not settle it (an error on the way: the job ended, the connection failed) releases
    whatever is left."""
    hold = Holding(dog)
    try:
        yield hold
    finally:
        if not hold.settled:
            release(dog, timeout=30)
