"""Fixtures shared by the unit tests of snapshots and sync."""

from __future__ import annotations

import pytest

from rv.layout import RemoteLayout


@pytest.fixture
def hermetic_home(tmp_path, monkeypatch):
    """A temp HOME and no system git config: the developer's own settings never leak in."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    # State, cache and sockets under the temp HOME too (the platform folders follow HOME).
    for name in (
        "XDG_STATE_HOME",
        "XDG_CACHE_HOME",
        "XDG_RUNTIME_DIR",
        "RV_STATE_DIR",
        "RV_CACHE_DIR",
        "RV_RUNTIME_DIR",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def layout(tmp_path) -> RemoteLayout:
    """A fresh remote root on the local disk, for tests that drive LocalTransport."""
    return RemoteLayout(str(tmp_path / "remote"))
