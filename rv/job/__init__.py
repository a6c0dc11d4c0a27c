"""A run's life on the laptop side: plan, submit, watch, record, clean up. No click, no rich.

A run is a chain of segments, each one Slurm job running the same script; the job keeps the run's
records on the cluster and submits the next segment itself (the job runtime, ``rv/agent/job.sh``),
so this package only submits the first, reads what the jobs wrote, follows, stops and collects
garbage.

    launch.py     the run pipeline: options and the profile -> a frozen, validated Plan -> launch
    prepare.py    the local half of starting a job (snapshot, environment plan), before any network call
    submit.py     check, snapshot upload, secrets and sbatch of segment 1, the local record
    interrupt.py  what a Ctrl-C during a submission says: sent, not sent, or may have been sent
    records.py    local run records, the cluster's records parsed, the views `rv ps` shows (pure)
    query.py      asking the cluster about runs: records, squeue and sacct in one round trip
    watch.py      following a run across segments: frames, state, reconnecting after a drop
    wait.py       `rv wait`: block until runs end (or run), for scripts
    why.py        `rv why`: why a run waits or ended, and what would start it sooner
    cleanup.py    stop, the secrets sweep, gc, what rv keeps on the cluster
    secretsweep.py  the secrets sweep a command's session carries along, or makes at its end
    footprint.py  what rv keeps on the cluster and the site's quota: the quota tools' text (pure)
    workdir.py    where a job's work dir lives (--work-dir), and what a run costs in files
    runfiles.py   the files a run ran: `rv diff RUN_A RUN_B`, `rv checkout RUN DIR`
    results.py    a sweep's points and a run's metrics, as data (the CLI's views and the page)
    retry.py      `rv sweep retry`: which points run again, and sending them
    stats.py      `rv stats`: what a run used and cost (from the jobs' own measurements), advice (pure)
    container.py  --container: the image and runtime asked for, checked; the script's lines
    up.py         `rv up`: an allocation that never outlives the shell it was asked for
    inside.py     working inside a running job: its job and nodes now, and the ways in (rv ssh, gpu)
    serve.py      what an `rv up` session serves: an editor's SSH host, a notebook
    editor.py     `rv code`: a session's node reachable by plain OpenSSH
    notebook.py   `rv jupyter`: JupyterLab in a step of a live session's job
    onsession.py  `rv run --on SESSION`: a run as a step of a session's job, what it may ask
"""
