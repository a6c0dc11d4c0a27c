"""Issue 37 on the real clusters, in a real browser: `rv ui` over both loopback layouts at once.

`rv ui` is the installed program, started as a user starts it (one config holding the default and the
bare layout's profiles); the page is Debian's headless chromium driven through chromedriver
(tests/integration/browser.py). Each test saves a screenshot of every page it looks at in
tests/artifacts/ui/ (see browser.py). Everything is checked against what the cluster says through
the `rv` commands (`rv ps`, `rv sweep results`), never against the page alone.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from selenium.webdriver.support.ui import Select

from rv.config import load_config, save_config
from tests.integration.browser import chromium, screenshot, wait_until
from tests.integration.conftest import RV_PROGRAM, base_env, make_remote_dir, run_cli, stop_warm
from tests.integration.projects import git_project, wait_for

# A sweep's program: three steps of loss lr*10/step, each a line of $RV_METRICS; lr 0.3 crashes once.
SWEEPER = """\
import json, os, sys, time
lr = sys.argv[1]
mark = os.path.join(os.environ["RV_CHECKPOINT_DIR"], "crashed-once")
if lr == "0.3" and not os.path.exists(mark):
    open(mark, "w").close()
    sys.exit(3)
for step in (1, 2, 3):
    with open(os.environ["RV_METRICS"], "a") as fh:
        fh.write(json.dumps({"step": step, "loss": float(lr) * 10 / step}) + "\\n")
    time.sleep(0.5)
print("done", lr, flush=True)
"""

# Ticks twice a second for a minute (a line of stdout and a metric each), and says it got its secret
# without saying it; one line on stderr.
TICKER = """\
import hashlib, json, os, sys, time
print("ticker starting", file=sys.stderr, flush=True)
secret = os.environ.get("UI_SECRET", "")
print("secret length", len(secret), "sha", hashlib.sha256(secret.encode()).hexdigest()[:12], flush=True)
for i in range(1, 121):
    print(f"tick {i}", flush=True)
    with open(os.environ["RV_METRICS"], "a") as fh:
        fh.write(json.dumps({"step": i, "loss": 1 / i}) + "\\n")
    time.sleep(0.5)
