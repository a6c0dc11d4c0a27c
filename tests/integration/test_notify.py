"""Issue 36 on the real clusters: a run's end told once, from the cluster (`rv run --notify`).

A webhook receiver (a tiny http.server on 127.0.0.1, in the test: the compute nodes are this machine)
counts what the jobs post; Slurm's own mail is counted by the loopback cluster's MailProg, which
records each mail in <state>/log/mail.log (scripts/testcluster). Both layouts, as the cluster user.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import STATES
from projects import git_project, wait_for

# Follows the stop protocol without waiting for a signal: each segment does one step, saves it and
# writes PREEMPTED (a clean stop with progress: rv continues the run) until step 3, then finishes.
CHAIN = """\
import os
ckpt = os.environ["RV_CHECKPOINT_DIR"]
path = os.path.join(ckpt, "step")
step = int(open(path).read()) + 1 if os.path.exists(path) else 1
open(path, "w").write(str(step))
print("segment", os.environ["RV_SEGMENT"], "did step", step, flush=True)
if step < 3:
    open(os.path.join(ckpt, "PREEMPTED"), "w").write(str(step))
"""
CRASH = """\
import sys
for i in range(30):
    print("noise", i, file=sys.stderr)
print("ValueError: the last words of a crash", file=sys.stderr, flush=True)
sys.exit(3)
"""


class Receiver:
    """Webhooks on 127.0.0.1: ``/ok/...`` answers 200, ``/fail/...`` 500; every POST is kept."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.posts.append((self.path, json.loads(body)))
                self.send_response(500 if self.path.startswith("/fail/") else 200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, kind: str) -> str:
        return f"http://127.0.0.1:{self.server.server_port}/{kind}/{uuid.uuid4().hex}"

    def to(self, url: str) -> list[dict]:
        path = url.split(str(self.server.server_port), 1)[1]
        return [body for p, body in self.posts if p == path]


class Silent:
    """A webhook on 127.0.0.1 that takes the request and never answers: the time of each one it took."""

    def __init__(self) -> None:
        self.took: list[tuple[str, float]] = []
        self.release = threading.Event()
        silent = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                silent.took.append((self.path, time.monotonic()))
                silent.release.wait(120)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


def run_dir_of(remote_root: str, name: str) -> Path:
    for p in (Path(remote_root) / "runs").iterdir():
        if json.loads((p / "run.json").read_text())["name"] == name:
            return p
    raise AssertionError(f"no run {name} under {remote_root}")


def submitted_name(stderr: str) -> str:
    m = re.search(r"submitted run (\S+): job", stderr)
    assert m, stderr[-2000:]
    return m.group(1)


def test_a_chain_of_three_segments_posts_once_and_a_failing_hook_never_fails_it(layout, receiver, tmp_path):
    good, broken = receiver.url("ok"), receiver.url("fail")
    assert layout.run_rv("env", "set", f"RUN_HOOK={good}").returncode == 0
    assert layout.run_rv("env", "set", f"BROKEN_HOOK={broken}").returncode == 0
    proj = git_project(tmp_path / "p", {"chain.py": CHAIN})
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "--max-segments", "5", "--notify", "secret:RUN_HOOK",
        "--notify", "secret:BROKEN_HOOK", "-f", "--", "python3", "chain.py", cwd=proj, timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("did step") == 3, r.stdout
    name = submitted_name(r.stderr)
    # The job posts right after it wrote ENDED (which ends -f), and retries the broken hook 4 times.
    wait_for(lambda: len(receiver.to(broken)) >= 4, 60, "the broken hook's tries")
    time.sleep(3)  # anything more (a second message) would come now
    (message,) = receiver.to(good)
    facts = message["rv"]
    assert (facts["event"], facts["run"], facts["state"], facts["segments"], facts["exit_code"]) == (
        "end", name, "COMPLETED", 3, 0
    )  # fmt: skip
    assert message["text"] == message["content"] and f"rv logs {name}" in message["text"]
    assert len(receiver.to(broken)) == 4  # bounded: tried 4 times, then given up
    # The run finished all the same, and said why the broken hook got nothing, never its URL.
    rows = {row["name"]: row for row in json.loads(layout.run_rv("ps", "-a", "--json").stdout)}
    assert (rows[name]["state"], rows[name]["exit_code"]) == ("COMPLETED", 0)
    rdir = run_dir_of(layout.remote_root, name)
    logs = "".join(p.read_text(errors="replace") for p in (rdir / "logs").iterdir())
    assert "secret BROKEN_HOOK: not delivered after 4 tries (HTTP 500" in logs, logs[-3000:]
    assert "posted the run's end to secret RUN_HOOK (HTTP 200)" in logs
    assert not (rdir / "secrets.env").exists()
    # The URLs are in no file of the run (scripts, records, logs) and in no job's command line.
    for path in rdir.rglob("*"):
        if path.is_file():
            text = path.read_bytes()
            assert good.encode() not in text and broken.encode() not in text, path


