"""Where rv keeps things under a profile's remote root, and what a checkpoint folder holds.

One place for both layouts, read by every side: the laptop (:class:`rv.layout.RemoteLayout`, a typed
view over these names), the agent, and the job's runtime (``job.sh`` spells the names in shell; a unit
test holds its spellings to these). rv_train writes the checkpoint layout; it imports only
:mod:`rv.contract` of rv, so it keeps its own copy of these names and a unit test holds the two equal.

<root>/store.git/               the snapshot store: a bare git repository (rv.agent.store); each
                                snapshot a commit held by refs/rv/snapshots/<id>
    rv-incoming-<pid>-<rand>/   a send's quarantine: packs wait here until index-pack accepted them
<root>/snapshots/<id>.git.json  the snapshot's provenance, touched at every use (gc's age)
<root>/objects/.lock            the store's lock (gc exclusive, uploads shared)
The store of earlier rv versions (rv.agent.oldstore), kept while runs it queued use it, then
collected by rv gc:
<root>/objects/ab/abcdef...     content-addressed file store (git blob ids)
<root>/snapshots/<id>/          immutable tree of hard links into objects/ (read-only) ...
<root>/snapshots/<id>.manifest  ... and its manifest (one line per file; a layer's too)
<root>/snapshots/<id>.layer/    or a layer over another snapshot: tree/ (what differs), remove, base
<root>/snapshots/<id>.json      the snapshot's provenance (and a layer's rows), beside it
<root>/workspaces/<project>/<branch>/   mutable mirror for `rv sync push`
<root>/runs/<run id>/           one run (a chain of Slurm jobs, its segments); everything but its
    run.json                    checkpoints and outputs, so one rmtree cleans it up:
    job.sbatch                  the batch script, the same for every segment
    job.<i>.sbatch, candidates  a run over several GPU types: a script per type; "<script> <type>" lines
    array.sbatch                a sweep's part: the job array's script (in the run of its task 0)
    submit.env                  the environment segment 1 was submitted with (for continuations)
    secrets.env                 `rv env` values, mode 0600, deleted when the run ends
    seg/<k>.job, seg/<k>.json   segment k's job id (written by its submitter) and record (by the job);
    seg/<k>.candidates, .claim  the jobs sent for it once per GPU type; who follows it (`rv logs`)
    STOP, ENDED                 `rv stop` was asked; the run is over (JSON: why, exit code)
    faults                      GPU faults the run continued after: "<segment> <node> <what>" lines
    stats/<k>/<node>.json       what segment k's program used on that node (rv/agent/stats.py: CPU
    stats/<k>/<node>.gpu.jsonl  time, peak memory, GPU figures) and its GPU samples (rv stats)
    work/                       RV_WORK_DIR: the run's private copy of its snapshot (checked out
    work.index                  from the store with an index of its own: what the job checked)
    jobs/<job id>/              RV_JOB_DIR: per Slurm job (node exit codes, stop deliveries)
    jobs/<job id>/env.sh        the program's environment, for `rv ssh`/`rv up` shells (0600, holds
                                the secrets; removed when the job ends)
    up.alive, up.detached       `rv up`: the watchdog's heartbeat; --detach (the job keeps itself)
    node-ssh/                   `rv code`: the node's sshd config, host key, authorized keys, scripts
    jupyter/                    `rv jupyter`: its config (the token), kernel spec, runtime file, log
    logs/<job id>.out|.err      batch logs; multi-node: <job id>-node<i>.out|.err
<root>/names/<project>/<name>   the id of the newest run of that name (refusing a second live one);
                                a sweep's is a folder: names/<project>/<sweep>/<index>
<root>/checkpoints/<project>/<name>/    RV_CHECKPOINT_DIR: shared by the runs of one name (resume)
<root>/outputs/<project>/<name>/        RV_OUTPUT_DIR: likewise; metrics.jsonl is RV_METRICS's default
<root>/cache/{hf,torch,triton,pip,wandb,xdg,uv}   caches kept off the home quota
<root>/envs/<key>/              the jobs' Python environments (rv.agent.envs)
<root>/images/<key>/            images pulled from registries, by reference and digest (rv.agent.images)
<root>/tools/uv, tools/python   uv, installed once when the cluster has none, and the Pythons it fetches
<root>/tmp/                     staging for uploads; renamed into place when complete
<root>/runtime/job-<hash>.sh    rv's job runtime (rv/agent/job.sh, its job_*.sh parts joined) that
                                batch scripts source, and
<root>/runtime/rank-label-<hash>.py   its rank labeller, notify-<hash>.py its webhook poster and
                                stats-<hash>.py its meter; named by content, read-only, written once

A checkpoint folder in rv_train's layout (any other files are the program's own)::

    step_0000040/       a complete checkpoint: it has COMPLETE (step_<N>: any number of digits reads)
        COMPLETE        written last
    step_0000050.tmp/   being written, or left by a crash: never a checkpoint
    PREEMPTED           the stop protocol's marker (rv.contract): the program saved on the stop signal

Every rv writes here is private to the user (folders 0700, files 0600, executables 0700) unless the
profile sets ``share_with_group = true``: then the group may read (0750/0640).

Paths here are relative to the root (or to a run's folder, or a checkpoint folder), joined with "/":
the laptop joins them under its remote root as text, the agent as bytes (:func:`rv.agent.common.under`).
Imports nothing of the agent: laptop modules import this one (a shared format: see :mod:`rv.agent`).
"""

