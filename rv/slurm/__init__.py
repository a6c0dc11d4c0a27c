"""Slurm, from the laptop: the commands rv runs, the batch script it writes, and what Slurm prints.

commands.py  the Slurm commands rv runs, built in one place: argv lists in, nothing executed
client.py    questions to Slurm asked often, each answered in one round trip
parse.py     pure parsers of squeue, sacct, sinfo, sacctmgr and Rivanna's allocations output
pending.py   why a job waits, in words: pending reasons, the limits they name (rv why)
script.py    a run's batch script: its #SBATCH lines, values and the user's own lines (pure)
launch.py    the program's line in the job: the user's command with the launcher's flags
container.py a run's container in its script: binds, the program inside, rv ssh's way in, Pyxis
"""
