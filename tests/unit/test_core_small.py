"""Small pure pieces of the CLI core: probe parsing and secrets."""

from __future__ import annotations

import subprocess

import pytest

from rv.errors import RemoteCommandMissing, UsageError
from rv.probe import facts_from_probe
from rv.secrets import SecretStore, mask, parse_dotenv, render_env_file

PROBE = """\
@@user
abc1de
@@home
/home/abc1de
@@commands
sbatch
squeue
sacct
sinfo
sacctmgr
@@scratch
/scratch/abc1de
@@allocations
@@assoc
mylab
mylab
other
@@sinfo
@@end
"""


def test_probe_facts():
    facts = facts_from_probe(PROBE)
    assert (facts.user, facts.scratch, facts.account) == ("abc1de", "/scratch/abc1de", "mylab")
    assert facts.accounts == ("mylab", "other")
    assert facts.default_remote_root == "/scratch/abc1de/rv"


def test_probe_says_what_is_missing_of_git():
    assert facts_from_probe(PROBE).git_problem is not None  # no @@git answer: no git
    assert "git is not installed" in facts_from_probe(PROBE).git_problem
    with_git = PROBE.replace("@@end", "@@git\ngit version 2.39.5\n@@end")
    assert facts_from_probe(with_git).git_version == "git version 2.39.5"
    assert facts_from_probe(with_git).git_problem is None
    old = facts_from_probe(PROBE.replace("@@end", "@@git\ngit version 1.8.3.1\n@@end"))
    assert "git version 1.8.3.1 is too old" in old.git_problem and "2.20 or newer" in old.git_problem


def test_probe_missing_sbatch_says_what_to_do():
    with pytest.raises(RemoteCommandMissing) as exc:
        facts_from_probe(PROBE.replace("sbatch\n", ""))
    assert exc.value.message == "sbatch not found on the cluster's login node"
    assert exc.value.exit_code == 7 and "module load slurm" in exc.value.hint


def test_dotenv_and_env_file_round_trip_through_bash(tmp_path):
    values = parse_dotenv("# c\nexport A=1\nB='two words'\nC=\"x $y\"\nD=plain # comment\nE=\n")
    assert values == {"A": "1", "B": "two words", "C": "x $y", "D": "plain", "E": ""}
    values["F"] = "multi\nline `cmd` $HOME 'q'"
    f = tmp_path / "env"
    f.write_text(render_env_file(values))
    out = subprocess.run(["bash", "-c", f". {f}; printf '%s' \"$F\""], capture_output=True, text=True)
    assert out.stdout == values["F"]
    with pytest.raises(UsageError):
        parse_dotenv("1BAD=x\n")


def test_secret_store_mode_and_mask(tmp_path):
    store = SecretStore(tmp_path / "s.json")
    store.set("TOKEN", "hf_abcdefghijkl", "mycluster")
    assert (tmp_path / "s.json").stat().st_mode & 0o777 == 0o600
    # Issue 33: these said "hf******kl" and "*****" (4 of 15 characters; the exact length).
    assert mask("hf_abcdefghijkl") == "********" and mask("short") == "********"
    assert mask("") == "********" and mask("s3cr3tpw!") == "********"
    assert mask("hf_" + "x" * 30 + "yz") == "hf********yz"
    assert store.remove(["TOKEN"], "mycluster") == [] and store.remove(["TOKEN"], "mycluster") == ["TOKEN"]


def test_a_ctrl_c_says_whether_a_submission_was_sent_and_recording_what_was_sent_runs_whole():
    import os
    import signal

    from rv.errors import Interrupted
    from rv.job.interrupt import SubmitStage, held_interrupts, said_on_interrupt

    said = []
    for move in (lambda s: None, SubmitStage.sending, lambda s: s.sent("job array 7")):
        with pytest.raises(Interrupted) as err, said_on_interrupt(SubmitStage("sweep", "g")) as stage:
            move(stage)
            raise KeyboardInterrupt
        said.append((err.value.exit_code, err.value.message, err.value.hint))
    assert said == [
        (130, "interrupted before sweep g was sent: nothing was queued", "run it again"),
        (130, "interrupted while sweep g was being sent: it may have been sent",
         "rv ps g   (rv stop g if it was and you do not want it)"),
        (130, "interrupted after sweep g was sent (job array 7); it is queued and recorded", "rv ps g"),
    ]  # fmt: skip
    done, before = [], signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), held_interrupts():
        os.kill(os.getpid(), signal.SIGINT)
        done.append("recorded")  # the Ctrl-C waits for the block's end
    assert done == ["recorded"] and signal.getsignal(signal.SIGINT) is before
