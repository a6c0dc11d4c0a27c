"""``follow``: a run's output, segment after segment, from given offsets, as frames on stdout.

Frames carry state too; the stream ends when the run ends (following) or when the logs are read (not
following). A heartbeat frame at least every ``Frames.BEAT_S`` seconds tells rv a quiet job from a
dead connection.
"""

import json
import os
import re
import select
import struct
import sys
import time

from rv.agent import common, layout, manifest, rundir, runs, slurmcmd

POLL_S = 2.0  # how often a follower asks squeue
# How often the logs are read: every QUICK_S for the first QUICK_FOR_S of following a segment (its
# program's first lines: what a user of `rv run -f` waits for), then every SLOW_S. A read is a
# listdir and a seek per log (~0.1 ms): 250 of them cost a few ms of the login node once per
# segment, and the first line reaches the laptop ~0.1 s sooner than at SLOW_S alone. Not longer:
# a chatty program followed for hours would cost the shared login node ten times the reads.
QUICK_S, QUICK_FOR_S, SLOW_S = 0.02, 5.0, 0.2


class Frames:
    """Framed output: 4-byte header length, 4-byte data length, a JSON header, then the data."""

    BEAT_S = 10.0  # a frame at least this often, so rv can tell a silent connection from a quiet job

    def __init__(self):
        self.out = sys.stdout.buffer
        self.last = time.time()

    def send(self, header, data=b""):
        head = json.dumps(header).encode("utf-8")
        self.out.write(struct.pack(">II", len(head), len(data)) + head + data)
        self.out.flush()
        self.last = time.time()

    def beat(self):
        if time.time() - self.last > self.BEAT_S:
            self.send({"t": "beat"})


def _client_gone(timeout):
    """Wait up to ``timeout`` s on stdin; True once it is closed (rv went away: stop at once)."""
    ready, _, _ = select.select([0], [], [], timeout)
    if not ready:
        return False
    try:
        return os.read(0, 4096) == b""
    except OSError:
        return True


# The segment's start line (job.sh: rv_start, the batch shell's last word before rv_launch starts the
# program). In a job over several nodes the program writes to each node's log, and what follows this
# line in the batch log was written after the program ended ("rv: run X ended after segment 1").
START_LINE = re.compile(rb"(?m)^rv: run .*, segment \d+/\d+: job .*\n")
SPLIT_SCAN = 8 << 20  # the start line is looked for in the batch log's first 8 MiB (setup output)
_splits = {}  # batch log -> the offset right after its start line, once found


def _after_start_line(path):
    """Where ``path``'s last start line ends; None while it has none (the program has not started)."""
    if path in _splits:
        return _splits[path]
    try:
        with open(path, "rb") as fh:
            text = fh.read(SPLIT_SCAN)
    except OSError:
        return None
    found = None
    for m in START_LINE.finditer(text):
        found = m.end()
    if found is not None:
        _splits[path] = found
    return found


def _segment_files(rdir, job, streams, node):
    """Log files of one job, as (path, stream, read up to): the batch log, and per-node logs of a
    multi-node job. Read in the order the lines were written: the batch log's stdout up to its start
    line, each node's log, then the rest of the batch log (its closing lines)."""
    logs = common.under(rdir, layout.LOGS)
    try:
        names = os.listdir(logs)
    except OSError:
        names = []
    files = []
    for stream in streams:
        batch = common.join(logs, manifest.enc(layout.log_name(job, stream)))
        per_node = sorted(n for n in names if re.match(("^%s-node(\\d+)\\.%s$" % (job, stream)).encode(), n))
        split = _after_start_line(batch) if node is None and per_node and stream == "out" else None
        if node is None:
            files.append((batch, stream, split))
        for n in per_node:
            index = int(re.match(rb"^\d+(?:_\d+)?-node(\d+)", n).group(1))
            if node is None or index == node:
                files.append((common.join(logs, n), stream, None))
        if split is not None:
            files.append((batch, stream, None))
    return files


def _tail_offset(path, lines):
    """The offset where the last ``lines`` lines of ``path`` begin."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return 0
    with open(path, "rb") as fh:
        pos, seen = size, -1
        while pos > 0:
            step = min(65536, pos)
            pos -= step
            fh.seek(pos)
            block = fh.read(step)
            for i in range(len(block) - 1, -1, -1):
                if block[i] == 10:
                    seen += 1
                    if seen == lines:
                        return pos + i + 1
        return 0


def _pump(frames, files, offsets, segment):
    """Send what is new in ``files`` from ``offsets``; True when anything was sent."""
    sent = False
    for path, stream, until in files:
        key = manifest.dec(path)
        offset = offsets.get(key, 0)
        if until is not None and offset >= until:
            continue
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read(1 << 16 if until is None else min(1 << 16, until - offset))
        except OSError:
            continue
        if data:
            frames.send({"t": "data", "f": key, "o": offset, "s": stream, "seg": segment}, data)
            offsets[key] = offset + len(data)
            sent = True
    return sent


def _drain(frames, rdir, job, streams, node, offsets, segment, settle):
    if settle:
        time.sleep(1.0)  # shared filesystems show a job's last writes a moment late
    files = _segment_files(rdir, job, streams, node)
    while _pump(frames, files, offsets, segment):
        pass


def _placed_job(frames, rdir, k, seg, squeue_argv):
    """The job that took segment ``k`` of a run sent once per GPU type (``seg/<k>.claim``), once one
    did; until then, state frames of the first candidate still queued. None: the client went away.
    When none is queued any more and none took it (all cancelled), the segment's representative."""
    claim = common.under(rdir, layout.segment_file(k, layout.SEGMENT_CLAIM))
    ids = [c[0] for c in seg["candidates"]]
    last, next_poll = None, 0.0
    while True:
        try:
            return manifest.dec(os.readlink(claim))
        except OSError:
            pass
        now = time.time()
        if now >= next_poll:
            next_poll = now + POLL_S
            try:
                live = slurmcmd.live_jobs(squeue_argv)
            except common.AgentError as exc:
                frames.send({"t": "warn", "msg": str(exc), "retry_in": POLL_S})
                live = None
            if live is not None:
                queued = [j for j in ids if j in live]
                if not queued and not os.path.lexists(claim):
                    return seg["job_id"]
                if queued and live[queued[0]] != last:
                    last = live[queued[0]]
                    frames.send({"t": "state", "segment": k, "job_id": queued[0], "squeue": last})
        frames.beat()
        if _client_gone(0.5):
            return None


