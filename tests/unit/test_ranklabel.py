"""rv's rank labeller (rv/agent/ranklabel.py), run for real: processes, pipes, signals, a shared file.

The integration tests run it under torchrun and accelerate on the loopback cluster; these check its
own promises on this machine, where a failure is quicker to read.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from rv.agent import ranklabel

LABELLER = Path(ranklabel.__file__)


def run_rank(
    tmp_path: Path, rank: str, code: str, *, log: Path, own_python: str = "", **popen
) -> subprocess.Popen:
    """One rank as torchrun starts it in a job: ``$PYTHON_EXEC -u -c CODE`` with RANK set, the user's
    own PYTHON_EXEC (if any) in RV_PYTHON_EXEC, stdout a pipe (as srun's) unless the test says."""
    env = dict(os.environ, RANK=rank, RV_PYTHON_EXEC=own_python, RV_LOG_OUT=str(log), RV_LOG_ERR=str(log))
    env.pop("PYTHON_EXEC", None)
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(
        [sys.executable, str(LABELLER), "-u", "-c", textwrap.dedent(code)], env=env, cwd=tmp_path, **popen
    )


def test_four_ranks_of_long_lines_at_once_stay_whole_and_labelled(tmp_path):
    # 70,000-byte lines: longer than a pipe's buffer (64 KiB), so a pipe shared by the ranks would
    # interleave them; print() also writes the text and the newline in two writes.
    log = tmp_path / "out.log"
    log.touch()
    code = """
        import os, sys
        rank = os.environ["RANK"]
        for i in range(300):
            print(f"rank={rank} i={i} " + rank * 70000)
        sys.stdout.write("no newline at the end")
    """
    procs = [run_rank(tmp_path, str(r), code, log=log) for r in range(4)]
    for p in procs:
        p.communicate(timeout=120)
        assert p.returncode == 0
    seen: Counter[str] = Counter()
    for line in log.read_bytes().split(b"\n")[:-1]:
        m = re.fullmatch(rb"\[(\d)\] rank=(\d) i=(\d+) (\d)+", line)
        if m and m.group(1) == m.group(2) and line.endswith(m.group(1) * 70000) and len(line) < 70030:
            seen[f"{m.group(1).decode()}:{m.group(3).decode()}"] += 1
        else:
            assert re.fullmatch(rb"\[\d\] no newline at the end", line), line[:120]
            seen["tail"] += 1
    assert seen["tail"] == 4
    assert sorted(k for k in seen if k != "tail") == sorted(f"{r}:{i}" for r in range(4) for i in range(300))
    assert set(seen.values()) == {1, 4}  # each line exactly once


def _labelled(chunks: list[bytes], label: bytes = b"[2] ") -> bytes:
    r, w = os.pipe()
    labeller = ranklabel.Labeller(w, label)
    for chunk in chunks:
        labeller.feed(chunk)
    labeller.flush()
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        return fh.read()


def test_progress_redraws_are_labelled_piece_by_piece_and_crlf_is_one_end():
    # tqdm writes "\r<state>" and a newline at the end; a "\r\n" may arrive split over two reads.
    assert _labelled([b"\r 10%", b"\r 20%", b"\r 30%\n"]) == b"[2] \r[2]  10%\r[2]  20%\r[2]  30%\n"
    assert _labelled([b"dos line\r", b"\nnext\n"]) == b"[2] dos line\r\n[2] next\n"
    assert _labelled([b"a\nb", b"c\n", b"half"]) == b"[2] a\n[2] bc\n[2] half\n"
    assert _labelled([]) == b""


def test_a_line_over_the_limit_is_written_in_pieces(monkeypatch):
    monkeypatch.setattr(ranklabel, "MAX_PIECE", 10)
    assert _labelled([b"0123456789abc", b"def\n"]) == b"[2] 0123456789abc\n[2] def\n"


def test_exit_code_and_death_by_signal_are_the_programs(tmp_path):
    log = tmp_path / "log"
    p = run_rank(tmp_path, "1", "import sys; print('bye'); sys.exit(7)", log=log)
    assert p.wait(timeout=30) == 7
    p = run_rank(tmp_path, "1", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", log=log)
    assert p.wait(timeout=30) == -signal.SIGKILL
    assert log.read_text() == "[1] bye\n"


def test_the_program_gets_the_signal_and_its_last_lines_still_arrive(tmp_path):
    # torchrun stops a worker with killpg: the labeller ignores the signal, the program handles it
    # (or dies of it), and what the program printed on the way out still reaches the log.
    log = tmp_path / "log"
    code = """
        import os, signal, sys, time
        def stop(signum, frame):
            print("saving on", signal.Signals(signum).name)
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        print("ready", flush=True)
        time.sleep(60)
    """
    p = run_rank(tmp_path, "3", code, log=log, start_new_session=True)
    for _ in range(600):
        if log.exists() and "ready" in log.read_text():
            break
        p.poll()
        assert p.returncode is None
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGTERM)
    assert p.wait(timeout=30) == 0
    assert log.read_text() == "[3] ready\n[3] saving on SIGTERM\n"


def test_the_program_sees_the_environment_without_the_labeller(tmp_path):
    # The interpreter is the launcher's own (here: this test's parent python) unless the user had a
    # PYTHON_EXEC of their own, which the program then sees again.
    log = tmp_path / "log"
    code = "import os, sys; print(os.environ.get('PYTHON_EXEC'), 'RV_PYTHON_EXEC' in os.environ, sys.prefix)"
    assert run_rank(tmp_path, "0", code, log=log).wait(timeout=30) == 0
    assert log.read_text() == f"[0] None False {sys.prefix}\n"
    log.unlink()
    assert run_rank(tmp_path, "0", code, log=log, own_python=sys.executable).wait(timeout=30) == 0
    assert log.read_text() == f"[0] {sys.executable} False {sys.prefix}\n"


def test_exec_mode_labels_any_program_with_the_given_label(tmp_path):
    log = tmp_path / "log"
    env = dict(os.environ, RV_LOG_OUT=str(log), RV_LOG_ERR=str(log))
    env.pop("RANK", None)
    program = ["sh", "-c", "echo out; echo err >&2; exit 3"]
    p = subprocess.run(
        [sys.executable, str(LABELLER), "--exec", "--label", "5", *program],
        env=env,
        capture_output=True,
        timeout=30,
    )
    assert p.returncode == 3
    assert sorted(log.read_text().splitlines()) == ["[5] err", "[5] out"]


@pytest.mark.parametrize("target", ["file", "pipe"])
def test_a_file_on_stdout_is_written_directly_and_a_pipe_means_the_named_log(tmp_path, target):
    named = tmp_path / "named.log"
    direct = tmp_path / "direct.log"
    with open(direct, "ab") as fh:
        out = fh if target == "file" else subprocess.PIPE
        p = run_rank(tmp_path, "0", "print('x')", log=named, stdout=out)
        piped, _ = p.communicate(timeout=30)
    named_text = named.read_text() if named.exists() else ""
    assert (direct.read_text(), named_text) == (("[0] x\n", "") if target == "file" else ("", "[0] x\n"))
    assert not piped
