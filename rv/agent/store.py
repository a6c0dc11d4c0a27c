"""The snapshot store: a bare git repository under the remote root (``store.git``).

A snapshot is a git commit: its tree holds the snapshot's files (git's modes keep exec bits and
symlinks), its message names the snapshot, and nothing else goes into it, so the same files always
make the same commit. ``refs/rv/snapshots/<id>`` holds it while a run, a cache or rv's laptop needs
it; ``snapshots/<id>.git.json`` beside the store keeps the provenance and says when it was last used.

Mode ``snap-put`` receives what the laptop's store sent (:mod:`rv.files.packs`): whole packs made by
``git pack-objects``, each taken in by ``git index-pack --fix-thin`` (a thin pack's bases come from
the store), then checks that every object the snapshot's commit reaches is here, and only then moves
the ref. Rules every mode keeps:

* A pack is written into a folder of this call's own (a quarantine, as git's receive-pack has) and
  moved into ``objects/pack`` only once index-pack accepted it whole, its index last: an
  interrupted send leaves no visible pack (the quarantine goes with the call, or with the next
  call's sweep of stale ones) and no ref.
* A ref exists only for a commit whose every object was found here when it was set. That is checked
  again at every use (``git rev-list --objects --missing=print``: an index lookup per object), since
  a scratch filesystem's purge deletes files and leaves folders: what is missing is named, and the
  laptop sends it again.
* Packs pile up one per send; ``git gc --auto`` consolidates them by git's own rules, run by jobs
  in their background on their compute node (never detached on the login node: gc.autoDetach is
  off), through :mod:`rv.agent.storecheck`, which writes a failure where ``rv status`` shows it.
  ``rv gc`` drops refs and lets git prune what they held, with a grace period; uploads hold the
  store lock shared, gc exclusively. Unreachable objects younger than the grace go into one cruft
  pack (never exploded into loose files: a file quota counts them), and a ref whose objects are
  gone (it would fail every gc) is dropped first.
* A pack whose bytes do not read back (written over: every file is there) is set aside by the job
  that finds it (:mod:`rv.agent.storecheck`); its objects are then missing, which the next send
  mends. ``rv gc`` removes set-aside packs once older than the grace.
* The user's git configuration never applies: no system or global config is read, and
  ``info/attributes`` turns off every conversion (eol, filters, ident, export-ignore), so a
  checkout writes each blob's bytes exactly.

The store of earlier rv versions (one file per object, trees of hard links) is read by
:mod:`rv.agent.oldstore`.
"""

import contextlib
import json
import os
import re
import shutil
import struct
import subprocess
import time

from rv.agent import common, layout, locks, manifest, packfile, storecheck

META_VERSION = 4

# rev-list --missing=print reports missing trees as well as blobs from git 2.20 (before, a missing
# tree stopped it). The job needs read-tree and checkout-index, which every git has.
MIN_GIT = (2, 20)

# Every conversion off: a checkout (or archive) writes each blob's bytes as they were listed.
ATTRIBUTES = b"* -text -eol -crlf -filter -ident -working-tree-encoding -export-ignore -export-subst -diff\n"

CONFIG = (
    b"[core]\n"
    b"\trepositoryformatversion = 0\n"
    b"\tbare = true\n"
    b"\tlogAllRefUpdates = false\n"
    b"\tautocrlf = false\n"
    b"\tsymlinks = true\n"
    b"\tfileMode = true\n"
    b"[gc]\n"
    # Never a repack left running in the background of a login node others share: jobs run git's
    # gc --auto, in their own background, on their compute node (rv/agent/job.sh: rv_store_tidy).
    b"\tautoDetach = false\n"
    b"[pack]\n"
    b"\tthreads = 1\n"
)

STALE_QUARANTINE_S = common.TMP_STALE_S

_SID = re.compile(r"^[0-9a-f]{24}$")

_OID = re.compile(r"^[0-9a-f]{40}$")


def check_sid(sid):
    if not isinstance(sid, str) or not _SID.match(sid):
        raise common.AgentError("bad snapshot id %r" % (sid,), "usage")
    return sid


def check_oid(oid):
    if not isinstance(oid, str) or not _OID.match(oid):
        raise common.AgentError("bad object id %r" % (oid,), "usage")
    return oid


def store_path(root):
    return common.under(root, layout.STORE)


