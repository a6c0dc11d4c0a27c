"""The command server: one background process per user and rv install, with rv imported, that forks
a copy of itself for each command the `rv` front end (rv.entry) hands it.

Rules it keeps (the same as the warm connections', rv.remote.warm):

* **Private.** Its socket is in the user's private runtime folder (rv.runtime), mode 0600, and the
  peer's uid is checked on every connection.
* **Never stale.** It serves only requests from the same interpreter, search path and rv folder
  (the key in the socket's name and in each request), and only while no ``.py`` file of its rv
  package changed since it started; otherwise it answers "stale", exits, and the command runs
  in-process (and starts a fresh server).
* **One at a time.** A lock file held for its whole life: a second server for the same key exits
  at once.
* **Single-threaded**, so that forking is safe: the copy starts with nothing half-done.
* **Idle exit** after 30 minutes (or ``RV_WARM_SECONDS``, if longer) with no command running or
  asked for. It holds no connection, only memory (~60 MB), so it outlives the warm connections:
  the first command after a pause pays the SSH handshake, not Python's imports as well.
* **Nothing outlives its command.** The copy runs in its own process group, which the front end
  signals; if the front end goes away without a word (SIGKILL), the server kills that group, as
  the in-process command would have died with it. (The server watches, not a thread in the copy:
  the copy stays single-threaded, so it too can fork, see rv.remote.warm._spawn.)

What the copy does before running the command: its stdin, stdout and stderr become the front end's
(passed as file descriptors), it moves to the front end's folder and takes its environment and
command line, rebuilds ``sys.stdin/stdout/stderr`` with the front end's encodings (line-buffered on
a terminal, as Python does), and resets the signal handlers. Then the CLI runs at the top of the
interpreter's stack, so it exits as any Python program does (atexit handlers, flushed streams).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from rv import runtime
from rv.commands import COMMANDS

# Set in a forked copy: everything is imported, so a background process it starts (a warm
# connection, rv.remote.warm._spawn) is best forked from it too, rather than started afresh.
in_copy = False
_LOCK_WAIT_S = 2.0
# Modules that commands import lazily; loading them here is what the server is for. The served
# commands' own modules (rv.cli.*) and everything they import at the top come along.
_PRELOAD_EXTRA = (
    "rv.remote.connect",
    "rv.remote.warm",
    "rv.remote.warmwire",
    "rv.remote.warmd",
    "rv.remote.transport",
    "rv.remote.sshconfig",
    "rv.remote.ssh",
    "rv.files.snapshot",
    "rv.files.listing",
    "rv.files.provenance",
    "rv.files.sync",
    "rv.files.pull",
    "rv.files.progress",
    "rv.cli.logview",
    "rv.remote.agent_client",
    "rv.agent.manifest",
    "rv.files.treecache",
    "rv.job.cleanup",
    "rv.job.launch",
    "rv.job.query",
    "rv.job.submit",
    "rv.job.watch",
    "rv.misplaced",
    "rv.pyenv.plan",
    "rv.pyenv.spec",
    "rv.slurm.client",
    "rv.slurm.script",
    "platformdirs",
    "pwd",
    "difflib",
    "click._textwrap",
    "rich.console",
    "rich.table",
    "rich.progress",
    "rich.markup",
    # GitPython, for the repository's facts each run records (rv.files.repo, on a thread while the
    # cluster answers): its import costs a served resubmit more than rv's own work there (measured
    # with benchmarks/cli.py --before), so the copies find it here. Last: the rest comes first.
    "git",
)


@dataclasses.dataclass
class Request:
    conn: socket.socket
    fds: list[int]
    key: str
    cwd: str
    encodings: list[str]
    argv: list[str]
    environ: dict[str, str]


class BadRequest(Exception):
    pass


def decode_request(body: bytes) -> tuple[str, str, list[str], list[str], dict[str, str]]:
    """(key, cwd, encodings, argv, environ) from rv.entry.encode_request's body (after the length)."""
    fields = body.split(b"\0")
    if len(fields) < 10 or fields[0] != runtime.COMMAND_PROTOCOL:
        raise BadRequest("not an rv command request (another rv version?)")
    key, cwd = fields[1].decode(), os.fsdecode(fields[2])
    encodings = [f.decode() for f in fields[3:9]]
    count = int(fields[9])
    argv = [os.fsdecode(a) for a in fields[10 : 10 + count]]
    environ = {}
    for item in fields[10 + count :]:
        name, sep, value = item.partition(b"=")
        if sep:
            environ[os.fsdecode(name)] = os.fsdecode(value)
    return key, cwd, encodings, argv, environ


