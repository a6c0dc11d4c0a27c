"""Following a run: its output segment after segment, until it ends, across dropped connections.

One process on the cluster (the agent's ``follow`` mode) does the watching: it streams the current
segment's log files from byte offsets, asks ``squeue`` every two seconds, moves on to the next
segment when one is submitted, and ends when the run's ``ENDED`` record appears. Only a terminal
state ends a follow: a failed ``squeue`` comes back as a warning frame, never as the end.

This side keeps the byte offset of every file it has received. When the connection drops (or goes
silent: the agent sends a heartbeat every few seconds), it reconnects with backoff and starts the
follower again from those offsets and that segment, so no line comes twice and none is lost. The
follower reads stdin and exits when it closes, so nothing it started outlives rv: not after the end,
Ctrl-C, a killed rv or a dropped connection (sshd closes the channel and its stdin with it).
"""

from __future__ import annotations

import json
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rv.errors import ConnectError, NotFound, RemoteError
from rv.remote.agent_client import agent_command
from rv.slurm import commands

if TYPE_CHECKING:
    from rv.remote.transport import Transport

# A follower that sent nothing (not even a heartbeat) for this long is taken for a dead connection.
SILENCE_S = 45.0
MAX_BACKOFF_S = 30.0


class FollowerFrameReader:
    """Splits the follower's stdout into (header, data) frames; chunks may split frames anywhere."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> Iterator[tuple[dict[str, Any], bytes]]:
        self._buf += chunk
        while len(self._buf) >= 8:
            head_len, data_len = struct.unpack(">II", self._buf[:8])
            if len(self._buf) < 8 + head_len + data_len:
                return
            head = json.loads(bytes(self._buf[8 : 8 + head_len]))
            data = bytes(self._buf[8 + head_len : 8 + head_len + data_len])
            del self._buf[: 8 + head_len + data_len]
            yield head, data


class FollowView(Protocol):
    """What following shows; the CLI renders it (stdout for output, a status line on stderr)."""

    def output(self, stream: str, data: bytes, source: str = "") -> None: ...
    def segment(self, frame: dict[str, Any]) -> None: ...
    def segment_end(self, frame: dict[str, Any]) -> None: ...
    def state(self, frame: dict[str, Any]) -> None: ...
    def warning(self, message: str) -> None: ...
    def reconnecting(self, error: str, wait: float) -> None: ...


@dataclass
class Position:
    """Where a follow has got to: resume from here after a reconnect."""

    segment: int | None = None
    offsets: dict[str, int] = field(default_factory=dict)
    run_id: str | None = None  # None until the follower has found the run (``find``)
    only: int | None = None  # the one segment shown, or None for all


# Sees the run a follower found (the agent's run dict, or None when nothing matched) and the reply
# of the secrets sweep that rode along (None when none was asked for); may raise to stop.
OnRun = Callable[[dict[str, Any] | None, dict[str, Any] | None], None]


@dataclass(frozen=True)
class Followed:
    ended: dict[str, Any] | None  # the run's ENDED record; None when not following and still going
    last_segment: int


def follower_args(
    root: str,
    pos: Position,
    *,
    follow: bool,
    streams: tuple[str, ...],
    node: int | None,
    tail: int | None,
    find: dict[str, Any] | None = None,
    sweep: Sequence[str] = (),
) -> dict[str, Any]:
    args: dict[str, Any] = {
        "root": root,
        "follow": follow,
        "streams": list(streams),
        "node": node,
        "segment": pos.only,
        "offsets": pos.offsets,
        "from_segment": pos.segment,
        "squeue": commands.squeue_user(),
    }
    if pos.run_id is not None:
        args["run_id"] = pos.run_id
    else:
        args["find"] = find or {}
        if sweep:
            args["secrets_sweep"] = list(sweep)
    if tail is not None and not pos.offsets:
        args["tail"] = tail
    return args


def follow_run(
    connect: Callable[[], Any],
    reconnect: Callable[[], Any],
    root: str,
    run_id: str | None,
    view: FollowView,
    *,
    follow: bool = True,
    streams: tuple[str, ...] = ("out", "err"),
    node: int | None = None,
    segment: int | None = None,
    tail: int | None = None,
    find: dict[str, Any] | None = None,
    sweep: Sequence[str] = (),
    on_run: OnRun | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Followed:
    """Stream a run's output to ``view``; with ``follow``, until the run ends. Ctrl-C propagates.

    ``connect()`` gives the session's transport; ``reconnect()`` a fresh one after a drop. With
    ``run_id`` None, ``find`` (the agent's ``runs`` selectors: ``ids``, ``job_ids``, ``any_names``)
    names the run and the follower finds it in the same call (and sweeps ``sweep``'s secrets):
    ``on_run`` sees it before any output and may raise to stop. One round trip for `rv logs`.
    """
    pos = Position(segment=segment, run_id=run_id, only=segment)
    backoff = 1.0
    transport = connect()
    while True:
        args = follower_args(
            root, pos, follow=follow, streams=streams, node=node, tail=tail, find=find, sweep=sweep
        )
        try:
            end = _one_follower(transport, args, pos, view, on_run)
        except (ConnectError, RemoteError, OSError, EOFError) as exc:
            error = getattr(exc, "message", None) or str(exc) or type(exc).__name__
        else:
            if end is not None:
                return end
            error = "the follower on the cluster stopped without saying the run ended"
        # Reconnect with backoff; the output resumes from the offsets received so far.
        wait = backoff
        view.reconnecting(error, wait)
        sleep(wait)
        backoff = min(backoff * 2, MAX_BACKOFF_S)
        try:
            transport = reconnect()
            backoff = 1.0
        except (ConnectError, RemoteError, OSError) as exc:
            view.warning(f"reconnecting failed: {getattr(exc, 'message', None) or exc}")


def _one_follower(
    transport: Transport, args: dict[str, Any], pos: Position, view: FollowView, on_run: OnRun | None = None
) -> Followed | None:
    """Run one follower to its end frame (returned) or until the connection fails (raises)."""
    frames: queue.Queue[tuple[str, Any]] = queue.Queue()
    reader = FollowerFrameReader()
    errors: list[bytes] = []

    def on_stdout(chunk: bytes) -> None:
        for frame in reader.feed(chunk):
            frames.put(("frame", frame))

    def pump() -> None:
        try:
            code = transport.stream(
                agent_command("follow", args),
                on_stdout=on_stdout,
                on_stderr=errors.append,
                keep_stdin_open=True,
            )
            frames.put(("exit", code))
        except BaseException as exc:  # handed to the main thread, which raises it there
            frames.put(("error", exc))

    worker = threading.Thread(target=pump, daemon=True)
    worker.start()
    last = time.monotonic()
    try:
        while True:
            try:
                kind, item = frames.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() - last > SILENCE_S:
                    raise ConnectError(f"no word from the cluster for {SILENCE_S:.0f} s") from None
                continue
            last = time.monotonic()
            if kind == "error":
                raise item
            if kind == "exit":
                detail = b"".join(errors).decode("utf-8", "replace").strip().splitlines()[-3:]
                if item != 0:
                    raise RemoteError(f"the follower exited with code {item}: {' / '.join(detail)}")
                return None
            head, data = item
            end = _handle(head, data, pos, view, on_run)
            if end is not None:
                return end
    finally:
        # After its end frame the follower exits at once; otherwise (Ctrl-C, a silent connection)
        # closing our side ends it: its stdin closes.
        worker.join(timeout=0.5)
        if worker.is_alive():
            transport.close()
            worker.join(timeout=5)


def _handle(
    head: dict[str, Any], data: bytes, pos: Position, view: FollowView, on_run: OnRun | None = None
) -> Followed | None:
    kind = head.get("t")
    if kind == "run":
        run = head.get("run")
        if on_run is not None:
            on_run(run, head.get("secrets_sweep"))
        if run is None:
            raise NotFound("no such run on the cluster", hint="`rv ps -a` lists runs")
        pos.run_id = str(run["run_id"])
        pos.only = head.get("segment")
        if pos.segment is None:
            pos.segment = pos.only
    elif kind == "data":
        # Count before showing: a line shown is a line never sent again.
        pos.offsets[head["f"]] = int(head["o"]) + len(data)
        view.output(head["s"], data, head["f"])  # the file: a line is only whole within its own file
    elif kind == "segment":
        if pos.segment != head["segment"]:
            pos.segment = head["segment"]
        view.segment(head)
    elif kind == "segment-end":
        view.segment_end(head)
        pos.segment = int(head["segment"]) + 1
    elif kind == "state":
        view.state(head)
    elif kind == "warn":
        view.warning(f"{head.get('msg')}; asking again in {head.get('retry_in', 0):g} s")
    elif kind == "end":
        return Followed(head.get("ended"), int(head.get("segment") or 0))
    return None