def meta_path(root, sid):
    # Not <id>.json: that is the meta file of the same snapshot in the store of earlier rv versions,
    # which an older rv (its jobs, its gc) may still read beside this one.
    return common.under(root, layout.snapshot_meta(check_sid(sid)))


# -- git ---------------------------------------------------------------------------------------------


def git_env(store, **extra):
    """git's environment for the store: its folder, and nothing of the user's own configuration."""
    env = dict(os.environ)
    for key in list(env):
        if key.startswith("GIT_"):
            del env[key]  # a GIT_DIR or GIT_INDEX_FILE from a login script must not redirect git
    env.update(
        GIT_DIR=manifest.dec(store),
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,  # git >= 2.32; older git reads $HOME's, hence HOME below
        HOME=manifest.dec(store),
        XDG_CONFIG_HOME=manifest.dec(store),
        GIT_TERMINAL_PROMPT="0",
        LC_ALL="C",
    )
    env.update(extra)
    return env


def run_git(store, args, stdin=None, env=None, ok=(0,)):
    """``git ARGS`` on the store: (exit code, stdout, stderr); an exit code not in ``ok`` raises."""
    try:
        proc = subprocess.Popen(
            ["git"] + list(args),
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env or git_env(store),
            cwd=store if os.path.isdir(store) else None,
        )
    except OSError:
        raise common.AgentError(NO_GIT, "git") from None
    out, err = proc.communicate(stdin)
    if ok is not None and proc.returncode not in ok:
        raise common.AgentError(
            "git %s failed in %s: %s"
            % (args[0], manifest.dec(store), err.decode("utf-8", "replace").strip()[-400:]),
            "remote",
        )
    return proc.returncode, out, err


NO_GIT = (
    "git is not installed on the cluster (no `git` on PATH): rv's store is a git repository; "
    "install git there, or load it in ~/.bashrc (module load git), on the login node and the compute nodes"
)

_VERSION = []


def git_version():
    """The cluster's git version as a tuple, or None when there is no git (asked once per call)."""
    if not _VERSION:
        try:
            out = subprocess.check_output(["git", "--version"], stderr=subprocess.STDOUT)
        except (OSError, subprocess.CalledProcessError):
            _VERSION.append(None)
        else:
            found = re.search(rb"(\d+)\.(\d+)(?:\.(\d+))?", out)
            _VERSION.append(tuple(int(x) for x in found.groups("0")) if found else None)
    return _VERSION[0]


def git_problem():
    """What is wrong with the cluster's git for rv's store, or None."""
    version = git_version()
    if version is None:
        return NO_GIT
    if version[:2] < MIN_GIT:
        return (
            "git %s on the cluster is too old for rv's store (it needs %d.%d or newer): load a newer git"
            % (
                ".".join(str(v) for v in version),
                MIN_GIT[0],
                MIN_GIT[1],
            )
        )
    return None


def require_git():
    problem = git_problem()
    if problem is not None:
        raise common.AgentError(problem, "git")


# -- the store ---------------------------------------------------------------------------------------


def _write_if_missing(path, data):
    if not os.path.exists(path):
        common.makedirs(os.path.dirname(path), 0o700)
        common.write_atomic(path, data, 0o644)


def ensure_store(root):
    """The store's folder, made on first use and mended after a purge took some of its files.

    A purge leaves folders and deletes files: git needs ``HEAD`` and ``config`` to know a
    repository, and the attributes keep checkouts exact; each is written again when missing.
    """
    store = store_path(root)
    if not os.path.isdir(common.join(store, b"objects")):
        common.makedirs(root, 0o700)
        tmp = common.temp_name(root, "store")
        common.cleanup_paths.add(tmp)
        try:
            # --template= (empty): no sample hooks, no description; the files git needs and ours.
            run_git(tmp, ["init", "-q", "--bare", "--template=", manifest.dec(tmp)], env=git_env(tmp))
            common.write_atomic(common.join(tmp, b"config"), CONFIG, 0o644)
            _write_if_missing(common.join(tmp, b"info", b"attributes"), ATTRIBUTES)
            try:
                os.rename(tmp, store)
            except OSError:
                if not os.path.isdir(common.join(store, b"objects")):
                    raise
                # another upload made it a moment ago
        finally:
            common.cleanup_paths.discard(tmp)
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    _write_if_missing(common.join(store, b"HEAD"), b"ref: refs/heads/main\n")
    _write_if_missing(common.join(store, b"config"), CONFIG)
    _write_if_missing(common.join(store, b"info", b"attributes"), ATTRIBUTES)
    for folder in (b"refs", b"objects/pack", b"objects/info"):
        common.makedirs(common.join(store, folder), 0o700)
    return store