def test_a_crash_posts_the_last_lines_of_its_stderr(layout, receiver, tmp_path):
    hook = receiver.url("ok")
    assert layout.run_rv("env", "set", f"CRASH_HOOK={hook}").returncode == 0
    proj = git_project(tmp_path / "p", {"crash.py": CRASH})
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "--notify", "secret:CRASH_HOOK", "-f", "--", "python3", "crash.py",
        cwd=proj, timeout=300,
    )  # fmt: skip
    assert r.returncode == 3, r.stderr[-3000:]
    (message,) = wait_for(lambda: receiver.to(hook), 60, "the crash's message")
    facts = message["rv"]
    assert (facts["state"], facts["exit_code"], facts["segments"]) == ("FAILED", 3, 1)
    assert facts["stderr_tail"][-1] == "ValueError: the last words of a crash"
    assert "ValueError: the last words of a crash" in message["text"]
    time.sleep(2)
    assert len(receiver.to(hook)) == 1


def mail_log(layout) -> Path:
    """Where the cluster's MailProg records each mail; fails when the cluster does not record them."""
    state = STATES[layout.name]
    config = subprocess.run(
        ["scontrol", "show", "config"], capture_output=True, text=True, env=scontrol_env(layout)
    ).stdout
    prog = re.search(r"^MailProg\s*=\s*(\S+)", config, re.M)
    assert prog and prog.group(1) == str(state / "mailprog"), (
        f"the {layout.name} cluster's MailProg is {prog.group(1) if prog else '?'}, not the recorder "
        "scripts/testcluster writes: `scripts/testcluster down && scripts/testcluster up` applies it"
    )
    return state / "log" / "mail.log"


def scontrol_env(layout) -> dict[str, str]:
    return dict(os.environ, SLURM_CONF=str(STATES[layout.name] / "slurm.conf"))


def test_mail_is_asked_of_slurm_once_per_run_by_the_job_that_ends_it(layout, tmp_path):
    address = f"rv-{uuid.uuid4().hex[:8]}@example.org"
    proj = git_project(tmp_path / "p", {"chain.py": CHAIN})
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "--max-segments", "5", "--notify", f"mail:{address}", "-f",
        "--", "python3", "chain.py", cwd=proj, timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    name = submitted_name(r.stderr)
    jobs = json.loads(layout.run_rv("ps", "-a", "--json").stdout)
    (row,) = [row for row in jobs if row["name"] == name]
    assert len(row["jobs"]) == 3
    last = row["jobs"][-1]
    if layout.name == "default":  # the bare layout forgets a job 10 s after its end (MinJobAge)
        # The job that ended the run carries the mail type and user; the segments before it, none.
        for job in row["jobs"]:
            shown = subprocess.run(
                ["scontrol", "-o", "show", "job", job],
                capture_output=True,
                text=True,
                env=scontrol_env(layout),
            ).stdout
            assert f"JobId={job} " in shown, shown
            # scontrol leaves MailUser and MailType out of a job that has no mail type.
            mail = re.search(r"MailUser=(\S*) MailType=(\S*)", shown)
            assert (mail.groups() if mail else None) == ((address, "END") if job == last else None), shown
    log = mail_log(layout)

    def mails() -> list[str]:
        return [line for line in log.read_text().splitlines() if address in line] if log.exists() else []

    (mail,) = wait_for(mails, 60, "Slurm's mail")
    # Slurm mailed the end of the last segment's job, and of no other job of the run.
    assert f"Job_id={last} " in mail and "Ended" in mail, mail
    time.sleep(3)
    assert mails() == [mail]


