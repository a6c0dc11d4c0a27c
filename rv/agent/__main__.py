"""The agent's entry point: the one table of modes, and how a mode's outcome becomes a reply.

``MODE ARGS``: ARGS is one JSON object (or ``z:`` and its zlib-compressed base64, when long); every
reply is zlib-compressed JSON on stdout (``follow`` and ``up`` write frames instead). A failure the
client can explain is a reply with ``error`` and ``code``; an input that ended early (the client
went away) exits 3.
"""

import base64
import contextlib
import errno
import json
import os
import signal
import sys
import zlib

from rv.agent import (
    common,
    envs,
    follow,
    gc,
    images,
    metrics,
    runfiles,
    runs,
    store,
    submit,
    transfer,
    up,
    why,
)

# The one table: every mode the agent answers, and the function that answers it.
MODES = {
    # the snapshot store, a git repository (rv run, rv sync snapshot)
    "snap-put": store.mode_snap_put,
    # rv diff, rv checkout: which commit each run ran, and the diff of two
    "snap-code": runfiles.mode_snap_code,
    # rv sync push / pull
    "scan": transfer.mode_scan,
    "apply": transfer.mode_apply,
    "send": transfer.mode_send,
    # runs: submitting them
    "run-check": submit.mode_run_check,
    "run-submit": submit.mode_run_submit,
    "run-arrived": submit.mode_run_arrived,
    "sweep-submit": submit.mode_sweep_submit,
    # runs that exist
    "runs": runs.mode_runs,
    "follow": follow.mode_follow,
    "run-stop": runs.mode_run_stop,
    "secrets-sweep": runs.mode_secrets_sweep,
    "ckpt-ls": runs.mode_ckpt_ls,
    # rv why: the run's own script judged by sbatch --test-only with one option changed
    "why-probe": why.mode_why_probe,
    # rv sweep results, rv metrics: what programs wrote to $RV_METRICS
    "metrics": metrics.mode_metrics,
    "up": up.mode_up,
    # rv gc, rv status
    "gc": gc.mode_gc,
    "usage": gc.mode_usage,
    # the job's Python environments
    "env": envs.mode_env,
    "venv-ls": envs.mode_venv_ls,
    "venv-rm": envs.mode_venv_rm,
    # container images pulled from registries (rv run --container docker://...)
    "image-pull": images.mode_image_pull,
}


def _on_signal(signum, _frame):
    raise SystemExit(128 + signum)


def main(argv):
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _on_signal)
    mode, raw = argv[1], argv[2]
    if raw.startswith("z:"):  # rv.remote.agent_client.encode_args: long arguments come compressed
        raw = zlib.decompress(base64.b64decode(raw[2:])).decode("utf-8")
    args = json.loads(raw)
    common.UMASK = int(args.get("umask", 0o077)) & 0o777
    os.umask(common.UMASK)
    try:
        if "root" in args and "umask" in args:
            # Only a client that states the policy narrows the root: one that sends no umask (an
            # older caller) still writes private files but must not undo share_with_group.
            common.protect_root(common.root_path(args["root"]))
        result = MODES[mode](args)
        if result is not None:
            common.reply(result)
        return 0
    except common.Truncated:
        sys.stderr.write("rv agent: input ended early (the client went away); partial files removed\n")
        return 3
    except common.AgentError as exc:
        common.reply({"error": str(exc), "code": exc.code})
        return 0
    except OSError as exc:
        if mode == "send":
            raise  # mid-stream: a reply here would corrupt the frames; the traceback goes to stderr
        where = exc.filename.decode("utf-8", "replace") if isinstance(exc.filename, bytes) else exc.filename
        name = errno.errorcode.get(exc.errno or 0, "")
        common.reply({"error": "%s: %s" % (exc.strerror or exc, where), "code": "oserror", "errno": name})
        return 0
    finally:
        for path in list(common.cleanup_paths):
            with contextlib.suppress(OSError):
                common.force_rmtree(path) if os.path.isdir(path) else os.unlink(path)
