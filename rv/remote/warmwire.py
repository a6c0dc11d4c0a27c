"""What travels between an rv command and its warm connection's process (rv.remote.warm, the client;
rv.remote.warmd, the process): the frames, the errors, and the description of the connection.

Frames are ``kind:1 length:4 payload``. The command sends ``H`` (a JSON header), then ``D`` (stdin
data) frames and ``e`` (end of stdin); the process answers ``h`` (alive, at once), ``K`` (an unknown
host key to confirm, answered by ``k``), then ``O`` (started) or ``S`` (stale) or ``E`` (error),
then ``1``/``2`` (stdout/stderr), and ``X`` (exit code) or ``F`` (done). The process never reads
local files for a command: put and get stream through the socket.

An error the process meets travels as JSON (error_json) and is raised again in the command as the
same class with the same words (raise_error). Every header carries the connection's identity
(identity): two requests share a process only if theirs are equal.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import struct
import sys
from pathlib import Path
from typing import Any

from rv import __version__, errors
from rv.errors import ConnectError, RemoteError, RvError
from rv.remote.sshconfig import SSHTarget
from rv.remote.transport import RemoteTimeout, TransferError

PROTOCOL = 1
HEADER = struct.Struct(">cI")


# --------------------------------------------------------------------------------------------------
# The connection's description


def _stat_sig(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_mtime_ns, st.st_size, st.st_ino]


def _code_stamp() -> list[Any]:
    """The files whose code a warm process runs: one changed (an editable install updated) makes it
    stale. The agent's too: the process pre-starts agents of the code it read, which a command of
    other agent code cannot use (each of its calls would start an agent of its own)."""
    from rv.remote.agent_client import AGENT_MODULES

    here = Path(__file__).parent
    modules = (
        "warm.py",
        "warmd.py",
        "warmwire.py",
        "ssh.py",
        "sshconfig.py",
        "transport.py",
        "agent_client.py",
    )
    files = [here / n for n in modules] + [here.parent / "agent" / f"{m}.py" for m in AGENT_MODULES]
    return [sys.executable, *(_stat_sig(str(p)) for p in files)]


def identity(target: SSHTarget, mask: int, channels: dict[str, bool]) -> dict[str, Any]:
    """Everything that decides what a connection is; two requests share one only if these are equal."""
    hops = []
    for hop in target.hops():
        hops.append(
            {
                "host": hop.host,
                "hostname": hop.hostname,
                "port": hop.port,
                "user": hop.user,
                "identity_files": [[f, _stat_sig(f)] for f in hop.identity_files],
                "known_hosts": str(hop.known_hosts_path),
                "proxy_command": hop.proxy_command,
            }
        )
    return {
        "hops": hops,
        "mask": mask,
        "channels": channels,
        "rv": __version__,
        "protocol": PROTOCOL,
        "code": _code_stamp(),
    }


def target_to_json(target: SSHTarget) -> dict[str, Any]:
    return dataclasses.asdict(target)


def target_from_json(data: dict[str, Any]) -> SSHTarget:
    jump = data.get("proxy_jump")
    return SSHTarget(
        **{
            **data,
            "identity_files": tuple(data["identity_files"]),
            "proxy_jump": target_from_json(jump) if jump else None,
        }
    )


# --------------------------------------------------------------------------------------------------
# Frames


# A frame longer than this (an upload's stdin, 1 MiB at a time) is sent and received without the
# copies that suit small ones: no header glued in front, no growing of the reader's buffer.
LARGE_FRAME = 1 << 16


def send_frame(sock: socket.socket, kind: bytes, payload: bytes = b"") -> None:
    if len(payload) > LARGE_FRAME:
        sock.sendall(HEADER.pack(kind, len(payload)))
        sock.sendall(payload)
    else:
        sock.sendall(HEADER.pack(kind, len(payload)) + payload)


def send_json(sock: socket.socket, kind: bytes, obj: Any) -> None:
    send_frame(sock, kind, json.dumps(obj).encode())


class SocketFrameReader:
    """Frames, one at a time, from a socket (buffered: a read may bring in the next frames too)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self, n: int) -> bool:
        while len(self.buf) < n:
            data = self.sock.recv(max(1 << 16, n - len(self.buf)))
            if not data:
                return False
            self.buf += data
        return True

    def read(self) -> tuple[bytes, bytes] | None:
        """The next frame, or None when the other side closed (or broke off mid-frame)."""
        if not self._fill(HEADER.size):
            return None
        kind, n = HEADER.unpack(bytes(self.buf[: HEADER.size]))
        del self.buf[: HEADER.size]
        if len(self.buf) < n and n > LARGE_FRAME:
            # Received straight into its own buffer, not grown 64 KiB at a time and then sliced
            # out (three copies of every byte sent).
            payload = bytearray(n)
            have = len(self.buf)
            payload[:have] = self.buf
            self.buf.clear()
            view = memoryview(payload)
            while have < n:
                got = self.sock.recv_into(view[have:], n - have)
                if not got:
                    return None
                have += got
            return kind, bytes(payload)
        if not self._fill(n):
            return None
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return kind, out


# --------------------------------------------------------------------------------------------------
# Errors


def error_json(exc: BaseException, *, retry: bool) -> dict[str, Any]:
    """An error met by the process, for the command; ``retry``: nothing ran, it may go elsewhere."""
    if isinstance(exc, RvError):
        return {"kind": type(exc).__name__, "message": exc.message, "hint": exc.hint, "retry": retry}
    return {"kind": "RemoteError", "message": f"{type(exc).__name__}: {exc}", "hint": None, "retry": retry}


def raise_error(data: dict[str, Any]) -> None:
    """Raise, in the rv command, the error the background process met (same class, same words)."""
    classes: dict[str, type[RvError]] = {
        c.__name__: c
        for c in (
            errors.UsageError, errors.ConfigError, errors.ConnectError, errors.ConnectionLost,
            errors.AuthError, errors.HostKeyError, errors.RemoteCommandMissing, errors.RemoteError,
            errors.NotFound, RemoteTimeout, TransferError,
        )
    }  # fmt: skip
    classes["ChannelOpenError"] = ConnectError
    cls = classes.get(data.get("kind", ""), RemoteError)
    raise cls(data.get("message", "the background connection failed"), hint=data.get("hint"))
