"""tgis.config.env: where values come from, and the only writes to the process environment."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tgis
from tgis.config import DEMO_MODEL, LauncherArgs, model_reference
from tgis.config.env import Sources, env_bool, env_int, use_inductor_cache
from tgis.errors import ConfigError


def test_sources_flag_beats_env_and_labels_the_origin() -> None:
    env = {"MAX_TOTAL_TOKENS": "2048", "MAX_INPUT_TOKENS": "100", "TGIS_COMPILE": "yes"}
    r = Sources(LauncherArgs(max_total_tokens=1024), env)
    assert (r.get("max_total_tokens"), r.get("max_input_tokens"), r.get("compile")) == (
        1024,
        100,
        True,
    )
    assert r.get("max_batch_size") is None and not r.given("max_batch_size")
    assert r.label("max_total_tokens", 1024) == "--max-total-tokens 1024"
    assert r.label("max_input_tokens", 100) == "MAX_INPUT_TOKENS=100"
    assert r.label("max_batch_size", 4) == "--max-batch-size (derived: 4)"


def test_sources_parse_each_type_and_name_the_variable() -> None:
    r = Sources(LauncherArgs(), {"WAITING_SERVED_RATIO": "1.5", "TGIS_BACKEND": " cpu "})
    assert (r.get("waiting_served_ratio"), r.get("backend")) == (1.5, "cpu")
    with pytest.raises(ConfigError, match="WAITING_SERVED_RATIO='x' is not a number"):
        Sources(LauncherArgs(), {"WAITING_SERVED_RATIO": "x"}).get("waiting_served_ratio")
    assert Sources(LauncherArgs(), {"MAX_BATCH_SIZE": "  "}).get("max_batch_size") is None


def test_env_helpers() -> None:
    assert env_int({"N": " 7 "}, "N") == 7 and env_int({"N": ""}, "N") is None
    with pytest.raises(ConfigError, match="N=0 must be >= 1"):
        env_int({"N": "0"}, "N")
    assert env_bool({}, "B", True) is True and env_bool({"B": "off"}, "B", True) is False


def test_model_reference_defaults_to_the_demo_model() -> None:
    assert model_reference(LauncherArgs(), {}) == (DEMO_MODEL, None)
    assert Path(DEMO_MODEL, "config.json").is_file()
    assert model_reference(LauncherArgs(), {"MODEL_ID": "org/m", "REVISION": "v2"}) == (
        "org/m",
        "v2",
    )
    assert model_reference(LauncherArgs(model_id="x"), {"MODEL_ID": "org/m"}) == ("x", None)


def test_process_settings_written_into_the_mapping_given(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    use_inductor_cache(tmp_path / "cache", env)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "cache").resolve())


def test_only_the_config_core_touches_the_environment() -> None:
    """os.environ / os.getenv / os.putenv appear in tgis/config/env.py and nowhere else."""
    root = Path(tgis.__file__).resolve().parent
    touching = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in (
                "environ",
                "getenv",
                "putenv",
                "unsetenv",
            ):
                touching.add(path.relative_to(root).as_posix())
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "os"
                and {a.name for a in node.names} & {"environ", "getenv", "putenv"}
            ):
                touching.add(path.relative_to(root).as_posix())
    assert touching == {"config/env.py"}
