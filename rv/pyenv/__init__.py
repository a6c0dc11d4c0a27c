"""Python environments for jobs: found in the snapshot, built once per key on the cluster with uv."""
