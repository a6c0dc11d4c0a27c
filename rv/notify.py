"""Where a run's end is told (`rv run --notify`, the profile's and the project's ``notify`` key).

Three kinds of target, each checked here before anything is sent:

``mail:ADDRESS``
    Slurm's own mail, sent once when the run ends: the job that ends the run asks Slurm for it
    (rv/agent/job.sh, ``rv_notify_end``); no earlier segment's job carries a mail type.
``secret:NAME``
    a webhook whose URL is kept as the rv secret NAME (``rv env set NAME``): the job posts to it from
    the compute node (rv/agent/notify.py). The URL travels only in the job's 0600 secrets file.
``desktop``
    this machine, while ``rv run -f`` or ``rv wait`` follows the run (:func:`desktop_notify`).

``none`` clears what a profile or project set. Decided on the cluster: closing the laptop stops
neither the mail nor the webhooks.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from rv.errors import UsageError
from rv.secrets import KEY

FORMS = "mail:ADDRESS, secret:NAME (a webhook URL kept with `rv env set NAME`), desktop, or none"
# One address per value: Slurm passes MailUser to its MailProg as one argument, and rv joins several
# with commas, so an address holds no comma, space, quote or '%' (Slurm's own pattern character).
_ADDRESS = re.compile(r"^[^@\s,;'\"\\%]+@[A-Za-z0-9.-]+$")


# A webhook's URL: printable ASCII without spaces. The job's notifier (rv/agent/notify.py, url_problem)
# keeps the same rules, and a unit test holds the two equal: a value copied with a trailing newline or
# "# comment" made http.client raise InvalidURL quoting the URL's path, token included, into the log.
_URL_CHARS = re.compile(r"[!-~]+\Z")


def webhook_problem(url: str) -> str | None:
    """Why ``url`` is not one http(s) URL to post to, in words that quote none of it; None when it is."""
    if not _URL_CHARS.match(url):
        return "it holds a space, a line break or a character outside printable ASCII"
    try:
        parts = urlsplit(url)
        _port = parts.port  # raises ValueError for a port that is not a number
    except ValueError:
        return "it does not parse as a URL"
    if parts.scheme.lower() not in ("http", "https"):
        return "it does not begin with http:// or https://"
    if not parts.hostname:
        return "it names no host"
    return None


@dataclass(frozen=True)
class Notify:
    """The checked targets, in the order given (duplicates dropped)."""

    targets: tuple[str, ...] = ()

    @property
    def mail(self) -> tuple[str, ...]:
        return tuple(t.split(":", 1)[1] for t in self.targets if t.startswith("mail:"))

    @property
    def hooks(self) -> tuple[str, ...]:
        return tuple(t.split(":", 1)[1] for t in self.targets if t.startswith("secret:"))

    @property
    def desktop(self) -> bool:
        return "desktop" in self.targets


def parse_targets(values: Sequence[str], secrets: Mapping[str, str]) -> Notify:
    """``--notify`` values checked: each a known form; each ``secret:NAME`` one the job gets
    (``secrets``: this profile's and the global secrets) holding one http(s) URL. ``none`` drops what
    came before. A bad value is a UsageError naming it (never quoting a secret's value), before the
    first network call."""
    targets: list[str] = []
    for raw in values:
        value = raw.strip()
        kind, sep, rest = value.partition(":")
        if value == "none":
            targets = []
            continue
        if value == "desktop":
            pass
        elif sep and kind == "mail":
            if not _ADDRESS.match(rest):
                raise UsageError(
                    f"--notify {raw!r}: {rest!r} is not a mail address Slurm can use",
                    hint="one address per --notify, e.g. --notify mail:me@example.org",
                )
        elif sep and kind == "secret":
            if not KEY.match(rest):
                raise UsageError(
                    f"--notify {raw!r}: {rest!r} is not a secret name (letters, digits and _)",
                    hint="--notify secret:SLACK_HOOK, after `rv env set SLACK_HOOK`",
                )
            if rest not in secrets:
                raise UsageError(
                    f"--notify {raw!r}: there is no secret {rest} for this profile; nothing was sent",
                    hint=f"keep the webhook's URL as a secret first: rv env set {rest}   (rv env list)",
                )
            problem = webhook_problem(secrets[rest])
            if problem is not None:
                raise UsageError(
                    f"--notify {raw!r}: secret {rest} does not hold one http(s) URL ({problem}); "
                    "nothing was sent",
                    hint=f"set it to the webhook's URL alone: rv env set {rest}   (a trailing comment or "
                    "line break copied with it counts)",
                )
        else:
            raise UsageError(f"--notify {raw!r}: expected {FORMS}", hint="--notify mail:me@example.org")
        if value not in targets:
            targets.append(value)
    return Notify(tuple(targets))


# --- the desktop ---------------------------------------------------------------------------------


def end_words(name: str, ended: Mapping[str, Any] | None, state: str) -> tuple[str, str]:
    """(title, body) of a desktop notification for a run's end."""
    ended = ended or {}
    reason = str(ended.get("reason") or "no record of its end")
    segment = ended.get("segment")
    segs = f", {segment} segment{'s' if segment != 1 else ''}" if segment else ""
    return f"rv: {name} {state}", f"{reason} (exit code {ended.get('exit_code')}{segs})"


def desktop_notify(
    title: str,
    body: str,
    *,
    platform: str = sys.platform,
    which: Callable[[str], str | None] = shutil.which,
    run: Callable[..., Any] = subprocess.run,
) -> str | None:
    """Show a notification on this machine: notify-send (Linux, in a graphical session), osascript
    (macOS). Returns the program used, or None: the caller rings the terminal's bell and prints a line.
    A notifier that fails counts as none (the run's end is never lost for it)."""
    if platform == "darwin" and which("osascript"):
        script = f"display notification {_applescript(body)} with title {_applescript(title)}"
        argv = ["osascript", "-e", script]
    elif platform.startswith("linux") and which("notify-send"):
        argv = ["notify-send", "--app-name=rv", title, body]
    else:
        return None
    try:
        done = run(argv, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return argv[0] if getattr(done, "returncode", 1) == 0 else None


def _applescript(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
