"""Running the Slurm commands a call carries: each comes from the laptop as an argv built by
:mod:`rv.slurm.commands` (``{user}`` stands for the login name), so the agent writes no Slurm
command text of its own. Answers are text for the laptop's parsers, or the live jobs squeue lists.
"""

import os
import pwd
import subprocess

from rv.agent import common


def user_name():
    return pwd.getpwuid(os.getuid()).pw_name


def run_argv(argv, env=None, timeout=60, stdin_data=None):
    """(exit code, stdout, stderr) of ``argv``; 127 when the program is missing."""
    return finish(start(argv, env, stdin_data is not None), stdin_data, timeout)


def start(argv, env=None, stdin=False):
    """The process running ``argv``, or (127, "", why) when it cannot start."""
    # "{user}" stands for the login name, alone or in a word ("user={user}").
    argv = [word.replace("{user}", user_name()) if "{user}" in word else word for word in argv]
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
    except OSError as exc:
        return 127, "", "%s: %s" % (argv[0], exc.strerror)


def finish(proc, stdin_data=None, timeout=60):
    """(exit code, stdout, stderr) of a process :func:`start` began (or its reason it could not)."""
    if isinstance(proc, tuple):
        return proc
    try:
        out, err = proc.communicate(stdin_data, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return 124, "", "%s did not answer within %d s" % (proc.args[0], timeout)
    return proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def answer(argv):
    """{"text": stdout, "error": None, or what went wrong} of ``argv``, for a reply."""
    code, text, err = run_argv(argv)
    return {"text": text, "error": None if code == 0 else (err.strip() or "exit %d" % code)}


def slurm_answers(asks, meanwhile=None):
    """{key: answer(argv)} for each Slurm command a call carries along (``slurm``: {key: argv}), all
    at once (sacctmgr alone takes ~0.2 s a call), and ``meanwhile()``'s result, run beside them:
    (answers, result)."""
    started = [(key, start(argv)) for key, argv in sorted((asks or {}).items())]
    try:
        result = meanwhile() if meanwhile is not None else None
    finally:
        # Each is read to its end in turn; the others meanwhile run (or wait on a full pipe).
        done = [(key, finish(proc)) for key, proc in started]
    out = {}
    for key, (code, text, err) in done:
        out[key] = {"text": text, "error": None if code == 0 else (err.strip() or "exit %d" % code)}
    return out, result


def live_jobs(squeue_argv):
    """{job id: squeue line} of the user's queued and running jobs; raises when squeue fails."""
    code, out, err = run_argv(squeue_argv)
    if code != 0:
        raise common.AgentError(squeue_failure(code, err), "squeue")
    return jobs_of(out)


def squeue_failure(code, err):
    return "squeue failed (%s)" % (err.strip()[-300:] or "exit %d" % code)


def jobs_of(squeue_text):
    """{job id: line} from squeue's ``|``-separated output."""
    jobs = {}
    for line in squeue_text.splitlines():
        job = line.split("|", 1)[0].strip()
        if job:
            jobs[job] = line
    return jobs
