# shellcheck shell=bash disable=SC2154
# (SC2154: the batch script and job.sh set the job's values before any of these functions runs.)
# rv's job runtime, the snapshot store: a part of job.sh, shipped joined to it as one file (job.sh's header
# says how). Functions and constants only.
#
# git on the run's store (a bare repository, rv.agent.store), its background gc, and what the job
# says when the store lost or damaged a snapshot's objects (rv/agent/storecheck.py finds which).

# git on the run's store, with the index $1, reading none of the user's git configuration (a
# global core.autocrlf or filter would change the bytes checked out) and no GIT_* of the job's.
rv_git() {
    local index="$1"
    shift
    env -u GIT_WORK_TREE -u GIT_OBJECT_DIRECTORY -u GIT_ALTERNATE_OBJECT_DIRECTORIES -u GIT_COMMON_DIR \
        -u GIT_NAMESPACE -u GIT_CEILING_DIRECTORIES -u GIT_QUARANTINE_PATH \
        GIT_DIR="$rv_store" GIT_INDEX_FILE="$index" GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null \
        HOME="$rv_store" XDG_CONFIG_HOME="$rv_store" LC_ALL=C GIT_TERMINAL_PROMPT=0 \
        git -c core.autocrlf=false -c core.symlinks=true -c core.protectNTFS=false -c core.protectHFS=false \
        "$@"
}

# git's own rule for when the store's packs pile up (one per upload), applied by the job on its
# compute node, in its background at the lowest priority: on the login node a repack would slow
# every rv command, and a detached one outlive the call that started it. Another job's gc running
# makes this one a no-op (git's gc.pid); the job's end stops it, which git's atomic renames survive.
# Unreachable objects go into a cruft pack (git >= 2.37; older git ignores the setting), never
# exploded into loose files. storecheck.py drops a ref whose objects are gone and sets aside a pack
# git calls corrupt, either of which fails every gc; a failure left is written where `rv status`
# reads it (the store's rv-gc-failed), never dropped.
rv_store_tidy() {
    (
        local err who
        who="job $rv_job on $(hostname)"
        renice -n 19 "$BASHPID" >/dev/null 2>&1 || :
        if [ -r "${rv_store_prog:-}" ] && command -v python3 >/dev/null 2>&1; then
            python3 "$rv_store_prog" tidy "$rv_store" "$who" >/dev/null 2>&1 || :
        elif err="$(rv_git "$1" -c gc.autoDetach=false -c gc.cruftPacks=true -c gc.writeCommitGraph=false \
            -c repack.writeBitmaps=false -c repack.updateServerInfo=false gc --auto --quiet 2>&1 >/dev/null)"; then
            rm -f -- "$rv_store/rv-gc-failed"
        else
            printf '%s %s: git gc --auto failed: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$who" \
                "$(printf '%s' "$err" | tr '\n' ' ' | tail -c 600)" >"$rv_store/rv-gc-failed" 2>/dev/null || :
        fi
    ) </dev/null &
}

# rv_store_damaged COMMIT OUTPUT: git could not give the snapshot whole. Objects whose bytes do not
# read back (a pack with bytes written over: its files are all there) are named by storecheck.py,
# their packs set aside, and the job ends here; the next `rv run` finds them missing and sends them.
# Nothing damaged (a purge took files, or no python3): the callers' messages say what is lost.
rv_store_damaged() {
    local found
    [ -n "$1" ] && [ -r "${rv_store_prog:-}" ] && command -v python3 >/dev/null 2>&1 || return 0
    found="$(python3 "$rv_store_prog" check "$rv_store" "$1" "$RV_SNAPSHOT")" || return 0
    [ -z "$2" ] || printf '%s\n' "$2" >&2
    rv_fail "$found; so the program was not started: run \`rv run\` again from your machine, it finds what" \
        "the store lacks and sends it"
}

# rv_lost COMMIT OUTPUT: the snapshot's folders themselves (trees, or its commit) are gone.
rv_lost() {
    local n
    n="$(rv_git "$rv_store/index" rev-list --objects --missing=print "$1" 2>/dev/null | grep -c '^?')" || n=''
    printf '%s\n' "$2" >&2
    rv_fail "the store lost ${n:-some} object(s) of snapshot $RV_SNAPSHOT, its folders' listings among them" \
        "(a purge of the filesystem?), so the program was not started; run \`rv run\` again from your" \
        "machine: it finds what the store lacks and sends it"
}
