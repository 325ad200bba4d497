"""Configuration precedence: defaults (embedded mode) < TOML file < environment < explicit overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from ballast.config import load_settings


def test_embedded_defaults_follow_the_data_dir(tmp_path: Path) -> None:
    s = load_settings({"BALLAST_DATA_DIR": str(tmp_path)})
    assert s.database_url == f"sqlite:///{tmp_path / 'ballast.db'}"
    assert s.broker_url == f"sqla+sqlite:///{tmp_path / 'broker.db'}"
    assert s.address("store") == "127.0.0.1:50051"


def test_file_then_environment_then_overrides(tmp_path: Path) -> None:
    (tmp_path / "ballast.toml").write_text('store_port = 6001\nplanner_port = 6003\nlease_seconds = 12.5\n')
    env = {"BALLAST_DATA_DIR": str(tmp_path), "BALLAST_PLANNER_PORT": "7003",
           "BALLAST_ALLOWED_MODEL_FACTORIES": "a.b:c, d.e:f"}
    s = load_settings(env, profiler_port=8002)
    assert (s.store_port, s.planner_port, s.profiler_port, s.lease_seconds) == (6001, 7003, 8002, 12.5)
    assert s.allowed_model_factories == ("a.b:c", "d.e:f")
    assert load_settings({**env, "BALLAST_STORE_ADDRESS": "store:50051"}).address("store") == "store:50051"


def test_unknown_file_setting_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "ballast.toml").write_text('stor_port = 1\n')
    with pytest.raises(ValueError, match="stor_port"):
        load_settings({"BALLAST_DATA_DIR": str(tmp_path)})


def test_token_comes_from_env_or_the_embedded_token_file(tmp_path: Path) -> None:
    assert load_settings({"BALLAST_DATA_DIR": str(tmp_path)}).resolved_token() == ""
    (tmp_path / "admin.token").write_text("blt_file\n")
    assert load_settings({"BALLAST_DATA_DIR": str(tmp_path)}).resolved_token() == "blt_file"
    assert load_settings({"BALLAST_DATA_DIR": str(tmp_path), "BALLAST_TOKEN": "blt_env"}).resolved_token() == "blt_env"


def test_agents_never_advertise_a_wildcard_address(tmp_path: Path) -> None:
    base = {"BALLAST_DATA_DIR": str(tmp_path)}
    assert load_settings(base).advertised_host() == "127.0.0.1"
    assert load_settings({**base, "BALLAST_HOST": "0.0.0.0"}).advertised_host() not in ("0.0.0.0", "")
    explicit = {**base, "BALLAST_HOST": "0.0.0.0", "BALLAST_ADVERTISE_HOST": "gpu-7"}
    assert load_settings(explicit).advertised_host() == "gpu-7"