def package_signature(root: Path | None = None) -> list[tuple[str, int, int]]:
    """(path, mtime, size) of every .py file of the rv package (or under ``root``): what the server
    has loaded, or will load lazily in a copy. An edit or an upgrade changes it."""
    root = root or Path(__file__).resolve().parent
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with contextlib.suppress(FileNotFoundError):
                    st = os.stat(path)
                    out.append((path, st.st_mtime_ns, st.st_size))
    return out


# --------------------------------------------------------------------------------------------------
# Starting one (from the front end, after a command it ran in-process)


def start_server(key: str) -> None:
    """Start the server for ``key`` in the background, unless this user's runtime folder is not
    private. Returns at once; a server already up makes the new one exit (the lock).

    With ``RV_DEBUG=1`` it waits for the server to listen, and says on stderr that it did or why
    not (what the server wrote before it died: a module it could not import, say)."""
    from rv.remote.connect import debug

    try:
        folder = runtime.runtime_dir()
    except (OSError, runtime.NotPrivate) as exc:
        debug(f"no command server: {exc}")
        return
    base = runtime.command_socket(folder, key).removesuffix(".sock")
    try:
        logged = os.path.getsize(base + ".log")  # what the new server writes comes after this
    except OSError:
        logged = 0
    spec = {"key": key, "folder": folder, "idle": _idle_seconds()}
    proc = runtime.spawn_python(_BOOT, spec, log=base + ".log")
    if os.environ.get("RV_DEBUG") == "1":
        debug(_started(proc, base, logged))