import re

# --- under the root -------------------------------------------------------------------------------
STORE = "store.git"
OBJECTS = "objects"
SNAPSHOTS = "snapshots"
WORKSPACES = "workspaces"
RUNS = "runs"
NAMES = "names"
CHECKPOINTS = "checkpoints"
OUTPUTS = "outputs"
CACHE = "cache"
ENVS = "envs"
IMAGES = "images"  # container images pulled from registries (rv run --container docker://...)
TOOLS = "tools"
TMP = "tmp"
RUNTIME = "runtime"
UV_HOME = TOOLS + "/uv"  # uv, installed once when the cluster has none (its binary: bin/uv)
UV_PYTHONS = TOOLS + "/python"  # the interpreters uv fetches (UV_PYTHON_INSTALL_DIR)
UV_CACHE = CACHE + "/uv"  # UV_CACHE_DIR

# In the git store: the ref holding a snapshot's commit, and a send's quarantine (a folder prefix).
SNAPSHOT_REF_PREFIX = "refs/rv/snapshots/"
STORE_QUARANTINE = "rv-incoming-"
# In the git store: packs set aside as damaged (a folder per event, removed by rv gc once old), and
# the last failure of a job's background gc (rv status shows it). storecheck.py spells them too.
STORE_DAMAGED = "rv-damaged"
STORE_GC_FAILED = "rv-gc-failed"
# In the git store: the snapshots found whole, and the files their objects were found in (store.py).
STORE_VERIFIED = "rv-verified"
# In snapshots/: a git store snapshot's meta file. Not <id>.json: that is the same snapshot's meta in
# the store of earlier rv versions, which an older rv (its jobs, its gc) may still read beside it.
SNAPSHOT_META = ".git.json"

# The store of earlier rv versions: beside a snapshot's folder its provenance, its manifest; or,
# instead of the folder, a layer.
OLD_SNAPSHOT_META = ".json"
SNAPSHOT_MANIFEST = ".manifest"
SNAPSHOT_LAYER = ".layer"

LOCK = ".lock"  # a name's lock (beside its index), the store's (objects/.lock)

# --- in a run's folder ----------------------------------------------------------------------------
RUN_FILE = "run.json"
SCRIPT_SUFFIX = ".sbatch"  # every batch script rv writes: runtime files still named in one are kept
SCRIPT = "job" + SCRIPT_SUFFIX
CANDIDATES = "candidates"  # a run over several GPU types: "<script> <type>" lines, in preference order
ARRAY_SCRIPT = "array" + SCRIPT_SUFFIX
SUBMIT_ENV = "submit.env"
SECRETS = "secrets.env"
STOP = "STOP"
ENDED = "ENDED"
FAULTS = "faults"
STATS = "stats"  # stats/<segment>/<node>.json and .gpu.jsonl: rv's meter (rv/agent/stats.py)
SEG = "seg"
WORK = "work"
WORK_INDEX = WORK + ".index"  # the git index the work dir was checked out with (job.sh)
WORK_CHANGES = WORK + ".changes"  # --work-dir node: what the program changed (files.tar, deleted)
JOBS = "jobs"
JOB_ENV = "env.sh"  # jobs/<id>/env.sh: the job's environment, secrets included
LOGS = "logs"
UP_ALIVE = "up.alive"  # rv up: the watchdog's heartbeat counter, read by the job's holder
UP_DETACHED = "up.detached"  # rv up --detach: the holder keeps the allocation without a watchdog
NODE_SSH = "node-ssh"  # rv code: the session's sshd on the node (config, host key, scripts)
JUPYTER = "jupyter"  # rv jupyter: JupyterLab's config (the token), kernel spec, runtime file, log

