"""``snap-code``: the code a run ran, from the git store (``rv diff``, ``rv checkout``).

One call resolves each run the user named (a run id, a name: its newest run, or a job id of any
segment) to its snapshot and the commit the store holds for it, and, asked for a diff, answers
``git diff`` of the two commits as git prints it (no colour, no external diff tool, none of the
user's configuration: the store's own attributes turn conversions off).
"""

import re
import shutil

from rv.agent import common, manifest, rundir, store

_JOB_ID = re.compile(r"^\d+(?:_\d+)?$")

DIFF_MAX = 64 << 20  # bytes of diff text one reply carries


def _resolve(root, ref):
    """(run id, name, snapshot id, the user's commit it was made from) of the run ``ref`` names, the
    newest of several of one name."""
    found = rundir.select_runs(
        root, {"ids": [ref], "any_names": [ref], "job_ids": [ref] if _JOB_ID.match(ref) else []}
    )
    if not found:
        points = rundir.select_runs(root, {"sweeps": [ref]})
        if points:
            # rv.job.runfiles.sweep_message's words: this file runs on the cluster without rv's package.
            raise common.AgentError(
                "%s is a sweep of %d point(s), and rv diff and rv checkout take runs: name points of it, "
                "e.g. %s/0 and %s/1 (rv sweep results %s lists them)" % (ref, len(points), ref, ref, ref),
                "usage",
            )
        raise common.AgentError("no run %r on the cluster (by name, run id or job id)" % ref, "not-found")
    meta = found[-1]["meta"]
    return found[-1]["run_id"], meta.get("name"), meta.get("snapshot"), meta.get("commit")


def mode_snap_code(args):
    root = common.root_path(args["root"])
    store.require_git()
    git_store = store.store_path(root)
    out = {"runs": []}
    for ref in args["refs"]:
        run_id, name, sid, made_from = _resolve(root, ref)
        commit = None
        if sid and re.match(r"^[0-9a-f]{24}$", sid):
            commit = store.resolve(git_store, sid)
        if commit is None:
            raise common.AgentError(
                "run %s: its snapshot %s is not in the store (removed by rv gc, lost to a purge, or made by "
                "an rv before the git store)" % (name or run_id, sid),
                "not-found",
            )
        out["runs"].append(
            {
                "ref": ref,
                "run_id": run_id,
                "name": name,
                "snapshot": sid,
                "commit": commit,
                "made_from": made_from,
            }
        )
    if args.get("diff"):
        a, b = (r["commit"] for r in out["runs"])
        text = _diff(root, git_store, a, b)
        out["diff"] = text[:DIFF_MAX].decode("utf-8", "surrogateescape")
        out["diff_cut"] = len(text) > DIFF_MAX
    return out


def _diff(root, git_store, a, b):
    """``git diff A B`` as git prints it for a user's repository: from an empty repository of this
    call's own that borrows the store's objects, since the store's attributes mark every file
    ``-diff`` (no text diff) along with the conversions they turn off."""
    tmp = common.temp_name(root, "diff")
    common.cleanup_paths.add(tmp)
    try:
        store.run_git(tmp, ["init", "-q", "--bare", "--template=", manifest.dec(tmp)], env=store.git_env(tmp))
        env = store.git_env(
            tmp, GIT_ALTERNATE_OBJECT_DIRECTORIES=manifest.dec(common.join(git_store, b"objects"))
        )
        _rc, text, _err = store.run_git(tmp, ["diff", "--no-color", "--no-ext-diff", a, b], env=env)
        return text
    finally:
        common.cleanup_paths.discard(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
