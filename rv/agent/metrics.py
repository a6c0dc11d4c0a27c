"""``metrics``: what each run's program wrote to ``RV_METRICS``, summed up for a whole table at once.

The file (``RV_METRICS``; rv sets it in every job): JSON lines, one object per line, written by the
program (rv_train writes one per step). A numeric value is a metric; an integer ``step`` is the x
axis (a line without one belongs to the step before it; a file with no steps counts lines); nested
objects are flattened with ``/`` (``{"train": {"loss": 1}}`` is ``train/loss``); strings, booleans,
nulls and non-finite numbers are not metrics.

Where: ``<root>/outputs/<project>/<name>/metrics.jsonl``, in the run's output folder
(``RV_OUTPUT_DIR``), unless the run's ``run.json`` names another file (``"metrics"``). So it survives
``rv gc`` removing the run's folder, each sweep point (a run name of its own) has its own, and every
segment of a run, and a later run of the same name that resumes it, appends to one file.

Reading it, for ``rv sweep results`` and ``rv metrics`` (one call for every run of the table):

* A last line with no newline that does not parse is a write in progress: skipped, ``partial``. A
  line that a killed segment left half-written and the next segment appended to is split: the
  object that ends it counts (``joined_lines``). Any other line that does not parse is counted
  (``bad_lines``, the first one's number) and skipped.
* A step below one already seen means the program started again from an earlier checkpoint (a
  resumed segment repeats the steps after it): the lines before it at that step or above are
  superseded, as if the file had been cut back there (``rewinds`` counts the lines left out). Lines
  that share a step without going back (a training line, then an evaluation line) all count.
* Per metric: the last value and its x, the lowest and the highest with theirs (which one is best is
  the reader's choice: ``--sort loss:min``), how many values, and, for the metrics asked for, a
  series of at most ``max_points`` ``[x, value]`` pairs, evenly thinned, always with the last one.

Memory stays small whatever the file's length: one pass (two when the file rewinds: the first
learns which lines are superseded), a bounded buffer per series.
"""

import json
import os
import re

from rv.agent import common, layout, manifest

DEFAULT_POINTS = 100
MAX_POINTS = 1000

_RUN_ID = re.compile(r"^[A-Za-z0-9._-]+$")
_FLATTEN_DEPTH = 4


def metrics_path(root, run_id, meta):
    """The metrics file of the run ``run_id`` whose ``run.json`` is ``meta``."""
    named = meta.get("metrics")
    if isinstance(named, str) and named.startswith("/"):
        return manifest.enc(named)
    folder = layout.output_dir(meta.get("project") or "", meta.get("name") or run_id)
    return common.under(root, folder, layout.METRICS_FILE)


def _step(obj):
    step = obj.get("step")
    if isinstance(step, bool):
        return None
    if isinstance(step, int):
        return step
    if isinstance(step, float) and step - step == 0.0 and step == int(step):
        return int(step)
    return None


def _flatten(obj, prefix, out, depth):
    """The finite numbers of ``obj`` by name (nested objects as ``a/b``). JSON gives exact types, so
    ``type() is int`` leaves booleans out; ``v - v == 0`` is false for NaN and the infinities."""
    for key, value in obj.items():
        kind = type(value)
        if kind is float:
            if value - value == 0.0:
                out[prefix + key] = value
        elif kind is int:
            out[prefix + key] = value
        elif kind is dict and depth < _FLATTEN_DEPTH:
            _flatten(value, prefix + key + "/", out, depth + 1)
    return out