# What segment k leaves in seg/<k>.<kind>: its job id, its record, the jobs sent for it once per GPU
# type (its submitter and its job write these), and the claim of whoever follows it (rv logs).
SEGMENT_RECORDS = ("job", "json", "candidates")
SEGMENT_CLAIM = "claim"
SEGMENT_FILES = SEGMENT_RECORDS + (SEGMENT_CLAIM,)

# --- in a run's output folder ---------------------------------------------------------------------
METRICS_FILE = "metrics.jsonl"  # RV_METRICS's default: later segments append to it

# --- in a checkpoint folder (rv_train's layout) ---------------------------------------------------
STEP_PREFIX = "step_"
STEP_DIGITS = 7  # how rv_train names a step: step_0000040
STEP_NAME = re.compile(r"^%s(\d+)$" % re.escape(STEP_PREFIX))  # how rv reads one: any number of digits
COMPLETE = "COMPLETE"  # in a step's folder, written last: only a step that has it is a checkpoint
PARTIAL = ".tmp"  # a step's folder being written: step_<N>.tmp
PREEMPTED = "PREEMPTED"  # the stop protocol's marker (rv.contract.PREEMPTED)


def _join(*parts):
    return "/".join(parts)


def store_lock():
    return _join(OBJECTS, LOCK)


def snapshot_ref(snapshot_id):
    """The ref in the git store (``STORE``) that holds the snapshot's commit."""
    return SNAPSHOT_REF_PREFIX + snapshot_id


def snapshot_meta(snapshot_id):
    """The git store's meta file of a snapshot (provenance; its mtime says when it was last used)."""
    return _join(SNAPSHOTS, snapshot_id) + SNAPSHOT_META


# --- the store of earlier rv versions (rv.agent.oldstore)


def object_file(oid):
    return _join(OBJECTS, oid[:2], oid)


def snapshot(snapshot_id):
    return _join(SNAPSHOTS, snapshot_id)


def old_snapshot_meta(snapshot_id):
    return snapshot(snapshot_id) + OLD_SNAPSHOT_META


def snapshot_manifest(snapshot_id):
    return snapshot(snapshot_id) + SNAPSHOT_MANIFEST


def snapshot_layer(snapshot_id):
    return snapshot(snapshot_id) + SNAPSHOT_LAYER


# --- the rest of the root


def workspace(project, branch):
    return _join(WORKSPACES, project, branch.replace("/", "_"))


def run_dir(run_id):
    return _join(RUNS, run_id)


def name_index(project, name):
    """The file holding the id of the newest run of ``name``. A sweep's points (``SWEEP/INDEX``)
    have theirs in a folder ``SWEEP``: a sweep's name index is a folder, a plain run's a file."""
    return _join(NAMES, project, name)


def name_lock(project, name):
    return name_index(project, name) + LOCK


def checkpoint_dir(project, name):
    return _join(CHECKPOINTS, project, name)


def output_dir(project, name):
    return _join(OUTPUTS, project, name)


def runtime_file(name):
    return _join(RUNTIME, name)


# --- relative to a run's folder


def candidate_script(index):
    """A run over several GPU types: the batch script of its ``index``-th type (from 1)."""
    return "job.%d%s" % (index, SCRIPT_SUFFIX)


def segment_file(segment, kind):
    """``seg/<k>.<kind>``, kind one of :data:`SEGMENT_FILES`."""
    if kind not in SEGMENT_FILES:
        raise ValueError("not a segment file: %r" % kind)
    return _join(SEG, "%d.%s" % (segment, kind))


def job_dir(job_id):
    return _join(JOBS, job_id)


def job_env(job_id):
    return _join(JOBS, job_id, JOB_ENV)


def log_name(job_id, stream="out", node=None):
    """A batch log's file name in ``logs/``: ``<job id>.out``, multi-node ``<job id>-node<i>.out``."""
    return "%s%s.%s" % (job_id, "" if node is None else "-node%d" % node, stream)


def log_file(job_id, stream="out", node=None):
    return _join(LOGS, log_name(job_id, stream, node))


# --- relative to a checkpoint folder


def step_name(step):
    """The folder rv_train saves step ``step`` into: ``step_0000040``."""
    return "%s%0*d" % (STEP_PREFIX, STEP_DIGITS, step)


def step_of(name):
    """The step a checkpoint folder's entry is named for (``step_<N>``), or None."""
    m = STEP_NAME.match(name)
    return int(m.group(1)) if m else None


def step_complete(name):
    return _join(name, COMPLETE)