def ref_name(sid):
    return layout.snapshot_ref(check_sid(sid))


def snapshot_refs(store):
    """``{snapshot id: commit}`` of every snapshot ref (one git call)."""
    prefix = layout.SNAPSHOT_REF_PREFIX
    _rc, out, _err = run_git(store, ["for-each-ref", "--format=%(objectname) %(refname)", prefix])
    refs = {}
    for line in out.decode("ascii", "replace").splitlines():
        oid, _, name = line.partition(" ")
        sid = name[len(prefix) :]
        if _SID.match(sid):
            refs[sid] = oid
    return refs


def resolve(store, sid):
    """The commit ``refs/rv/snapshots/<sid>`` holds, or None (its file may be gone: a purge)."""
    rc, out, _err = run_git(store, ["rev-parse", "-q", "--verify", ref_name(sid)], ok=(0, 1, 128))
    oid = out.decode("ascii", "replace").strip()
    return oid if rc == 0 and _OID.match(oid) else None


def missing_objects(store, commit, env=None, bases=()):
    """The ids of objects ``commit`` reaches that the store lacks (the commit itself when it is gone).

    git lists the commit's trees and looks every object up (in pack indexes: cheap); a missing tree
    is reported without what is under it, which the laptop then sends whole. ``bases``: trees known
    whole (:func:`whole_snapshot_missing`), whose objects git then neither lists nor looks up.
    """
    return _walk(store, commit, env, bases)[0]


def _walk(store, commit, env=None, bases=()):
    """(missing ids, the commit's root tree or None when not listed) of ``rev-list --objects``."""
    # A tree after --not marks what it reaches uninteresting (a commit there would not: snapshot
    # commits have no parents, and rev-list marks a commit's trees only for --objects-edge).
    args = ["rev-list", "--objects", "--missing=print", commit] + (["--not"] + list(bases) if bases else [])
    rc, out, err = run_git(store, args, env=env, ok=None)
    if rc != 0:
        rc2, _o, _e = run_git(store, ["cat-file", "-e", commit], env=env, ok=None)
        if rc2 != 0:
            return [commit], None
        raise common.AgentError(
            "the store cannot read snapshot commit %s: %s"
            % (commit, err.decode("utf-8", "replace").strip()[-400:]),
            "remote",
        )
    lines = out.splitlines()
    # The root tree is the one object listed with an empty path ("<id> ").
    roots = [line[:40].decode("ascii") for line in lines[1:3] if len(line) == 41 and line.endswith(b" ")]
    return [line[1:41].decode("ascii") for line in lines if line.startswith(b"?")], (roots or [None])[0]


# -- the whole-snapshot check, remembered ---------------------------------------------------------
# Walking every object a snapshot reaches cost 50-160 ms on every upload at 50,000 files (a third of
# an unchanged resync; docs/measured.md). A snapshot found whole stays whole while every file its
# objects were found in is still there, unchanged: the record (store.git/rv-verified) keeps each
# file of objects/pack by (name, size, inode) and each loose-object folder by (inode, mtime) as
# they were before the walk, and the snapshots found whole then. A purge (a file gone), a damaged
# pack set aside (moved into rv-damaged: its name is gone), a gc (packs rewritten, loose objects
# pruned) each leave files the record is not within, and the next upload walks the whole snapshot
# again. A new snapshot is walked minus the trees of the last one found whole (what changed, not
# the whole tree). Bytes written over in place (same name, size, inode) pass this as they pass the
# walk, which reads trees and never a blob's bytes: the job's checkout finds them (storecheck).
VERIFIED_VERSION = 1
VERIFIED_KEEP = 64  # snapshots remembered (the oldest forgotten first)


