# shellcheck shell=bash disable=SC2154
# (SC2154: the batch script and job.sh set the job's values before any of these functions runs.)
# rv's job runtime, the work dir: a part of job.sh, shipped joined to it as one file (job.sh's header
# says how). Functions and constants only.
#
# The run's private copy of its snapshot (rv_work_dir: the shared one, or each node's with
# --work-dir node), what a node's program changed carried to the next segment, and the -o outputs
# copied out of it at the segment's end.

# Copy each -o path from the work dir into $RV_OUTPUT_DIR, where it keeps its place in the repo; a
# missing one is a warning only. A path with * ? or [ is a pattern (bash's, with ** for any depth):
# every match is copied, and a pattern that matches nothing is said as a missing path is.
rv_keep_outputs() {
    local path src match
    local -a matches
    for path in ${rv_outputs[@]+"${rv_outputs[@]}"}; do
        case "$path" in
            *[*?[]*)
                # The pattern expanded where it was written (the work dir), never split on spaces;
                # read NUL by NUL (not mapfile -d, which bash before 4.4 lacks).
                matches=()
                while IFS= read -r -d '' match; do matches+=("$match"); done < <(
                    shopt -s nullglob globstar
                    cd -- "$RV_WORK_DIR" || exit 0
                    IFS=
                    # shellcheck disable=SC2086  # the pattern is meant to expand
                    for match in $path; do printf '%s\0' "$match"; done
                )
                if [ "${#matches[@]}" = 0 ]; then
                    echo "rv: warning: output pattern $path matched nothing in the work dir; nothing copied"
                fi
                for match in ${matches[@]+"${matches[@]}"}; do rv_keep_output "$match"; done
                ;;
            *)
                src="$RV_WORK_DIR/$path"
                if [ ! -e "$src" ] && [ ! -L "$src" ]; then
                    echo "rv: warning: output $path not found in the work dir; nothing copied"
                    continue
                fi
                rv_keep_output "$path"
                ;;
        esac
    done
}

rv_keep_output() {  # rv_keep_output PATH (relative to the work dir)
    local dst="$RV_OUTPUT_DIR/$1"
    mkdir -p -- "$(dirname -- "$dst")" && rm -rf -- "$dst" && cp -a -- "$RV_WORK_DIR/$1" "$dst" \
        || echo "rv: warning: could not copy output $1"
}

# --work-dir node keeps on the shared filesystem only what the program changed: at each segment's end
# the files it created or changed in its work dir (git's index of the snapshot tells which) go into
# one tar in the run's folder, and the snapshot's files it deleted into a list beside it; the next
# segment (or a requeue) checks the snapshot out on its node and puts them back. Two files at most,
# however many the program wrote, and none when it changed nothing.
RV_WORK_SAVED=work.changes

# The run's own copy of its snapshot, made once and kept by later segments and requeues: checked out
# of the store (a bare git repository, rv.agent.store) by git itself, with an index of the run's own
# (work.index beside the work dir). Its files are new files, never links into the store: a job may
# chmod and edit them without touching the store or another run.
#
# Never a work dir with holes: read-tree fails on a tree the store lost, checkout-index on a blob,
# and `ls-files --deleted` then names every file that is not there, so a store a purge took files
# from stops the job before the program, naming them and the fix. Later segments check their work
# dir the same way (a purge may reach it too) and restore what is missing from the store.
rv_work_dir() {
    local index="$RV_WORK_DIR.index" tmp="$RV_WORK_DIR.tmp" commit out
    command -v git >/dev/null 2>&1 || rv_fail "git is not on PATH on $(hostname): rv checks the run's files" \
        "out of its store with git; the compute nodes need git too (ask the cluster's admins)"
    if [ -d "$RV_WORK_DIR" ]; then
        rv_work_dir_check "$index"
        return
    fi
    rm -rf -- "$tmp" "$index.tmp"
    commit="$(rv_git "$index.tmp" rev-parse -q --verify "refs/rv/snapshots/$RV_SNAPSHOT")" \
        || rv_fail "snapshot $RV_SNAPSHOT is not in the store $rv_store (removed by rv gc, or lost to a" \
            "purge of the filesystem): run \`rv run\` again from your machine; it sends the snapshot again"
    rv_try "making the work dir" mkdir -p -- "$tmp"
    if ! out="$(rv_git "$index.tmp" read-tree "$commit" 2>&1)"; then
        rv_store_damaged "$commit" "$out"
        rv_lost "$commit" "$out"
    fi
    out="$(rv_git "$index.tmp" --work-tree="$tmp" checkout-index -a -u 2>&1)" || :
    rv_work_dir_whole "$index.tmp" "$tmp" "$out"
    [ "${rv_work_node:-0}" != 1 ] || rv_work_restore "$tmp"
    rv_try "placing the work dir" mv -- "$index.tmp" "$index"
    rv_try "placing the work dir" mv -- "$tmp" "$RV_WORK_DIR"
    rv_store_tidy "$index"
}

