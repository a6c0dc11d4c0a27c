"""--notify: the targets checked before anything is sent, the notifier's messages and retries, the desktop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from urllib import error as urlerror

import pytest

from rv.agent import notify as notifier
from rv.agent.segment import END_REASONS
from rv.errors import UsageError
from rv.notify import Notify, desktop_notify, end_words, parse_targets

# --- the targets ---------------------------------------------------------------------------------

HOOKS = {"HOOK": "https://hooks.example.org/services/T0/B0/TOKEN"}


def test_targets_are_checked_and_kept_in_order():
    told = parse_targets(["mail:me@example.org", "secret:HOOK", "desktop", "secret:HOOK"], HOOKS)
    assert told == Notify(("mail:me@example.org", "secret:HOOK", "desktop"))
    assert (told.mail, told.hooks, told.desktop) == (("me@example.org",), ("HOOK",), True)
    # none drops what came before (a profile's default), and what follows it stays.
    assert parse_targets(["mail:a@b.org", "none", "desktop"], {}).targets == ("desktop",)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("slack", "expected mail:ADDRESS"),
        ("mail:", "is not a mail address"),
        ("mail:a@b.org,c@d.org", "is not a mail address"),
        ("mail:me at example.org", "is not a mail address"),
        ("secret:NOT-A-NAME", "is not a secret name"),
        ("secret:MISSING", "there is no secret MISSING for this profile"),
        ("https://hooks.slack.com/x", "expected mail:ADDRESS"),
    ],
)
def test_a_bad_target_is_refused_with_what_to_type(value, words):
    with pytest.raises(UsageError) as info:
        parse_targets([value], HOOKS)
    assert words in info.value.message
    assert info.value.hint


def test_a_missing_secret_says_how_to_set_it():
    with pytest.raises(UsageError) as info:
        parse_targets(["secret:SLACK"], {})
    assert "rv env set SLACK" in (info.value.hint or "")


# Values that are not one http(s) URL: what `rv env set` took from a copy with a comment or a line
# break, another scheme, no host. The laptop refuses them when --notify is typed; the job's notifier
# (which runs alone on the node) posts to none of them: the two keep the same rules.
NOT_URLS = [
    "https://hooks.slack.com/services/T0/B0/TOKEN # the team's channel",
    "https://hooks.slack.com/services/T0/B0/TOKEN\n",
    "https://hooks.slack.com/services/T0/B0/TOKEN\t",
    " https://hooks.slack.com/services/T0/B0/TOKEN",
    "https://hooks.slack.com/services/T0/B0/TOKÉN",
    "ftp://hooks.example.org/TOKEN",
    "hooks.slack.com/services/T0/B0/TOKEN",
    "https:///services/T0/B0/TOKEN",
    "https://hooks.example.org:port/TOKEN",
    "http://[::1/TOKEN",
]
URLS = [
    "https://hooks.slack.com/services/T0/B0/TOKEN",
    "http://127.0.0.1:8080/ok/x?sig=a#f",
    "https://ntfy.sh/topic",
]


@pytest.mark.parametrize("value", NOT_URLS)
def test_a_secret_that_is_not_one_url_is_refused_without_quoting_it(value):
    with pytest.raises(UsageError) as info:
        parse_targets(["secret:HOOK"], {"HOOK": value})
    said = info.value.message + (info.value.hint or "")
    assert "secret HOOK does not hold one http(s) URL" in said and "rv env set HOOK" in said
    assert "TOKEN" not in said and "hooks." not in said and "comment" not in info.value.message


def test_the_laptop_and_the_notifier_keep_the_same_url_rules():
    from rv.notify import webhook_problem

    for value in NOT_URLS + URLS:
        assert webhook_problem(value) == notifier.url_problem(value), value
    assert [webhook_problem(v) for v in URLS] == [None] * len(URLS)
    assert parse_targets(["secret:HOOK"], {"HOOK": URLS[1]}).hooks == ("HOOK",)


# --- the notifier's messages ---------------------------------------------------------------------


def test_the_notifiers_state_words_are_the_agents():
    # notify.py runs alone on the compute node: its copy of the table must stay the agent's.
    assert notifier.END_REASONS == END_REASONS


def make_run(tmp_path: Path, reason: str, code: int, segments: int = 1) -> Path:
    run = tmp_path / "runs" / "r1"
    (run / "seg").mkdir(parents=True)
    (run / "logs").mkdir()
    (run / "run.json").write_text(json.dumps({"name": "train-1", "run_id": "r1", "created": 1000.0}))
    for k in range(1, segments + 1):
        record = {"segment": k, "job_id": str(100 + k), "start": 1000.0 + 100 * k, "end": 1060.0 + 100 * k}
        (run / "seg" / f"{k}.json").write_text(json.dumps(record))
    (run / "ENDED").write_text(
        json.dumps({"reason": reason, "exit_code": code, "segment": segments, "end": 2000})
    )
    return run


def test_the_end_message_says_run_state_segments_time_and_what_to_type(tmp_path):
    run = make_run(tmp_path, "finished", 0, segments=3)
    title, text, facts = notifier.end_message(str(run), "103")
    assert title == "rv: run train-1 COMPLETED"
    assert "run train-1: COMPLETED (finished, exit code 0)" in text
    assert "3 segments, ran 3m00s, 16m40s since it was submitted" in text
    assert "rv logs train-1 --err" in text and "rv why train-1" in text
    assert facts["segments"] == 3 and facts["state"] == "COMPLETED" and "stderr_tail" not in facts


def test_a_crash_brings_the_last_lines_of_its_stderr_but_not_rvs_own(tmp_path):
    run = make_run(tmp_path, "crashed", 3)
    lines = [f"line {i}" for i in range(30)] + ["ValueError: boom", "rv: run train-1 ended after segment 1"]
    # What srun and slurmstepd write after the program (seen on the bare layout) is not the program's.
    lines += [
        "srun: error: gpu-01: task 0: Exited with exit code 3",
        "slurmstepd-gpu-01: error: *** STEP 4000123.0 ON gpu-01 CANCELLED AT 2026-11-27T21:00:00 ***",
        "slurmstepd: error: Terminating StepId=4000123.0",
    ]
    (run / "logs" / "101.err").write_text("\n".join(lines) + "\n")
    (run / "logs" / "1010.err").write_text("another job's log\n")
    _, text, facts = notifier.end_message(str(run), "101")
    assert (
        facts["stderr_tail"][-1] == "ValueError: boom" and len(facts["stderr_tail"]) == notifier.STDERR_LINES
    )
    assert "rv: run" not in "\n".join(facts["stderr_tail"]) and "another job" not in text
    assert not [ln for ln in facts["stderr_tail"] if ln.startswith(("srun", "slurmstepd"))]
    assert "last lines of stderr (job 101):\n    line 16" in text


def test_no_message_before_the_end_and_none_for_a_start_without_a_wait(tmp_path):
    run = make_run(tmp_path, "finished", 0)
    (run / "ENDED").unlink()
    assert notifier.end_message(str(run), "101") is None
    assert notifier.started_message(str(run), "101", now=1000.0 + notifier.PENDING_WORTH_SAYING - 1) is None
    title, text, facts = notifier.started_message(str(run), "101", now=1000.0 + 600)
    assert title == "rv: run train-1 started" and "after 10m00s in the queue: job 101" in text
    assert facts["event"] == "started"


def test_one_body_for_slack_discord_and_ntfy():
    url, body = notifier.body_for("https://hooks.slack.com/services/T/B/x", "t", "x" * 2500, {"event": "end"})
    assert url == "https://hooks.slack.com/services/T/B/x"
    assert body["text"] == "x" * 2500 and len(body["content"]) == notifier.DISCORD_LIMIT
    assert body["title"] == "t" and body["rv"] == {"event": "end"} and "topic" not in body
    url, body = notifier.body_for("https://ntfy.sh/my-runs", "t", "m", {})
    assert (url, body["topic"], body["message"]) == ("https://ntfy.sh/", "my-runs", "m")


# --- posting: retried, bounded, never failing, never showing the URL --------------------------------


class FakeResponse:
    def __init__(self, status: int) -> None:
        self.status = status

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


URL = "https://hooks.example.org/services/SECRET-TOKEN?sig=abc123"


def opener_of(outcomes, seen):
    def opener(req, timeout):
        seen.append((req.full_url, json.loads(req.data), timeout))
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return FakeResponse(outcome)

    return opener


def test_a_failing_hook_is_tried_a_bounded_number_of_times_with_growing_waits():
    seen, waits, said = [], [], []
    outcomes = [urlerror.URLError(f"cannot reach {URL}")] * notifier.TRIES
    ok = notifier.deliver(
        "HOOK", URL, "t", "m", {"event": "end"}, opener_of(outcomes, seen), waits.append, said.append
    )
    assert not ok and len(seen) == notifier.TRIES and waits == [1.0, 2.0, 4.0]
    assert said == [f"rv: notify: secret HOOK: not delivered after {notifier.TRIES} tries (URLError)"]
    assert "SECRET-TOKEN" not in "".join(said)


@pytest.mark.parametrize(
    "exc",
    [
        # What http.client raised for a URL with a trailing space: its text quotes the path, token included.
        __import__("http.client").client.InvalidURL(
            "URL can't contain control characters. '/services/T0/B0/SECRET-TOKEN ' (found at least ' ')"
        ),
        urlerror.URLError(ConnectionRefusedError(111, f"refused by {URL}")),
        ValueError(f"unknown url type: {URL}"),
        urlerror.HTTPError(URL, 503, f"busy: {URL}", {}, None),  # type: ignore[arg-type]
    ],
)
def test_no_part_of_the_url_reaches_what_the_notifier_says(exc):
    said: list[str] = []
    opener = opener_of([exc] * notifier.TRIES, [])
    notifier.deliver("HOOK", URL, "t", "m", {}, opener, lambda s: None, said.append)
    (line,) = said
    assert line.startswith("rv: notify: secret HOOK: not delivered after"), line
    for part in ("SECRET-TOKEN", "services", "hooks.example", "sig=", "abc123"):
        assert part not in line, line
    assert ("ECONNREFUSED" in line) == isinstance(getattr(exc, "reason", None), ConnectionRefusedError)


def test_a_value_that_is_not_one_url_is_never_posted_and_never_quoted():
    seen: list = []
    said: list[str] = []
    bad = "https://hooks.example.org/services/T0/B0/SECRET-TOKEN # team channel"
    opener = opener_of([200], seen)
    assert not notifier.deliver("HOOK", bad, "t", "m", {}, opener, lambda s: None, said.append)
    assert seen == [] and len(said) == 1 and "does not hold one http(s) URL" in said[0]
    assert "SECRET-TOKEN" not in said[0] and "team" not in said[0]


def test_a_receiver_that_accepts_and_never_answers_holds_the_notifier_no_longer_than_its_deadline():
    import socket
    import time

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # connections are accepted by the kernel, and never answered
    port = listener.getsockname()[1]
    said: list[str] = []
    try:
        started = time.monotonic()
        late = notifier.deliver_all(
            [("HANG", f"http://127.0.0.1:{port}/services/SECRET-TOKEN"), ("NOT_URL", "https://x.org/a b")],
            "t", "m", {"event": "end"}, deadline_s=2.0, write=said.append,
        )  # fmt: skip
        took = time.monotonic() - started
    finally:
        listener.close()
    assert took < 3.0, took
    assert late == ["HANG"] and "rv: notify: secret HANG: no answer within 2 s: not delivered" in said
    assert any("secret NOT_URL does not hold one http(s) URL" in line for line in said)
    assert "SECRET-TOKEN" not in "".join(said)


def test_a_refusal_is_not_retried_and_a_busy_receiver_is():
    seen, waits, said = [], [], []
    refused = urlerror.HTTPError(URL, 404, "Not Found", {}, None)  # type: ignore[arg-type]
    assert not notifier.deliver("H", URL, "t", "m", {}, opener_of([refused], seen), waits.append, said.append)
    assert len(seen) == 1 and waits == [] and "HTTP 404" in said[0] and "SECRET" not in said[0]
    busy = urlerror.HTTPError(URL, 429, "Too Many", {}, None)  # type: ignore[arg-type]
    seen, said = [], []
    assert notifier.deliver(
        "H", URL, "t", "m", {"event": "end"}, opener_of([busy, 200], seen), waits.append, said.append
    )
    assert len(seen) == 2 and said == ["rv: notify: posted the run's end to secret H (HTTP 200)"]


def test_the_notifier_reads_the_url_from_the_environment_and_always_exits_0(tmp_path):
    run = make_run(tmp_path, "finished", 0)
    # An unreachable URL, a missing secret: the notifier says so and exits 0 (the job's end goes on).
    done = subprocess.run(
        [sys.executable, notifier.__file__, "end", str(run), "101", "MISSING"],
        capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0
    assert "secret MISSING is not in the job's environment" in done.stderr
    bad = subprocess.run(
        [sys.executable, notifier.__file__, "bogus"], capture_output=True, text=True, timeout=30
    )
    assert bad.returncode == 0 and "usage" in bad.stderr


# --- the desktop ---------------------------------------------------------------------------------


def test_desktop_uses_notify_send_or_osascript_else_says_none():
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0)

    assert (
        desktop_notify("t", 'b "q"', platform="linux", which=lambda n: "/usr/bin/" + n, run=run)
        == "notify-send"
    )
    assert calls[-1] == ["notify-send", "--app-name=rv", "t", 'b "q"']
    assert (
        desktop_notify("t", 'b "q"', platform="darwin", which=lambda n: "/usr/bin/" + n, run=run)
        == "osascript"
    )
    assert calls[-1][2] == 'display notification "b \\"q\\"" with title "t"'
    assert desktop_notify("t", "b", platform="linux", which=lambda n: None, run=run) is None
    failing = lambda argv, **kw: subprocess.CompletedProcess(argv, 1)  # noqa: E731  (no session bus)
    assert desktop_notify("t", "b", platform="linux", which=lambda n: "/x", run=failing) is None


def test_end_words():
    assert end_words("r", {"reason": "crashed", "exit_code": 3, "segment": 2}, "FAILED") == (
        "rv: r FAILED",
        "crashed (exit code 3, 2 segments)",
    )


# --- the profile's key -------------------------------------------------------------------------------


def test_the_profile_key_notify_is_read_kept_and_checked(tmp_path):
    from rv.config import parse_config, render_config
    from rv.errors import ConfigError

    path = tmp_path / "config.toml"
    text = '[profiles.lab]\nhost = "h"\nnotify = ["mail:me@example.org", "desktop"]\n'
    cfg = parse_config(text, path)
    assert cfg.profile("lab").notify == ("mail:me@example.org", "desktop")
    assert parse_config(render_config(cfg), path).profile("lab").notify == ("mail:me@example.org", "desktop")
    with pytest.raises(ConfigError, match="notify must be a list of strings"):
        parse_config('[profiles.lab]\nhost = "h"\nnotify = [1]\n', path)
    with pytest.raises(ConfigError, match="notify"):
        parse_config('[profiles.lab]\nhost = "h"\nnotify = "desktop"\n', path)
