"""`rv env`: names a secret may not have, piped values, the kernel's size limits, profiles, and
.env files that are not UTF-8 (issue 28, items 1-4 and 10). The real CLI as a subprocess; no network."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rv.errors import UsageError
from rv.secrets import (
    MAX_ENV_STRING,
    MAX_TOTAL_BYTES,
    RESERVED,
    SecretStore,
    check_value,
    parse_dotenv,
    read_piped_value,
    reserved_reason,
)

CONFIG = """
default = "alpha"

[profiles.alpha]
host = "alpha.invalid"
remote_root = "/scratch/me/rv"

[profiles.beta]
host = "beta.invalid"
remote_root = "/scratch/me/rv"
"""


@pytest.fixture
def env(tmp_path):
    (tmp_path / "rv.toml").write_text(CONFIG)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("RV_", "XDG_"))}
    e.update(
        RV_CONFIG=str(tmp_path / "rv.toml"), RV_STATE_DIR=str(tmp_path / "state"), HOME=str(tmp_path),
        NO_COLOR="1",
    )  # fmt: skip
    return e


def rv(env, *args, input=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rv", *args], env=env, input=input, capture_output=True, cwd=env["HOME"]
    )


def stored(env) -> dict:
    return json.loads((Path(env["RV_STATE_DIR"]) / "secrets.json").read_text())


def listed(env, *args) -> list[dict]:
    r = rv(env, "env", "list", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# --- item 1: names rv or Slurm set, and names that run the job ------------------------------------


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("PATH", "every program the job runs is found with it"),
        ("RV_RUN_DIR", "rv sets RV_* variables"),
        ("SLURM_JOB_ID", "Slurm sets SLURM_* variables"),
        ("SLURMD_NODENAME", "Slurm sets SLURMD_*"),
        ("SRUN_CPUS_PER_TASK", "srun reads SRUN_*"),
        ("MASTER_PORT", "rv sets it from the job id"),
        ("LD_PRELOAD", "the dynamic loader reads LD_*"),
        ("PYTHONPATH", "change which Python and which modules"),
        ("HOME", "find their files with it"),
        ("BASH_ENV", "every bash the job starts runs the file"),
        ("CUDA_VISIBLE_DEVICES", "GPUs allocated to the job"),
    ],
)
def test_set_refuses_names_rv_slurm_or_the_job_own_and_says_why(env, name, why):
    r = rv(env, "env", "set", f"{name}=/nonexistent")
    assert r.returncode == 2, r.stderr
    assert f"{name} cannot be a secret" in r.stderr.decode() and why in r.stderr.decode()
    assert "--setup" in r.stderr.decode()  # the way to set it on purpose
    assert not (Path(env["RV_STATE_DIR"]) / "secrets.json").exists()


def test_ordinary_names_stay_allowed():
    for name in ("HF_TOKEN", "WANDB_API_KEY", "OPENAI_API_KEY", "MY_PATH", "RV", "SLURMISH", "PATHS"):
        assert reserved_reason(name) is None, name
    # Every rule has its reason, and every glob is a plain `case` pattern the job's shell can use.
    assert all(
        reason and set(glob) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_*") for glob, reason in RESERVED
    )


def test_import_refuses_reserved_names_with_their_lines_reasons_and_imports_nothing(env, tmp_path):
    dotenv = tmp_path / "x.env"
    dotenv.write_text("HF_TOKEN=abc\nexport PATH=/nowhere\nRV_RUN_DIR=/tmp\n")
    r = rv(env, "env", "import", str(dotenv))
    err = r.stderr.decode()
    assert r.returncode == 2 and "nothing imported" in err
    assert "PATH: every program the job runs is found with it" in err and "RV_RUN_DIR: rv sets" in err
    assert not (Path(env["RV_STATE_DIR"]) / "secrets.json").exists()


def test_a_reserved_secret_in_the_file_is_not_sent_and_the_user_is_told(tmp_path):
    notices: list[str] = []
    path = tmp_path / "secrets.json"
    # Edited by hand: `rv env set` refuses such names.
    path.write_text(json.dumps({"version": 2, "global": {"PATH": "/nonexistent", "HF_TOKEN": "hf_x"}}))
    store = SecretStore(path, notices.append)
    assert store.for_job("alpha") == {"HF_TOKEN": "hf_x"}
    assert any("secret PATH is not sent to the job" in n and "rv env rm --global PATH" in n for n in notices)


# --- item 2: piped values, whole -------------------------------------------------------------------


def test_a_piped_multiline_value_is_stored_whole_without_a_python_warning(env):
    pem = "-----BEGIN KEY-----\nAAAA\nBBBB\n-----END KEY-----"
    r = rv(env, "env", "set", "KEY", input=(pem + "\n").encode())
    assert r.returncode == 0, r.stderr
    assert b"Warning" not in r.stderr and b"echoed" not in r.stderr
    assert stored(env)["profiles"]["alpha"]["KEY"] == pem  # every line; one final newline dropped
    r = rv(env, "env", "set", "TWO", input=b"a\nb\n\n")
    assert stored(env)["profiles"]["alpha"]["TWO"] == "a\nb\n"  # only ONE trailing newline goes
    r = rv(env, "env", "set", "CRLF", input=b"tok\r\n")
    assert stored(env)["profiles"]["alpha"]["CRLF"] == "tok"


def test_empty_piped_input_is_a_clear_error_not_aborted(env):
    for data in (b"", b"\n"):
        r = rv(env, "env", "set", "KEY", input=data)
        err = r.stderr.decode()
        assert r.returncode == 2 and "no value for KEY: standard input was empty" in err
        assert "Aborted" not in err
    with pytest.raises(UsageError, match="not UTF-8"):
        read_piped_value(b"\xff\xfe", "KEY")


# --- item 3: the kernel's limits ---------------------------------------------------------------------


def test_max_env_string_is_the_kernels_limit_for_one_environment_string():
    # The figure rv refuses at is the one execve enforces: NAME=value plus its NUL.
    name = "K"
    fits = "x" * (MAX_ENV_STRING - len(name) - 2)
    assert subprocess.run(["true"], env={name: fits}).returncode == 0
    with pytest.raises(OSError) as exc:
        subprocess.run(["true"], env={name: fits + "x"})
    assert exc.value.errno == errno.E2BIG
    assert check_value(name, fits) == fits
    with pytest.raises(UsageError, match=f"at most {MAX_ENV_STRING} bytes per environment variable"):
        check_value(name, fits + "x")


def test_a_value_over_the_limit_is_refused_with_the_limit_named(env):
    r = rv(env, "env", "set", "BIG", input=b"x" * MAX_ENV_STRING)
    assert r.returncode == 2 and f"at most {MAX_ENV_STRING} bytes" in r.stderr.decode()
    assert "MAX_ARG_STRLEN" in r.stderr.decode()
    r = rv(env, "env", "set", "NUL", input=b"a\0b")
    assert r.returncode == 2 and "NUL" in r.stderr.decode()


def test_all_secrets_of_a_job_together_are_kept_under_the_total(tmp_path):
    store = SecretStore(tmp_path / "s.json")
    chunk = "x" * 100_000
    count = MAX_TOTAL_BYTES // len(chunk)
    store.update({f"G{i}": chunk for i in range(count // 2)}, None)
    store.update({f"A{i}": chunk for i in range(count - count // 2)}, "alpha")
    with pytest.raises(UsageError, match=f"over rv's limit of {MAX_TOTAL_BYTES}"):
        store.set("A_MORE", chunk, "alpha")
    with pytest.raises(UsageError, match="on profile alpha"):
        store.set("G_MORE", chunk, None)  # global: it would reach alpha's jobs too
    store.set("B0", chunk, "beta")  # beta's jobs have room
    assert len(store.for_job("alpha")) == count


# --- item 4: secrets belong to a profile -------------------------------------------------------------


def test_secrets_belong_to_the_current_profile_unless_global(env):
    assert rv(env, "env", "set", "ONLY_ALPHA=a").returncode == 0  # the default profile
    assert rv(env, "env", "set", "--profile", "beta", "ONLY_BETA=b").returncode == 0
    assert rv(env, "-p", "beta", "env", "set", "CLASH=beta-wins").returncode == 0
    r = rv(env, "env", "set", "--global", "SHARED=s")
    assert r.returncode == 0 and "for global (every profile)" in r.stderr.decode()
    r = rv(env, "env", "set", "--global", "CLASH=global")
    assert r.returncode == 0
    store = SecretStore(Path(env["RV_STATE_DIR"]) / "secrets.json")
    assert store.for_job("alpha") == {"ONLY_ALPHA": "a", "SHARED": "s", "CLASH": "global"}
    assert store.for_job("beta") == {"ONLY_BETA": "b", "SHARED": "s", "CLASH": "beta-wins"}
    rows = {(r["name"], r["profile"]) for r in listed(env, "-p", "beta")}
    assert rows == {("ONLY_BETA", "beta"), ("SHARED", None), ("CLASH", "beta")}
    text = rv(env, "-p", "beta", "env", "list").stdout.decode()
    # Issue 33: this said "be******ns", 4 of the 9 characters of "beta-wins".
    assert "CLASH=********  (profile beta, over the global one)" in text and "(global)" in text
    assert len(listed(env, "--all")) == 5
    # rm: its scope only, and a name set elsewhere says where it is.
    r = rv(env, "env", "rm", "SHARED")
    assert r.returncode == 9 and "rv env rm --global SHARED" in r.stderr.decode()
    assert rv(env, "env", "rm", "--global", "SHARED").returncode == 0
    assert rv(env, "env", "set", "--global", "--profile", "beta", "X=1").returncode == 2
    r = rv(env, "env", "set", "--profile", "nosuch", "X=1")
    assert r.returncode == 3 and "unknown profile 'nosuch'" in r.stderr.decode()


def test_a_global_secret_can_be_moved_to_one_profile_and_back(env):
    assert rv(env, "env", "set", "--global", "HF_TOKEN=hf_abc").returncode == 0
    assert rv(env, "env", "set", "--global", "WANDB_API_KEY=w").returncode == 0
    assert stored(env)["global"] == {"HF_TOKEN": "hf_abc", "WANDB_API_KEY": "w"}
    assert os.stat(Path(env["RV_STATE_DIR"]) / "secrets.json").st_mode & 0o777 == 0o600
    # Every profile's jobs get them.
    assert {r["name"] for r in listed(env, "-p", "beta")} == {"HF_TOKEN", "WANDB_API_KEY"}
    r = rv(env, "env", "move", "HF_TOKEN", "--profile", "alpha")
    assert r.returncode == 0, r.stderr
    assert {r["name"] for r in listed(env, "-p", "beta")} == {"WANDB_API_KEY"}
    assert {(r["name"], r["profile"]) for r in listed(env, "-p", "alpha")} == {
        ("HF_TOKEN", "alpha"),
        ("WANDB_API_KEY", None),
    }
    assert rv(env, "env", "move", "--global", "HF_TOKEN", "-p", "alpha").returncode == 0
    assert stored(env)["global"] == {"HF_TOKEN": "hf_abc", "WANDB_API_KEY": "w"}


def test_without_any_profile_a_secret_must_be_global(env, tmp_path):
    env = {**env, "RV_CONFIG": str(tmp_path / "none.toml")}
    r = rv(env, "env", "set", "K=v")
    assert r.returncode == 3 and "--global" in r.stderr.decode()
    assert rv(env, "env", "set", "--global", "K=v").returncode == 0


# --- item 10: a .env file that is not UTF-8 ----------------------------------------------------------


def test_import_of_a_non_utf8_file_reads_the_rest_and_names_the_line(env, tmp_path):
    dotenv = tmp_path / "latin1.env"
    dotenv.write_bytes(b"\xef\xbb\xbfHF_TOKEN=abc\nPASSWORD=caf\xe9-s3cret\nWANDB_API_KEY=w\n")
    r = rv(env, "env", "import", str(dotenv))
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 0, err
    assert "line 2 is not UTF-8 text: skipped" in err
    assert "s3cret" not in err and "caf" not in err  # never a value
    assert "UnicodeDecodeError" not in err
    assert stored(env)["profiles"]["alpha"] == {"HF_TOKEN": "abc", "WANDB_API_KEY": "w"}
    with pytest.raises(UsageError, match="line 2 is not UTF-8"):
        parse_dotenv(b"A=1\nB=\xff\n")


def test_a_value_typed_in_a_terminal_is_still_hidden(env):
    import select

    master, slave = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rv", "env", "set", "TYPED"], stdin=slave, stdout=slave, stderr=slave,
        env=env, cwd=env["HOME"], start_new_session=True,
    )  # fmt: skip
    os.close(slave)
    seen = b""

    def read_until(marker: bytes) -> None:
        nonlocal seen
        while marker not in seen:
            ready, _, _ = select.select([master], [], [], 30)
            assert ready, seen
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the command has exited
                chunk = b""
            assert chunk, seen
            seen += chunk

    read_until(b"Value for TYPED")
    os.write(master, b"typed-s3cret\r")
    read_until(b"set TYPED")
    assert proc.wait(30) == 0
    os.close(master)
    assert b"typed-s3cret" not in seen  # no echo
    assert stored(env)["profiles"]["alpha"]["TYPED"] == "typed-s3cret"
