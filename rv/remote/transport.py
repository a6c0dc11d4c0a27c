"""The transport API: run a command, stream one, put and get files, on the cluster or locally.

What every part of rv that talks to the cluster is given is a :class:`Transport`; which one, and how
it got there, is decided in rv.remote.connect (the only module that chooses a route). The three:

* rv.remote.warm.WarmTransport: through the profile's warm background connection (rv.remote.warmd);
  rv.remote.connect.WarmFirst sends what it cannot take over SSH instead.
* rv.remote.ssh.SSHTransport: one paramiko connection in this process (and in that background process).
* :class:`LocalTransport` (here): local bash and files, the one fake seam for unit tests.

Here too: the one loop that drives a running command (run_process; each transport supplies its
primitives, a :class:`Process`), the result type, the errors every transport raises, the upload and
download helpers they share, and the file-mode rule (private by default). This module imports
neither paramiko nor any rv module that does: where to connect is rv.remote.sshconfig, connecting
is rv.remote.ssh.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rv.errors import RemoteError

Stdin = bytes | Iterable[bytes] | None
_CHUNK = 1 << 16
PRIVATE_MASK = 0o077  # what rv never grants to anyone but the user...
GROUP_MASK = 0o027  # ...unless the profile says share_with_group = true (then the group may read)


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    stdout: bytes
    stderr: bytes

    @property
    def out(self) -> str:
        return self.stdout.decode("utf-8", errors="replace")

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def check(self, what: str) -> RunResult:
        """Raise :class:`RemoteError` naming ``what`` and the tail of stderr when the command failed."""
        if self.exit_code != 0:
            tail = self.err.strip().splitlines()[-3:]
            detail = ": " + " / ".join(tail) if tail else ""
            raise RemoteError(f"{what} failed (exit {self.exit_code}){detail}")
        return self


class Transport(Protocol):
    def run(self, command: str, *, stdin: Stdin = None, timeout: float | None = None) -> RunResult: ...

    def stream(
        self,
        command: str,
        *,
        on_stdout: Callable[[bytes], None],
        on_stderr: Callable[[bytes], None] | None = None,
        stdin: Stdin = None,
        timeout: float | None = None,
        keep_stdin_open: bool = False,
    ) -> int: ...

    def put_bytes(self, data: bytes, remote_path: str, mode: int = 0o600) -> None: ...

    def put_file(self, local_path: str | Path, remote_path: str, mode: int | None = None) -> None: ...

    def get_file(self, remote_path: str, local_path: str | Path) -> None: ...

    def close(self) -> None: ...


def _chunks(stdin: Stdin) -> Iterator[bytes]:
    if stdin is None:
        return iter(())
    if isinstance(stdin, bytes | bytearray | memoryview):
        data = bytes(stdin)
        return (data[i : i + _CHUNK] for i in range(0, len(data), _CHUNK))
    return iter(stdin)


def _temp_name(path: str) -> str:
    """A sibling name for an atomic write: same directory, so the final rename never crosses devices."""
    head, tail = posixpath.split(path)
    return posixpath.join(head, f".{tail}.rv-tmp-{os.urandom(6).hex()}")


def file_mode(mode: int, mask: int) -> int:
    """``mode`` with what ``mask`` forbids removed: 0o644 -> 0o600 when private, 0o640 with the group."""
    return mode & ~mask & 0o7777


def local_file_mode(local_path: str | Path, mask: int) -> int:
    """The mode an uploaded copy of a local file gets: executables stay executable, for the user only."""
    executable = os.stat(local_path).st_mode & 0o100
    return file_mode(0o755 if executable else 0o644, mask)


def read_chunks(path: str | Path, size: int = 1 << 20) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        while data := fh.read(size):
            yield data


def write_local_atomically(
    local_path: str | Path, produce: Callable[[Callable[[bytes], None]], None]
) -> None:
    """Write a local file by temp file and rename: a failure or Ctrl-C never leaves half a file."""
    local = Path(local_path)
    tmp = local.with_name(f".{local.name}.rv-tmp-{os.getpid()}-{os.urandom(6).hex()}")
    try:
        with open(tmp, "wb") as fh:

            def sink(data: bytes) -> None:
                fh.write(data)

            produce(sink)
        tmp.replace(local)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class RemoteTimeout(RemoteError):
    pass


class TransferError(RemoteError):
    """The data being sent could not be read here (a file vanished or failed mid-read)."""


class Cancelled(Exception):
    """The caller went away while its command ran (see run_process's ``cancelled``)."""


# --------------------------------------------------------------------------------------------------
# The runner: one loop drives every command, whatever carries it


class Process:
    """One started command, as run_process drives it: the primitives each transport supplies.

    Local bash (:class:`LocalTransport`), an SSH channel (rv.remote.ssh) and the socket to a warm
    connection's process (rv.remote.warm) each say how to feed the command's stdin, hand on its
    output, learn its exit code and stop it; the loop around them (stdin from a thread, the
    deadline, stopping the command on any exception) is written once, in run_process.
    """

    feeder_join_s = 5.0  # how long the end of the loop waits for the thread feeding stdin

    def __init__(self, command: str) -> None:
        self.command = command

    def write(self, chunk: bytes) -> bool:
        """Send ``chunk`` to the command's stdin; False when it stopped reading (it exited: its
        exit code and stderr say why)."""
        raise NotImplementedError

    def close_stdin(self) -> None:
        """No more stdin: the command reads end of file."""
        raise NotImplementedError

    def pump(
        self, wait: float | None, on_stdout: Callable[[bytes], None], on_stderr: Callable[[bytes], None]
    ) -> None:
        """Hand on the output that arrives within about ``wait`` seconds (None: no deadline, wait
        as long as suits the command), in this thread: an exception from a callback (Ctrl-C in a
        progress bar) stops the command."""
        raise NotImplementedError

    def exit_code(self) -> int | None:
        """The exit code once the command ended and its output was handed on; None before. Raises
        when none will ever come (the connection dropped)."""
        raise NotImplementedError

    def kill(self) -> None:
        """Stop the command now (a failed read of its stdin, Ctrl-C, the deadline, a callback's
        error): it must not outlive the caller, exactly as when an SSH channel closes."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the command held, however it ended."""
        raise NotImplementedError

    def timed_out(self, timeout: float) -> RemoteTimeout:
        return RemoteTimeout(
            f"remote command timed out after {timeout:g}s: {self.command[:80]}",
            hint="raise the limit with --timeout",
        )


def _discard(data: bytes) -> None:
    pass


def _upload_stopped(exc: BaseException) -> TransferError:
    error = TransferError(f"upload stopped: reading the data to send failed: {exc}")
    error.__cause__ = exc
    return error


def _feed(process: Process, source: Iterator[bytes], failure: list[BaseException]) -> None:
    """Feed the command's stdin, in a thread of its own: a command that writes a lot before it reads
    everything cannot deadlock against us (both sides' buffers full)."""
    try:
        for chunk in source:
            if not process.write(chunk):
                return  # the command stopped reading (it exited): its exit code says why
        process.close_stdin()
    except BaseException as exc:  # handed to the caller by run_process, never dropped
        failure.append(exc)
        process.kill()  # at once: the command must not wait for the rest of its stdin


def run_process(
    process: Process,
    *,
    on_stdout: Callable[[bytes], None],
    on_stderr: Callable[[bytes], None] | None = None,
    stdin: Stdin = None,
    keep_stdin_open: bool = False,
    timeout: float | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> int:
    """Drive ``process`` to its end and return its exit code: the one command-stream loop.

    ``stdin`` is fed from a thread; without it the command's stdin is closed at once, unless
    ``keep_stdin_open`` (a remote watchdog reading stdin learns at once when rv goes away).
    ``timeout`` bounds the whole command (RemoteTimeout). ``cancelled``, asked a few times a second,
    stops the command when it turns true (Cancelled). When the data for stdin cannot be produced
    (a file fails mid-read), the command is stopped at once and TransferError raised. On any
    exception, the command is killed before the exception goes on.
    """
    failure: list[BaseException] = []
    feeder = None
    if stdin is not None:
        feeder = threading.Thread(target=_feed, args=(process, _chunks(stdin), failure), daemon=True)
        feeder.start()
    elif not keep_stdin_open:
        process.close_stdin()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            process.pump(left, on_stdout, on_stderr or _discard)
            if failure:
                raise _upload_stopped(failure[0])
            code = process.exit_code()
            if code is not None:
                if failure:
                    raise _upload_stopped(failure[0])
                return code
            if cancelled is not None and cancelled():
                raise Cancelled()
            if deadline is not None and timeout is not None and time.monotonic() >= deadline:
                raise process.timed_out(timeout)
    except BaseException:
        process.kill()
        raise
    finally:
        process.close()
        if feeder is not None:
            feeder.join(timeout=process.feeder_join_s)


class _Collecting:
    """`run` for any transport with `stream`: collect the output instead of handing it on."""

    def stream(
        self,
        command: str,
        *,
        on_stdout: Callable[[bytes], None],
        on_stderr: Callable[[bytes], None] | None = None,
        stdin: Stdin = None,
        timeout: float | None = None,
        keep_stdin_open: bool = False,
    ) -> int:
        raise NotImplementedError

    def run(self, command: str, *, stdin: Stdin = None, timeout: float | None = None) -> RunResult:
        out: list[bytes] = []
        err: list[bytes] = []
        code = self.stream(command, on_stdout=out.append, on_stderr=err.append, stdin=stdin, timeout=timeout)
        return RunResult(code, b"".join(out), b"".join(err))


# --------------------------------------------------------------------------------------------------
# Local: the unit-test seam


class _LocalProcess(Process):
    """A local bash command: its pipes and its process group."""

    def __init__(self, command: str, proc: subprocess.Popen[bytes]) -> None:
        super().__init__(command)
        self.proc = proc
        assert proc.stdout is not None and proc.stderr is not None
        self.reading = {proc.stdout.fileno(): True, proc.stderr.fileno(): False}  # fd -> is it stdout?

    def write(self, chunk: bytes) -> bool:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(chunk)
            self.proc.stdin.flush()  # as over SSH: each chunk is sent as it comes
        except (BrokenPipeError, ValueError):
            return False
        return True

    def close_stdin(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):  # exited before reading everything
                self.proc.stdin.close()

    def pump(
        self, wait: float | None, on_stdout: Callable[[bytes], None], on_stderr: Callable[[bytes], None]
    ) -> None:
        if not self.reading:
            return
        ready, _, _ = select.select(list(self.reading), [], [], 0.5 if wait is None else min(0.5, wait))
        for fd in ready:
            data = os.read(fd, _CHUNK)
            if not data:
                del self.reading[fd]
            elif self.reading[fd]:
                on_stdout(data)
            else:
                on_stderr(data)

    def exit_code(self) -> int | None:
        return None if self.reading else self.proc.wait()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group: the command's children too

    def close(self) -> None:
        self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()

    def timed_out(self, timeout: float) -> RemoteTimeout:
        return RemoteTimeout(f"command timed out after {timeout:g}s: {self.command[:80]}")


@dataclass
class LocalTransport(_Collecting):
    """Runs commands with local bash and moves files with the local file system."""

    env: dict[str, str] | None = None
    calls: list[str] = field(default_factory=list)  # every command run, so tests can count round trips
    mask: int = PRIVATE_MASK

    def stream(
        self,
        command: str,
        *,
        on_stdout: Callable[[bytes], None],
        on_stderr: Callable[[bytes], None] | None = None,
        stdin: Stdin = None,
        timeout: float | None = None,
        keep_stdin_open: bool = False,
    ) -> int:
        self.calls.append(command)
        proc = subprocess.Popen(
            ["bash", "-c", command],
            stdin=subprocess.PIPE if stdin is not None or keep_stdin_open else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.env,
            start_new_session=True,  # so a kill reaches the command's children too
        )
        return run_process(
            _LocalProcess(command, proc),
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            stdin=stdin,
            keep_stdin_open=keep_stdin_open,
            timeout=timeout,
        )

    def put_bytes(self, data: bytes, remote_path: str, mode: int = 0o600) -> None:
        self._put([data], remote_path, file_mode(mode, self.mask))

    def _put(self, chunks: Iterable[bytes], remote_path: str, mode: int) -> None:
        tmp = _temp_name(remote_path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, mode)  # umask must not widen or narrow what the caller asked for
            with os.fdopen(fd, "wb") as fh:
                for chunk in chunks:
                    fh.write(chunk)
            os.replace(tmp, remote_path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def put_file(self, local_path: str | Path, remote_path: str, mode: int | None = None) -> None:
        want = file_mode(mode, self.mask) if mode is not None else local_file_mode(local_path, self.mask)
        self._put(read_chunks(local_path), remote_path, want)

    def get_file(self, remote_path: str, local_path: str | Path) -> None:
        local = Path(local_path)
        tmp = local.with_name(f".{local.name}.rv-tmp-{os.urandom(6).hex()}")
        tmp.write_bytes(Path(remote_path).read_bytes())
        tmp.replace(local)

    def close(self) -> None:
        pass
