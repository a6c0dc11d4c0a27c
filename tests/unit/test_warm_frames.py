"""The frames between an rv command and its warm connection's process (rv.remote.warmwire): what goes in comes
out, whole, in order, whatever the sizes; a frame cut short reads as the other side gone."""

from __future__ import annotations

import os
import socket
import threading

from rv.remote.warmwire import HEADER, SocketFrameReader, send_frame


def read_all(reader: SocketFrameReader) -> list[tuple[bytes, bytes]]:
    frames = []
    while (frame := reader.read()) is not None:
        frames.append(frame)
    return frames


def test_frames_of_every_size_come_out_whole_and_in_order():
    # Small frames ride in the reader's buffer; a large one (an upload's stdin) is received into
    # its own buffer, starting with whatever of it the last read already brought in.
    sent = [(b"H", b"{}"), (b"D", os.urandom(70_000)), (b"D", b""), (b"D", os.urandom(1 << 20)),
            (b"e", b""), (b"D", os.urandom(3 << 20)), (b"X", b"0")]  # fmt: skip
    a, b = socket.socketpair()

    def send() -> None:
        for kind, payload in sent:
            send_frame(a, kind, payload)
        a.close()

    sender = threading.Thread(target=send)
    sender.start()
    got = read_all(SocketFrameReader(b))
    sender.join()
    assert got == sent


def test_a_frame_cut_short_reads_as_the_other_side_gone():
    for size, cut in ((1 << 20, 100_000), (1000, 10)):
        a, b = socket.socketpair()
        a.sendall(HEADER.pack(b"D", size) + os.urandom(cut))
        a.close()
        assert SocketFrameReader(b).read() is None


def test_a_change_to_the_agents_code_makes_a_warm_process_stale(monkeypatch):
    """The warm process pre-starts agents of the code it read; a command of other agent code (an
    editable install updated) could use none of them, so every agent file is in its code stamp."""
    from pathlib import Path

    from rv.remote import warmwire
    from rv.remote.agent_client import AGENT_MODULES

    seen: list[str] = []
    monkeypatch.setattr(warmwire, "_stat_sig", lambda path: seen.append(path) or [len(seen)])
    warmwire._code_stamp()
    names = {(Path(p).parent.name, Path(p).name) for p in seen}
    assert {("agent", f"{m}.py") for m in AGENT_MODULES} <= names
    assert ("remote", "agent_client.py") in names and all(Path(p).is_file() for p in seen)
