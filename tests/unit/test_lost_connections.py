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


# --- agent calls whose connection is lost before their answer (rv.remote.agent_client.call_agent) -----


class _Flaky:
    """A transport whose first ``losses`` agent calls lose the connection after they ran."""

    def __init__(self, replies: dict[str, dict], losses: int = 1) -> None:
        self.replies = replies
        self.losses = losses
        self.calls: list[str] = []
        self.reconnects = 0

    def run_agent(self, mode, args, *, stdin=None, timeout=None):
        import json
        import zlib

        from rv.remote.transport import RunResult

        self.calls.append(mode)
        if self.losses:
            self.losses -= 1
            raise ConnectionLost("connection to h was lost while a command ran")
        return RunResult(0, zlib.compress(json.dumps(self.replies[mode]).encode()), b"")

    def reconnect(self) -> None:
        self.reconnects += 1


def test_every_agent_mode_says_what_a_lost_connection_does_to_it():
    from rv.agent.__main__ import MODES
    from rv.remote.agent_client import ON_LOST

    assert set(ON_LOST) == set(MODES)
    assert ON_LOST["run-submit"] in MODES and ON_LOST[ON_LOST["run-submit"]] is True


@pytest.mark.parametrize("mode", ["runs", "run-stop", "usage", "ckpt-ls", "why-probe"])
def test_a_call_safe_to_repeat_is_asked_again_once_over_a_fresh_connection(mode, capsys):
    from rv.remote.agent_client import call_agent

    t = _Flaky({mode: {"ok": 1}})
    assert call_agent(t, mode, {}, stdin=b"data") == {"ok": 1}
    assert (t.calls, t.reconnects) == ([mode, mode], 1)
    assert capsys.readouterr().err == (
        "rv: note: connection to h was lost while a command ran; reconnected and asked again\n"
    )
    t = _Flaky({mode: {"ok": 1}}, losses=2)  # lost again: that is the command's error
    with pytest.raises(ConnectionLost, match=r"^connection to h was lost while a command ran$"):
        call_agent(t, mode, {})
    assert (t.calls, t.reconnects) == ([mode, mode], 1)


def test_gc_s_listing_is_asked_again_and_a_collection_is_not():
    from rv.remote.agent_client import call_agent

    t = _Flaky({"gc": {"ok": 1}})
    assert call_agent(t, "gc", {"dry_run": True}) == {"ok": 1} and t.calls == ["gc", "gc"]
    t = _Flaky({"gc": {"ok": 1}})
    with pytest.raises(ConnectionLost, match="may have been done"):
        call_agent(t, "gc", {"dry_run": False})
    assert t.calls == ["gc"]


@pytest.mark.parametrize("mode", ["sweep-submit", "apply", "gc", "env", "up"])
def test_a_call_not_safe_to_repeat_is_never_sent_again_and_says_it_may_have_been_done(mode, capsys):
    from rv.remote.agent_client import call_agent

    t = _Flaky({mode: {"ok": 1}})
    with pytest.raises(ConnectionLost, match="may have been done") as raised:
        call_agent(t, mode, {"dry_run": False}, stdin=b"data")
    assert "before running the command again" in str(raised.value.hint)
    assert (t.calls, t.reconnects, capsys.readouterr().err) == ([mode], 0, "")


def test_a_call_whose_stdin_was_a_stream_is_not_sent_again():
    from rv.remote.agent_client import call_agent

    t = _Flaky({"scan": {"ok": 1}})
    with pytest.raises(ConnectionLost):
        call_agent(t, "scan", {}, stdin=iter([b"a stream", b"read once"]))
    assert t.calls == ["scan"]


def test_a_submission_lost_after_it_arrived_is_not_sent_again(capsys):
    from rv.remote.agent_client import call_agent

    t = _Flaky({"run-arrived": {"arrived": True, "job_id": "42", "candidates": []}})
    assert call_agent(t, "run-submit", {"run_id": "r1"}, stdin=b"SECRET=1\n")["job_id"] == "42"
    assert (t.calls, t.reconnects) == (["run-submit", "run-arrived"], 1)
    assert capsys.readouterr().err.count("\n") == 1


def test_a_submission_lost_before_it_arrived_is_sent_again(capsys):
    from rv.remote.agent_client import call_agent

    t = _Flaky({"run-arrived": {"arrived": False, "job_id": None}, "run-submit": {"job_id": "43"}})
    assert call_agent(t, "run-submit", {"run_id": "r1"})["job_id"] == "43"
    assert t.calls == ["run-submit", "run-arrived", "run-submit"]
    assert "had not reached the cluster, and was sent again" in capsys.readouterr().err


def test_a_submission_whose_check_is_lost_too_says_it_may_have_been_sent():
    from rv.remote.agent_client import call_agent

    t = _Flaky({}, losses=2)
    with pytest.raises(ConnectionLost, match="may have been done"):
        call_agent(t, "run-submit", {"run_id": "r1"})
    assert t.calls == ["run-submit", "run-arrived"]
