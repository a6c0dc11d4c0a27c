"""Issue 43's registry references: each runtime's own pull command line, against its documented
options (Apptainer/Singularity `pull`, enroot `import`, Charliecloud `ch-image pull` + `ch-convert`),
how a reference is read and keyed, and the cache's collection. Apptainer, Singularity and enroot are
not in Debian 12: their lines are checked here; Charliecloud's run for real in
tests/integration/test_container_registry.py."""

from __future__ import annotations

import json
import os
import time

import pytest

from rv.agent import container, images
from rv.agent.gc import Freed
from rv.job.container import DRY_RUN_IMAGE, dry_run_container, dry_run_pull, parse_container

REF = "docker://nvcr.io/nvidia/pytorch:24.01-py3"


def test_apptainer_and_singularity_pull_a_sif_without_their_home_cache():
    for rt in ("apptainer", "singularity"):
        [(argv, env)] = container.pull_steps(
            rt, REF, "/r/images/.pull-k/scratch", "/r/images/.pull-k/image.sif"
        )
        assert argv == [rt, "pull", "--disable-cache", "/r/images/.pull-k/image.sif", REF]
        assert env == {rt.upper() + "_TMPDIR": "/r/images/.pull-k/scratch"}


def test_apptainer_takes_oras_and_library_references_as_given():
    [(argv, _)] = container.pull_steps("apptainer", "oras://ghcr.io/a/b:1", "/t", "/o.sif")
    assert argv[-1] == "oras://ghcr.io/a/b:1"
    assert container.reference_runners("oras://ghcr.io/a/b:1") == ("apptainer", "singularity")
    assert container.reference_runners(REF) == ("apptainer", "singularity", "charliecloud", "pyxis")


@pytest.mark.parametrize(
    "ref, uri",
    [
        (REF, "docker://nvcr.io#nvidia/pytorch:24.01-py3"),
        ("docker://127.0.0.1:5000/rv/img:1", "docker://127.0.0.1:5000#rv/img:1"),
        ("docker://localhost/img", "docker://localhost#img"),
        ("docker://ubuntu:22.04", "docker://ubuntu:22.04"),  # Docker Hub: no registry part
        ("docker://library/ubuntu", "docker://library/ubuntu"),
        ("docker://nvcr.io#nvidia/pytorch:24.01-py3", "docker://nvcr.io#nvidia/pytorch:24.01-py3"),
    ],
)
def test_enroot_imports_with_a_hash_after_the_registry(ref, uri):
    [(argv, env)] = container.pull_steps("pyxis", ref, "/t", "/o/image.sqsh")
    assert argv == ["enroot", "import", "--output", "/o/image.sqsh", uri]
    assert env == {"ENROOT_TEMP_PATH": "/t", "ENROOT_CACHE_PATH": "/t/cache"}


def test_charliecloud_pulls_into_its_own_storage_then_squashes():
    steps = container.pull_steps("charliecloud", "docker://127.0.0.1:5000/rv/img:1", "/t", "/o/image.sqfs")
    assert steps == [
        (["ch-image", "--no-cache", "pull", "127.0.0.1:5000/rv/img:1"], {"CH_IMAGE_STORAGE": "/t/storage"}),
        (["ch-convert", "--tmp", "/t", "-i", "ch-image", "-o", "squash", "127.0.0.1:5000/rv/img:1",
          "/o/image.sqfs"], {"CH_IMAGE_STORAGE": "/t/storage"}),
    ]  # fmt: skip
    unpacked = container.pull_steps("charliecloud", "docker://a.io/b", "/t", "/o/image", squash=False)
    assert unpacked[1][0][5:7] == ["-o", "dir"]


