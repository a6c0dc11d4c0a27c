"""The transport API: run a command, stream one, put and get files, on the cluster or locally.

What every part of rv that talks to the cluster is given is a :class:`Transport`; which one, and how
it got there, is decided in rv.remote.connect (the only module that chooses a route). The three:

* rv.remote.warm.WarmTransport: through the profile's warm background connection.
* rv.remote.ssh.SSHTransport: one paramiko connection in this process (and in that background process).
* :class:`LocalTransport` (here): local bash and files, the one fake seam for unit tests.

Here too: the result type, the errors every transport raises, the upload and download helpers they
share, and the file-mode rule (private by default). This module imports neither paramiko nor any
rv module that does: where to connect is rv.remote.sshconfig, connecting is rv.remote.ssh.
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

        def kill() -> None:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.killpg(proc.pid, signal.SIGKILL)

        # As over SSH: stdout is read (and its callback runs) in this thread, so an exception from
        # a callback (Ctrl-C in a progress bar) stops the command; stdin and stderr have threads.
        failure: list[BaseException] = []
        threads = []

        def pump_stderr() -> None:
            assert proc.stderr is not None
            fd = proc.stderr.fileno()
            try:
                for chunk in iter(lambda: os.read(fd, _CHUNK), b""):
                    if on_stderr is not None:
                        on_stderr(chunk)
            except BaseException as exc:  # handed to the caller below, never dropped
                failure.append(exc)
                kill()

        threads.append(threading.Thread(target=pump_stderr, daemon=True))
        if stdin is not None:
            source = _chunks(stdin)

            def feed() -> None:
                assert proc.stdin is not None
                while True:
                    try:
                        chunk = next(source)
                    except StopIteration:
                        break
                    except BaseException as exc:  # handed to the caller below, never dropped
                        failure.append(
                            TransferError(f"upload stopped: reading the data to send failed: {exc}")
                        )
                        failure[-1].__cause__ = exc
                        kill()
                        return
                    try:
                        proc.stdin.write(chunk)
                        proc.stdin.flush()  # as over SSH: each chunk is sent as it comes
                    except (BrokenPipeError, ValueError):
                        return  # the command exited early: its exit code and stderr say why
                with contextlib.suppress(BrokenPipeError):  # exited before reading everything
                    proc.stdin.close()

            threads.append(threading.Thread(target=feed, daemon=True))
        for t in threads:
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        try:
            while True:
                wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
                ready, _, _ = select.select([fd], [], [], wait)
                if ready:
                    data = os.read(fd, _CHUNK)
                    if not data:
                        break
                    on_stdout(data)
                if deadline is not None and time.monotonic() >= deadline:
                    raise RemoteTimeout(f"command timed out after {timeout:g}s: {command[:80]}")
            code = proc.wait()
        except BaseException:
            # Ctrl-C, a timeout, a callback's error: the command must not outlive us (as a closed channel).
            kill()
            proc.wait()
            raise
        finally:
            for t in threads:
                t.join(timeout=5)
            proc.stdout.close()
            if proc.stderr is not None:
                proc.stderr.close()
        if failure:
            raise failure[0]
        return code

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
