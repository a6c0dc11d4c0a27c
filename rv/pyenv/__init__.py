"""Python environments for jobs: found in the snapshot, built once per key on the cluster with uv.

spec.py    which environment a run needs, read from the snapshot before anything is sent
plan.py    the run's environment, decided from the snapshot and the flags alone
client.py  laptop side: ask the cluster for the run's environment, building it if it must
"""
