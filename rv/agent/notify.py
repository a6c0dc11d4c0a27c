#!/usr/bin/env python3
"""rv's run notifier: posts what happened to a run to the webhooks its user named (``--notify secret:NAME``).

The job's runtime (rv/agent/job.sh) runs it on the compute node, once per run, never once per segment:

``notify.py end RUN_DIR JOB NAME...``
    from the job that ends the run (after it wrote ``ENDED``): run, state, segments, time, the last
    lines of stderr when the program crashed, and the commands to see more.
``notify.py idle RUN_DIR JOB NAME...``
    from rv's meter on a node (rv/agent/stats.py) whose GPUs all stayed idle for ``--idle-gpu``: the
    line it wrote to the run's log, in ``RV_IDLE_MESSAGE``.
``notify.py started RUN_DIR JOB NAME...``
    from segment 1 when it starts, and only when it waited in the queue at least
    :data:`PENDING_WORTH_SAYING` seconds (a run that starts at once needs no word).

Each NAME is an rv secret (``rv env set NAME``) holding the webhook's URL: the job's environment has
it (the secrets file, 0600, sourced by the job), so the URL is in no script, no argv and no log. A
line that names a hook says ``secret NAME``, and what went wrong only in words this program chose (the
exception's type, an HTTP status, an errno's name): never the URL, never an exception's text (urllib's
and http.client's quote the URL, or part of it, in theirs). A value that is not one http(s) URL is
not posted to at all (rv run refuses it before sending: rv.notify.webhook_problem).

One JSON body serves the common receivers: Slack and Mattermost read ``text``, Discord ``content``
(at most 2000 characters), ntfy ``message``/``title`` (ntfy takes JSON only at its root URL with the
topic inside: a URL on a host named ``ntfy.*`` is posted that way), and any other receiver gets
``rv``: the same facts as fields.

A post is tried :data:`TRIES` times with a growing wait in between (not after a refusal that
another try cannot change: 4xx other than 408/429); it never fails the job: this program always
exits 0, and the job calls it with ``|| :`` anyway. The whole notification, every hook and every
try, ends within :data:`DEADLINE_S`: urllib's timeout bounds each socket operation, not a request (a
receiver that accepts and never answers held a job's end for 43 s), so each hook is posted from its
own thread and the program stops waiting for them at the deadline.

Python 3.6, standard library only: it runs with whatever ``python3`` the job has.
"""

import errno
import json
import os
import re
import sys
import threading
import time
from urllib import error as urlerror
from urllib import parse as urlparse
from urllib import request as urlrequest

TRIES = 4
FIRST_WAIT_S = 1.0  # then 2, 4, each cut to what is left before the deadline
TIMEOUT_S = 8.0  # one socket operation
DEADLINE_S = 15.0  # the whole notification (every hook, every try): the job's end waits no longer
PENDING_WORTH_SAYING = 60  # seconds in the queue before a start is worth a message
STDERR_LINES = 15
DISCORD_LIMIT = 2000
GIB = 1 << 30  # memory in the usage line, as rv stats shows it

# How a reason begins -> the state word (rv.agent.segment.END_REASONS; a unit test holds the two equal:
# this file runs alone on the compute node and imports nothing of rv).
END_REASONS = (
    ("finished", "COMPLETED"),
    ("crashed", "FAILED"),
    ("failed before", "FAILED"),
    ("time limit", "TIMEOUT"),
    ("stopped", "STOPPED"),
    ("preempted", "PREEMPTED"),
    ("cancelled", "CANCELLED"),
    ("requeued", "REQUEUED"),
    ("gpu fault", "FAULT"),
    ("ended without a record", "LOST"),
)


def end_state(reason):
    for prefix, word in END_REASONS:
        if reason.startswith(prefix):
            return word
    return "ENDED"


