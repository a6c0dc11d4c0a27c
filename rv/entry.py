"""The `rv` program: hand the command to a waiting rv (rv.forkserver) when one is up, else run it here.

Most of an rv command's time on a warm connection was Python importing rv, click, rich and paramiko
(~150 ms of ~220 ms for `rv ps`). A background process of this user keeps all of that imported and
forks a copy of itself per command; this front end passes it the command line, the folder, the
environment and its own stdin/stdout/stderr (the file descriptors themselves, so terminals, pipes
and prompts behave as they do in-process), forwards the signals it gets (Ctrl-C, SIGTERM, Ctrl-Z)
and exits with the copy's exit status. It imports nothing Python had not already loaded but the C
modules it needs, rv.remote.connect (which decides) and rv.commands (plain data), so it starts in a few
milliseconds.

Whether a command is served is rv.remote.connect's to say (in_process_reason): not the interactive
commands, not with ``RV_COMMAND_SERVER=0`` or ``RV_WARM_SECONDS=0``. Anything unusual runs the command
in-process too, exactly as ``python -m rv`` does: no server (this command then starts one for the
next), or a server from other rv code (the package was edited or upgraded: it says "stale" and
exits). ``RV_DEBUG=1`` says on stderr which way each command went, and why.
"""

from __future__ import annotations

import os
import sys

from rv import runtime
from rv.remote.connect import debug, in_process_reason


def encode_request(
    key: str, argv: list[str], cwd: str, environ: dict[str, str], encodings: list[str]
) -> bytes:
    """NUL-separated fields (none of them can hold a NUL): protocol, key, cwd, the stdio encodings,
    then the counted argv and environment."""
    fields = [runtime.COMMAND_PROTOCOL, key.encode(), os.fsencode(cwd)]
    fields += [e.encode() for e in encodings]
    fields.append(str(len(argv)).encode())
    fields += [os.fsencode(a) for a in argv]
    fields += [os.fsencode(k) + b"=" + os.fsencode(v) for k, v in environ.items()]
    body = b"\0".join(fields)
    return len(body).to_bytes(4, "big") + body


def _stdio_encodings() -> list[str]:
    out = []
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        out += [getattr(stream, "encoding", None) or "utf-8", getattr(stream, "errors", None) or "strict"]
    return out


class _Fallback(Exception):
    """The server cannot take this command; nothing ran. Run it in-process."""


def _read_line(sock: object) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(64)  # type: ignore[attr-defined]
        if not chunk:
            return buf
        buf += chunk
    return buf


def _via_server(argv: list[str]) -> int:
    """Run the command in a forked copy of the server; its exit status. _Fallback when none runs it."""
    import _socket
    import array

    key = runtime.command_server_key()
    try:
        path = runtime.command_socket(runtime.runtime_dir(), key)
        cwd = os.getcwd()
    except (OSError, runtime.NotPrivate) as exc:
        raise _Fallback(str(exc)) from None
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(5.0)  # a live server answers at once; a wedged one must not hang the command
        sock.connect(path)
        request = encode_request(key, ["rv", *argv], cwd, dict(os.environ), _stdio_encodings())
        fds = array.array("i", [0, 1, 2])
        sent = sock.sendmsg([request], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds)])
        if sent < len(request):
            sock.sendall(request[sent:])
        answer = _read_line(sock)
    except OSError as exc:  # no server, a dead one's socket, a closed stdio fd, a timeout
        sock.close()
        raise _Fallback(str(exc)) from None
    if not answer.startswith(b"P "):
        sock.close()
        raise _Fallback(answer.decode(errors="replace").strip() or "the server went away")
    # From here on the command runs: whatever happens, never run it again in-process.
    group = int(answer[2:])
    debug(f"served by the command server (its copy: pid {group})")
    sock.settimeout(None)
    _forward_signals(group)
    _signals(block=False)  # one that came meanwhile goes to the command now
    status = _read_line(sock)
    sock.close()
    if not status.startswith(b"X "):
        sys.stderr.write("rv: the command server went away; the command's exit status is unknown\n")
        return 1
    code = int(status[2:])
    if code < 0:  # ended by a signal: end the same way, so a shell sees what happened
        import _signal  # type: ignore[import-not-found]  # signal's enum costs 10 ms

        _signal.signal(-code, _signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


def _signals(*, block: bool) -> None:
    """Hold back (or let through) the signals the front end passes on."""
    import _signal

    wanted = [getattr(_signal, n) for n in runtime.FORWARDED_AND_STOP if hasattr(_signal, n)]
    _signal.pthread_sigmask(_signal.SIG_BLOCK if block else _signal.SIG_UNBLOCK, wanted)


def _forward_signals(group: int) -> None:
    import _signal

    def forward(signum: int, _frame: object) -> None:
        try:
            os.killpg(group, signum)
        except ProcessLookupError:
            return  # it ended already; its status is on the way

    def stop(signum: int, _frame: object) -> None:
        forward(signum, _frame)
        os.kill(os.getpid(), _signal.SIGSTOP)  # Ctrl-Z: the shell sees this front end stop

    for name, handler in [*((n, forward) for n in runtime.FORWARDED_SIGNALS), ("SIGTSTP", stop)]:
        signum = getattr(_signal, name, None)
        # One this process ignores (SIGINT in a job started with `&` by a script) stays ignored,
        # as it would be in-process.
        if signum is not None and _signal.getsignal(signum) != _signal.SIG_IGN:
            _signal.signal(signum, handler)


def main() -> None:
    argv = sys.argv[1:]
    why = in_process_reason(argv, os.environ)
    if why is None:
        # Until the command runs and its signals are passed on, they wait: a Ctrl-C typed now is
        # the command's (or, if it runs here after all, this process's), never lost half-way.
        _signals(block=True)
        try:
            sys.exit(_via_server(argv))
        except _Fallback as exc:  # nothing ran: run it here, and start a server for the next one
            debug(f"in-process: no command server to take it ({exc})")
        try:
            _signals(block=False)
        except KeyboardInterrupt:
            sys.stderr.write("rv: interrupted\n")
            sys.exit(130)
    else:
        debug(f"in-process: {why}")
    from rv.cli.main import main as cli_main

    try:
        cli_main()
    finally:
        if why is None:
            from rv.forkserver import start_server

            start_server(runtime.command_server_key())
