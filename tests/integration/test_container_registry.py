"""Issue 43's registry references on the real clusters, both layouts: `rv run --container docker://...`
pulls the image once with Charliecloud's own tool (ch-image pull, then ch-convert to SquashFS) from
the loopback registry scripts/testcluster runs (Debian's docker-registry, on 127.0.0.1 with TLS by a
certificate the machine trusts), holding the test image pushed there by skopeo. The image is cached
under the remote root, reused by the next run, listed by `rv status` and collected by `rv gc` once no
run it keeps names it. Apptainer, Singularity and enroot are not in Debian 12: their pull lines are
checked in tests/unit/test_container_pull.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

from projects import git_project, wait_for
from test_store import ended, run_folder

PROGRAM = 'print("marker", open("/etc/rv-test-image").read().split()[:3], flush=True)\n'


def reference(layout) -> str:
    ref = layout.cluster.get("RV_TESTCLUSTER_REGISTRY_IMAGE")
    assert ref, "RV_TESTCLUSTER_REGISTRY_IMAGE missing: scripts/testcluster up pushes the test image"
    return "docker://" + ref


def cache(layout) -> list[Path]:
    folder = Path(layout.remote_root, "images")
    return (
        sorted(p for p in folder.iterdir() if not p.name.startswith(".") and p.is_dir())
        if folder.exists()
        else []
    )


def test_a_reference_is_pulled_once_reused_listed_and_collected_when_no_run_names_it(layout, tmp_path):
    ref = reference(layout)
    proj = git_project(tmp_path / "p", {"inside.py": PROGRAM, "wait.py": "import time; time.sleep(300)\n"})
    run = ("run", "-g", "0", "--mem", "500M", "--container", ref)
    first = layout.run_rv(*run, "--name", "pull1", "-f", "--", "python3", "inside.py", cwd=proj, timeout=900)
    assert first.returncode == 0, first.stdout + first.stderr[-3000:]
    assert "marker ['rv', 'test', 'image']" in first.stdout, first.stdout
    assert f"pulling {ref} with ch-image" in first.stderr and f"pulled {ref} in" in first.stderr, first.stderr
    [entry] = cache(layout)
    meta = json.loads((entry / "rv-image.json").read_text())
    assert meta["reference"] == ref and meta["digest"].startswith("sha256:") and meta["tool"] == "ch-image"
    assert (entry / "image.sqfs").stat().st_size > 1_000_000
    # The job ran the cached SquashFS file with ch-run.
    script = (run_folder(layout.remote_root, "pull1") / "job.sbatch").read_text()
    assert f'--cd="$PWD" {entry}/image.sqfs -- python3' in script
    assert (
        json.loads((run_folder(layout.remote_root, "pull1") / "run.json").read_text())["image"] == entry.name
    )

    # The second run reuses it: no pull, the same entry.
    second = layout.run_rv(*run, "--name", "pull2", "-f", "--", "python3", "inside.py", cwd=proj, timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr[-3000:]
    assert "marker ['rv', 'test', 'image']" in second.stdout
    assert "pulling" not in second.stderr and f"image {ref}: pulled before, reused" in second.stderr
    assert cache(layout) == [entry]

    # A live run names it: rv status lists it with its runs, rv gc keeps it.
    live = layout.run_rv(*run, "--name", "pull-live", "--", "python3", "wait.py", cwd=proj, timeout=300)
    assert live.returncode == 0, live.stderr[-3000:]
    status = layout.run_rv("status", "--json")
    assert status.returncode == 0, status.stderr
    [shown] = json.loads(status.stdout)["container_images"]
    assert shown["reference"] == ref and shown["key"] == entry.name and shown["bytes"] > 1_000_000
    assert sorted(r["name"] for r in shown["runs"]) == ["pull-live", "pull1", "pull2"]
    text = layout.run_rv("status").stdout
    assert re.search(
        rf"image +{re.escape(ref)} \(charliecloud, .*{entry.name}\): used by 3 run\(s\)", text
    ), text
    dry = layout.run_rv("gc", "--older-than", "0", "--dry-run")
    assert f"keep    image {ref} ({entry.name}): used by run(s) pull-live" in dry.stdout, dry.stdout
    kept = layout.run_rv("gc", "--older-than", "0")
    assert kept.returncode == 0 and f"keep    image {ref}" in kept.stdout, kept.stdout + kept.stderr
    assert cache(layout) == [entry]

    # Once no run names it, rv gc --dry-run lists it, and rv gc removes it.
    assert layout.run_rv("stop", "pull-live").returncode == 0
    ended(layout.remote_root, "pull-live")
    dry = layout.run_rv("gc", "--older-than", "0", "--dry-run")
    assert f"would remove  image {ref} ({entry.name})" in dry.stdout, dry.stdout
    assert cache(layout) == [entry]
    gone = layout.run_rv("gc", "--older-than", "0")
    assert f"removed  image {ref} ({entry.name})" in gone.stdout, gone.stdout + gone.stderr
    assert "1 pulled image(s)" in gone.stderr
    wait_for(lambda: not entry.exists(), 10, "the image to go")


def test_a_reference_the_registry_does_not_have_is_refused_before_anything_is_sent(layout, tmp_path):
    missing = reference(layout).rsplit(":", 1)[0] + "-nope:1"
    proj = git_project(tmp_path / "p", {"t.py": "print(1)\n"})
    r = layout.run_rv(
        "run", "-g", "0", "--name", "nopull", "--container", missing, "--", "python3", "t.py", cwd=proj
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"--container {missing}: the registry 127.0.0.1:" in r.stderr and "has no such image" in r.stderr
    assert "nothing was pulled or submitted" in r.stderr
    assert not list(Path(layout.remote_root, "runs").glob("*/run.json")) and cache(layout) == []