@pytest.mark.parametrize(
    "ref, parsed",
    [
        ("docker://ubuntu", ("registry-1.docker.io", "library/ubuntu", "latest", None)),
        ("docker://python:3.11", ("registry-1.docker.io", "library/python", "3.11", None)),
        ("docker://docker.io/pytorch/pytorch:2.1", ("registry-1.docker.io", "pytorch/pytorch", "2.1", None)),
        (REF, ("nvcr.io", "nvidia/pytorch", "24.01-py3", None)),
        ("docker://127.0.0.1:5000/rv/img", ("127.0.0.1:5000", "rv/img", "latest", None)),
        ("docker://ghcr.io/a/b@sha256:abc", ("ghcr.io", "a/b", "latest", "sha256:abc")),
    ],
)
def test_a_docker_reference_is_read_as_docker_reads_it(ref, parsed):
    assert images.parse_docker(ref) == parsed


def test_a_digest_in_the_reference_needs_no_registry_and_other_schemes_are_not_asked():
    assert images.resolve_digest("docker://ghcr.io/a/b@sha256:abc") == ("sha256:abc", None)
    digest, why = images.resolve_digest("oras://ghcr.io/a/b:1")
    assert digest is None and "only docker://" in why


def test_the_key_changes_with_the_digest_and_the_format():
    a = images.image_key(REF, "sha256:1", "image.sif")
    assert a == images.image_key(REF, "sha256:1", "image.sif")
    assert a != images.image_key(REF, "sha256:2", "image.sif")
    assert a != images.image_key(REF, "sha256:1", "image.sqfs")


def test_dry_run_shows_the_cache_path_and_the_pull():
    spec = parse_container(REF, "pyxis")
    assert spec is not None
    assert dry_run_container(spec, "/r").image == f"/r/images/{DRY_RUN_IMAGE}/image.sqsh"
    [line] = dry_run_pull(spec, "/r")
    assert "enroot import --output" in line and "docker://nvcr.io#nvidia/pytorch:24.01-py3" in line
    assert dry_run_pull(parse_container("/a.sif", None), "/r") == []  # type: ignore[arg-type]


def _entry(root, key, ref, age):
    path = os.path.join(root, "images", key)
    os.makedirs(path)
    with open(os.path.join(path, "image.sif"), "wb") as fh:
        fh.write(b"x" * 5000)
    with open(os.path.join(path, "rv-image.json"), "w") as fh:
        json.dump({"reference": ref, "file": "image.sif", "runtime": "apptainer", "pulled_at": 0}, fh)
    used = os.path.join(path, ".last-used")
    open(used, "w").close()
    os.utime(used, (time.time() - age, time.time() - age))
    return path


def test_gc_keeps_an_image_a_kept_run_names_and_one_used_lately(tmp_path):
    root = str(tmp_path)
    named = _entry(root, "a" * 16, REF, 10 * 86400)
    lately = _entry(root, "b" * 16, REF, 60)
    unused = _entry(root, "c" * 16, REF, 10 * 86400)
    os.remove(os.path.join(_entry(root, "d" * 16, REF, 0), "image.sif"))  # a purge took it: not an image
    freed = Freed()
    removed, kept = images.gc_images(root.encode(), 86400, {"a" * 16: ["run1"]}, freed, dry=False)
    assert [r["key"] for r in removed] == ["c" * 16] and not os.path.exists(unused)
    assert {k["key"]: k["why"] for k in kept} == {"a" * 16: "used by run(s) run1", "b" * 16: "used 1m ago"}
    assert os.path.exists(named) and os.path.exists(lately) and freed.bytes >= 5000
    dry = images.gc_images(root.encode(), 0, {}, Freed(), dry=True)[0]
    assert sorted(r["key"] for r in dry) == ["a" * 16, "b" * 16] and os.path.exists(named)


def test_the_pull_tools_run_without_the_venv_the_setup_lines_activated():
    env = {"PATH": "/r/venv/bin:/usr/local/bin:/usr/bin", "VIRTUAL_ENV": "/r/venv", "HOME": "/h"}
    assert images.tool_environment(env) == {"PATH": "/usr/local/bin:/usr/bin", "HOME": "/h"}
    assert images.tool_environment({"PATH": "/usr/bin"}) == {"PATH": "/usr/bin"}