def mode_follow(args):
    """Stream a run's logs from ``offsets``, segment by segment; with ``follow``, until it ends.

    Given ``find`` (``runs``' selectors) instead of ``run_id``, the follower first finds the run
    (the newest that matches) and sends it in a ``run`` frame, with the ``secrets_sweep`` of the session:
    `rv logs` is then one call to the cluster. With ``tail`` and no ``segment``, that is the last
    segment only.
    """
    root = common.root_path(args["root"])
    frames = Frames()
    only = args.get("segment")
    if args.get("find") is not None:
        head = {"t": "run", "run": None}
        if args.get("secrets_sweep"):
            try:
                head["secrets_sweep"] = runs.sweep_secrets(
                    root, args["secrets_sweep"], slurmcmd.live_jobs(args["squeue"])
                )
            except common.AgentError as exc:
                head["secrets_sweep"] = {"error": str(exc)}
        found = rundir.select_runs(root, args["find"])
        if found:
            head["run"] = max(found, key=lambda info: float(info["meta"].get("created") or 0))
            segs = head["run"]["segments"]
            if only is None and args.get("tail") is not None and segs:
                only = segs[-1]["segment"]
        head["segment"] = only  # which segment alone is shown (None: all), for a reconnect to ask again
        frames.send(head)
        if head["run"] is None:
            return None
        run_id = head["run"]["run_id"]
    else:
        run_id = args["run_id"]
    rdir = rundir.run_path(root, run_id)
    streams = args.get("streams") or ["out", "err"]
    node = args.get("node")
    follow = bool(args.get("follow"))
    offsets = dict(args.get("offsets") or {})
    k = int(args.get("from_segment") or only or 1)
    backoff, next_poll, last_state = POLL_S, 0.0, None
    while True:
        segs = {s["segment"]: s for s in rundir.segments(rdir)}
        seg = segs.get(k)
        if seg is None or not seg["job_id"]:
            ended = common.read_json(common.under(rdir, layout.ENDED))
            if ended is not None or not follow or only:
                frames.send({"t": "end", "ended": ended, "segment": k - 1})
                return None
            frames.beat()
            if _client_gone(1.0):
                return None
            continue
        job = seg["job_id"]
        if follow and seg.get("candidates"):
            # Sent once per GPU type: wait for one of them to take the segment, then follow that one.
            job = _placed_job(frames, rdir, k, seg, args["squeue"])
            if job is None:
                return None
        if args.get("tail") is not None and not offsets:
            for path, _, _ in _segment_files(rdir, job, streams, node):
                offsets[manifest.dec(path)] = _tail_offset(path, int(args["tail"]))
        frames.send({"t": "segment", "segment": k, "job_id": job, "record": seg["record"]})
        on_session = bool((common.read_json(common.under(rdir, layout.RUN_FILE)) or {}).get("on"))
        quick_until = time.time() + QUICK_FOR_S
        while follow:
            files = _segment_files(rdir, job, streams, node)
            if _pump(frames, files, offsets, k):
                continue
            now = time.time()
            if now >= next_poll:
                try:
                    line = slurmcmd.live_jobs(args["squeue"]).get(job)
                    backoff = POLL_S
                    next_poll = now + POLL_S
                except common.AgentError as exc:
                    # Never a reason to stop following: say so, ask again later.
                    frames.send({"t": "warn", "msg": str(exc), "retry_in": backoff})
                    next_poll = now + backoff
                    backoff = min(backoff * 2, 30.0)
                    line = "?"
                if line is None or (on_session and os.path.exists(common.under(rdir, layout.ENDED))):
                    # The job is no longer queued or running (rv run --on: the session's job goes on
                    # after the run's step, whose end is the run's ENDED): drain, then its record.
                    break
                if line != "?" and line != last_state:
                    frames.send({"t": "state", "segment": k, "job_id": job, "squeue": line})
                    last_state = line
            frames.beat()
            if _client_gone(QUICK_S if now < quick_until else SLOW_S):
                return None
        _drain(frames, rdir, job, streams, node, offsets, k, settle=follow)
        record = common.read_json(common.under(rdir, layout.segment_file(k, "json")))
        frames.send({"t": "segment-end", "segment": k, "job_id": job, "record": record})
        if only:
            frames.send(
                {"t": "end", "ended": common.read_json(common.under(rdir, layout.ENDED)), "segment": k}
            )
            return None
        k += 1
        if follow:
            # The job is gone from the queue; its EXIT trap wrote the next segment or ENDED just before.
            deadline = time.time() + 30
            while not os.path.exists(common.under(rdir, layout.segment_file(k, "job"))):
                if os.path.exists(common.under(rdir, layout.ENDED)) or time.time() > deadline:
                    frames.send(
                        {
                            "t": "end",
                            "ended": common.read_json(common.under(rdir, layout.ENDED)),
                            "segment": k - 1,
                        }
                    )
                    return None
                frames.beat()
                if _client_gone(0.5):
                    return None