def object_files(store):
    """{file: identity} of what holds the store's objects now, or None (objects elsewhere too)."""
    objects = common.join(store, b"objects")
    if os.path.exists(common.join(objects, b"info", b"alternates")):
        return None  # what another repository holds: nothing here says it is still there
    state = {}
    for entry in os.scandir(common.join(objects, b"pack")):
        st = entry.stat(follow_symlinks=False)
        state["pack/" + os.fsdecode(entry.name)] = [st.st_size, st.st_ino]
    for entry in os.scandir(objects):
        if len(entry.name) == 2 and entry.is_dir(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            state[os.fsdecode(entry.name)] = [st.st_ino, st.st_mtime_ns]
    return state


def stored_objects(files):
    """How many objects the packs of ``files`` (:func:`object_files`) hold, from their index files'
    sizes (a version 2 index: 1,072 bytes of header, fan-out and trailer, and 28 an object);
    loose objects are not counted."""
    return sum(
        max(0, (identity[0] - 1072) // 28)
        for name, identity in files.items()
        if name.startswith("pack/") and name.endswith(".idx")
    )


# A lookup of an object the store lacks costs git 17 us (7 system calls: its loose file, and
# objects/pack read again each time), one it holds 1 us: a first send's check of 49,253 missing
# blobs took 0.8-0.9 s (docs/measured.md). When the store holds fewer objects than half the
# snapshot's files, listing what it holds once (cat-file --batch-all-objects) and the snapshot's blobs
# from its trees (ls-tree, no lookup) costs what the store and the trees hold instead: 0.05 s.
def _walk_listed(store, commit):
    """What :func:`_walk` finds, from the trees' walk (blobs left out) and a listing of the store."""
    args = ["rev-list", "--objects", "--missing=print", "--filter=blob:none", commit]
    rc, out, _err = run_git(store, args, ok=None)
    lines = out.splitlines()
    if rc != 0 or any(line.startswith(b"?") for line in lines):
        return _walk(store, commit)  # the commit or a tree missing: git's walk says what, in full
    roots = [line[:40].decode("ascii") for line in lines[1:3] if len(line) == 41 and line.endswith(b" ")]
    _rc, tree, _err = run_git(store, ["ls-tree", "-r", "-z", "--full-tree", commit])
    blobs = {}
    for entry in tree.split(b"\0"):
        head = entry.split(b"\t", 1)[0].split(b" ")
        if len(head) == 3 and head[1] == b"blob":
            blobs[head[2]] = None
    _rc, held, _err = run_git(store, ["cat-file", "--batch-all-objects", "--batch-check=%(objectname)"])
    have = set(held.split())
    return [oid.decode("ascii") for oid in blobs if oid not in have], (roots or [None])[0]


def _verified_path(store):
    return common.under(store, layout.STORE_VERIFIED)


def read_verified(store, now):
    """[[commit, root tree], ...] found whole in files that are all still here, unchanged."""
    record = common.read_json(_verified_path(store))  # None when there is none: the snapshot is walked
    if not isinstance(record, dict) or record.get("version") != VERIFIED_VERSION:
        return []
    kept, commits = record.get("state"), record.get("commits")
    if not isinstance(kept, dict) or not isinstance(commits, list) or now is None:
        return []
    if any(now.get(name) != identity for name, identity in kept.items()):
        return []  # a file the objects were found in is gone or another: walk again
    return [c for c in commits if isinstance(c, list) and len(c) == 2 and all(map(_is_oid, c))]


def _is_oid(value):
    return isinstance(value, str) and bool(_OID.match(value))


def whole_snapshot_missing(store, commit, files=0):
    """:func:`missing_objects` of ``commit``, remembered while the files its objects are in stay.

    ``files``: the snapshot's file count (the header's), which tells a store holding fewer objects
    than half that (a first send): its objects are listed once instead (:func:`_walk_listed`). A
    store holding about as many is walked (a snapshot has fewer distinct blobs than files where
    files repeat: listing 50,000 objects costs more than walking what changed since the last one).
    """
    before = object_files(store)
    known = read_verified(store, before)
    if any(c == commit for c, _tree in known):
        return []
    if before is not None and stored_objects(before) < files // 2:
        missing, tree = _walk_listed(store, commit)
    else:
        missing, tree = _walk(store, commit, bases=[known[-1][1]] if known else ())
    if tree is None and known:
        tree = known[-1][1]  # not listed: the root tree is what the base reaches (the same tree)
    # Only when nothing moved during the walk: an object found in a file that came meanwhile is in
    # no file the record names, and could go without the record seeing it.
    if missing or tree is None or before is None or object_files(store) != before:
        return missing
    commits = [c for c in known if c[0] != commit][-(VERIFIED_KEEP - 1) :] + [[commit, tree]]
    record = {"version": VERIFIED_VERSION, "state": before, "commits": commits}
    common.write_atomic(_verified_path(store), json.dumps(record).encode("ascii"), 0o600)
    return []


# -- receiving packs ---------------------------------------------------------------------------------

PACK_DATA, PACK_END, PACKS_END, WHOLE_PACK = b"D", b"N", b"E", b"W"


def _quarantine(store):
    """A folder of this call's own for incoming packs (removed however the call ends)."""
    name = layout.STORE_QUARANTINE + "%d-%s" % (os.getpid(), os.urandom(4).hex())
    path = common.under(store, name)
    common.cleanup_paths.add(path)
    os.mkdir(path, 0o700)
    os.mkdir(common.join(path, b"pack"), 0o700)
    return path


def clean_stale_quarantines(store):
    """Quarantines of calls that were killed before they could remove theirs."""
    common.remove_stale(store, manifest.enc(layout.STORE_QUARANTINE), STALE_QUARANTINE_S)


def _pack_order(name):
    # As git's own quarantine moves them: the pack before its reverse index, the index last (git
    # sees a pack once its .idx is there).
    for i, suffix in enumerate((b".keep", b".pack", b".rev", b".idx")):
        if name.endswith(suffix):
            return (i, name)
    return (9, name)


def _migrate(quarantine, store):
    """Move the packs index-pack finished into the store, each file by one rename."""
    src = common.join(quarantine, b"pack")
    dest = common.join(store, b"objects", b"pack")
    for name in sorted(os.listdir(src), key=_pack_order):
        if not name.startswith(b"pack-"):
            continue  # index-pack's temp files of a pack it did not finish
        target = common.join(dest, name)
        if os.path.exists(target):
            os.unlink(common.join(src, name))  # the same pack (named by its content) is there already
        else:
            os.rename(common.join(src, name), target)


def receive_packs(store):
    """Read packs framed as ``D <len:4> <bytes>``..., ``N`` after each, ``E`` after the last.

    Each goes to its own ``git index-pack --stdin --fix-thin`` in a quarantine whose alternate is
    the store, and into the store once accepted. A ``W <count:4>`` pack is whole objects, written
    into a pack by :mod:`rv.agent.packfile` (no index-pack: see there why). Returns (packs taken
    in, their bytes, an error message or None). After a refused pack the rest of the stream is
    read and dropped, so the reply still comes after the whole request.
    """
    quarantine = _quarantine(store)
    env = git_env(
        store,
        GIT_OBJECT_DIRECTORY=manifest.dec(quarantine),
        GIT_ALTERNATE_OBJECT_DIRECTORIES=manifest.dec(common.join(store, b"objects")),
    )
    packs = received = 0
    error = None
    proc = None
    try:
        while True:
            tag = common.read_exact(1)
            if tag == PACK_DATA:
                (n,) = struct.unpack(">I", common.read_exact(4))
                data = common.read_exact(n)
                received += n
                if error is not None:
                    continue
                if proc is None:
                    proc = subprocess.Popen(
                        ["git", "index-pack", "--stdin", "--fix-thin"],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        env=env, cwd=store,
                    )  # fmt: skip
                try:
                    proc.stdin.write(data)
                except OSError:
                    pass  # index-pack stopped (a bad pack): its exit says why, below
            elif tag == PACK_END:
                if proc is not None and error is None:
                    error = _finish_index_pack(proc)
                    proc = None
                    if error is None:
                        _migrate(quarantine, store)
                        packs += 1
            elif tag == WHOLE_PACK:
                (count,) = struct.unpack(">I", common.read_exact(4))
                if error is not None:
                    packfile.skip_objects()
                    continue
                _name, n, error = packfile.receive(common.join(quarantine, b"pack"), count)
                received += n
                if error is None:
                    _migrate(quarantine, store)
                    packs += 1
            elif tag == PACKS_END:
                break
            else:
                raise common.AgentError("corrupt pack stream (tag %r)" % tag)
    finally:
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            proc.kill()
            proc.wait()
        common.cleanup_paths.discard(quarantine)
        shutil.rmtree(quarantine, ignore_errors=True)
    return packs, received, error


def _finish_index_pack(proc):
    _out, err = proc.communicate()  # closes its stdin: the end of the pack
    if proc.returncode == 0:
        return None
    return err.decode("utf-8", "replace").strip()[-400:] or "index-pack exited %d" % proc.returncode


# -- snapshots ---------------------------------------------------------------------------------------


def read_meta(root, sid):
    with open(meta_path(root, sid), "rb") as fh:
        return json.loads(fh.read().decode("ascii"))


def write_meta(root, sid, commit, payload, provenance):
    meta = {
        "version": META_VERSION,
        "id": sid,
        "commit": commit,
        "created": time.time(),
        "files": payload.get("files"),
        "bytes": payload.get("bytes"),
        "provenance": provenance,
    }
    path = meta_path(root, sid)
    common.makedirs(os.path.dirname(path), 0o700)
    common.write_atomic(path, json.dumps(meta, ensure_ascii=True).encode("ascii"), 0o444)


def touch(path):
    with contextlib.suppress(OSError):
        os.utime(path, None)


def set_ref(store, sid, commit):
    run_git(store, ["update-ref", ref_name(sid), commit])


def snapshot_status(root, sid):
    """What the store holds of snapshot ``sid``: ``(commit or None, missing object ids)``."""
    store = store_path(root)
    if not os.path.isdir(common.join(store, b"objects")):
        return None, []
    commit = resolve(store, sid)
    return commit, (missing_objects(store, commit) if commit else [])


def mode_snap_put(args):
    """Receive packs, check the snapshot's commit is whole, then set its ref.

    Header: ``id``, ``commit``, ``files``, ``bytes``, ``packs`` (packs follow), ``build`` (a
    provenance frame follows the packs: the laptop makes it while they travel). Replies:
    ``exists`` / ``created`` (the ref is set and everything it reaches is here); ``missing`` with
    the ids the store lacks (the laptop sends them and calls again); ``bad-pack`` (index-pack refused
    a pack: a thin pack whose base is gone; the laptop sends whole objects).
    """
    root = common.root_path(args["root"])
    payload = common.read_header()
    sid = check_sid(payload["id"])
    commit = check_oid(payload["commit"])
    build = bool(payload.get("build"))
    trailer = []

    def provenance():
        """The provenance frame after the packs (read once: every reply comes after the whole request)."""
        if not trailer:
            trailer.append(common.read_header()["provenance"] if build else None)
        return trailer[0]

    require_git()
    with locks.store_lock(root, exclusive=False):
        store = ensure_store(root)
        clean_stale_quarantines(store)
        result = {"packs": 0, "received_bytes": 0}
        if payload.get("packs"):
            packs, received, error = receive_packs(store)
            result.update(packs=packs, received_bytes=received)
            if error is not None:
                provenance()
                result.update(status="bad-pack", refused=error)
                return result
        had = resolve(store, sid)
        missing = whole_snapshot_missing(store, commit, _count(payload.get("files")))
        if missing:
            provenance()
            result.update(status="missing", missing=missing)
            return result
        if had == commit:
            provenance()
            if os.path.exists(meta_path(root, sid)):
                touch(meta_path(root, sid))  # "last used": gc measures age from here
            else:
                write_meta(root, sid, commit, payload, None)  # purged: gc needs its age back
            result["status"] = "exists"
            return result
        if not build:
            # The laptop thought the store held it; the ref is gone (a purge, rv gc): ask for the
            # provenance, then set it.
            result.update(status="missing", missing=[])
            return result
        write_meta(root, sid, commit, payload, provenance())
        set_ref(store, sid, commit)  # last: the snapshot exists once every object was found
        result["status"] = "created"
        return result


def _count(value):
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def held_whole(root, snapshot):
    """run-check's word on a snapshot the laptop believes the store holds (``id``, ``commit``,
    ``files``): True when its ref names that commit and every object it reaches is here, what
    snap-put would answer "exists" to (its "last used" touched, as snap-put does), so that the laptop
    need not ask snap-put. False on anything else (no git, no store, no ref, an object missing, no
    meta: a purge, which snap-put mends): the laptop then sends its snapshot as ever."""
    sid, commit = check_sid(snapshot["id"]), check_oid(snapshot["commit"])
    store = store_path(root)
    meta = meta_path(root, sid)
    if (
        git_problem() is not None
        or not os.path.isdir(common.join(store, b"objects"))
        or not os.path.exists(meta)
    ):
        return False
    with locks.store_lock(root, exclusive=False):
        if resolve(store, sid) != commit or whole_snapshot_missing(
            store, commit, _count(snapshot.get("files"))
        ):
            return False
        touch(meta)
    return True


def has_snapshot(root, sid):
    """Is there a ref for ``sid`` in the store, or an old store's folder (:mod:`rv.agent.oldstore`)?"""
    if not re.match(r"^[0-9A-Za-z_-]+$", sid or ""):
        return False
    if os.path.isdir(common.under(root, layout.snapshot(sid))) or os.path.isdir(
        common.under(root, layout.snapshot_layer(sid))
    ):
        return True
    store = store_path(root)
    if not os.path.isdir(common.join(store, b"objects")):
        return False
    rc, _out, _err = run_git(store, ["rev-parse", "-q", "--verify", layout.snapshot_ref(sid)], ok=(0, 1, 128))
    return rc == 0


# -- gc ----------------------------------------------------------------------------------------------


def _du(path):
    """(bytes on disk, files and folders) under ``path``."""
    total = count = 0
    for dirpath, dirs, files in os.walk(path):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                total += os.lstat(common.join(dirpath, name)).st_blocks * 512
                count += 1
    return total, count


def _only_reached_by(store, drop, keep):
    """(count, bytes on disk) of the objects the commits ``drop`` reach and ``keep`` do not."""
    if not drop:
        return 0, 0
    # Snapshot commits have no parents: only the aggressive edge walk leaves out all ``keep`` reach.
    args = (
        ["rev-list", "--objects-edge-aggressive"] + sorted(drop) + (["--not"] + sorted(keep) if keep else [])
    )
    _rc, out, _err = run_git(store, args, ok=None)
    oids = b"".join(line[:40] + b"\n" for line in out.splitlines() if len(line) >= 40 and line[:1] != b"-")
    _rc, sizes, _err = run_git(store, ["cat-file", "--batch-check=%(objectsize:disk)"], stdin=oids, ok=None)
    found = [int(s) for s in sizes.split() if s.isdigit()]
    return len(found), sum(found)


def collect_garbage(root, in_use, args, freed, dry):
    """Snapshot refs no kept run uses and unused for ``older_than``; then git drops what they held.

    A snapshot's age is that of its meta file (touched at every use); one whose meta file is gone
    (a purge) counts as old. git prunes with rv's grace period (``--prune``), so a send in flight
    (under the store lock's shared side, which gc waits for) never loses its objects.
    """
    older_than = float(args["older_than"])
    grace = float(args.get("grace", 900))
    report = {"removed": [], "kept": [], "objects_removed": 0}
    store = store_path(root)
    if not os.path.isdir(common.join(store, b"objects")):
        return report
    require_git()
    with locks.store_lock(root, exclusive=True, wait=float(args.get("lock_wait", 120))):
        return _collect(root, store, in_use, older_than, grace, report, freed, dry)


def _collect(root, store, in_use, older_than, grace, report, freed, dry):
    now = time.time()
    refs = snapshot_refs(store)
    drop, keep = {}, {}
    for sid in sorted(refs):
        try:
            age = now - os.lstat(meta_path(root, sid)).st_mtime
        except OSError:
            age = float("inf")
        if sid in in_use:
            keep[sid] = (age, "used by a run that is kept")
        elif age < max(older_than, grace):
            keep[sid] = (age, "used %s ago" % common.human_age(age))
        else:
            drop[sid] = age
    for sid in sorted(keep):
        age = keep[sid][0]
        report["kept"].append(
            {"id": sid, "age_s": round(age) if age != float("inf") else None, "reason": keep[sid][1]}
        )
    for sid in sorted(drop):
        age = drop[sid]
        report["removed"].append({"id": sid, "age_s": round(age) if age != float("inf") else None})
    count, size = _only_reached_by(store, [refs[s] for s in drop], [refs[s] for s in keep])
    report["objects_removed"] = count
    if dry:
        freed.extra += size  # an estimate: git's repack below may free a little more or less
        for sid in drop:
            with contextlib.suppress(OSError):
                freed.note(meta_path(root, sid))
        return report
    before = _du(store)
    report["store_files_before"] = before[1]
    if drop:
        commands = "".join("delete %s\n" % ref_name(sid) for sid in sorted(drop))
        run_git(store, ["update-ref", "--stdin"], stdin=commands.encode("ascii"))
        for sid in drop:
            with contextlib.suppress(OSError):
                common.remove_counted(meta_path(root, sid), freed, dry)
    # A ref whose objects are gone (a purge, a pack set aside) fails git's gc for every snapshot:
    # dropped (with its meta file: a send sets both again, provenance included).
    broken = storecheck.broken_refs(manifest.dec(store))
    _drop_broken(root, store, broken, report, freed)
    if drop or broken or _untidy(store):
        # Unreachable objects older than the grace period go; the packs are rewritten into one.
        report["repairs"] = _git_gc(root, store, grace, report, freed)
    _remove_set_aside(store, grace)
    after = _du(store)
    report["store_files_after"] = after[1]
    freed.extra += max(0, before[0] - after[0])  # measured: what git's repack and prune freed
    # Net, as a file quota counts: git's gc may add a file or two (packed-refs) as it removes others.
    freed.extra_files += before[1] - after[1]
    return report


def _drop_broken(root, store, refs, report, freed):
    storecheck.drop_refs(manifest.dec(store), refs)
    for name in refs:
        sid = name[len(layout.SNAPSHOT_REF_PREFIX) :]
        report.setdefault("broken_removed", []).append(sid)
        if _SID.match(sid):
            with contextlib.suppress(OSError):
                common.remove_counted(meta_path(root, sid), freed, False)


def _untidy(store):
    """Loose objects, or more than one pack that is not a cruft pack: git's gc has work to do."""
    objects = common.join(store, b"objects")
    for name in os.listdir(objects):
        if len(name) == 2 and os.listdir(common.join(objects, name)):
            return True
    packs = [n for n in os.listdir(common.join(objects, b"pack")) if n.endswith(b".pack")]
    cruft = [n for n in packs if os.path.exists(common.join(objects, b"pack", n[:-5] + b".mtimes"))]
    return len(packs) - len(cruft) > 1


def _git_gc(root, store, grace, report, freed):
    """git's gc, unreachable objects younger than ``grace`` kept in a cruft pack (git >= 2.37; older
    git: see :func:`_gc_without_cruft`). A damaged pack or a ref to lost objects that fails it is
    set aside or dropped, and gc tried again. Returns what was repaired."""
    prune = "--prune=%d.seconds.ago" % int(grace)
    repairs = []
    for _attempt in range(3):
        rc, _out, err = run_git(store, storecheck.GC_SETTINGS + ["gc", "--quiet", "--cruft", prune], ok=None)
        if rc == 129 and b"cruft" in err:
            rc, err = _gc_without_cruft(store, grace)  # git older than 2.37: no --cruft
        if rc == 0:
            with contextlib.suppress(OSError):
                os.unlink(common.under(store, layout.STORE_GC_FAILED))  # gc works again
            return repairs
        text = err.decode("utf-8", "replace")
        packs = storecheck.set_aside_corrupt(manifest.dec(store), text)
        broken = storecheck.broken_refs(manifest.dec(store))  # a set-aside pack's snapshots among them
        _drop_broken(root, store, broken, report, freed)
        if not packs and not broken:
            break  # nothing to repair: gc's failure stands
        repairs += ["set aside damaged pack %s" % p for p in packs]
    raise common.AgentError("git gc failed in %s: %s" % (manifest.dec(store), text.strip()[-400:]), "remote")


def _gc_without_cruft(store, grace):
    """gc for git without cruft packs, which would explode unreachable objects into loose files:
    packs younger than ``grace`` (a send in flight may need what they hold) are kept as they are
    (.keep), everything else reachable is packed into one and the rest dropped; loose objects
    older than the grace are pruned. Returns (exit code, stderr)."""
    folder = common.join(store, b"objects", b"pack")
    now = time.time()
    kept = []
    try:
        for name in os.listdir(folder):
            path = common.join(folder, name)
            keep = path[:-5] + b".keep"
            if name.endswith(b".pack") and now - os.lstat(path).st_mtime < grace and not os.path.exists(keep):
                common.write_atomic(keep, b"rv gc: a send in flight may need it\n", 0o644)
                kept.append(keep)
        steps = (
            storecheck.GC_SETTINGS + ["repack", "-a", "-d", "-l", "-n", "-q"],
            ["prune", "--expire=%d.seconds.ago" % int(grace)],
            ["pack-refs", "--all", "--prune"],
        )
        for args in steps:
            rc, _out, err = run_git(store, args, ok=None)
            if rc != 0:
                return rc, err
        return 0, b""
    finally:
        for keep in kept:
            with contextlib.suppress(OSError):
                os.unlink(keep)


def _remove_set_aside(store, grace):
    """Packs set aside as damaged, once older than the grace: no job is reading them any more."""
    common.remove_stale(common.under(store, layout.STORE_DAMAGED), b"", grace)


def background_gc_failure(root):
    """The last failure of a job's background gc (its line), or None."""
    path = common.under(store_path(root), layout.STORE_GC_FAILED)
    try:
        with open(path, "rb") as fh:
            return fh.read(2000).decode("utf-8", "replace").strip() or None
    except OSError:
        return None
