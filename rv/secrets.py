"""Secrets for jobs (`rv env`): kept on the laptop, mode 0600, sent to a job in a 0600 file.

They never enter the job script, a command line or a log: the script sources the file, then deletes it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

from rv.errors import UsageError

KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_key(key: str) -> str:
    if not KEY.match(key):
        raise UsageError(f"invalid variable name {key!r}: letters, digits and _, not starting with a digit")
    return key


def mask(value: str) -> str:
    """Enough to recognise a value, never enough to use it."""
    if len(value) <= 8:
        return "*" * len(value)
    return value[:2] + "*" * 6 + value[-2:]


def parse_dotenv(text: str) -> dict[str, str]:
    """KEY=VALUE lines; `export ` prefixes, comments, and single/double quotes as in a shell .env file."""
    values: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        key, sep, value = line.partition("=")
        if not sep:
            # Never echo the line: without its '=' it may be nothing but the secret itself.
            raise UsageError(
                f".env line {n} has no '=' (expected KEY=VALUE)", hint="fix that line and import again"
            )
        value = value.strip()
        if value[:1] in ("'", '"'):
            try:
                value = shlex.split(value)[0] if value not in ("''", '""') else ""
            except ValueError as exc:
                raise UsageError(f".env line {n}: unbalanced quotes") from exc
        else:
            value = value.split(" #", 1)[0].strip()
        try:
            values[check_key(key.strip())] = value
        except UsageError:
            raise UsageError(
                f".env line {n}: the name before '=' is not a valid variable name "
                "(letters, digits and _, not starting with a digit)",
                hint="fix that line and import again",
            ) from None
    return values


def render_env_file(values: dict[str, str]) -> str:
    """Bash-sourceable text: every value quoted once, so `$`, quotes and newlines stay literal."""
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(values.items()))


class SecretStore:
    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, str]:
        if not self.path.exists():
            return {}
        return dict(json.loads(self.path.read_text(encoding="utf-8")))

    def save(self, values: dict[str, str]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        # Created 0600 from the first byte: never a moment where others could read it.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(values, fh, indent=1, sort_keys=True)
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.path)

    def set(self, key: str, value: str) -> None:
        values = self.load()
        values[check_key(key)] = value
        self.save(values)

    def remove(self, key: str) -> bool:
        values = self.load()
        found = values.pop(key, None) is not None
        if found:
            self.save(values)
        return found