# Where this job's work dir is: the run's folder on the shared filesystem, or with --work-dir node a
# folder of this job's own on the node's local disk (the profile's node_work_dir, else $SLURM_TMPDIR,
# else $TMPDIR, else /tmp), named by run, job and node: two nodes sharing one /tmp (the loopback
# cluster's do) never share a work dir, and a requeue on the same node finds its own.
rv_work_place() {
    if [ "${rv_work_node:-0}" = 1 ]; then
        rv_node_dir="${rv_work_base:-${SLURM_TMPDIR:-${TMPDIR:-/tmp}}}/rv-$RV_RUN_ID-$rv_job-${SLURMD_NODENAME:-$(hostname)}"
        export RV_WORK_DIR="$rv_node_dir/work"
    else
        export RV_WORK_DIR="$RV_RUN_DIR/work"
    fi
}

rv_work_save() {
    local index="$RV_WORK_DIR.index" saved="$RV_RUN_DIR/$RV_WORK_SAVED" changed="$rv_node_dir/changed"
    local deleted="$rv_node_dir/deleted"
    [ -d "$RV_WORK_DIR" ] && [ -e "$index" ] || return 0
    # Names NUL-separated and led by ./, so none (a leading dash, a newline) is read as tar's option;
    # git asked from the work dir's top (-C), as ls-files names and lists what is under the folder it runs in.
    # Two walks of the work dir: diff-files (changed, deleted) and ls-files (new).
    local git=(rv_git "$index" -C "$RV_WORK_DIR" --work-tree="$RV_WORK_DIR") status path
    "${git[@]}" diff-files -z --name-status >"$changed.status" || return 1
    while IFS= read -r -d '' status && IFS= read -r -d '' path; do
        if [ "$status" = D ]; then printf '%s\0' "$path" >&3; else printf './%s\0' "$path"; fi
    done <"$changed.status" >"$changed" 3>"$deleted" || return 1
    # --directory: a folder of new files is one name (tar takes it whole), and an empty one is kept too.
    "${git[@]}" ls-files -z --others --directory | sed -z 's|^|./|' >>"$changed" || return 1
    rm -rf -- "$saved.tmp" "$saved.old" || return 1
    if [ -s "$changed" ] || [ -s "$deleted" ]; then
        mkdir -p -- "$saved.tmp" || return 1
        if [ -s "$changed" ]; then
            tar -cf "$saved.tmp/files.tar" --null -C "$RV_WORK_DIR" -T "$changed" || return 1
        fi
        if [ -s "$deleted" ]; then cp -- "$deleted" "$saved.tmp/deleted" || return 1; fi
    fi
    if [ -e "$saved" ]; then mv -- "$saved" "$saved.old" || return 1; fi
    if [ -e "$saved.tmp" ]; then mv -- "$saved.tmp" "$saved" || return 1; fi
    rm -rf -- "$saved.old"
}

rv_work_restore() {  # rv_work_restore DIR: the last segment's changes over the snapshot's files in DIR
    local saved="$RV_RUN_DIR/$RV_WORK_SAVED"
    [ -d "$saved" ] || return 0
    if [ -e "$saved/files.tar" ]; then
        rv_try "restoring what the last segment's program wrote in its work dir" \
            tar -xpf "$saved/files.tar" -C "$1"
    fi
    if [ -s "$saved/deleted" ]; then
        # shellcheck disable=SC2016  # expanded by the inner shell
        rv_try "removing the files the last segment's program deleted from its work dir" \
            bash -c 'cd -- "$1" && xargs -0 rm -f --' rv-restore "$1" <"$saved/deleted"
    fi
    echo "rv: work dir on $(hostname) ($1): the snapshot with what earlier segments' programs changed"
}