def _started(proc: subprocess.Popen[bytes], base: str, logged: int, limit: float = 30.0) -> str:
    """Whether the server ``proc`` came up (it writes its pid file once it listens), in words."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        with contextlib.suppress(OSError, ValueError):
            if int(Path(base + ".pid").read_text()) == proc.pid:
                return f"started the command server (pid {proc.pid}; log: {base}.log)"
        code = proc.poll()
        if code is not None:
            if code == 0:
                return "a command server is up already (the new one left)"
            with contextlib.suppress(OSError):
                with open(base + ".log", "rb") as fh:
                    fh.seek(logged)
                    said = fh.read().decode("utf-8", "replace").strip().splitlines()
                if said:
                    return f"the command server did not start: {said[-1]} (log: {base}.log)"
            return f"the command server did not start (exit {code}; log: {base}.log)"
        time.sleep(0.02)
    return f"the command server did not say it was up within {limit:g} s (log: {base}.log)"


# After rv.runtime.BOOT_PREFIX (the data in `d`, the search path set).
_BOOT = "import rv.forkserver as f;r=f.serve(d);r and f.run_command(r)"


SERVER_IDLE_S = 1800.0


def _idle_seconds() -> float:
    try:
        return max(SERVER_IDLE_S, float(os.environ.get("RV_WARM_SECONDS") or 0))
    except ValueError:
        return SERVER_IDLE_S


# --------------------------------------------------------------------------------------------------
# The server


def serve(spec: dict[str, object]) -> Request | None:
    """Serve until idle. Returns None in the server (to exit), and the request in each forked copy:
    the copy then runs it at the top of the stack (run_command)."""
    import fcntl

    folder, key = str(spec["folder"]), str(spec["key"])
    base = os.path.join(folder, f"cmd-{key}")
    lock_fd = os.open(base + ".lock", os.O_WRONLY | os.O_CREAT, 0o600)
    deadline = time.monotonic() + _LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                return None  # another server for this key is up
            time.sleep(0.05)  # or one that said "stale" is on its way out
    with contextlib.suppress(OSError):
        os.setsid()
    log = _open_log(base + ".log")
    server = _Server(key, base, float(spec["idle"]), log, lock_fd)  # type: ignore[arg-type]
    server.preload()
    return server.loop()


def _open_log(path: str) -> int:
    fd = runtime.open_log(path)
    for target in (1, 2):
        os.dup2(fd, target)  # a traceback from here lands in the log, not nowhere
    return fd


class _Server:
    def __init__(self, key: str, base: str, idle: float, log_fd: int, lock_fd: int) -> None:
        self.key, self.base, self.idle, self.log_fd, self.lock_fd = key, base, idle, log_fd, lock_fd
        self.pid = os.getpid()
        self.children: dict[int, socket.socket] = {}
        # Stands in for the connection of a command whose front end is gone: never readable.
        self.gone, self._gone_peer = socket.socketpair()
        self.signature: list[tuple[str, int, int]] = []
        self.closing: str | None = None  # why the server is going, once it is

    def log(self, text: str) -> None:
        os.write(self.log_fd, f"{time.strftime('%H:%M:%S')} [{os.getpid()}] {text}\n".encode())

    def preload(self) -> None:
        import importlib

        wanted = [command.module for command in COMMANDS.values() if command.served]
        for name in ["rv.cli.main", *wanted, *_PRELOAD_EXTRA]:
            try:
                importlib.import_module(name)
            except ImportError as exc:  # an optional part missing: its commands import it themselves
                self.log(f"preload: {name}: {exc}")
        from rv.remote.agent_client import agent_key

        agent_key()  # the agent's sources, read and compressed once (a stale check guards them)
        self.signature = package_signature()
        # What was imported stays as it is: the garbage collector need not look at it in each copy
        # (which would touch, and so copy, every page of it).
        gc.freeze()

    def loop(self) -> Request | None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = self.base + ".sock"
        tmp = f"{self.base}.{self.pid}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        old_mask = os.umask(0o177)
        try:
            listener.bind(tmp)
        finally:
            os.umask(old_mask)
        listener.listen(16)
        os.replace(tmp, path)  # atomically over a dead server's socket
        runtime.write_pid(self.base + ".pid")
        self.log(f"serving {path}")
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._on_term)
        signal.set_wakeup_fd(wake_w.fileno())
        last = time.monotonic()
        try:
            while True:
                if self.closing is not None and listener.fileno() >= 0:
                    # Going (stale, idle, SIGTERM): take no more commands, but report the status
                    # of those running before leaving (their front ends are waiting for it).
                    self.log(f"{self.closing}: exiting when the running commands end")
                    self.shut(listener, path)
                if self.closing is not None and not self.children:
                    return None
                timeout = None if self.children else max(0.0, last + self.idle - time.monotonic())
                if timeout == 0.0:
                    self.closing = "idle"
                    continue
                waiting = [wake_r, *self.children.values()]
                if listener.fileno() >= 0:
                    waiting.append(listener)
                readable, _, _ = select.select(waiting, [], [], timeout)
                if wake_r in readable:
                    with contextlib.suppress(BlockingIOError):
                        wake_r.recv(4096)
                    self.reap()
                    last = time.monotonic()
                for pid, conn in list(self.children.items()):
                    if conn in readable:
                        self.front_end_said(pid, conn)
                if listener in readable and listener.fileno() >= 0:
                    last = time.monotonic()
                    conn, _ = listener.accept()
                    request = self.take(conn)
                    if not isinstance(request, Request):
                        continue
                    # The copy starts with the front end's signals held back: it lets them through
                    # once it is the command (run_command), so none lands half-way through that.
                    signal.pthread_sigmask(signal.SIG_BLOCK, _forwarded())
                    pid = os.fork()
                    if pid != 0:
                        signal.pthread_sigmask(signal.SIG_UNBLOCK, _forwarded())
                    if pid == 0:
                        signal.set_wakeup_fd(-1)
                        held = [listener, wake_r, wake_w, self.gone, self._gone_peer]
                        for other in {*held, *self.children.values()}:
                            other.close()
                        os.close(self.log_fd)
                        os.close(self.lock_fd)  # the lock is the server's: a copy must not hold it
                        return request
                    self.started(pid, request)
        finally:
            if os.getpid() == self.pid:
                self.shut(listener, path)

    def _on_term(self, _signum: int, _frame: object) -> None:
        self.closing = "SIGTERM"  # the wakeup descriptor wakes the loop

    def take(self, conn: socket.socket) -> Request | None:
        """Read one request. None when it is refused (answered and closed); a request from other rv
        code (stale) also sets ``closing``."""
        fds: list[int] = []
        try:
            if runtime.peer_uid(conn) not in (None, os.getuid()):
                conn.close()
                return None
            conn.settimeout(5.0)
            data, fds = _recv_with_fds(conn)
            size = int.from_bytes(data[:4], "big")
            body = data[4:]
            while len(body) < size:
                chunk = conn.recv(size - len(body))
                if not chunk:
                    raise BadRequest("the request ended early")
                body += chunk
            key, cwd, encodings, argv, environ = decode_request(body)
            if len(fds) != 3:
                raise BadRequest(f"expected stdin, stdout and stderr, got {len(fds)} descriptors")
            if key != self.key:
                raise BadRequest("another rv install")
            if package_signature() != self.signature:
                conn.sendall(b"S rv changed; run in-process\n")
                conn.close()
                _close_all(fds)
                self.closing = "rv changed since this server started"
                return None
            conn.settimeout(None)
            return Request(conn, fds, key, cwd, encodings, argv, environ)
        except (OSError, ValueError, BadRequest) as exc:
            self.log(f"refused a request: {exc}")
            with contextlib.suppress(OSError):
                conn.sendall(f"E {exc}\n".encode())
            conn.close()
            _close_all(fds)
            return None

    def started(self, pid: int, request: Request) -> None:
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # also done by the copy: whichever runs first, the group exists
        _close_all(request.fds)
        self.children[pid] = request.conn
        self.log(f"command {pid}: rv {' '.join(request.argv[1:2])}")
        try:
            request.conn.sendall(f"P {pid}\n".encode())
        except OSError:
            # The front end is gone already: so must the copy be.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)

    def front_end_said(self, pid: int, conn: socket.socket) -> None:
        """The front end sends nothing after its request: end of file means it went away without
        passing on a signal (SIGKILL). Its command goes the same way, as it would have in-process."""
        try:
            said = conn.recv(64)
        except OSError:
            said = b""
        if said:
            return
        self.log(f"command {pid}: its front end went away; killing it")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        conn.close()
        self.children[pid] = self.gone  # reaped as usual; nothing left to tell

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None or conn is self.gone:
                continue
            code = os.waitstatus_to_exitcode(status)  # negative: ended by that signal
            self.log(f"command {pid}: exit {code}")
            with contextlib.suppress(OSError):
                conn.sendall(f"X {code}\n".encode())
            conn.close()

    def shut(self, listener: socket.socket, path: str) -> None:
        """Stop listening; the socket and pid files go unless a newer server's replaced them."""
        if listener.fileno() < 0:
            return
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == os.fstat(listener.fileno()).st_ino:
                os.unlink(path)
                os.unlink(self.base + ".pid")
        listener.close()
        # A server that is only waiting for its last commands lets a fresh one start at once.
        os.close(self.lock_fd)


