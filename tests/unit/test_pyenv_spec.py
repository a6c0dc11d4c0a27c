"""Which environment a snapshot asks for (rv.pyenv.spec), and the requires-python check the agent makes."""

from __future__ import annotations

import subprocess

import pytest

from rv.agent.envs import python_satisfies
from rv.errors import UsageError
from rv.pyenv.spec import activation_lines, find_spec, import_paths

PYPROJECT = b"""[project]
name = "p"
version = "0"
requires-python = ">=3.10"
dependencies = ["six"]
[project.optional-dependencies]
train = ["numpy"]
"""


def spec_of(files: dict[str, bytes], **kwargs):
    return find_spec(set(files), files.__getitem__, **kwargs)


def test_nothing_declared_means_no_environment():
    assert spec_of({"train.py": b"", "pyproject.toml": b"[tool.ruff]\nline-length = 100\n"}) is None


def test_uv_lock_wins_then_requirements_then_pyproject():
    files = {"pyproject.toml": PYPROJECT, "uv.lock": b"version = 1\n", "requirements.txt": b"six\n"}
    assert spec_of(files).kind == "uv.lock"
    del files["uv.lock"]
    assert spec_of(files).kind == "requirements"
    del files["requirements.txt"]
    spec = spec_of(files, extras=["train"])
    assert (spec.kind, spec.extras, spec.requires_python) == ("pyproject", ("train",), ">=3.10")


def test_the_folder_typed_in_first_then_each_folder_above():
    files = {"requirements.txt": b"six\n", "sub/app/requirements.txt": b"idna\n", "sub/app/x/y.py": b""}
    assert spec_of(files, start="sub/app/x").folder == "sub/app"
    assert spec_of(files, start="other").folder == ""


def test_requirements_follow_includes_and_drop_the_project_itself():
    files = {
        "requirements.txt": b"-r reqs/base.txt\n-e .\nsix==1.16.0  # pinned\n",
        "reqs/base.txt": b"-c ../constraints.txt\nidna\n",
        "constraints.txt": b"idna<4\n",
    }
    spec = spec_of(files)
    assert spec.file_names == ("requirements.txt", "reqs/base.txt", "constraints.txt")
    assert spec.dropped == ("requirements.txt: -e .",)
    assert b"-e ." not in spec.files[0][1]


def test_the_key_part_changes_with_any_byte_and_with_the_options():
    base = spec_of({"requirements.txt": b"six==1.16.0\n"})
    assert base.digest() == spec_of({"requirements.txt": b"six==1.16.0\n"}).digest()
    assert base.digest() != spec_of({"requirements.txt": b"six==1.15.0\n"}).digest()
    assert (
        base.digest() != spec_of({"requirements.txt": b"six==1.16.0\n"}, system_site_packages=True).digest()
    )
    assert base.digest() != spec_of({"requirements.txt": b"six==1.16.0\n"}, python="3.12").digest()


@pytest.mark.parametrize(
    ("files", "kwargs", "message"),
    [
        ({"a.py": b""}, {"requirements": "reqs.txt"}, "reqs.txt is not in the snapshot"),
        ({"pyproject.toml": PYPROJECT}, {"extras": ["gpu"]}, "--extra gpu: pyproject.toml has no such group"),
        ({"requirements.txt": b"-r missing.txt\n"}, {}, "includes missing.txt, which is not in the snapshot"),
        ({"requirements.txt": b"six\n"}, {"extras": ["train"]}, "requirements.txt comes first"),
        ({"a.py": b""}, {"requirements": "../outside.txt"}, "must be a file inside the repo"),
    ],
)
def test_bad_flags_fail_before_anything_is_sent(files, kwargs, message):
    with pytest.raises(UsageError, match=message.replace("[", r"\[")):
        spec_of(files, **kwargs)


def test_import_paths_src_layout_or_the_project_folder():
    assert import_paths({"src/pkg/__init__.py", "train.py"}, "") == ("src",)
    assert import_paths({"pkg/__init__.py", "train.py"}, "") == (".",)
    assert import_paths({"app/src/pkg/m.py"}, "app") == ("app/src",)


def test_activation_lines_run_in_bash(tmp_path):
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin/python").write_text("#!/bin/sh\n")
    (env / "bin/python").chmod(0o755)
    (env / "pyvenv.cfg").write_text("home = /usr/bin\n")
    script = "\n".join(
        ["set -eu", f"RV_WORK_DIR={tmp_path}/work", *activation_lines(str(env), ("src",)),
         'echo "$VIRTUAL_ENV|${CONDA_PREFIX:-}|$PYTHONPATH|${PATH%%:*}"']
    )  # fmt: skip
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"{env}||{tmp_path}/work/src|{env}/bin"
    assert (env / ".last-used").exists()
    gone = subprocess.run(
        ["bash", "-c", "\n".join(activation_lines(str(tmp_path / "gone")))], capture_output=True
    )
    assert gone.returncode == 3 and b"rv venv build" in gone.stderr


@pytest.mark.parametrize(
    ("version", "requires", "ok"),
    [
        ("3.11.2", ">=3.10", True), ("3.11.2", ">=3.99", False), ("3.11.2", ">=3.8,<3.11", False),
        ("3.11.2", "~=3.9", True), ("3.11.2", "~=3.12", False), ("3.11.2", "==3.11.*", True),
        ("3.10.1", "==3.11.*", False), ("3.6.8", ">=3.7", False), ("3.11.2", "!=3.11.*", False),
    ],
)  # fmt: skip
def test_requires_python(version, requires, ok):
    assert python_satisfies(version, requires) is ok