# At the segment's end (also a requeue's, or a time limit's), on the batch script's node: save what
# the program changed, then free the node's disk. A save that fails leaves the folder where it is.
rv_node_work_end() {
    if rv_work_save; then
        rm -rf -- "$rv_node_dir" 2>/dev/null || { chmod -R u+w -- "$rv_node_dir" && rm -rf -- "$rv_node_dir"; } || :
    else
        echo "rv: warning: could not save what the program changed in its work dir into" \
            "$RV_RUN_DIR/$RV_WORK_SAVED; the work dir stays on $(hostname) in $rv_node_dir" >&2
    fi
}

# In each node's task (--work-dir node): a node other than the batch script's makes a work dir of its
# own and starts where the batch script stood in its; the batch script's node keeps the one it made.
# PYTHONPATH was set (the env-build hook) to the first node's folder: it names this one's instead.
rv_task_work_dir() {
    local head="$RV_WORK_DIR" rel
    rv_work_place
    [ "$RV_WORK_DIR" != "$head" ] || return 0
    rv_work_dir
    rel="${PWD#"$head"}"
    cd -- "$RV_WORK_DIR$rel" || return 1
    if [ -n "${PYTHONPATH:-}" ]; then export PYTHONPATH="${PYTHONPATH//"$head"/$RV_WORK_DIR}"; fi
    # shellcheck disable=SC2034  # rv_task (job.sh) removes it at the task's end
    rv_task_own_dir="$rv_node_dir"
}

# rv_work_dir_whole INDEX DIR OUTPUT: every file of the index is in DIR, or the job ends here.
rv_work_dir_whole() {
    local missing n
    missing="$(rv_git "$1" -C "$2" --work-tree="$2" ls-files --deleted)" \
        || rv_fail "could not compare the work dir with its snapshot: $3"
    [ -n "$missing" ] || return 0
    rv_store_damaged "$(rv_git "$1" rev-parse -q --verify "refs/rv/snapshots/$RV_SNAPSHOT")" "$3"
    n="$(printf '%s\n' "$missing" | wc -l)"
    [ -z "$3" ] || printf '%s\n' "$3" >&2
    rv_fail "the store lost $n file(s) of snapshot $RV_SNAPSHOT (a purge of the filesystem?), so the" \
        "program was not started: $(printf '%s\n' "$missing" | head -n 10 | tr '\n' ' ')$([ "$n" -le 10 ] \
        || echo "and $((n - 10)) more "); run \`rv run\` again from your machine: it finds what the" \
        "store lacks and sends it"
}

# A later segment's work dir: files of the snapshot that are gone (a purge of the run's folder) come
# back from the store; if the store lost them too, the job ends before the program.
rv_work_dir_check() {
    local index="$1" gone out
    [ -e "$index" ] || return 0  # a work dir of an older rv, copied without an index
    local git=(rv_git "$index" -C "$RV_WORK_DIR" --work-tree="$RV_WORK_DIR")
    gone="$("${git[@]}" ls-files -z --deleted | tr -cd '\0' | wc -c)" || gone=0
    [ "$gone" -gt 0 ] || return 0
    echo "rv: $gone file(s) of the snapshot are missing from the work dir (a purge?): restoring them" \
        "from the store" >&2
    out="$("${git[@]}" ls-files -z --deleted | "${git[@]}" checkout-index -u -z --stdin 2>&1)" || :
    rv_work_dir_whole "$index" "$RV_WORK_DIR" "$out"
}

# At a segment's end (a requeue's too), the shared work dir: the snapshot's files the program deleted
# leave the work dir's index, so the next segment's check (rv_work_dir_check) restores only what went
# missing after this segment ended (a purge's, while nothing ran) and never undoes the program's own
# deletions. (A node work dir keeps the program's deletions in its saved changes: rv_work_save.)
rv_work_deletions() {
    local index="$RV_WORK_DIR.index"
    if [ "${rv_work_node:-0}" = 1 ] || [ "$rv_program_ran" != 1 ] || [ ! -d "$RV_WORK_DIR" ] ||
        [ ! -e "$index" ]; then
        return 0
    fi
    rv_git "$index" -C "$RV_WORK_DIR" --work-tree="$RV_WORK_DIR" ls-files -z --deleted |
        rv_git "$index" -C "$RV_WORK_DIR" --work-tree="$RV_WORK_DIR" update-index -z --remove --stdin \
        || echo "rv: warning: could not note which of the snapshot's files the program deleted from its" \
            "work dir: the next segment restores them" >&2
}
