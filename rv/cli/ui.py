"""`rv ui [--port N] [--no-browser]`: a local web page of every run, chain and sweep of every profile."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from rv.cli.common import note

if TYPE_CHECKING:
    from rv.config import Profile
    from rv.remote.transport import Transport


@click.command()
@click.option(
    "--port", type=click.IntRange(min=0, max=65535), default=0, show_default="a free one",
    help="The port on 127.0.0.1 to serve on.",
)  # fmt: skip
@click.option("--no-browser", is_flag=True, help="Print the URL only; do not open a browser.")
def ui(port: int, no_browser: bool) -> None:
    """Serve a page of your runs on every profile: runs, a run's segments and live logs, a sweep's
    results and curves, a run's metrics; stop and retry from it. Only on this machine (127.0.0.1),
    only with the token in the URL it prints. Ctrl-C stops it."""
    from rv.errors import UsageError

    try:
        import werkzeug  # noqa: F401  (the page's server: rv's `ui` extra)
    except ImportError:
        import sys

        raise UsageError(
            "rv ui needs Werkzeug, which rv installs with its `ui` extra",
            hint=install_hint(sys.executable, sys.prefix, _direct_url()),
        ) from None
    import logging
    import webbrowser

    from rv.cli.common import run_store
    from rv.config import load_config
    from rv.remote.connect import open_transport
    from rv.ui import data
    from rv.ui.server import App, new_token, serve, url

    config = load_config()
    if not config.profiles:
        raise UsageError(f"no profiles in {config.path}", hint="rv init")

    def opener(profile: Profile) -> Transport:
        # No terminal to ask on: an unknown host key is refused (connect once with any rv command).
        return open_transport(profile, confirm_host_key=None, config_path=config.path)

    clusters = data.clusters_of(config, opener)
    for cluster in clusters.values():
        cluster.connect_ahead()  # while the server starts and the browser opens
    app = App(clusters, run_store(), new_token())
    try:
        server = serve(app, port)
    except OSError as exc:
        raise UsageError(
            f"cannot serve on 127.0.0.1:{port}: {exc.strerror or exc}", hint="rv ui --port 0"
        ) from None
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    address = url(app)
    click.echo(address)  # stdout: the one datum (a script reads it); the rest is chatter on stderr
    note(
        f"rv ui: serving {len(clusters)} profile(s) ({', '.join(clusters)}) on 127.0.0.1:{app.port}; "
        "Ctrl-C stops"
    )
    if not no_browser and not webbrowser.open(address):
        note("no browser found here: open the URL above in one")
    try:
        server.serve_forever()  # returns on Ctrl-C (Werkzeug's server catches it) and closes the socket
    finally:
        for cluster in clusters.values():
            cluster.close()
    note("rv ui: stopped")


WERKZEUG = "'werkzeug>=3.0'"


def install_hint(executable: str, prefix: str, direct_url: dict[str, Any] | None) -> str:
    """The command that installs Werkzeug where this rv runs, for how rv was installed. Not
    `pip install 'rv[ui]'`: rv is on no package index, so that would fetch some other project."""
    import shlex
    from urllib.parse import unquote, urlsplit

    url = str((direct_url or {}).get("url") or "")
    source = unquote(urlsplit(url).path) if url.startswith("file://") else None
    editable = bool(((direct_url or {}).get("dir_info") or {}).get("editable"))
    parts = Path(prefix).parts
    if "pipx" in parts and "venvs" in parts:  # ~/.local/share/pipx/venvs/rv
        return f"pipx inject {shlex.quote(Path(prefix).name)} {WERKZEUG}"
    if "uv" in parts and "tools" in parts:  # ~/.local/share/uv/tools/rv: no pip inside
        where = shlex.quote(source) if source else "WHERE-YOU-INSTALLED-RV-FROM"
        return f"uv tool install --reinstall --with {WERKZEUG} {where}"
    python = shlex.quote(executable)
    if editable and source:  # `pip install -e CLONE`: the clone's extra
        return f"{python} -m pip install -e {shlex.quote(source + '[ui]')}"
    return f"{python} -m pip install {WERKZEUG}   (into the Python rv runs in)"


def _direct_url() -> dict[str, Any] | None:
    """How pip installed rv (PEP 610's direct_url.json): from a folder, editable or not, or a wheel;
    None when it does not say (rv run from a source tree)."""
    import json
    from importlib import metadata

    try:
        text = metadata.distribution("rv").read_text("direct_url.json")
        value = json.loads(text) if text else None
    except (metadata.PackageNotFoundError, ValueError):
        return None
    return value if isinstance(value, dict) else None