def _recv_with_fds(conn: socket.socket) -> tuple[bytes, list[int]]:
    data, ancdata, _flags, _addr = conn.recvmsg(1 << 16, socket.CMSG_SPACE(3 * struct.calcsize("i")))
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % struct.calcsize("i")
            fds += list(struct.unpack(f"{usable // struct.calcsize('i')}i", payload[:usable]))
    if len(data) < 4:
        _close_all(fds)
        raise BadRequest("empty request")
    return data, fds


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


# --------------------------------------------------------------------------------------------------
# The forked copy


def run_command(request: Request) -> None:
    """Become the front end's command and run it; the interpreter exits with its status."""
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGTSTP):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    for target, fd in enumerate(request.fds):
        os.dup2(fd, target)
    _close_all(request.fds)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.environ)
    sys.argv = request.argv
    enc = request.encodings
    # New streams over the front end's descriptors, as Python would have made them at its start:
    # its encodings, and line-buffered output on a terminal (stderr always).
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), enc[0], enc[1])
    sys.stdout = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w", closefd=False)), enc[2], enc[3], line_buffering=os.isatty(1)
    )
    sys.stderr = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)), enc[4], enc[5], line_buffering=True
    )
    request.conn.close()  # the server keeps its copy: it reports the exit status
    global in_copy
    in_copy = True
    _exit_quickly()

    from rv.cli.main import main

    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _forwarded())  # what came meanwhile is raised here
    except KeyboardInterrupt:
        sys.stderr.write("rv: interrupted\n")
        _status[0] = 130
        raise SystemExit(130) from None
    try:
        main()
    except SystemExit as exc:
        _status[0] = _exit_code(exc.code)
        raise
    _status[0] = 0


def _forwarded() -> set[signal.Signals]:
    return {getattr(signal, name) for name in runtime.FORWARDED_AND_STOP if hasattr(signal, name)}


# The command's exit status, for _exit_quickly (1 if it ends by an uncaught exception).
_status = [1]


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1  # Python prints a string exit message itself


def _exit_quickly() -> None:
    """End the copy as a Python program ends (non-daemon threads joined, atexit handlers run,
    streams flushed), but skip tearing down the ~400 modules it inherited: 60 ms for nothing.
    Registered first, so it is the last atexit handler to run."""
    import atexit

    def leave() -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed pipe: the status still counts
                stream.flush()
        os._exit(_status[0])

    atexit.register(leave)
