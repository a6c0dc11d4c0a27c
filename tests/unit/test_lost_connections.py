"""A command's end read from an SSH channel whose state another thread changes, and agent calls whose
connection is lost before their answer (rv.remote.ssh, rv.remote.agent_client)."""

from __future__ import annotations

import pytest

from rv.errors import ConnectionLost
from rv.remote.ssh import _ChannelProcess


class _Transport:
    def __init__(self, active: bool = True) -> None:
        self.active = active

    def is_active(self) -> bool:
        return self.active

    def join(self, timeout: float | None = None) -> None:
        pass


class _RacingChannel:
    """A paramiko channel whose transport thread takes the exit status, EOF and close, all at once,
    after ``flip_after`` reads of its state: as sshd sends them together when a command ends."""

    def __init__(self, flip_after: int, status: int = 0) -> None:
        self.reads = 0
        self.flip_after = flip_after
        self.status = status
        self.ended = False
        self.transport = _Transport()

    def _read(self) -> bool:
        self.reads += 1
        if self.reads > self.flip_after:
            self.ended = True
        return self.ended

    @property
    def closed(self) -> bool:
        return self._read()

    @property
    def eof_received(self) -> bool:
        return self._read()

    def exit_status_ready(self) -> bool:
        return self._read()

    def recv_ready(self) -> bool:
        self._read()
        return False

    def recv_stderr_ready(self) -> bool:
        self._read()
        return False

    def recv_exit_status(self) -> int:
        return self.status if self.ended else -1

    def get_transport(self) -> _Transport:
        return self.transport


@pytest.mark.parametrize("flip_after", range(12))
def test_a_command_that_ends_between_two_reads_of_its_channel_ends_with_its_own_exit_code(flip_after):
    # The race that failed `rv stop` with "connection to 127.0.0.1 was lost" (exit 4) on a loaded
    # machine: the channel's close was read after "no exit status yet", while its exit status was 0.
    process = _ChannelProcess("cmd", _RacingChannel(flip_after), "127.0.0.1", tick=0.5)
    codes = [process.exit_code() for _ in range(4)]
    assert 0 in codes and set(codes) <= {None, 0}


class _Closed:
    """A channel closed without an exit status."""

    closed = True
    eof_received = True

    def __init__(self, transport: _Transport) -> None:
        self.transport = transport

    def exit_status_ready(self) -> bool:
        return True

    def recv_ready(self) -> bool:
        return False

    def recv_stderr_ready(self) -> bool:
        return False

    def recv_exit_status(self) -> int:
        return -1

    def get_transport(self) -> _Transport:
        return self.transport


def test_a_channel_closed_with_its_connection_is_a_lost_connection_and_one_killed_by_a_signal_is_255():
    with pytest.raises(ConnectionLost, match="connection to h was lost while a command ran"):
        _ChannelProcess("cmd", _Closed(_Transport(active=False)), "h", tick=0.5).exit_code()
    assert _ChannelProcess("cmd", _Closed(_Transport(active=True)), "h", tick=0.5).exit_code() == 255
