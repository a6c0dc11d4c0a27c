"""Issue 24, on the real loopback cluster: what a new user hit (gc of everything that ended, what uv
writes under the remote root, credentials on this machine, secrets-looking files left out)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo, check=True, capture_output=True
    )


def project(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git(path, "init", "-q", "-b", "main")
    git(path, "add", ".")
    git(path, "commit", "-q", "-m", "init")
    return path


def wait_for(check, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {seconds} s waiting for {what}")


# --- rv gc --older-than 0 ----------------------------------------------------------------------------


def test_gc_older_than_zero_removes_every_ended_run_and_never_a_live_one(run_rv, tmp_path):
    proj = project(tmp_path / "p", {"job.py": "import sys, time\ntime.sleep(float(sys.argv[1]))\n"})
    for name in ("done1", "done2"):
        r = run_rv(
            "run", "-g", "0", "--mem", "200M", "--name", name, "-f", "--", "python3", "job.py", "0", cwd=proj
        )
        assert r.returncode == 0, r.stderr
    live = run_rv(
        "run", "-g", "0", "--mem", "200M", "--name", "alive", "--", "python3", "job.py", "300", cwd=proj
    )
    assert live.returncode == 0, live.stderr
    try:
        wait_for(lambda: "RUNNING" in run_rv("ps").stdout, 60, "the live run to start")
        # Both spellings of zero; the runs ended seconds ago (the default, 14d, keeps them).
        dry = run_rv("gc", "--older-than", "0s", "--dry-run", "--json")
        assert dry.returncode == 0, dry.stderr
        assert sorted(r["name"] for r in json.loads(dry.stdout)["runs_removed"]) == ["done1", "done2"]
        report = run_rv("gc", "--older-than", "0", "--json")
        assert report.returncode == 0, report.stderr
        data = json.loads(report.stdout)
        assert sorted(r["name"] for r in data["runs_removed"]) == ["done1", "done2"]
        assert {k["name"]: k["why"] for k in data["runs_kept"]}["alive"].startswith("live (job ")
        assert "RUNNING" in run_rv("ps").stdout  # the live run goes on
    finally:
        assert run_rv("stop", "alive").returncode == 0
    bad = run_rv("gc", "--older-than", "3")
    assert bad.returncode == 2 and bad.stderr.startswith("rv: error: --older-than '3' has no unit")
    assert "--time" not in bad.stderr


# --- what uv writes under the remote root ------------------------------------------------------------


def loose_paths(root: Path, allowed: int) -> list[str]:
    """Paths under ``root`` with permission bits beyond ``allowed`` (symlinks have none of their own;
    the root itself is the test fixture's)."""
    found = []
    for path in root.rglob("*"):
        st = path.lstat()
        if not path.is_symlink() and st.st_mode & 0o777 & ~allowed:
            found.append(f"{oct(st.st_mode & 0o777)} {path.relative_to(root)}")
    return found


def share_with_group(rv_env: dict[str, str]) -> None:
    """The test's profile with ``share_with_group = true`` (``rv init --share-with-group``)."""
    from dataclasses import replace

    from rv.config import load_config, save_config

    cfg = load_config(Path(rv_env["RV_CONFIG"]))
    profile = replace(cfg.profile(cfg.default), share_with_group=True)
    save_config(replace(cfg.with_profile(profile, make_default=True), path=Path(rv_env["RV_CONFIG"])))


@pytest.mark.parametrize("layout", ["bare"], indirect=True)
@pytest.mark.parametrize("allowed", [0o700, 0o750], ids=["private", "group"])
def test_everything_uv_writes_is_private_and_a_failed_build_leaves_no_lock(layout, tmp_path, allowed):
    root = Path(layout.remote_root)
    if allowed == 0o750:
        share_with_group(layout.rv_env)
    proj = project(tmp_path / "p", {"requirements.txt": "six==1.16.0\n", "main.py": "import six\n"})
    built = layout.run_rv("venv", "build", "--no-system-site-packages", cwd=proj)
    assert built.returncode == 0, built.stderr
    (key,) = [p.name for p in (root / "envs").iterdir() if not p.name.endswith(".lock")]
    # uv's own lock files were 0666 whatever the folder: created by uv, not by rv.
    loose = loose_paths(root, allowed)
    assert not loose, "\n".join(loose)
    for lock in (root / "cache" / "uv" / ".lock", root / "envs" / key / ".lock"):
        assert lock.exists(), lock
        assert lock.stat().st_mode & 0o777 == 0o666 & allowed, (lock, oct(lock.stat().st_mode))

    (proj / "requirements.txt").write_text("rv-no-such-package-anywhere==1.0\n")
    git(proj, "commit", "-qam", "a requirement nobody can meet")
    failed = layout.run_rv("venv", "build", "--no-system-site-packages", cwd=proj)
    assert failed.returncode == 2, failed.stdout + failed.stderr
    assert "rv-no-such-package-anywhere" in failed.stderr
    # The failed build's lock file is gone: the complete environment and its lock are all there is.
    left = sorted(p.name for p in (root / "envs").iterdir())
    assert left == [key, f"{key}.lock"], left
    loose = loose_paths(root, allowed)
    assert not loose, "\n".join(loose)


# --- no credential in a file rv writes ----------------------------------------------------------------

TOKEN = "ghp_rvTestToken0123456789"  # a made-up token the test looks for


def files_holding(folder: Path, needle: bytes) -> list[str]:
    """Every regular file under ``folder`` whose bytes hold ``needle``."""
    found = []
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink() and needle in path.read_bytes():
            found.append(str(path))
    return found


@pytest.mark.parametrize(
    ("url", "recorded"),
    [
        (f"https://bob:{TOKEN}@git.example.invalid/lab/p.git", "https://git.example.invalid/lab/p.git"),
        (f"https://{TOKEN}@github.invalid/x.git", "https://github.invalid/x.git"),  # the user part alone
    ],
)
def test_no_file_rv_writes_holds_the_remote_urls_token(run_rv, rv_env, remote_root, tmp_path, url, recorded):
    proj = project(tmp_path / "p", {"job.py": "print('ran')\n"})
    git(proj, "remote", "add", "origin", url)
    # A first submit (a full listing), then an edit and a resubmit (the cached listing's path), and
    # a snapshot of the edited tree.
    for text in ("print('ran')\n", "print('ran')  # edited\n"):
        (proj / "job.py").write_text(text)
        r = run_rv("run", "-g", "0", "--mem", "200M", "-f", "--", "python3", "job.py", cwd=proj)
        assert r.returncode == 0, r.stderr
        assert "ran" in r.stdout and TOKEN not in r.stdout + r.stderr
    snap = run_rv("sync", "snapshot", cwd=proj)
    assert snap.returncode == 0, snap.stderr
    home = Path(rv_env["HOME"])
    assert len(list(home.rglob("*"))) > 5, home  # rv wrote its config, state and cache there
    assert files_holding(home, TOKEN.encode()) == []
    assert files_holding(Path(rv_env["RV_RUNTIME_DIR"]), TOKEN.encode()) == []
    assert files_holding(Path(remote_root), TOKEN.encode()) == []
    # The URL itself is kept, without the token: the snapshot says where its code came from.
    metas = [json.loads(p.read_text()) for p in (Path(remote_root) / "snapshots").glob("*.json")]
    assert metas and {m.get("provenance", m).get("remote_url") for m in metas} == {recorded}, metas


# --- files that look like secrets ---------------------------------------------------------------------

SHOW = "import os\nprint('files:', sorted(f for f in os.listdir('.') if not f.startswith('.git')))\n"


def test_secret_looking_files_stay_on_this_machine_unless_named(run_rv, remote_root, tmp_path):
    proj = project(tmp_path / "p", {"show.py": SHOW})
    first = run_rv("run", "-g", "0", "--mem", "200M", "-f", "--", "python3", "show.py", cwd=proj)
    assert first.returncode == 0, first.stderr
    # Between two submits: an untracked .env and a key appear. The resubmit lists from the cache.
    (proj / ".env").write_text("WANDB_API_KEY=rv-test-secret-value\n")
    (proj / "deploy.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    (proj / "notes.txt").write_text("sent\n")
    second = run_rv("run", "-g", "0", "--mem", "200M", "-f", "--", "python3", "show.py", cwd=proj)
    assert second.returncode == 0, second.stderr
    assert "files: ['notes.txt', 'show.py']" in second.stdout
    assert "left out 2 untracked file(s) that look like secrets: .env, deploy.pem" in second.stderr
    assert "add the line `!.env` to the top .rvignore" in second.stderr
    assert files_holding(Path(remote_root), b"rv-test-secret-value") == []
    # Named in .rvignore: sent (and said no more).
    (proj / ".rvignore").write_text("!.env\n")
    third = run_rv("run", "-g", "0", "--mem", "200M", "-f", "--", "python3", "show.py", cwd=proj)
    assert third.returncode == 0, third.stderr
    assert "files: ['.env', '.rvignore', 'notes.txt', 'show.py']" in third.stdout
    assert "look like secrets: deploy.pem" in third.stderr


# --- rv logs --json, rv stop --json -------------------------------------------------------------------

TALK = """\
import sys, time
print('out line 1')
print('err line', file=sys.stderr)
print('out line 2')
time.sleep(float(sys.argv[1]))
"""


def test_logs_and_stop_speak_json(run_rv, tmp_path):
    proj = project(tmp_path / "p", {"talk.py": TALK})
    done = run_rv(
        "run", "-g", "0", "--mem", "200M", "--name", "talky", "-f", "--", "python3", "talk.py", "0", cwd=proj
    )
    assert done.returncode == 0, done.stderr
    out = run_rv("logs", "talky", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)  # stdout is the one document and nothing else
    assert (doc["run"], doc["stream"], doc["exit_code"]) == ("talky", "out", None)
    (segment,) = doc["segments"]
    assert segment["segment"] == 1 and segment["job_id"]
    # The log as `rv logs` shows it: the program's lines, and rv's own (the job's start and end).
    texts = [line["text"] for line in segment["lines"]]
    assert [t for t in texts if not t.startswith("rv: ")] == ["out line 1", "out line 2"], texts
    assert texts[0].startswith("rv: run talky, segment 1/10")
    assert {(line["node"], line["rank"]) for line in segment["lines"]} == {(None, None)}
    err = json.loads(run_rv("logs", "talky", "--err", "--json").stdout)
    assert [line["text"] for line in err["segments"][0]["lines"] if not line["text"].startswith("rv: ")] == [
        "err line"
    ]
    followed = json.loads(run_rv("logs", "talky", "-f", "--json").stdout)
    assert followed["ended"] is True and followed["exit_code"] == 0

    live = run_rv(
        "run", "-g", "0", "--mem", "200M", "--name", "sleepy", "--", "python3", "talk.py", "300", cwd=proj
    )
    assert live.returncode == 0, live.stderr
    job_id = live.stdout.strip()
    wait_for(lambda: "RUNNING" in run_rv("ps").stdout, 60, "the run to start")
    stopped = run_rv("stop", "sleepy", "--json")
    assert stopped.returncode == 0, stopped.stderr
    (row,) = json.loads(stopped.stdout)
    assert (row["name"], row["cancelled"], row["error"]) == ("sleepy", [job_id], None)
    assert row["secrets_removed"] in (True, False) and row["run_id"]
    nothing = run_rv("stop", "--all", "--yes", "--json")
    assert nothing.returncode == 0 and json.loads(nothing.stdout) == []


# --- the job id on stdout: for scripts, not on a terminal ---------------------------------------------


@pytest.mark.parametrize("front", ["python -m rv", "rv"])
def test_the_job_id_goes_to_stdout_for_a_script_and_not_to_a_terminal(run_rv, rv_env, tmp_path, front):
    import os
    import select
    import sys

    proj = project(tmp_path / "p", {"ok.py": "print('ok')\n"})
    piped = run_rv("run", "-g", "0", "--mem", "200M", "--", "python3", "ok.py", cwd=proj)
    assert piped.returncode == 0, piped.stderr
    assert re.fullmatch(r"\d+\n", piped.stdout), piped.stdout  # `job=$(rv run ...)` gets the id alone
    argv = (
        [sys.executable, "-m", "rv"] if front == "python -m rv" else [str(Path(sys.executable).parent / "rv")]
    )
    master, slave = os.openpty()
    proc = subprocess.Popen(
        [*argv, "run", "-g", "0", "--mem", "200M", "--", "python3", "ok.py"], cwd=proj, env=rv_env,
        stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    os.close(slave)
    _, err = proc.communicate(timeout=120)
    shown = b""
    while select.select([master], [], [], 0.2)[0]:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the terminal's other end is closed
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    assert proc.returncode == 0, err
    job = re.search(r"submitted run ok-\w+: job (\d+)", err)
    assert job, err  # the id is in the line on stderr
    assert job.group(1).encode() not in shown, shown  # and not alone on the terminal