@pytest.mark.parametrize("layout", ["default"], indirect=True)  # no job: one layout says it all
def test_a_bad_target_is_refused_before_anything_is_sent_and_the_project_key_counts(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"a.py": "print(1)\n"})
    r = layout.run_rv("run", "-g", "0", "--notify", "secret:NO_SUCH_HOOK", "--", "python3", "a.py", cwd=proj)
    assert (
        r.returncode == 2
        and "there is no secret NO_SUCH_HOOK" in r.stderr
        and "rv env set NO_SUCH_HOOK" in r.stderr
    )
    assert not (Path(layout.remote_root) / "runs").exists()  # nothing reached the cluster
    assert layout.run_rv("env", "set", "TEAM_HOOK=https://hooks.example.org/x").returncode == 0
    (proj / ".rv.toml").write_text('notify = ["secret:TEAM_HOOK", "mail:me@example.org"]\n')
    dry = layout.run_rv("run", "-g", "0", "--dry-run", "--", "python3", "a.py", cwd=proj)
    assert dry.returncode == 0, dry.stderr
    assert "rv_notify_mail=me@example.org rv_notify_hooks=TEAM_HOOK" in dry.stdout
    assert "hooks.example.org" not in dry.stdout + dry.stderr
    assert "--notify secret:TEAM_HOOK mail:me@example.org (.rv.toml)" in dry.stderr
    plain = layout.run_rv(
        "run", "-g", "0", "--notify", "none", "--dry-run", "--", "python3", "a.py", cwd=proj
    )
    assert plain.returncode == 0 and "rv_notify" not in plain.stdout


def test_a_run_that_waited_in_the_queue_says_when_it_starts_and_when_it_ends(layout, receiver, tmp_path):
    hook = receiver.url("ok")
    assert layout.run_rv("env", "set", f"START_HOOK={hook}").returncode == 0
    proj = git_project(tmp_path / "p", {"a.py": "print('ran')\n"})
    # Held in the queue for 70 s by its begin time: a start worth telling (a minute or more of waiting).
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "100M", "--notify", "secret:START_HOOK", "--sbatch=--begin=now+70", "--",
        "python3", "a.py", cwd=proj,
    )  # fmt: skip
    name = submitted_name(r.stderr)
    waited = layout.run_rv("wait", name, timeout=400)
    assert waited.returncode == 0, waited.stderr[-2000:]
    messages = wait_for(
        lambda: receiver.to(hook) if len(receiver.to(hook)) >= 2 else None, 60, "two messages"
    )
    assert [m["rv"]["event"] for m in messages] == ["started", "end"], messages
    assert messages[0]["rv"]["waited_seconds"] >= 60 and "in the queue" in messages[0]["text"]
    assert messages[1]["rv"]["state"] == "COMPLETED"


# Its last words on stderr without a newline, then a failure: srun's own "srun: error: ... Exited with
# exit code 4" follows in the same log, and must start a line of its own (issue 41, item 9).
BOOM = "import sys\nsys.stderr.write('boom')\nsys.stderr.flush()\nsys.exit(4)\n"


