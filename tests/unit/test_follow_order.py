"""The agent's follower reads a job over several nodes in the order its lines were written (issue 41:
"rv: run X ended" came before the program's output in `rv logs`)."""

from __future__ import annotations

from rv.agent import follow


class Sent:
    def __init__(self) -> None:
        self.data = b""

    def send(self, header, data=b""):  # as the agent's Frames
        self.data += data


def test_the_batch_logs_closing_lines_come_after_each_nodes_output(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "7.out").write_bytes(
        b"setup says hi\nrv: run r, segment 1/3: job 7 on n[1-2], 2 node(s)\n"
        b"rv: run r ended after segment 1\n"
    )
    (logs / "7-node0.out").write_bytes(b"[0] hello\n")
    (logs / "7-node1.out").write_bytes(b"[1] hello\n")
    (logs / "7.err").write_bytes(b"an error line\n")
    sent = Sent()
    follow._drain(sent, bytes(tmp_path), "7", ["out"], None, {}, 1, settle=False)
    assert sent.data == (
        b"setup says hi\nrv: run r, segment 1/3: job 7 on n[1-2], 2 node(s)\n[0] hello\n[1] hello\n"
        b"rv: run r ended after segment 1\n"
    )
    # One node asked for: its log alone; a batch log without its start line yet: read whole, first.
    one = Sent()
    follow._drain(one, bytes(tmp_path), "7", ["out"], 1, {}, 1, settle=False)
    assert one.data == b"[1] hello\n"
    (logs / "8.out").write_bytes(b"setup still running\n")
    (logs / "8-node0.out").write_bytes(b"[0] early\n")
    early = Sent()
    follow._drain(early, bytes(tmp_path), "8", ["out"], None, {}, 1, settle=False)
    assert early.data == b"setup still running\n[0] early\n"
