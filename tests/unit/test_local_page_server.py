"""`rv ui` without a cluster: who the server serves, what it sends, how log frames become lines.

The one seam: each profile's connection opener (rv.ui.data.Cluster), here one that refuses as an
unreachable cluster would. The page itself is tested in a real browser
(tests/integration/test_local_page_in_a_browser.py).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from werkzeug.test import Client

from rv.config import Config, Profile
from rv.errors import ConnectError
from rv.job.records import RunStore
from rv.ui import data
from rv.ui.server import COOKIE, App, static_files

PORT = 8123
BASE = f"http://127.0.0.1:{PORT}"
TOKEN = "t0ken-for-tests"


def unreachable(profile: Profile):
    raise ConnectError(f"cannot reach {profile.host}", hint="check the VPN")


@pytest.fixture
def app(tmp_path: Path) -> App:
    profiles = {
        name: Profile(name=name, host=f"{name}.example", user="me", identity_file="/keys/secret-key",
                      remote_root=f"/scratch/me/{name}")
        for name in ("alpha", "beta")
    }  # fmt: skip
    config = Config(path=tmp_path / "rv.toml", default="beta", profiles=profiles)
    served = App(data.clusters_of(config, unreachable), RunStore(tmp_path / "runs.json"), TOKEN)
    served.port = PORT
    return served


def get(app: App, path: str, **headers: str):
    return Client(app).get(path, base_url=BASE, headers=headers)


def test_a_request_without_the_token_is_refused_with_it_served(app):
    refused = get(app, "/api/profiles")
    assert refused.status_code == 403 and "no valid token" in refused.json["error"]
    assert get(app, "/api/profiles?token=wrong").status_code == 403
    assert get(app, "/").status_code == 403  # the page too, not only its data
    served = get(app, "/api/profiles", **{"X-RV-Token": TOKEN})
    assert served.status_code == 200
    # The default profile first; where each connects, never its keys.
    assert [p["name"] for p in served.json["profiles"]] == ["beta", "alpha"]
    assert "secret-key" not in served.get_data(as_text=True)


def test_the_urls_token_becomes_a_cookie_the_page_then_carries(app):
    client = Client(app)
    first = client.get(f"/?token={TOKEN}", base_url=BASE)
    assert first.status_code == 200 and b"/static/app.js" in first.data
    cookie = first.headers["Set-Cookie"]
    assert cookie.startswith(f"{COOKIE}={TOKEN};") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert client.get("/api/profiles", base_url=BASE).status_code == 200  # the cookie alone


def test_another_origin_another_host_and_an_action_without_origin_are_refused(app):
    token = {"X-RV-Token": TOKEN}
    other = get(app, "/api/profiles", Origin="http://evil.example", **token)
    assert other.status_code == 403 and "another origin" in other.json["error"]
    cross = get(app, "/api/profiles", **{"Sec-Fetch-Site": "cross-site"}, **token)
    assert cross.status_code == 403
    rebound = Client(app).get("/api/profiles", base_url=f"http://rebound.example:{PORT}", headers=token)
    assert rebound.status_code == 403 and "host" in rebound.json["error"]
    body = json.dumps({"profile": "alpha", "run_id": "r1"})
    no_origin = Client(app).post("/api/stop", base_url=BASE, headers=token, data=body)
    assert no_origin.status_code == 403 and "Origin" in no_origin.json["error"]
    # The page's own origin (either spelling of loopback) is served.
    assert get(app, "/api/profiles", Origin=BASE, **token).status_code == 200
    assert get(app, "/api/profiles", Origin=f"http://localhost:{PORT}", **token).status_code == 200


def test_a_cluster_that_fails_says_why_and_what_next_bad_input_is_a_400(app):
    token = {"X-RV-Token": TOKEN}
    failed = get(app, "/api/runs?profile=alpha", **token)
    assert failed.status_code == 502
    assert failed.json == {"error": "cannot reach alpha.example", "hint": "check the VPN"}
    unknown = get(app, "/api/runs?profile=gamma", **token)
    assert unknown.status_code == 400 and "no profile 'gamma'" in unknown.json["error"]
    missing = get(app, "/api/run?profile=alpha", **token)
    assert missing.status_code == 400 and missing.json["error"] == "missing ?id="
    stream = get(app, "/api/logs?profile=alpha&id=r1&stream=both&from=1", **token)
    assert stream.status_code == 400 and "out or err" in stream.json["error"]


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/api/logs?profile=alpha&id=r1&cursor=%7Bnot", None, "cursor: not JSON"),
        ("/api/logs?profile=alpha&id=r1&cursor=5", None, "cursor: a number; expected"),
        ("/api/logs?profile=alpha&id=r1&cursor=%7B%22segment%22%3Atrue%7D", None, "segment is true/false"),
        (
            "/api/logs?profile=alpha&id=r1&cursor=%7B%22offsets%22%3A%7B%22a%22%3A-1%7D%7D",
            None,
            "offsets must",
        ),
        ("/api/logs?profile=alpha&id=r1&from=2x", None, "from: a segment number"),
        ("/api/stop", {"profile": "alpha", "run_id": 5}, "run_id: a non-empty string (not a number)"),
        ("/api/stop", {"profile": "alpha", "run_id": ""}, "run_id: a non-empty string (not an empty one)"),
        ("/api/stop", {"profile": ["x"], "run_id": "r1"}, "profile: a profile's name, a string (not a list)"),
        ("/api/retry", {"profile": "alpha", "sweep": ["s"]}, "sweep: a non-empty string (not a list)"),
        ("/api/retry", {"profile": "alpha"}, "sweep: the name of the sweep to retry"),
        ("/api/retry", "[" * 5000, "the body is not JSON"),
    ],
)
def test_a_malformed_request_is_a_400_with_a_message_before_any_cluster_is_asked(app, path, body, words):
    token = {"X-RV-Token": TOKEN, "Origin": BASE}
    if body is None:
        answer = get(app, path, **token)
    else:
        data = body if isinstance(body, str) else json.dumps(body)
        answer = Client(app).post(path, base_url=BASE, headers=token, data=data)
    # A cluster asked would answer 502 (the fixture's clusters are unreachable): 400 means refused first.
    assert answer.status_code == 400, answer.get_data(as_text=True)
    assert words in answer.json["error"], answer.json


def test_static_files_only_what_the_package_holds_with_a_strict_policy(app):
    token = {"X-RV-Token": TOKEN}
    script = get(app, "/static/app.js", **token)
    assert script.status_code == 200 and script.mimetype in ("text/javascript", "application/javascript")
    policy = script.headers["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert script.headers["Referrer-Policy"] == "no-referrer"
    assert get(app, "/static/missing.js", **token).status_code == 404
    assert get(app, "/static/..%2Fserver.py", **token).status_code == 404


def test_the_page_loads_nothing_from_the_network():
    files = static_files()
    wanted = {"index.html", "app.js", "app.css", "uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE"}
    assert wanted <= set(files)
    page = files["index.html"].decode()
    loaded = re.findall(r'<script src="([^"]+)"|<link rel="stylesheet" href="([^"]+)"', page)
    assert len(loaded) == 4
    for ref in ("".join(pair) for pair in loaded):
        assert ref.startswith("/static/") and ref.removeprefix("/static/") in files, ref
    for name in ("index.html", "app.js", "app.css"):
        assert not re.search(r"https?://", files[name].decode()), name


def frame(kind: str, **head):
    return ({"t": kind, **head}, b"")


def test_log_frames_become_complete_lines_and_a_cursor_after_the_last_newline():
    frames = [
        ({"t": "segment", "segment": 2, "job_id": "12", "record": {"start": 1}}, b""),
        ({"t": "data", "f": "/r/logs/12.out", "o": 100, "s": "out", "seg": 2}, b"one\ntw"),
        ({"t": "data", "f": "/r/logs/12.out", "o": 106, "s": "out", "seg": 2}, b"o\nthr"),
        ({"t": "segment-end", "segment": 2, "job_id": "12", "record": {"start": 1, "end": 5}}, b""),
        ({"t": "segment", "segment": 3, "job_id": "13", "record": None}, b""),
        ({"t": "data", "f": "/r/logs/13.out", "o": 0, "s": "out", "seg": 3}, b"next \xe2\x9c\x93\n"),
        ({"t": "end", "ended": None, "segment": 3}, b""),
    ]
    got = data._log_answer(frames, {"/r/logs/12.out": 100, "/r/logs/old.out": 7}, 2)
    assert [s["segment"] for s in got["segments"]] == [2, 3]
    assert got["segments"][0]["files"] == {"12.out": {"text": "one\ntwo\n", "partial": "thr"}}
    assert got["segments"][0]["record"] == {"start": 1, "end": 5}
    assert got["segments"][1]["files"] == {"13.out": {"text": "next ✓\n", "partial": ""}}
    # "thr" is read again next time, whole once its line ends; files not read this time keep theirs.
    assert got["cursor"] == {
        "segment": 3, "offsets": {"/r/logs/12.out": 108, "/r/logs/13.out": 9, "/r/logs/old.out": 7}
    }  # fmt: skip
    assert got["ended"] is None


def test_a_line_that_never_ends_is_not_read_again_for_ever():
    endless = b"\r".join(b"progress %d" % i for i in range(20000))  # a bar redrawn, never a newline
    frames = [({"t": "data", "f": "/r/logs/1.err", "o": 0, "s": "err", "seg": 1}, endless)]
    got = data._log_answer(frames, {}, 1)
    assert got["cursor"]["offsets"] == {"/r/logs/1.err": len(endless)}
    assert got["segments"][0]["files"]["1.err"]["text"] == endless.decode()


def test_rv_ui_without_its_extra_says_how_to_get_it(monkeypatch):
    from rv.cli.main import cli

    monkeypatch.setitem(sys.modules, "werkzeug", None)  # import werkzeug now fails, as when not installed
    result = CliRunner().invoke(cli, ["ui", "--no-browser"])
    assert result.exit_code == 2, result.output
    assert "rv ui needs Werkzeug, which rv installs with its `ui` extra" in result.output
    assert " -m pip install " in result.output and "'rv[ui]'" not in result.output  # rv is on no index


EDITABLE = {"url": "file:///src/my%20rv", "dir_info": {"editable": True}}
FOLDER = {"url": "file:///src/rv", "dir_info": {}}
WHEEL = {"url": "file:///w/rv-0.1.0-py3-none-any.whl", "archive_info": {}}
INTO_RV = "/v/bin/python -m pip install 'werkzeug>=3.0'"


@pytest.mark.parametrize(
    ("prefix", "direct_url", "said"),
    [
        ("/v", EDITABLE, "/v/bin/python -m pip install -e '/src/my rv[ui]'"),  # pip install -e CLONE
        ("/v", FOLDER, INTO_RV),  # pip install CLONE: into rv's own Python
        ("/v", WHEEL, INTO_RV),  # a wheel
        ("/v", None, INTO_RV),  # pip does not say
        ("/h/.local/share/pipx/venvs/rv", None, "pipx inject rv 'werkzeug>=3.0'"),
        ("/h/.local/share/uv/tools/rv", FOLDER, "uv tool install --reinstall --with 'werkzeug>=3.0' /src/rv"),
    ],
)
def test_the_ui_extras_hint_is_what_works_for_how_rv_was_installed(prefix, direct_url, said):
    from rv.cli.ui import install_hint

    hint = install_hint(f"{prefix}/bin/python", prefix, direct_url)
    assert hint.startswith(said), hint
    assert "'rv[ui]'" not in hint  # rv is on no package index: that name is some other project's


def test_a_pending_runs_row_says_why_and_when_slurm_expects_it_to_start():
    from rv.agent.segment import segment_record
    from rv.job.records import parse_runs, run_views
    from rv.slurm.parse import parse_squeue

    def run(run_id: str, name: str, job: str, record):  # the agent's row for a one-segment run
        meta = {"name": name, "created": 100.0, "gpus": 2, "gpu_type": "a100", "max_segments": 3}
        return {"run_id": run_id, "meta": meta, "segments": [{"segment": 1, "job_id": job, "record": record}]}

    running = segment_record(1, "41", "running", "", None, start=90, nodes="gpu-07")
    runs = parse_runs([run("r1", "waits", "40", None), run("r2", "goes", "41", running)])
    queued = parse_squeue(
        "40|PENDING|Priority|0:00|1:00:00|1|(null)|gres/gpu:a100:2|gpu|2026-12-01T09:30:00|N/A|waits\n"
        "41|RUNNING|None|5:00|1:00:00|1|gpu-07|gres/gpu:a100:2|gpu|2026-11-30T08:00:00|N/A|goes\n"
    )
    views = {v.run_id: v for v in run_views(runs, queued, now=400.0)}
    by_run = {r.run_id: r for r in runs}
    by_job = {j.job_id: j for j in queued}
    waits = data._run_row("alpha", views["r1"], by_run, by_job)
    assert (waits["state"], waits["reason"], waits["expected_start"]) == (
        "PENDING",
        "Priority",
        "2026-12-01T09:30:00",
    )
    assert (waits["segments"], waits["gpus"], waits["gpu_type"], waits["node_list"]) == ("1/3", 2, "a100", [])
    goes = data._run_row("alpha", views["r2"], by_run, by_job)
    assert (goes["state"], goes["expected_start"], goes["node_list"], goes["elapsed"]) == (
        "RUNNING",
        None,
        ["gpu-07"],
        300,
    )
    assert goes["kind"] == "run" and goes["profile"] == "alpha"


class Closable:
    """A connection as the pool sees it: something to hand out and close."""

    def __init__(self, n: int) -> None:
        self.n, self.closed = n, False

    def close(self) -> None:
        self.closed = True


def test_a_pooled_connection_found_lost_is_replaced_once_never_for_what_must_not_run_twice():
    opened: list[Closable] = []

    def opener(profile: Profile):
        opened.append(Closable(len(opened)))
        return opened[-1]

    cluster = data.Cluster(Profile(name="alpha", host="a", remote_root="/r"), opener)
    with cluster.connection() as first:
        pass  # kept in the pool
    asked: list[int] = []

    def work(t: Closable) -> int:
        asked.append(t.n)
        if t is first:
            raise ConnectError("connection to a was lost")
        return t.n

    assert cluster.ask(work) == 1 and asked == [0, 1] and first.closed  # the lost one dropped, a fresh one
    assert cluster.ask(work) == 1 and asked == [0, 1, 1]  # the fresh one is the pool's now
    with cluster.connection() as t:
        assert t.n == 1
    lost = Closable(9)
    cluster._idle.append(lost)  # type: ignore[arg-type]
    with pytest.raises(ConnectError):
        cluster.ask(lambda t: (_ for _ in ()).throw(ConnectError("lost")), again=False)
    assert lost.closed
    cluster.close()
    assert all(c.closed for c in opened)
