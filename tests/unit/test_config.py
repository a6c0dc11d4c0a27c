"""Config loading and validation: exact error text, because users read it."""

from __future__ import annotations

from dataclasses import replace
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
        "known_hosts, account, remote_root, catalog, setup, gpus, share_with_group, system_site_packages, "
        "python, partition, qos, constraint, exclude, nodelist, reservation, sbatch, partitions, notify, "
        "work_dir, node_work_dir, container, idle_gpu"
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


def test_no_config_yet_says_run_init(tmp_path, monkeypatch):
    monkeypatch.delenv("RV_CONFIG", raising=False)
    monkeypatch.setenv("RV_TESTCLUSTER_DIR", str(tmp_path / "no-demo"))
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "none.toml")
    assert exc.value.message == f"no rv config yet ({tmp_path / 'none.toml'})"
    assert (
        exc.value.hint
        == "run `rv init` to connect rv to your cluster, or point RV_CONFIG at the config you have"
    )
    assert exc.value.exit_code == 3
    # The demo keeps its profile in a config of its own: named, with the line that uses it.
    (tmp_path / "no-demo").mkdir()
    (tmp_path / "no-demo" / "rv-config.toml").write_text("")
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "none.toml")
    assert (exc.value.hint or "").endswith(f"export RV_CONFIG={tmp_path / 'no-demo' / 'rv-config.toml'}")


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


# --- comments survive `rv init` ------------------------------------------------------------------

HAND_EDITED = """# my lab's clusters; rv must keep this line
default = "lab"

[profiles.lab]  # the big one
host = "login.example.edu"   # do not change
# the account below is shared
account = "mylab"
remote_root = "/scratch/me/rv"

[profiles.old]
host = "old.example.edu"
remote_root = "/scratch/me/rv-old"
"""


def test_saving_keeps_comments_order_and_untouched_profiles(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(HAND_EDITED)
    cfg = load_config(path)
    lab = cfg.profile("lab")
    from dataclasses import replace

    new = Profile(name="new", host="new.example.edu", remote_root="/scratch/me/rv-new")
    save_config(cfg.with_profile(replace(lab, user="me2"), make_default=False).with_profile(new, False))
    text = path.read_text()
    for kept in (
        "# my lab's clusters; rv must keep this line",
        "[profiles.lab]  # the big one",
        'host = "login.example.edu"   # do not change',
        "# the account below is shared",
    ):
        assert kept in text
    assert text.index("[profiles.lab]") < text.index("[profiles.old]") < text.index("[profiles.new]")
    again = load_config(path)
    assert again.profile("lab").user == "me2" and again.profile("new").host == "new.example.edu"
    assert again.profile("old") == cfg.profile("old")


def test_share_with_group_is_a_boolean_profile_key(tmp_path):
    cfg = parse_config('[profiles.a]\nhost = "h"\nshare_with_group = true\n', P)
    assert cfg.profile().share_with_group is True
    assert parse_config('[profiles.a]\nhost = "h"\n', P).profile().share_with_group is False
    with pytest.raises(ConfigError, match="share_with_group must be true or false"):
        parse_config('[profiles.a]\nhost = "h"\nshare_with_group = "yes"\n', P)
    path = tmp_path / "c.toml"
    save_config(cfg.__class__(path=path, default=None, profiles=cfg.profiles))
    assert "share_with_group = true" in path.read_text()


@pytest.mark.parametrize(
    ("root", "problem"),
    [
        ("scratch/me/rv", "must be an absolute path"),
        ("~/rv", "must be an absolute path"),  # the cluster expands ~ at `rv init`, never later
        ("/scratch/my results", "must not contain spaces"),
        ("/scratch/%u/rv", "must not contain '%'"),
        ("/scratch/../etc", "must not contain '..'"),
    ],
)
def test_remote_root_is_checked_when_the_config_is_read(root, problem):
    with pytest.raises(ConfigError, match=problem):
        parse_config(f'[profiles.a]\nhost = "h"\nremote_root = "{root}"\n', P)


# --- where state lives ------------------------------------------------------------------------------


def test_state_and_cache_follow_the_platform_folders(tmp_path, monkeypatch):
    from rv import config as config_mod

    monkeypatch.delenv("RV_STATE_DIR", raising=False)
    monkeypatch.delenv("RV_CACHE_DIR", raising=False)
    monkeypatch.setenv("RV_CONFIG", str(tmp_path / "c" / "config.toml"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xs"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xc"))
    assert config_mod.state_dir() == tmp_path / "xs" / "rv"
    assert config_mod.cache_dir() == tmp_path / "xc" / "rv"


def test_a_builtin_type_overlaid_by_the_profile_keeps_its_facts_and_saves_only_the_change(tmp_path):
    # What `rv init` writes for Rivanna: the nodes' CPUs and memory per GPU over the built-in a6000.
    from rv.probe import per_gpu_from_nodes

    found = {"a6000": GpuType("a6000", "gpu-a6000", "a6000", 8, cpus_per_gpu=6, mem_per_gpu="32125M")}
    overlay = per_gpu_from_nodes(RIVANNA, found)
    assert overlay == {"a6000": replace(RIVANNA["a6000"], cpus_per_gpu=6, mem_per_gpu="32125M")}
    assert per_gpu_from_nodes({"mig": RIVANNA["mig"]}, {"m": replace(RIVANNA["mig"], cpus_per_gpu=2)}) == {}
    cfg = parse_config(GOOD, P)
    uva = replace(cfg.profile("uva"), gpus=overlay)
    text = render_config(cfg.with_profile(uva, make_default=False))
    table = text[text.index("[profiles.uva.gpus.a6000]") :]
    assert table.split("\n\n")[0].splitlines()[1:] == ["cpus_per_gpu = 6", 'mem_per_gpu = "32125M"']
    back = parse_config(text, P).profile("uva").gpu_catalog()
    assert back["a6000"] == overlay["a6000"] and back["v100"] == RIVANNA["v100"]
