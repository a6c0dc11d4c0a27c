"""Everything rv runs on the cluster, and nothing else: one stdlib-only program, the agent.

rv installs nothing on the cluster. Each cluster-side step runs these modules as one
``python3 -I -S -c`` program over the SSH connection (see :mod:`rv.remote.agent_client`); bulk data travels
on the same command's stdin or stdout, so a step is one round trip however much it moves. The mode
table is in :mod:`rv.agent.__main__`; the job's shell runtime (``job.sh``), the rank labeller
(``ranklabel.py``), the webhook poster (``notify.py``), the store's repairs (``storecheck.py``,
also a module of the agent) and the meter (``stats.py``: what the program used, on each node) are
shipped beside it into the remote root, once per content.

Laptop code imports five modules of this package, the formats both sides share:
:mod:`rv.agent.manifest` (a snapshot's file list), :mod:`rv.agent.segment` (what a job records
about a segment), :mod:`rv.agent.layout` (where things are under the remote root, and in a
checkpoint folder), :mod:`rv.agent.container` (each container runtime's command line, which the
laptop writes into the job's script and the agent uses to build environments) and
:mod:`rv.agent.packformat` (a git pack written from whole objects: the agent's packs of what the
laptop sends, the laptop's of edited files). Nothing else here
is imported on the laptop (``tests/unit/test_structure.py``), and no module here uses another's
private (``_``) names.

Every module must run on the oldest ``python3`` a login node has (RHEL 8: 3.6): no dataclasses, no
walrus, no ``capture_output``, no postponed annotations; a test parses each file as 3.6.

    __main__.py    the entry point: the one table of modes, and how an outcome becomes a reply
    common.py      plumbing: errors, replies on stdout, paths under the remote root, private writes
    layout.py      where rv keeps things under the remote root, and what a checkpoint folder holds
    manifest.py    the snapshot manifest, byte for byte the laptop's format
    segment.py     what a job records about a segment and about its run's end
    locks.py       locks under the remote root: flock, or an atomic mkdir where there is none
    store.py       the snapshot store: a bare git repository (store.git)
    storecheck.py  the store's repairs: unreadable snapshots named, damaged packs set aside, gc kept working
    packformat.py  a git pack and its index, written from whole objects (a format both sides share)
    packfile.py    the packs of whole objects a send carries, written as they arrive
    oldstore.py    the store of earlier rv versions: read and collected
    transfer.py    `rv sync push` and `pull` on the cluster side: scan, apply, send
    submit.py      run-check, run-submit, run-arrived, sweep-submit, --from
    runs.py        runs, run-stop, secrets-sweep, ckpt-ls
    rundir.py      reading a run's folder and records, the name indexes, checkpoint folders
    follow.py      a run's output, segment after segment, as frames
    up.py          `rv up`'s job and its watchdog
    envs.py        Python environments: env, venv-ls, venv-rm
    images.py      container images pulled from registries: image-pull, and their cache for status and gc
    gc.py          gc and usage: what finished runs left, then what nothing uses
    metrics.py     what runs wrote to RV_METRICS, summed up for a table
    quota.py       the site's quota tools (lfs, mmlsquota, quota), run bounded
    slurmcmd.py    running the Slurm commands a call carries
    why.py         rv why's checks: would sbatch take the run's script with other options?
    runfiles.py    snap-code: the files a run ran, from the store (rv diff, rv checkout)
    container.py   container runtimes: which one runs an image, and the line that runs a node's
                   launcher inside it
    job.sh         the job runtime every segment sources (shipped beside the agent, its parts joined to it)
    job_workdir.sh the runtime's work dir: made from the store, checked, carried across nodes; -o outputs
    job_store.sh   the runtime's git on the store, its background gc, what a damaged store says
    job_stop.sh    the runtime's stop watcher: the stop signal before the time limit
    job_notify.sh  the runtime's --notify: Slurm's mail and the webhooks
    ranklabel.py   the rank labeller (shipped beside it)
    notify.py      the webhook poster (shipped beside it)
    stats.py       the meter each node's program runs under (shipped beside it)
"""
