"""scripts/demo's own behaviour, run for real in a copy of the repo whose installers and cluster are
stand-ins (scripts/bootstrap, scripts/testcluster and the rv in .venv record what they were given):
what a newcomer is told, and which config the demo writes its profile into."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BOOTSTRAP = """#!/bin/bash
mkdir -p .venv/bin
printf 'export PATH="%s/.venv/bin:$PATH"\\n' "$PWD" > .venv/bin/activate
cat > .venv/bin/rv <<'RV'
#!/bin/bash
[ "$1" = --version ] && { echo "rv, version 0.0"; exit 0; }
printf '%s | %s\\n' "${RV_CONFIG:-unset}" "$*" >> "$DEMO_LOG"
RV
printf '#!/bin/bash\\necho 2.13.0\\n' > .venv/bin/python
chmod +x .venv/bin/rv .venv/bin/python
"""

TESTCLUSTER = """#!/bin/bash
printf 'testcluster %s | %s\\n' "${RV_CONFIG:-unset}" "$*" >> "$DEMO_LOG"
echo "testcluster: default up in 1 s: state /nowhere"
"""


def test_the_demo_keeps_its_profile_out_of_your_config_and_says_how_to_use_rv_after(tmp_path):
    # Issue 33: the demo wrote a `testcluster` profile into the user's real config (and made it the
    # default) without a word, never said how to get rv on PATH, nor that phase 3 needs the index.
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "demo", repo / "scripts" / "demo")
    for name, text in (("bootstrap", BOOTSTRAP), ("testcluster", TESTCLUSTER)):
        (repo / "scripts" / name).write_text(text)
        (repo / "scripts" / name).chmod(0o755)
    log = tmp_path / "calls.log"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home"), "DEMO_LOG": str(log),
           "RV_TESTCLUSTER_DIR": str(tmp_path / "state"), "TMPDIR": str(tmp_path)}  # fmt: skip
    done = subprocess.run(["bash", "scripts/demo"], cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    own = str(tmp_path / "state" / "rv-config.toml")
    calls = log.read_text().splitlines()
    assert calls[0] == f"testcluster {own} | up", calls  # `rv init` inside it writes the demo's config
    assert all(line.startswith(f"{own} | ") for line in calls[1:]), calls
    said = done.stderr
    assert f"goes to the demo's own config {own} (yours is untouched)" in said
    assert "from the package index (PyPI: network needed)" in said
    assert f"  . .venv/bin/activate\n  export RV_CONFIG={own}\n" in said, said
    assert not (tmp_path / "home" / ".config").exists()


def test_the_readme_says_what_the_demo_says_to_type_after_it():
    # Issue 41: the README said the demo saved its profile "as your default one"; it is in the demo's
    # own config, and `rv ps -a` after activating said "no rv config yet".
    readme = (REPO / "README.md").read_text()
    demo = (REPO / "scripts" / "demo").read_text()
    assert "as your default one" not in readme
    default = "/tmp/rv-testcluster/rv-config.toml"
    assert "${RV_TESTCLUSTER_DIR:-/tmp/rv-testcluster}/rv-config.toml" in demo  # the demo's default
    assert f"    . .venv/bin/activate\n    export RV_CONFIG={default}\n" in readme
    assert "printf '  . .venv/bin/activate\\n  export RV_CONFIG=%q\\n' \"$RV_CONFIG\"" in demo
