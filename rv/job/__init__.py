"""A run's life on the laptop side: submit, watch, continue, record, clean up. No click, no rich.

A run is a chain of segments, each one Slurm job running the same script; the job keeps the run's
records on the cluster and submits the next segment itself (:mod:`rv.slurm.script`), so this
package only submits the first, reads what the jobs wrote, follows, stops and collects garbage.

    records.py   local run records, the cluster's records parsed, the views `rv ps` shows (pure)
    submit.py    check, snapshot upload, secrets and sbatch of segment 1, the local record
    watch.py     following a run across segments: frames, state, reconnecting after a drop
    cleanup.py   stop, the secrets sweep, gc, what rv keeps on the cluster
    container.py --container: the image and runtime asked for, checked; the script's lines
    stats.py     `rv stats`: what a run used and cost (from the jobs' own measurements), advice (pure)
    remote.py    the cluster-side agent modes (runs there, standard library only)
"""
