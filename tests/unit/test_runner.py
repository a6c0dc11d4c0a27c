"""The one command-stream loop (rv.remote.transport.run_process), driven through local bash: output
whole and in order, stdin fed without deadlock, and a command that never outlives an exception,
its deadline or a failed read of its stdin. The SSH and warm transports supply the same primitives
(tests/integration/test_warm.py runs them against the real sshd)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rv.remote.transport import LocalTransport, RemoteTimeout, TransferError


def gone(pid_file: Path, limit: float = 20.0) -> bool:
    """Has the process whose pid the command wrote exited? (A liveness bound, not a timing claim.)"""
    pid = int(pid_file.read_text())
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_output_and_the_exit_code_come_back_whole():
    r = LocalTransport().run("printf 'a%.0s' $(seq 100000); printf err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"a" * 100000, b"err")


def test_a_command_that_writes_a_lot_before_it_reads_does_not_deadlock():
    # Both pipes' buffers (64 KiB) would fill if stdin were fed from the loop that reads stdout.
    data = os.urandom(4 << 20)
    r = LocalTransport().run("head -c 4000000 /dev/zero; wc -c", stdin=data, timeout=60)
    assert r.exit_code == 0 and r.stdout[:4000000] == bytes(4000000)
    assert r.stdout[4000000:].strip() == str(len(data)).encode()


@pytest.mark.timeout(60)
def test_the_deadline_stops_the_command_and_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(RemoteTimeout, match=r"command timed out after 2s: sleep 300 &"):
        LocalTransport().run(f"sleep 300 & echo $! > {pid_file}; wait", timeout=2)
    assert gone(pid_file)


@pytest.mark.timeout(60)
def test_an_exception_in_a_callback_stops_the_command(tmp_path):
    pid_file = tmp_path / "child.pid"

    class Stop(Exception):
        pass

    def on_stdout(data: bytes) -> None:
        raise Stop()

    with pytest.raises(Stop):
        LocalTransport().stream(f"sleep 300 & echo $! > {pid_file}; echo ready; wait", on_stdout=on_stdout)
    assert gone(pid_file)


@pytest.mark.timeout(60)
def test_a_failed_read_of_stdin_stops_the_command_and_says_why(tmp_path):
    pid_file = tmp_path / "child.pid"

    def data():
        yield b"x" * 1000
        end = time.monotonic() + 10
        while not pid_file.exists() and time.monotonic() < end:  # the command is under way
            time.sleep(0.05)
        raise OSError(5, "Input/output error")

    with pytest.raises(TransferError, match="upload stopped: reading the data to send failed") as info:
        LocalTransport().run(f"sleep 300 & echo $! > {pid_file}; cat > /dev/null; wait", stdin=data())
    assert isinstance(info.value.__cause__, OSError)
    assert gone(pid_file)