def read_json(path):
    try:
        with open(path, "rb") as fh:
            value = json.loads(fh.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def segments(run_dir):
    """The run's segment records, in order."""
    found = []
    try:
        names = os.listdir(os.path.join(run_dir, "seg"))
    except OSError:
        return []
    for name in names:
        stem, _, ext = name.partition(".")
        if ext == "json" and stem.isdigit():
            record = read_json(os.path.join(run_dir, "seg", name))
            if record is not None:
                found.append((int(stem), record))
    return [record for _, record in sorted(found, key=lambda pair: pair[0])]


def duration(seconds):
    """``3h05m``, ``4m10s``, ``12s``."""
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return "%dh%02dm" % (hours, minutes)
    if minutes:
        return "%dm%02ds" % (minutes, secs)
    return "%ds" % secs


# Lines Slurm's own tools add to a job's stderr after the program's last words (srun's "error: ...:
# task 0: Exited with exit code 3", slurmstepd's "Terminating StepId"): not the program's.
SLURM_LINE = re.compile(r"^(srun|slurmstepd(-[\w.-]+)?): ")


def stderr_tail(run_dir, job, lines=STDERR_LINES):
    """The program's last lines of stderr in this job's log files (rv's own ``rv:`` lines and Slurm's
    own lines left out)."""
    logs = os.path.join(run_dir, "logs")
    try:
        names = sorted(n for n in os.listdir(logs) if n.startswith(job) and n.endswith(".err"))
    except OSError:
        return []
    names = [n for n in names if n == job + ".err" or n.startswith(job + "-node")]
    tail = []
    for name in names:
        try:
            with open(os.path.join(logs, name), "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 64 * 1024))
                text = fh.read().decode("utf-8", "replace")
        except OSError:
            continue
        own = [ln.rstrip() for ln in text.replace("\r", "\n").splitlines()]
        mine = [ln for ln in own if ln.strip() and not ln.startswith("rv: ") and not SLURM_LINE.match(ln)]
        tail += mine[-lines:]
    return tail[-lines:]


def end_message(run_dir, job, now=None):
    """(title, text, facts) for the end of the run in ``run_dir``; None when it has not ended."""
    ended = read_json(os.path.join(run_dir, "ENDED"))
    if ended is None:
        return None
    meta = read_json(os.path.join(run_dir, "run.json")) or {}
    name = str(meta.get("name") or os.path.basename(run_dir))
    reason = str(ended.get("reason") or "")
    state = end_state(reason)
    segs = segments(run_dir)
    ran = sum(max(0, (s.get("end") or s.get("start") or 0) - s.get("start")) for s in segs if s.get("start"))
    end = ended.get("end") or now or time.time()
    since = end - meta["created"] if isinstance(meta.get("created"), (int, float)) else None
    count = ended.get("segment") or len(segs)
    facts = {
        "event": "end", "run": name, "run_id": meta.get("run_id"), "state": state, "reason": reason,
        "exit_code": ended.get("exit_code"), "segments": count, "ran_seconds": int(ran),
        "since_submit_seconds": int(since) if since is not None else None, "job": job,
    }  # fmt: skip
    title = "rv: run %s %s" % (name, state)
    waited = ", %s since it was submitted" % duration(since) if since is not None else ""
    lines = [
        "run %s: %s (%s, exit code %s)"
        % (name, state, reason or "no reason recorded", ended.get("exit_code")),
        "%d segment%s, ran %s%s" % (count, "" if count == 1 else "s", duration(ran), waited),
    ]
    if state in ("FAILED", "FAULT"):
        tail = stderr_tail(run_dir, job)
        facts["stderr_tail"] = tail
        if tail:
            lines.append("last lines of stderr (job %s):" % job)
            lines += ["    " + ln for ln in tail]
    usage = usage_line(run_dir, segs, meta)
    if usage:
        facts["usage"] = usage
        lines.append(usage)
    lines.append("more: rv logs %s --err    rv ps -a    rv why %s    rv stats %s" % (name, name, name))
    return title, "\n".join(lines), facts


def node_peak(rec):
    """A node's peak memory from rv's meter (rv.agent.stats.node_peak, held equal by a unit test):
    the job's cgroup where Slurm made one, else the larger of the largest process and the sampled
    sum of the program's processes."""
    if isinstance(rec.get("cgroup_peak_bytes"), int):
        return rec["cgroup_peak_bytes"]
    got = [v for v in (rec.get("maxrss_bytes"), rec.get("rss_peak_bytes")) if isinstance(v, int)]
    return max(got) if got else None


def usage_line(run_dir, segs, meta):
    """One line of what the run used (wall, GPU use, peak memory, SUs) from rv's meter, or None."""
    wall = sum(max(0, (s.get("end") or s.get("start") or 0) - s.get("start")) for s in segs if s.get("start"))
    base = os.path.join(run_dir, "stats")
    nodes = []
    try:
        for seg in os.listdir(base):
            for fname in os.listdir(os.path.join(base, seg)):
                if fname.endswith(".json"):
                    rec = read_json(os.path.join(base, seg, fname))
                    if rec is not None:
                        nodes.append(rec)
    except OSError:
        pass
    if not nodes:
        return None
    parts = ["used: %s wall" % duration(wall)]
    utils = [(g.get("util_sum") or 0, g.get("util_samples") or 0) for n in nodes for g in n.get("gpus") or []]
    count = sum(c for _, c in utils)
    if count:
        peak_g = max((g.get("memory_peak_bytes") or 0) for n in nodes for g in n.get("gpus") or [])
        parts.append(
            "GPU util %.0f%% mean, GPU memory peak %.1f GiB"
            % (sum(u for u, _ in utils) / count, peak_g / GIB)
        )
    peaks = [p for p in (node_peak(n) for n in nodes) if p is not None]
    if peaks:
        parts.append("peak memory %.1f GiB" % (max(peaks) / GIB))
    gpus, rates = meta.get("gpus") or 0, meta.get("su_rates") or {}
    su, unknown = 0.0, False
    for s in segs:
        if not s.get("start") or not gpus:
            continue
        rate = rates.get(s.get("gpu_type") or meta.get("gpu_type") or "")
        if not isinstance(rate, (int, float)):
            unknown = True
            continue
        su += rate * gpus * max(0, (s.get("end") or s.get("start")) - s["start"]) / 3600.0
    if gpus:
        parts.append("SUs ?" if unknown else "%.1f SUs" % su)
    return ", ".join(parts)


def idle_message(run_dir, job, environ):
    """(title, text, facts) for GPUs left idle, from the meter's line in RV_IDLE_MESSAGE."""
    meta = read_json(os.path.join(run_dir, "run.json")) or {}
    name = str(meta.get("name") or os.path.basename(run_dir))
    said = environ.get("RV_IDLE_MESSAGE") or "GPUs idle"
    facts = {"event": "idle", "run": name, "run_id": meta.get("run_id"), "state": "RUNNING", "job": job,
             "message": said}  # fmt: skip
    text = "run %s: %s\nmore: rv gpu %s    rv stop %s" % (name, said, name, name)
    return "rv: run %s has idle GPUs" % name, text, facts


def started_message(run_dir, job, now=None):
    """(title, text, facts) for segment 1 starting after a wait; None when it waited too little to say."""
    meta = read_json(os.path.join(run_dir, "run.json")) or {}
    created = meta.get("created")
    now = now or time.time()
    if not isinstance(created, (int, float)) or now - created < PENDING_WORTH_SAYING:
        return None
    name = str(meta.get("name") or os.path.basename(run_dir))
    waited = duration(now - created)
    nodes = os.environ.get("SLURM_JOB_NODELIST", "")
    facts = {"event": "started", "run": name, "run_id": meta.get("run_id"), "state": "RUNNING", "job": job,
             "waited_seconds": int(now - created), "nodes": nodes}  # fmt: skip
    text = "run %s started after %s in the queue: job %s%s\nmore: rv logs -f %s    rv ps" % (
        name, waited, job, " on " + nodes if nodes else "", name)  # fmt: skip
    return "rv: run %s started" % name, text, facts


def body_for(url, title, text, facts):
    """(URL to post to, JSON body) for one receiver: one body that each common receiver reads."""
    parts = urlparse.urlsplit(url)
    body = {"text": text, "content": text[:DISCORD_LIMIT], "title": title, "message": text, "rv": facts}
    host = (parts.hostname or "").lower()
    topic = parts.path.strip("/")
    if host.startswith("ntfy.") and topic and "/" not in topic:
        # ntfy reads JSON only at its root, with the topic inside; at the topic's URL it would show
        # the JSON itself as the message.
        body["topic"] = topic
        url = urlparse.urlunsplit((parts.scheme, parts.netloc, "/", "", ""))
    return url, body


def post(url, body, opener=None, timeout=TIMEOUT_S):
    """POST ``body`` as JSON; the HTTP status (raises on a refusal or a failure to connect)."""
    data = json.dumps(body).encode("utf-8")
    headers = {"Content-Type": "application/json", "User-Agent": "rv-notify"}
    req = urlrequest.Request(url, data=data, method="POST", headers=headers)
    with (opener or urlrequest.urlopen)(req, timeout=timeout) as resp:
        return resp.status if hasattr(resp, "status") else resp.getcode()


# What a webhook's URL may hold: printable ASCII without spaces (a trailing newline or "# comment"
# copied with the URL made http.client raise InvalidURL quoting the URL's path, token included).
URL_CHARS = re.compile(r"[!-~]+\Z")


def url_problem(url):
    """Why ``url`` is not one http(s) URL to post to, in words that quote none of it; None when it is.
    The same rules as rv.notify.webhook_problem on the laptop (a unit test holds them equal)."""
    if not URL_CHARS.match(url):
        return "it holds a space, a line break or a character outside printable ASCII"
    try:
        parts = urlparse.urlsplit(url)
        _port = parts.port  # raises ValueError for a port that is not a number
    except ValueError:
        return "it does not parse as a URL"
    if parts.scheme.lower() not in ("http", "https"):
        return "it does not begin with http:// or https://"
    if not parts.hostname:
        return "it names no host"
    return None


def problem_of(exc):
    """What went wrong, in words that quote nothing of the exception's text (which may hold the URL)."""
    if isinstance(exc, urlerror.HTTPError):
        return "HTTP %d" % exc.code
    cause = exc.reason if isinstance(exc, urlerror.URLError) else exc
    words = type(cause).__name__ if isinstance(cause, BaseException) else type(exc).__name__
    code = getattr(cause, "errno", None)
    if isinstance(code, int) and code in errno.errorcode:
        words += " " + errno.errorcode[code]
    return words


def retriable(exc):
    if isinstance(exc, urlerror.HTTPError):
        return exc.code in (408, 429) or exc.code >= 500
    return True  # no answer at all: a network that may come back


def deliver(name, url, title, text, facts, opener=None, sleep=time.sleep, say=None, deadline=None,
            clock=time.time):  # fmt: skip
    """Post to one hook, up to TRIES times and never past ``deadline`` (a ``clock()`` time; default
    DEADLINE_S from now); True when it took the message. Never raises, never quotes the URL."""
    say = say or (lambda line: sys.stderr.write(line + "\n"))
    deadline = clock() + DEADLINE_S if deadline is None else deadline
    problem = url_problem(url)
    if problem is not None:
        say("rv: notify: secret %s does not hold one http(s) URL (%s): nothing posted "
            "(rv env set %s)" % (name, problem, name))  # fmt: skip
        return False
    target, body = body_for(url, title, text, facts)
    wait = FIRST_WAIT_S
    for attempt in range(1, TRIES + 1):
        try:
            status = post(target, body, opener, timeout=max(0.1, min(TIMEOUT_S, deadline - clock())))
        except Exception as exc:  # every failure is the hook's, never the job's: say it and go on
            left = deadline - clock()
            if attempt == TRIES or not retriable(exc) or left <= 0:
                say("rv: notify: secret %s: not delivered after %d tr%s (%s)"
                    % (name, attempt, "y" if attempt == 1 else "ies", problem_of(exc)))  # fmt: skip
                return False
            sleep(min(wait, left))
            wait *= 2
            if deadline - clock() <= 0:
                say("rv: notify: secret %s: not delivered in time (%s)" % (name, problem_of(exc)))
                return False
            continue
        say("rv: notify: posted the run's %s to secret %s (HTTP %s)" % (facts.get("event"), name, status))
        return True
    return False


def deliver_all(hooks, title, text, facts, deadline_s=DEADLINE_S, write=None):
    """Post to each (name, url) of ``hooks`` at once, each from its own thread, and return by the
    deadline whatever they are doing: a hook still waiting then is named and left (its thread is a
    daemon, ended with this program)."""
    write = write or (lambda line: sys.stderr.write(line + "\n"))
    lock = threading.Lock()
    over = []  # set once the deadline passed: a late thread says nothing more

    def say(line):
        with lock:
            if not over:
                write(line)

    deadline = time.time() + deadline_s
    threads = []
    for name, url in hooks:
        thread = threading.Thread(target=deliver, args=(name, url, title, text, facts),
                                  kwargs={"say": say, "deadline": deadline})  # fmt: skip
        thread.daemon = True
        thread.start()
        threads.append((name, thread))
    for _, thread in threads:
        thread.join(max(0.0, deadline - time.time()))
    with lock:
        late = [name for name, thread in threads if thread.is_alive()]
        for name in late:
            write("rv: notify: secret %s: no answer within %d s: not delivered" % (name, deadline_s))
        over.append(True)
    return late


def main(argv, environ=None, now=None, deadline_s=DEADLINE_S):
    environ = os.environ if environ is None else environ
    if len(argv) < 4 or argv[1] not in ("end", "started", "idle"):
        sys.stderr.write("usage: notify.py end|started|idle RUN_DIR JOB NAME...\n")
        return 0
    event, run_dir, job, names = argv[1], argv[2], argv[3], argv[4:]
    if event == "idle":
        made = idle_message(run_dir, job, environ)
    else:
        made = (end_message if event == "end" else started_message)(run_dir, job, now)
    if made is None:
        return 0
    title, text, facts = made
    hooks = []
    for name in names:
        url = environ.get(name, "")
        if not url:
            sys.stderr.write("rv: notify: secret %s is not in the job's environment: nothing posted "
                             "(rv env list; rv env set %s)\n" % (name, name))  # fmt: skip
            continue
        hooks.append((name, url))
    deliver_all(hooks, title, text, facts, deadline_s)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except Exception as exc:  # the job goes on whatever happened here
        sys.stderr.write("rv: notify: %s\n" % type(exc).__name__)
        sys.exit(0)