class _Series(object):
    """At most ``2 * limit`` samples kept, every ``stride``-th one: halved (and the stride doubled)
    when full, so a file of any length is thinned evenly in one pass."""

    def __init__(self, limit):
        self.limit = limit
        self.kept = []
        self.stride = 1
        self.seen = 0
        self.last = None

    def add(self, x, value):
        self.last = [x, value]
        if self.seen % self.stride == 0:
            self.kept.append(self.last)
            if len(self.kept) >= 2 * self.limit:
                self.kept = self.kept[::2]
                self.stride *= 2
        self.seen += 1

    def points(self):
        kept = list(self.kept)
        if self.last is not None and (not kept or kept[-1] is not self.last):
            kept.append(self.last)
        if len(kept) <= self.limit:
            return kept
        # Evenly spaced, the first and the last included.
        n = self.limit
        if n == 1:
            return [kept[-1]]
        return [kept[(i * (len(kept) - 1)) // (n - 1)] for i in range(n)]


class _Metric(object):
    __slots__ = ("count", "last", "last_x", "max", "max_x", "min", "min_x", "series")

    def __init__(self, series):
        self.count = 0
        self.series = series
        self.last = self.last_x = self.min = self.min_x = self.max = self.max_x = None

    def add(self, x, value):
        if self.count == 0 or value < self.min:
            self.min, self.min_x = value, x
        if self.count == 0 or value > self.max:
            self.max, self.max_x = value, x
        self.last, self.last_x = value, x
        self.count += 1
        if self.series is not None:
            self.series.add(x, value)

    def reply(self):
        out = {
            "last": self.last, "last_x": self.last_x, "min": self.min, "min_x": self.min_x,
            "max": self.max, "max_x": self.max_x, "count": self.count,
        }  # fmt: skip
        if self.series is not None:
            out["series"] = self.series.points()
        return out


def _lines(path):
    """(line number from 1, bytes without the newline, whether it ended with one)."""
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            ended = raw.endswith(b"\n")
            yield number, raw.rstrip(b"\r\n") if ended else raw, ended


_DECODER = json.JSONDecoder()


def _parse(raw, ended):
    """(object or None, whether it was recovered from behind a half-written line). A last line with
    no newline is never split: it may be a write in progress whose inner object is already closed."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError is one
        return (_recover(raw) if ended else None), True
    return (obj if isinstance(obj, dict) else None), False


def _recover(raw):
    """A segment killed mid-write leaves a line without its newline, and the next segment's first
    line is appended to it: ``{"step": 51, "lo{"step": 41, ...}``. The object that ends the line is
    the new segment's: find it (the first ``{`` from which one object runs to the line's end)."""
    text = raw.decode("utf-8", "replace").rstrip()
    start = text.find("{", 1)
    while start != -1:
        try:
            obj, end = _DECODER.raw_decode(text, start)
        except ValueError:
            obj, end = None, -1
        if end == len(text) and isinstance(obj, dict):
            return obj
        start = text.find("{", start + 1)
    return None


def _superseded(steps):
    """Line numbers a later rewind supersedes: a line whose step is below the highest step before it
    sends the program back there, so every earlier line at that step or above is out of date. Lines
    that share a step without going back (a training line and an evaluation line) all count."""
    out = set()
    events = []
    high = None
    for number, step in steps:
        events.append((number, step, high is not None and step < high))
        high = step if high is None else max(high, step)
    back_to = None
    for number, step, rewind in reversed(events):
        if back_to is not None and step >= back_to:
            out.add(number)
        if rewind and (back_to is None or step < back_to):
            back_to = step
    return out


def _summarise(path, wanted, limit, skip):
    """One pass over the file; ``skip``: line numbers to leave out. Returns (reply, steps) where
    steps lists (line number, step) of every line with a step, and reply["rewinds"] whether a step
    went back."""
    metrics = {}
    steps = []
    out = {"lines": 0, "bad_lines": 0, "first_bad_line": None, "partial": False, "joined_lines": 0, "x": None}
    high = None
    rewound = False
    last_step = None
    for number, raw, ended in _lines(path):
        out["lines"] = number
        if not raw.strip():
            continue
        obj, recovered = _parse(raw, ended)
        if recovered and obj is not None:
            out["joined_lines"] += 1
        if obj is None:
            if not ended:
                out["partial"] = True  # a write in progress
            else:
                out["bad_lines"] += 1
                if out["first_bad_line"] is None:
                    out["first_bad_line"] = number
            continue
        step = _step(obj)
        if step is not None:
            steps.append((number, step))
            if high is not None and step < high:
                rewound = True
            high = step if high is None else max(high, step)
        if number in skip:
            continue
        values = _flatten(obj, "", {}, 0)
        values.pop("step", None)
        if step is not None:
            x = last_step = step
        else:
            # A line without a step (an evaluation, a summary) belongs to the step before it.
            x = number if last_step is None else last_step
        for name, value in values.items():
            metric = metrics.get(name)
            if metric is None:
                series = _Series(limit) if wanted is True or (wanted and name in wanted) else None
                metric = metrics[name] = _Metric(series)
            metric.add(x, value)
    out["x"] = "line" if high is None else "step"
    out["metrics"] = dict((name, m.reply()) for name, m in sorted(metrics.items()))
    return out, steps, rewound


def summarise_file(path, series=True, limit=DEFAULT_POINTS):
    """The summary of one metrics file (see the module's docstring); ``series``: True for every
    metric, a list of names, or False."""
    limit = max(1, min(int(limit), MAX_POINTS))
    wanted = series if series is True else set(series or ())
    out, steps, rewound = _summarise(path, wanted, limit, ())
    out["rewinds"] = 0
    if rewound:
        skip = _superseded(steps)
        out, _, _ = _summarise(path, wanted, limit, skip)
        out["rewinds"] = len(skip)
    return out


def read_runs(root, run_ids, series=True, limit=DEFAULT_POINTS):
    """``[{run_id, path, exists, ...summary}]`` for each run, in the order asked.

    Also the piece a ``runs`` call can carry along (``rv sweep results``: states and metrics in one
    round trip)."""
    out = []
    for run_id in run_ids:
        if not isinstance(run_id, str) or not _RUN_ID.match(run_id) or run_id.startswith("."):
            out.append({"run_id": run_id, "error": "bad run id"})
            continue
        meta = common.read_json(common.under(root, layout.run_dir(run_id), layout.RUN_FILE))
        if not isinstance(meta, dict):
            out.append({"run_id": run_id, "error": "no such run"})
            continue
        path = metrics_path(root, run_id, meta)
        row = {"run_id": run_id, "path": manifest.dec(path), "exists": os.path.isfile(path)}
        if row["exists"]:
            try:
                row["size"] = os.path.getsize(path)
                row.update(summarise_file(path, series, limit))
            except OSError as exc:
                row["error"] = "%s: %s" % (exc.strerror or exc, manifest.dec(path))
        out.append(row)
    return out


def mode_metrics(args):
    """``{"root", "runs": [run id], "series": true | [name] | false, "points": N}`` ->
    ``{"runs": [...]}`` (see :func:`read_runs`)."""
    root = common.root_path(args["root"])
    runs = args.get("runs") or []
    if not isinstance(runs, list):
        raise common.AgentError("runs must be a list of run ids", "usage")
    return {"runs": read_runs(root, runs, args.get("series", True), args.get("points") or DEFAULT_POINTS)}
