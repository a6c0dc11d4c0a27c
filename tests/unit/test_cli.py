"""The CLI without a network: import weight, dry runs, and errors before any connection."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

CONFIG = """
[profiles.lab]
host = "nowhere.invalid"
user = "me"
remote_root = "/scratch/me/rv"
account = "lab"

[profiles.lab.gpus.a6000]
partition = "gpu-a6000"
gres = "a6000"
gpus_per_node = 2
compute_capability = 8.6
nodes = 2
"""


def rv(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rv", *args], cwd=cwd, env=env, capture_output=True, text=True
    )


@pytest.fixture
def setup(tmp_path):
    (tmp_path / "rv.toml").write_text(CONFIG)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.py").write_text("print('hi')\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RV_")}
    env.update(RV_CONFIG=str(tmp_path / "rv.toml"), HOME=str(tmp_path), NO_COLOR="1", RV_CONNECT_TIMEOUT="1")
    # A short private folder of its own for warm-connection sockets (sun_path is ~100 bytes).
    runtime = tempfile.mkdtemp(prefix="rv-ut-", dir="/tmp")
    env["RV_RUNTIME_DIR"] = runtime
    yield repo, env
    shutil.rmtree(runtime, ignore_errors=True)


def test_importing_the_cli_pulls_neither_torch_nor_paramiko():
    code = (
        "import sys, rv.cli.main; print(sorted(m for m in ('torch', 'paramiko', 'rich') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_dry_run_prints_the_script_and_connects_to_nothing(setup):
    repo, env = setup
    r = rv("run", "--dry-run", "-g", "4", "-t", "a6000", "--", "torchrun", "train.py", cwd=repo, env=env)
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --gres=gpu:a6000:2" in r.stdout and "#SBATCH --nodes=2" in r.stdout
    assert "#SBATCH --account=lab" in r.stdout
    assert "dry run: nothing was sent" in r.stderr
    assert "\numask 077\n" in r.stdout  # what the job writes is the user's alone


def test_dry_run_shows_cpus_and_memory_per_gpu_and_options_win(setup, tmp_path):
    repo, env = setup
    config = tmp_path / "rv.toml"
    config.write_text(
        config.read_text().replace("nodes = 2\n", 'nodes = 2\ncpus_per_gpu = 6\nmem_per_gpu = "30G"\n')
    )
    r = rv("run", "--dry-run", "-g", "4", "-t", "a6000", "--", "torchrun", "train.py", cwd=repo, env=env)
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --cpus-per-task=12" in r.stdout and "#SBATCH --mem=60G" in r.stdout
    assert (
        "resources: 2 node(s) × 2 a6000; per node 12 CPUs (6 per GPU, from the catalog), "
        "60G memory (30G per GPU, from the catalog)"
    ) in r.stderr
    r = rv("run", "--dry-run", "-g", "4", "-t", "a6000", "--cpus", "3", "--mem", "5G", "--", "torchrun",
           "train.py", cwd=repo, env=env)  # fmt: skip
    assert "#SBATCH --cpus-per-task=3" in r.stdout and "#SBATCH --mem=5G" in r.stdout
    assert "per node 3 CPUs (--cpus), 5G memory (--mem)" in r.stderr


def test_a_plain_command_on_two_nodes_is_refused_before_anything_is_sent(setup):
    repo, env = setup
    r = rv("run", "--dry-run", "-g", "4", "-t", "a6000", "--", "python", "train.py", cwd=repo, env=env)
    assert r.returncode == 2
    assert "`python train.py` on 2 nodes would run 2 separate copies" in r.stderr
    assert "--each-node" in r.stderr and "torchrun" in r.stderr
    r = rv(
        "run",
        "--dry-run",
        "-g",
        "4",
        "-t",
        "a6000",
        "--each-node",
        "--",
        "python",
        "train.py",
        cwd=repo,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert '"$RV_RANK_LABEL" --exec --label "$SLURM_NODEID" python train.py' in r.stdout


def test_share_with_group_reaches_the_job(setup, tmp_path):
    repo, env = setup
    config = tmp_path / "rv.toml"
    config.write_text(
        config.read_text().replace(
            "[profiles.lab.gpus.a6000]", "share_with_group = true\n\n[profiles.lab.gpus.a6000]"
        )
    )
    r = rv("run", "--dry-run", "-g", "1", "-t", "a6000", "--", "python", "train.py", cwd=repo, env=env)
    assert r.returncode == 0, r.stderr
    assert "\numask 027\n" in r.stdout


def test_bad_type_lists_valid_ones_without_connecting(setup):
    repo, env = setup
    r = rv("run", "-t", "a100", "--", "python", "train.py", cwd=repo, env=env)
    assert r.returncode == 2
    assert "unknown GPU type 'a100'" in r.stderr and "a6000" in r.stderr
    assert "cannot connect" not in r.stderr


def test_unreachable_host_is_a_connection_error(setup):
    repo, env = setup
    r = rv("exec", "true", cwd=repo, env=env)
    assert r.returncode == 4
    assert r.stderr.startswith("rv: error: cannot connect to me@nowhere.invalid:22")
    assert "Traceback" not in r.stderr


def test_debug_shows_the_traceback(setup):
    repo, env = setup
    r = rv("exec", "true", cwd=repo, env={**env, "RV_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr


# --- nothing slow is imported for local work ---------------------------------------------------------

_MODULES_AT_EXIT = (
    "import atexit, sys\n"
    "atexit.register(lambda: sys.stderr.write('MODULES ' + ' '.join(sorted(m for m in sys.modules "
    "if m.split('.')[0] in ('torch', 'paramiko', 'rich', 'git', 'cryptography', 'tomlkit'))) + '\\n'))\n"
    "from rv.cli.main import main\nsys.argv[0] = 'rv'\nmain()\n"
)


def _modules(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    r = subprocess.run(
        [sys.executable, "-c", _MODULES_AT_EXIT, *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    line = next(line for line in r.stderr.splitlines() if line.startswith("MODULES"))
    return r, set(line.split()[1:])


def test_help_and_dry_run_import_neither_paramiko_nor_torch(setup):
    repo, env = setup
    r, mods = _modules(["--help"], repo, env)
    assert r.returncode == 0 and "Commands" in r.stdout
    assert mods == set()
    r, mods = _modules(
        ["run", "--dry-run", "-g", "2", "-t", "a6000", "--", "torchrun", "train.py"], repo, env
    )
    assert r.returncode == 0, r.stderr
    assert not {m for m in mods if m.split(".")[0] in ("paramiko", "torch", "cryptography", "git")}


# --- rough edges ---------------------------------------------------------------------------------------


def test_host_key_prompt_shows_bracketed_host_names(capsys):
    # rich read "[login.example.edu]" as a markup tag and printed ":2222" alone.
    from rv.cli.common import confirm_host_key_interactively

    assert confirm_host_key_interactively("[login.example.edu]:2222", "ssh-ed25519", "SHA256:abc") is False
    err = capsys.readouterr().err
    assert "[login.example.edu]:2222" in err and "SHA256:abc" in err


@pytest.mark.parametrize(
    ("root", "message"),
    [
        ("rv/runs", "must be an absolute path"),
        ("/scratch/my runs", "must not contain spaces"),
        ("~other/rv", "only your own home"),
        ("/scratch/%u/rv", "must not contain '%'"),
    ],
)
def test_init_checks_the_remote_root_before_connecting(setup, root, message):
    repo, env = setup
    r = rv("init", "--host", "nowhere.invalid", "--remote-root", root, "--yes", cwd=repo, env=env)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "next:" in r.stderr
    assert "cannot connect" not in r.stderr


def test_init_accepts_a_home_relative_root_and_goes_on_to_connect(setup):
    repo, env = setup
    r = rv("init", "--host", "nowhere.invalid", "--remote-root", "~/rv", "--yes", cwd=repo, env=env)
    assert r.returncode == 4 and "cannot connect" in r.stderr  # validation passed; ~ is expanded there


def test_env_errors_never_echo_a_value(setup, tmp_path):
    repo, env = setup
    dotenv = tmp_path / "bad.env"
    dotenv.write_text("GOOD=1\nsk-live-TOPSECRET123\n")
    r = rv("env", "import", str(dotenv), cwd=repo, env=env)
    assert r.returncode == 2 and ".env line 2" in r.stderr
    assert "TOPSECRET" not in r.stderr + r.stdout
    dotenv.write_text("MY TOKEN=TOPSECRET123\n")
    r = rv("env", "import", str(dotenv), cwd=repo, env=env)
    assert r.returncode == 2 and "TOPSECRET" not in r.stderr + r.stdout


def test_shell_completion_lists_commands_and_options_without_connecting(setup):
    repo, env = setup
    r = subprocess.run(
        [sys.executable, "-m", "rv"],
        env={**env, "_RV_COMPLETE": "bash_complete", "COMP_WORDS": "rv sync pull --", "COMP_CWORD": "3"},
        cwd=repo,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert {"plain,--force", "plain,--keep-local"} <= set(r.stdout.split())
    assert not os.listdir(env["RV_RUNTIME_DIR"])  # nothing was started
