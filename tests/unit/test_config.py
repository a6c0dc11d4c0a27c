"""Config loading and validation: exact error text, because users read it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rv.catalog import RIVANNA, GpuType
from rv.config import Config, Profile, load_config, parse_config, render_config, save_config
from rv.errors import ConfigError

P = Path("/cfg/config.toml")

GOOD = """
default = "lab"

[profiles.lab]
host = "login.example.edu"
port = 2222
user = "me"
account = "mylab"
remote_root = "/scratch/me/rv"
setup = ["module load cuda", "source ~/venv/bin/activate"]

[profiles.lab.gpus.a6000]
partition = "gpu"
gres = "a6000"
gpus_per_node = 4
compute_capability = 8.6

[profiles.uva]
host = "login.hpc.virginia.edu"
catalog = "rivanna"
"""


def test_good_config_parses_every_field():
    cfg = parse_config(GOOD, P)
    lab = cfg.profile()
    assert lab.name == "lab" and lab.port == 2222 and lab.user == "me" and lab.account == "mylab"
    assert lab.setup == ("module load cuda", "source ~/venv/bin/activate")
    assert lab.gpus["a6000"] == GpuType("a6000", "gpu", "a6000", 4, 8.6)
    assert cfg.profile("uva").gpu_catalog() == RIVANNA


def test_profile_choice_env_and_explicit(monkeypatch):
    cfg = parse_config(GOOD, P)
    monkeypatch.setenv("RV_PROFILE", "uva")
    assert cfg.profile().name == "uva"
    assert cfg.profile("lab").name == "lab"


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as exc:
        parse_config(text, P)
    return exc.value.message


def test_unknown_profile_key_lists_valid_keys():
    assert error_of('[profiles.a]\nhost = "h"\nhots = "x"\n') == (
        "/cfg/config.toml: profile 'a': unknown key 'hots'; valid keys: host, port, user, identity_file, "
        "known_hosts, account, remote_root, catalog, setup, gpus, share_with_group"
    )


def test_bad_value_types_are_named():
    assert error_of('[profiles.a]\nhost = "h"\nport = "22"\n') == (
        "/cfg/config.toml: profile 'a': port must be an integer, not \"22\""
    )
    assert error_of('[profiles.a]\nhost = "h"\nport = true\n') == (
        "/cfg/config.toml: profile 'a': port must be an integer, not true"
    )
    assert error_of('[profiles.a]\nhost = "h"\nport = 70000\n') == (
        "/cfg/config.toml: profile 'a': port must be between 1 and 65535, not 70000"
    )


def test_bad_catalog_lists_choices():
    assert error_of('[profiles.a]\nhost = "h"\ncatalog = "uva"\n') == (
        "/cfg/config.toml: profile 'a': catalog must be one of discovered, rivanna, not 'uva'"
    )


def test_gpu_table_validation():
    msg = error_of('[profiles.a]\nhost = "h"\n[profiles.a.gpus.x]\npartition = "p"\ngres = "x"\nvram = 3\n')
    assert msg.startswith(
        "/cfg/config.toml: profile 'a'.gpus.x: unknown key 'vram'; valid keys: partition, gres,"
    )
    assert error_of('[profiles.a]\nhost = "h"\n[profiles.a.gpus.x]\npartition = "p"\n') == (
        "/cfg/config.toml: profile 'a'.gpus.x: missing gres, gpus_per_node"
    )


def test_missing_default_and_unknown_profile():
    assert error_of('default = "b"\n[profiles.a]\nhost = "h"\n') == (
        "/cfg/config.toml: default profile 'b' does not exist; valid profiles: a"
    )
    cfg = parse_config(GOOD, P)
    with pytest.raises(ConfigError) as exc:
        cfg.profile("nope")
    assert exc.value.message == "unknown profile 'nope'; valid profiles: lab, uva"


def test_not_toml():
    assert error_of("[profiles\n").startswith("/cfg/config.toml is not valid TOML:")


def test_no_config_yet_says_run_init(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "none.toml")
    assert exc.value.message == f"no rv config yet ({tmp_path / 'none.toml'})"
    assert exc.value.hint == "run `rv init` to connect rv to your cluster"
    assert exc.value.exit_code == 3


def test_round_trip_and_file_mode(tmp_path):
    cfg = parse_config(GOOD, tmp_path / "c.toml")
    save_config(cfg)
    assert (tmp_path / "c.toml").stat().st_mode & 0o777 == 0o600
    again = load_config(tmp_path / "c.toml")
    assert again.profiles == cfg.profiles and again.default == cfg.default
    assert render_config(again) == render_config(cfg)


def test_with_profile_keeps_default_unless_asked():
    cfg = Config(P, None, {})
    cfg = cfg.with_profile(Profile("a", "h"), make_default=False)
    assert cfg.default == "a"  # the first profile becomes the default
    cfg = cfg.with_profile(Profile("b", "h2", setup=("echo 'quoted' \"x\"",)), make_default=False)
    assert cfg.default == "a"
    reparsed = parse_config(render_config(cfg), P)
    assert reparsed.profiles["b"].setup == ("echo 'quoted' \"x\"",)