def test_a_last_stderr_line_without_its_newline_is_never_glued_to_sruns_own_line(layout, receiver, tmp_path):
    hook = receiver.url("ok")
    assert layout.run_rv("env", "set", f"BOOM_HOOK={hook}").returncode == 0
    proj = git_project(tmp_path / "p", {"boom.py": BOOM})
    names = [f"boom{i}" for i in range(4)]  # srun relays in chunks: gluing was 2 runs of 3
    for name in names:
        r = layout.run_rv(
            "run", "-g", "0", "--mem", "100M", "--name", name, "--notify", "secret:BOOM_HOOK", "--",
            "python3", "boom.py", cwd=proj,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
    waited = layout.run_rv("wait", *names, timeout=400)
    assert waited.returncode == 4, waited.stderr[-2000:]
    for name in names:
        err = layout.run_rv("logs", name, "--err")
        assert err.returncode == 0, err.stderr
        lines = err.stdout.splitlines()
        assert "boom" in lines, err.stdout
        assert any(line.startswith("srun: error:") and "exit code 4" in line for line in lines), err.stdout
        assert "boomsrun" not in err.stdout, err.stdout
    messages = wait_for(lambda: receiver.to(hook) if len(receiver.to(hook)) >= 4 else None, 60, "4 messages")
    for message in messages:
        tail = message["rv"]["stderr_tail"]
        assert message["rv"]["exit_code"] == 4 and "boom" in tail, tail
        assert not any("boomsrun" in line for line in tail), tail


def test_a_hook_that_never_answers_holds_the_jobs_end_no_longer_than_the_deadline_and_no_log_has_its_url(
    layout, tmp_path
):
    silent = Silent()
    token = uuid.uuid4().hex
    hook = f"http://127.0.0.1:{silent.server.server_port}/services/T0/B0/{token}"
    try:
        assert layout.run_rv("env", "set", f"SILENT_HOOK={hook}").returncode == 0
        proj = git_project(tmp_path / "p", {"a.py": "print('ran')\n"})
        r = layout.run_rv(
            "run", "-g", "0", "--mem", "100M", "--notify", "secret:SILENT_HOOK", "-f", "--",
            "python3", "a.py", cwd=proj, timeout=300,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        name = submitted_name(r.stderr)
        rdir = run_dir_of(layout.remote_root, name)

        def said() -> str | None:
            text = "".join(p.read_text(errors="replace") for p in (rdir / "logs").iterdir())
            return text if "rv: notify: secret SILENT_HOOK:" in text else None

        logs = wait_for(said, 90, "the notifier's word on the silent hook", step=0.5)
        given_up = time.monotonic()
    finally:
        silent.close()
    # The secret was set and reached the job: the hook was asked, at the secret's own path.
    assert silent.took and silent.took[0][0] == f"/services/T0/B0/{token}", silent.took
    # Given up within the notifier's deadline (15 s) of the first try, not 4 tries of 8 s and 7 s of waits.
    assert given_up - silent.took[0][1] < 22, given_up - silent.took[0][1]
    assert "not delivered" in logs
    # No part of the URL in any file of the run: its token, its path.
    for path in rdir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert token.encode() not in data and b"/services/T0/B0" not in data, path


@pytest.mark.parametrize("layout", ["default"], indirect=True)  # refused before any job: one layout
def test_a_secret_that_is_not_one_url_is_refused_when_notify_is_typed_without_echoing_it(layout, tmp_path):
    token = uuid.uuid4().hex
    value = f"https://hooks.example.org/services/T0/B0/{token} # the team's channel"
    assert layout.run_rv("env", "set", f"COPIED_HOOK={value}").returncode == 0
    assert "COPIED_HOOK" in layout.run_rv("env", "list").stdout  # the secret is there, as typed
    proj = git_project(tmp_path / "p", {"a.py": "print(1)\n"})
    r = layout.run_rv("run", "-g", "0", "--notify", "secret:COPIED_HOOK", "--", "python3", "a.py", cwd=proj)
    assert r.returncode == 2, r.stderr
    assert "secret COPIED_HOOK does not hold one http(s) URL" in r.stderr
    assert "rv env set COPIED_HOOK" in r.stderr
    assert token not in r.stdout + r.stderr and "team" not in r.stdout + r.stderr
    assert not (Path(layout.remote_root) / "runs").exists()  # nothing reached the cluster
