"""The store of earlier rv versions, before the git store: a file per object, trees of hard links.

Read, not migrated: a job queued by that rv sources that rv's runtime (still in ``<root>/runtime/``),
which copies its snapshot's folder; those folders and objects stay until no kept run uses them, and
``rv gc`` removes them by the old rules (this module). New snapshots go into the git store only, so
the first ``rv run`` of a project after the upgrade sends its files once more.

    <root>/objects/ab/abcdef...     content-addressed files (git blob ids); <oid>.x executables
    <root>/snapshots/<id>/          a tree of hard links into objects/ (read-only) ...
    <root>/snapshots/<id>.layer/    ... or a layer over another snapshot: tree/, remove, base
    <root>/snapshots/<id>.json      its meta (version 1-3); .manifest its manifest
"""

import contextlib
import json
import os
import re
import time

from rv.agent import common, layout, locks, manifest

STALE_BUILD_S = 86400


def snapshot_dir(root, sid):
    return common.under(root, layout.snapshot(sid))


def snapshot_exists(root, sid):
    layer = common.under(root, layout.snapshot_layer(sid))
    return os.path.isdir(snapshot_dir(root, sid)) or os.path.isdir(layer)


def read_meta(root, sid):
    with open(common.under(root, layout.old_snapshot_meta(sid)), "rb") as fh:
        return json.loads(fh.read().decode("ascii"))


def read_manifest(root, sid):
    with open(common.under(root, layout.snapshot_manifest(sid)), "rb") as fh:
        return fh.read()


def clean_stale_temps(root):
    common.remove_stale(common.under(root, layout.TMP), b".rv-tmp-", common.TMP_STALE_S)


def _remove_if_empty(root):
    """The old store's folders, once nothing of it is left (the lock file stays: the git store uses it)."""
    objects = common.under(root, layout.OBJECTS)
    with contextlib.suppress(OSError):
        for fan in os.listdir(objects):
            if not fan.startswith(b"."):
                with contextlib.suppress(OSError):
                    os.rmdir(common.join(objects, fan))


# What may stand beside a snapshot's id in snapshots/: b"" (its tree), a layer, its meta, its manifest.
_LAYER = manifest.enc(layout.SNAPSHOT_LAYER)
_META = manifest.enc(layout.OLD_SNAPSHOT_META)
_MANIFEST = manifest.enc(layout.SNAPSHOT_MANIFEST)
_SNAP_NAME = re.compile(rb"^([0-9a-f]{24})(%s)?$" % b"|".join(map(re.escape, (_LAYER, _META, _MANIFEST))))


def _snapshot_objects(root, sid, meta):
    """The object ids a snapshot's own files use (a layer's, not its base's)."""
    if meta.get("version") != 2:
        return set(e[2] for e in meta["entries"])
    if meta.get("base") is not None:
        return set(r[2] for r in meta["layer"]["upsert"])
    return set(r[2] for r in manifest.manifest_rows(read_manifest(root, sid)))


def collect_garbage(root, in_use, args, freed, dry):
    """Old snapshots no kept run uses and unused for ``older_than``, then objects none of them needs.

    A kept layer keeps the snapshot it sits on, and that one its own, down to a full snapshot.
    """
    older_than = float(args["older_than"])
    grace = float(args.get("grace", 900))
    report = {"removed": [], "kept": [], "objects_removed": 0}
    warnings = []
    snaps = common.under(root, layout.SNAPSHOTS)
    with locks.store_lock(root, exclusive=True, wait=float(args.get("lock_wait", 120))):
        now = time.time()
        names = os.listdir(snaps) if os.path.isdir(snaps) else []
        parts = {}  # id -> the suffixes present (b"" for a full tree)
        for name in sorted(names):
            path = common.join(snaps, name)
            if name.startswith(b".tmp-"):
                if now - os.lstat(path).st_mtime > STALE_BUILD_S:
                    common.remove_counted(path, freed, dry)
                continue
            m = _SNAP_NAME.match(name)
            if m:  # (the git store's meta files, <id>.git.json, are not this store's)
                parts.setdefault(manifest.dec(m.group(1)), set()).add(m.group(2) or b"")
        metas = {}
        kept, doomed = {}, []
        for sid in sorted(parts):
            have = parts[sid]
            if b"" not in have and _LAYER not in have:
                continue  # a meta or manifest left without its tree: see below
            path = snapshot_dir(root, sid)
            meta_path = common.under(root, layout.old_snapshot_meta(sid))
            folder = path if b"" in have else common.under(root, layout.snapshot_layer(sid))
            used = os.lstat(meta_path).st_mtime if _META in have else os.lstat(folder).st_mtime
            age = now - used
            if sid in in_use:
                kept[sid] = (age, "used by a run that is kept")
            elif age < max(older_than, grace):
                kept[sid] = (age, "used %s ago" % common.human_age(age))
            else:
                doomed.append((sid, age))
        unreadable = []
        todo = list(kept)  # a kept layer keeps its base, and so on down the chain
        while todo:
            sid = todo.pop()
            try:
                metas[sid] = read_meta(root, sid)
            except (OSError, ValueError):
                unreadable.append(sid)
                continue
            base = metas[sid].get("base")
            if base is not None and base not in kept and base in parts:
                ages = dict(doomed)
                kept[base] = (ages.get(base, 0), "the base of kept layer %s" % sid)
                doomed = [d for d in doomed if d[0] != base]
                todo.append(base)
        for sid, age in doomed:
            row = {"id": sid, "age_s": round(age)}
            before = freed.bytes
            path = snapshot_dir(root, sid)
            for suffix in (b"", _LAYER, _META, _MANIFEST):
                if suffix in parts[sid]:
                    common.remove_counted(path + suffix, freed, dry)
            row["bytes"] = freed.bytes - before
            report["removed"].append(row)
        for sid in sorted(kept):
            report["kept"].append({"id": sid, "age_s": round(kept[sid][0]), "reason": kept[sid][1]})
        # Meta and manifest files left without their tree (a build that died between the renames).
        for sid, have in parts.items():
            if b"" in have or _LAYER in have:
                continue
            for suffix in (_META, _MANIFEST):
                p = snapshot_dir(root, sid) + suffix
                if suffix in have and now - os.lstat(p).st_mtime > grace:
                    common.remove_counted(p, freed, dry)
        referenced = set()
        for sid in unreadable:
            referenced = None
            warnings.append("snapshot %s has no readable manifest, so no object was removed" % sid)
            break
        for sid in sorted(kept) if referenced is not None else []:
            try:
                referenced.update(_snapshot_objects(root, sid, metas[sid]))
            except (OSError, ValueError, KeyError):
                referenced = None
                warnings.append("snapshot %s has no readable manifest, so no object was removed" % sid)
                break
        if referenced is not None:
            # In a dry run the removed snapshots still exist: their links are counted as removed by
            # _remove above, so the objects they share are counted as freed here, as they would be.
            objects = common.under(root, layout.OBJECTS)
            for fan in sorted(os.listdir(objects)) if os.path.isdir(objects) else []:
                fan_path = common.join(objects, fan)
                if fan.startswith(b".") or not os.path.isdir(fan_path):
                    continue
                for name in os.listdir(fan_path):
                    if manifest.dec(name)[:40] in referenced:
                        continue
                    report["objects_removed"] += 1
                    common.remove_counted(common.join(fan_path, name), freed, dry)
        if not dry:
            clean_stale_temps(root)
            _remove_if_empty(root)
    report["warnings"] = warnings
    return report