"""
SECRET = "s3cr3t-ui-value-9f2c"


@dataclass(frozen=True)
class TwoClusters:
    env: dict[str, str]  # rv's environment: a config whose default profile is the default layout
    default: str  # the default layout's profile name
    bare: str  # the bare layout's
    roots: dict[str, str]  # profile -> this test's remote root

    def rv(self, *args: str, profile: str | None = None, cwd: Path | None = None, timeout: int = 300):
        return run_cli([*(["-p", profile] if profile else []), *args], self.env, cwd=cwd, timeout=timeout)


@pytest.fixture
def two_clusters(
    cluster, bare_cluster, session_config, bare_session_config, remote_root, bare_remote_root, tmp_path
):
    """One config with both layouts' profiles (each its own remote root), the default layout's the default."""
    home = tmp_path / "home"
    home.mkdir()
    config_path = home / "rv.toml"
    default = load_config(session_config).profile(cluster["RV_TESTCLUSTER_PROFILE"])
    bare = load_config(bare_session_config).profile(bare_cluster["RV_TESTCLUSTER_PROFILE"])
    config = load_config(session_config)
    config = config.with_profile(replace(default, remote_root=remote_root), make_default=True)
    config = config.with_profile(replace(bare, remote_root=bare_remote_root), make_default=False)
    save_config(replace(config, path=config_path))
    make_remote_dir(remote_root, cluster["RV_TESTCLUSTER_USER"])
    make_remote_dir(bare_remote_root, bare_cluster["RV_TESTCLUSTER_USER"])
    yield TwoClusters(
        base_env(home, config_path),
        default.name,
        bare.name,
        {default.name: remote_root, bare.name: bare_remote_root},
    )
    stop_warm()
    shutil.rmtree(remote_root, ignore_errors=True)
    shutil.rmtree(bare_remote_root, ignore_errors=True)


@dataclass(frozen=True)
class Served:
    url: str  # as printed: http://127.0.0.1:PORT/?token=...
    base: str
    token: str
    port: int
    process: subprocess.Popen


@contextlib.contextmanager
def rv_ui(env: dict[str, str]):
    """`rv ui --no-browser` running; stopped with Ctrl-C (SIGINT) at the end, which must end it."""
    process = subprocess.Popen(
        [str(RV_PROGRAM), "ui", "--no-browser"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline().strip()
        m = re.fullmatch(r"(http://127\.0\.0\.1:(\d+))/\?token=([A-Za-z0-9_-]+)", line)
        assert m, (line, process.stderr.read() if process.poll() is not None else "")
        yield Served(line, m.group(1), m.group(3), int(m.group(2)), process)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                raise


def ask(served: Served, path: str, *, headers: dict[str, str] | None = None, data: bytes | None = None):
    """(status, JSON body) of one request to the running `rv ui`."""
    request = urllib.request.Request(served.base + path, headers=headers or {}, data=data)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def answered(browser) -> str:
    """What the page said of the action it sent ("" while it waits)."""
    text = browser.find_element("id", "action-result").text
    return "" if text == "sending…" else text


def test_only_the_token_holder_is_served_and_ctrl_c_leaves_nothing_running(two_clusters):
    with rv_ui(two_clusters.env) as served:
        token = {"X-RV-Token": served.token}
        status, body = ask(served, "/api/profiles")
        assert status == 403 and "token" in body["error"]
        status, body = ask(served, "/api/profiles?token=wrong")
        assert status == 403
        status, body = ask(served, "/api/profiles", headers={**token, "Origin": "http://evil.example"})
        assert status == 403 and "another origin" in body["error"]
        status, body = ask(
            served, "/api/profiles", headers={**token, "Host": f"rebound.example:{served.port}"}
        )
        assert status == 403 and "host" in body["error"]
        # An action without the page's Origin, token or not: refused before anything reaches a cluster.
        stop = json.dumps({"profile": two_clusters.default, "run_id": "x"}).encode()
        status, _ = ask(served, "/api/stop", headers=token, data=stop)
        assert status == 403
        status, _ = ask(served, "/api/stop", headers={**token, "Origin": "http://evil.example"}, data=stop)
        assert status == 403
        # The positive case, in the same run: the token is served, every profile listed.
        status, body = ask(served, "/api/profiles", headers=token)
        assert status == 200 and [p["name"] for p in body["profiles"]] == [
            two_clusters.default,
            two_clusters.bare,
        ]
        status, body = ask(served, f"/api/profiles?token={served.token}", headers={"Origin": served.base})
        assert status == 200
        with chromium() as browser:
            browser.get(served.base + "/")
            assert "no valid token" in browser.find_element("tag name", "body").text
            screenshot(browser, "refused-without-token")
        served.process.send_signal(signal.SIGINT)
        assert served.process.wait(timeout=30) == 0  # a liveness bound, not a timing claim
        assert "stopped" in served.process.stderr.read()
        with (
            pytest.raises(ConnectionRefusedError),
            socket.create_connection(("127.0.0.1", served.port), timeout=5),
        ):
            pass


def test_every_malformed_request_is_a_400_with_a_message_and_no_traceback(two_clusters):
    import urllib.parse

    with rv_ui(two_clusters.env) as served:
        token = {"X-RV-Token": served.token}
        action = {**token, "Origin": served.base, "Content-Type": "application/json"}
        profile = two_clusters.default
        logs = f"/api/logs?profile={profile}&id=r1&cursor="
        asked = [
            ask(served, logs + urllib.parse.quote("{not json"), headers=token),
            ask(served, logs + urllib.parse.quote("[1, 2]"), headers=token),
            ask(served, logs + urllib.parse.quote('{"segment": "x", "offsets": {}}'), headers=token),
            ask(
                served, logs + urllib.parse.quote('{"segment": 1, "offsets": {"a.out": "x"}}'), headers=token
            ),
            ask(served, logs + urllib.parse.quote('{"offsets": [1]}'), headers=token),
            ask(served, logs + urllib.parse.quote("[" * 5000), headers=token),  # RecursionError
            ask(served, f"/api/logs?profile={profile}&id=r1&from=x", headers=token),
            ask(
                served,
                "/api/stop",
                headers=action,
                data=json.dumps({"profile": profile, "run_id": 5}).encode(),
            ),
            ask(
                served,
                "/api/stop",
                headers=action,
                data=json.dumps({"profile": ["x"], "run_id": "r"}).encode(),
            ),
            ask(
                served,
                "/api/stop",
                headers=action,
                data=json.dumps({"profile": profile, "sweep": {}}).encode(),
            ),
            ask(
                served,
                "/api/retry",
                headers=action,
                data=json.dumps({"profile": profile, "sweep": 3}).encode(),
            ),
            ask(served, "/api/retry", headers=action, data=json.dumps({"profile": {"a": 1}}).encode()),
            ask(served, "/api/retry", headers=action, data=b"[" * 100000),
        ]
        for status, body in asked:
            assert status == 400 and isinstance(body, dict) and body["error"], (status, body)
        said = [body["error"] for _, body in asked]
        assert said[0].startswith("cursor: not JSON") and "run_id: a non-empty string (not a number)" in said
        assert "profile: a profile's name, a string (not a list)" in said
        # The positive case in the same run: a well-formed request of the same kind is answered.
        status, body = ask(served, f"/api/runs?profile={profile}", headers=token)
        assert status == 200, body
    stderr = served.process.stderr.read()
    assert "Traceback" not in stderr and " 500 " not in stderr, stderr[-3000:]


def test_the_runs_page_lists_both_clusters_and_a_sweeps_page_draws_each_points_curve(two_clusters, tmp_path):
    """A run on each layout and a sweep of four points (one crashes): the runs page lists both clusters'
    runs and the sweep folded to one row; the sweep's page draws one curve per point that wrote its
    metric, from those metrics, marks the failed point and retries it."""
    c = two_clusters
    proj = git_project(tmp_path / "p", {"sweeper.py": SWEEPER, "ticker.py": TICKER})
    for profile, name in ((c.default, "alpha"), (c.bare, "beta")):
        r = c.rv("run", "-g", "0", "--mem", "200M", "--name", name, "--", "python3", "sweeper.py", "0.1",
                 profile=profile, cwd=proj)  # fmt: skip
        assert r.returncode == 0, r.stderr
    lrs = ["0.1", "0.2", "0.3", "0.4"]
    r = c.rv("run", "-g", "0", "--mem", "200M", "--name", "grid", "--sweep", "lr=" + ",".join(lrs),
             "--parallel", "2", "--", "python3", "sweeper.py", "{lr}", cwd=proj)  # fmt: skip
    assert r.returncode == 0, r.stderr

    def sweep_ended():
        r = c.rv("sweep", "results", "grid", "--json")
        points = json.loads(r.stdout)["points"] if r.returncode == 0 else []
        return len(points) == 4 and all(p["state"] in ("COMPLETED", "FAILED") for p in points) and points

    points = wait_for(sweep_ended, 240, "every point of the sweep to end")
    assert {p["index"]: p["state"] for p in points} == {
        0: "COMPLETED",
        1: "COMPLETED",
        2: "FAILED",
        3: "COMPLETED",
    }

    with rv_ui(c.env) as served, chromium() as browser:
        browser.get(served.url)
        rows = lambda: browser.find_elements("css selector", "#runs-body tr")  # noqa: E731

        def listed():
            seen = {
                tuple(row.get_attribute(f"data-{key}") for key in ("profile", "name", "kind"))
                for row in rows()
            }
            wanted = {(c.default, "alpha", "run"), (c.bare, "beta", "run"), (c.default, "grid", "sweep")}
            return wanted <= seen and seen

        seen = wait_until(listed, 60, "the runs of both clusters and the sweep's row")
        assert not any(name.startswith("grid/") for _, name, _ in seen), (
            seen
        )  # the points are folded into one row
        # The page redraws its rows as it polls: each look finds them afresh.
        grid = wait_until(
            lambda: browser.find_element("css selector", '#runs-body tr[data-name="grid"]').text,
            30,
            "the sweep's row",
        )
        assert "4pt" in grid and "FAILED" in grid and "1 failed" in grid, grid
        screenshot(browser, "runs-two-clusters")

        # Unticking a cluster hides its rows (a filter per cluster).
        browser.find_element("css selector", f'input[data-profile="{c.bare}"]').click()
        wait_until(
            lambda: all(r.get_attribute("data-profile") != c.bare for r in rows()), 10, "the bare rows hidden"
        )
        browser.find_element("css selector", f'input[data-profile="{c.bare}"]').click()

        browser.find_element("css selector", '#runs-body tr[data-name="grid"] a').click()
        chart = wait_until(
            lambda: browser.execute_script(
                "const u = rvui.charts.sweep; return u && {labels: u.series.map(s => s.label), data: u.data};"
            ),
            60, "the sweep's chart",
        )  # fmt: skip
        # One curve per point that wrote loss (the crashed point wrote none), each from its own metrics.
        assert chart["labels"][1:] == ["0: lr=0.1", "1: lr=0.2", "3: lr=0.4"], chart["labels"]
        xs = chart["data"][0]
        assert xs == [1, 2, 3]
        for curve, lr in zip(chart["data"][1:], ("0.1", "0.2", "0.4"), strict=True):
            assert curve == pytest.approx([float(lr) * 10 / step for step in xs]), (lr, curve)
        failed = browser.find_elements("css selector", "#sweep-table tr.failed")
        assert [f.get_attribute("data-index") for f in failed] == ["2"] and "✗" in failed[0].text
        # Sortable by any metric: loss, highest first on the second click.
        header = browser.find_element("css selector", '#sweep-table th[data-key="metric:loss"]')
        header.click()
        browser.find_element("css selector", '#sweep-table th[data-key="metric:loss"]').click()
        order = [
            r.get_attribute("data-index")
            for r in browser.find_elements("css selector", "#sweep-table tbody tr")
        ]
        assert order[:3] == ["3", "1", "0"], order
        # An SU column and the sweep's total: CPU points, so no rate ("?").
        assert browser.find_element("css selector", '#sweep-table th[data-key="su"]').text == "SU"
        assert browser.find_element("id", "sweep-su-total").text.split() == ["total", "?"]
        # Log scale: the y scale becomes logarithmic (uPlot's distr 3), the same curves on it.
        browser.find_element("id", "sweep-log").click()
        wait_until(
            lambda: browser.execute_script("return rvui.charts.sweep.scales.y.distr") == 3, 10, "log scale"
        )
        screenshot(browser, "sweep-curves-log")
        browser.find_element("id", "sweep-log").click()
        screenshot(browser, "sweep-curves")

        # Retry from the page: a confirmation, then the same retry as `rv sweep retry`.
        browser.find_element("id", "retry-sweep").click()
        alert = wait_until(lambda: browser.switch_to.alert, 10, "the confirmation")
        assert "Retry points 2 of sweep grid" in alert.text
        alert.accept()
        said = wait_until(lambda: answered(browser), 60, "the retry's answer")
        assert "retrying 1 point(s) of sweep grid: 2 (failed)" in said, said
        points = wait_for(sweep_ended, 180, "the retried point to end")
        assert all(p["state"] == "COMPLETED" for p in points), points
        assert points[2]["metrics"]["loss"] == pytest.approx(0.3 * 10 / 3)
        wait_until(
            lambda: len(browser.execute_script("return rvui.charts.sweep.series")) == 5,
            60,
            "the retried point's curve",
        )
        screenshot(browser, "sweep-after-retry")


@pytest.mark.parametrize("which", ["default", "bare"])
def test_a_runs_logs_grow_live_its_metrics_redraw_and_stop_from_the_page_ends_it(
    two_clusters, tmp_path, which
):
    c = two_clusters
    profile = c.default if which == "default" else c.bare
    proj = git_project(tmp_path / "p", {"ticker.py": TICKER})
    assert c.rv("env", "set", "--profile", profile, f"UI_SECRET={SECRET}").returncode == 0
    r = c.rv("run", "-g", "0", "--mem", "200M", "--name", "ticker", "--json", "--", "python3", "ticker.py",
             profile=profile, cwd=proj)  # fmt: skip
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["run_id"]

    with rv_ui(c.env) as served, chromium() as browser:
        browser.get(served.url)
        browser.get(f"{served.base}/#/run/{profile}/{run_id}")
        log = lambda: browser.find_element("id", "log").text  # noqa: E731
        ticks = lambda: [int(n) for n in re.findall(r"^tick (\d+)$", log(), re.M)]  # noqa: E731
        first = wait_until(lambda: ticks(), 90, "the first ticks in the page's log")
        # The job got its secret (the positive case)...
        assert f"secret length {len(SECRET)} sha" in log()
        later = wait_until(lambda: (t := ticks()) and t[-1] >= first[-1] + 4 and t, 60, "the log to grow")
        assert later[: len(first)] == first and later == list(range(later[0], later[-1] + 1)), later
        browser.execute_script("document.getElementById('log').scrollIntoView()")
        screenshot(browser, f"run-live-logs-{which}")
        # The other stream: stderr's line alone.
        Select(browser.find_element("id", "log-stream")).select_by_value("err")
        wait_until(lambda: "ticker starting" in log(), 60, "stderr's line")
        assert not ticks(), log()

        browser.get(f"{served.base}/#/metrics/{profile}/{run_id}")
        steps = lambda: browser.execute_script(  # noqa: E731
            "const u = rvui.charts['metric:loss']; return u ? u.data[0].length : 0"
        )
        drawn = wait_until(steps, 60, "the loss chart")
        wait_until(lambda: steps() >= drawn + 4, 60, "the loss chart to redraw with new steps")
        screenshot(browser, f"run-metrics-{which}")

        browser.get(f"{served.base}/#/run/{profile}/{run_id}")
        wait_until(lambda: browser.find_element("id", "stop-run"), 60, "the stop button").click()
        alert = wait_until(lambda: browser.switch_to.alert, 10, "the confirmation")
        assert alert.text.startswith("Stop run ticker?")
        alert.accept()
        said = wait_until(lambda: answered(browser), 60, "the stop's answer")
        assert said.startswith("stopped run ticker: cancelled job"), said

        def ended():
            r = c.rv("ps", "-a", "--json", profile=profile)
            rows = [v for v in json.loads(r.stdout) if v["run_id"] == run_id] if r.returncode == 0 else []
            return rows and not rows[0]["live"] and rows[0]["state"] in ("CANCELLED", "STOPPED") and rows[0]

        row = wait_for(ended, 120, "the run to end")
        assert row["reason"].startswith("cancelled by rv stop"), row
        wait_until(
            lambda: "Stop run" not in browser.find_element("tag name", "main").text,
            60,
            "the page to see the end",
        )
        screenshot(browser, f"run-stopped-{which}")
        # What it used (rv stats's figures): one segment, CPU only, its CPU efficiency and peak memory.
        table = lambda: browser.find_element("id", "usage-table").text  # noqa: E731
        usage = wait_until(lambda: "CPU only" in table() and table(), 60, "the usage table")
        assert re.search(r"1 .* CPU only \d+% [\d.]+ (MiB|GiB|KiB) \? \(a CPU job", usage), usage
        assert "wall" in browser.find_element("id", "usage-summary").text
        # ... and no page ever showed it: not the run page, nor any answer the page got.
        assert SECRET not in browser.page_source
        asked = f"profile={profile}&id={run_id}"
        for path in (f"/api/run?{asked}", f"/api/logs?{asked}&stream=out", f"/api/runs?profile={profile}"):
            status, body = ask(served, path, headers={"X-RV-Token": served.token})
            assert status == 200 and SECRET not in json.dumps(body), path
    # The terminal's view of the same metric: `rv metrics --plot` draws its curve (braille dots) from 1 down.
    plot = c.rv("metrics", "ticker", "--plot", "loss", profile=profile)
    assert plot.returncode == 0, plot.stderr
    curve = plot.stdout.split("loss by step:\n", 1)[1].splitlines()
    top, drawn = curve[0].split("┤")
    assert top.strip() == "1" and any(0x2800 < ord(ch) <= 0x28FF for ch in drawn), plot.stdout
    assert curve[-1].split()[0] == "1"  # the first step under the axis
