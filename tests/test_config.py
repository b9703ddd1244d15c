"""The layered config: defaults < file < env < overrides, strict one-line errors, `kite config`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kite import config as C
from kite.cli.main import app
from kite.errors import BadInput, KiteError

runner = CliRunner()
EXAMPLE = Path(__file__).resolve().parent.parent / "configs" / "config.yaml"


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    """A fresh KITE_HOME and no KITE_* config variables from the outer environment."""
    home = tmp_path / "home"
    monkeypatch.setenv("KITE_HOME", str(home))
    for name in list(os.environ):
        if name.startswith("KITE_") and ("__" in name or name == "KITE_ADMIN_TOKEN"):
            monkeypatch.delenv(name)
    return home


def cfg_file(home: Path, text: str) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    path = home / "config.yaml"
    path.write_text(text)
    return path


def kite(*args: str):
    return runner.invoke(app, list(args))


def error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr  # one line, never a traceback
    return lines[0]


# --------------------------------------------------------------------------- layering

def test_defaults_without_a_file(home):
    cfg = C.load_config(env={})
    assert cfg.features.upcycle_yoco_fusion is False
    assert cfg.features.upcycle_compression_ratio is None  # unset: the upcycle config decides
    assert cfg.hardware_watermark.gpu_mem.sampling_interval_ms == 200
    assert cfg.server.state_dir == home / "states"
    for key in C.CONFIG_KEYS:
        assert C.config_source(cfg, key) == "default"
        if key != "server.state_dir":
            assert C.get_value(cfg, key) == C.DEFAULTS[key]


def test_each_layer_beats_the_one_below(home):
    cfg_file(home, "features:\n  upcycle_compression_ratio: 0.3\n  upcycle_yoco_fusion: true\n"
                   "server:\n  port: 9000\n  host: 0.0.0.0\n")
    env = {"KITE_SERVER__PORT": "9100", "KITE_FEATURES__UPCYCLE_YOCO_FUSION": "0",
           "KITE_HOME": str(home), "KITE_DEBUG": "0"}
    cfg = C.load_config(env=env, overrides={"server.port": 9200, "model.default": None})
    assert cfg.features.upcycle_compression_ratio == 0.3          # file
    assert cfg.server.host == "0.0.0.0"                           # file
    assert cfg.features.upcycle_yoco_fusion is False              # env beats file
    assert cfg.server.port == 9200                                # override beats env
    assert cfg.model.default == "smollm2-135m"                    # None override: not given
    assert C.config_source(cfg, "features.upcycle_compression_ratio") == "file"
    assert C.config_origin(cfg, "features.upcycle_compression_ratio").endswith("config.yaml:2")
    assert C.config_source(cfg, "features.upcycle_yoco_fusion") == "env"
    assert C.config_origin(cfg, "features.upcycle_yoco_fusion") == \
        "KITE_FEATURES__UPCYCLE_YOCO_FUSION"
    assert C.config_source(cfg, "server.port") == "override"
    assert C.config_source(cfg, "yoco.rules_file") == "default"
    assert C.load_config(env=env).server.port == 9100


def test_show_json_reports_values_and_sources(home, monkeypatch):
    cfg_file(home, "server:\n  port: 9000\n  admin_token: s3cret\n")
    monkeypatch.setenv("KITE_FEATURES__YOCO_MIN_HIT_GAIN", "1e-3")
    result = kite("config", "show", "--json", "--set", "model.default=tiny")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["config"]["server"]["port"] == 9000
    assert doc["config"]["server"]["admin_token"] == "***"   # show masks the secret
    assert doc["config"]["features"]["yoco_min_hit_gain"] == 0.001
    assert doc["config"]["model"]["default"] == "tiny"
    assert doc["sources"]["server.port"] == {"layer": "file", "origin": f"{home}/config.yaml:2"}
    assert doc["sources"]["features.yoco_min_hit_gain"]["layer"] == "env"
    assert doc["sources"]["model.default"]["layer"] == "override"
    assert doc["sources"]["yoco.rules_file"] == {"layer": "default", "origin": ""}
    human = kite("config", "show")
    assert human.exit_code == 0 and "file line 2" in human.stdout and "s3cret" not in human.stdout


@pytest.mark.parametrize("raw,expected", [("1", True), ("true", True), ("on", True),
                                          ("0", False), ("no", False), ("False", False)])
def test_env_booleans(raw, expected):
    cfg = C.load_config(env={"KITE_FEATURES__UPCYCLE_YOCO_FUSION": raw})
    assert cfg.features.upcycle_yoco_fusion is expected


def test_env_strings_are_taken_verbatim_and_admin_token_alias():
    cfg = C.load_config(env={"KITE_ADMIN_TOKEN": "0123"})
    assert cfg.server.admin_token == "0123"
    assert C.config_origin(cfg, "server.admin_token") == "KITE_ADMIN_TOKEN"
    cfg = C.load_config(env={"KITE_ADMIN_TOKEN": "a", "KITE_SERVER__ADMIN_TOKEN": "b"})
    assert cfg.server.admin_token == "b"


def test_state_dir_expands_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = C.load_config(env={"KITE_SERVER__STATE_DIR": "~/states"})
    assert cfg.server.state_dir == tmp_path / "states"


def test_get_and_path(home):
    cfg_file(home, "server:\n  port: 9000\n")
    result = kite("config", "get", "server.port", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"key": "server.port", "value": 9000, "layer": "file",
                                         "origin": f"{home}/config.yaml:2"}
    assert kite("config", "get", "server.port").stdout.strip() == "9000"
    section = json.loads(kite("config", "get", "features", "--json").stdout)
    assert section["value"]["upcycle_compression_ratio"] is None
    path = json.loads(kite("config", "path", "--json").stdout)
    assert path == {"path": str(home / "config.yaml"), "exists": True, "kite_home": str(home)}
    assert kite("config", "path").stdout.strip() == str(home / "config.yaml")


def test_get_unknown_key_suggests():
    result = kite("config", "get", "server.prot")
    assert result.exit_code == 2
    assert "did you mean 'server.port'" in error_line(result)


# --------------------------------------------------------------------------- file errors

BAD_FILES = [
    # (text, line, fragments the one error line must hold)
    ("features:\n  upcycle_yoco_fusion: [true\nserver:\n  port: 1\n", 3,
     ["YAML syntax error"]),
    ("features:\n  upcycle_yoco_fusion: true\n\tport: 1\n", 3, ["YAML syntax error"]),
    ("features:\n  upcycle_compression_ratio: 0.2\n  upcycle_yoco_fuson: true\n", 3,
     ["unknown key 'features.upcycle_yoco_fuson'", "did you mean 'upcycle_yoco_fusion'",
      "allowed in features: upcycle_yoco_fusion"]),
    ("upcycle_yoco_fusion: true\n", 1,
     ["unknown key 'upcycle_yoco_fusion'", "did you mean 'features.upcycle_yoco_fusion'"]),
    ("sever:\n  port: 1\n", 1, ["unknown key 'sever'", "did you mean 'server'"]),
    ("server:\n  host: localhost\n  port: eighty\n", 3,
     ["server.port = eighty has the wrong type", "allowed: an integer >= 1 and <= 65535"]),
    ("features:\n  upcycle_yoco_fusion: 1\n", 2,
     ["features.upcycle_yoco_fusion = 1 has the wrong type", "allowed: true or false"]),
    ("server:\n  admin_token: 1234\n", 2, ["server.admin_token", "a non-empty string, or null"]),
    ("features:\n  upcycle_compression_ratio: 1.5\n", 2,
     ["features.upcycle_compression_ratio = 1.5 is out of range",
      "allowed: a number > 0 and <= 1"]),
    ("hardware_watermark:\n  gpu_mem:\n    sampling_interval_ms: 0\n", 3,
     ["hardware_watermark.gpu_mem.sampling_interval_ms = 0 is out of range", "an integer > 0"]),
    ("features:\n  yoco_min_hit_gain: -0.1\n", 2, ["out of range", "a number >= 0"]),
    ("features: 5\n", 1, ["features must be a mapping", "upcycle_yoco_fusion"]),
    ("- features\n", 1, ["top level must be a mapping"]),
    ("server:\n  port: 1\n  port: 2\n", 3, ["server.port is set twice (first on line 2)"]),
    # two problems: the first by line is reported
    ("model:\n  default: x\nserver:\n  port: 0\nfeatures:\n  upcycle_compression_ratio: 7\n", 4,
     ["server.port = 0 is out of range"]),
]


@pytest.mark.parametrize("text,line,fragments", BAD_FILES)
def test_validate_bad_file_one_line_with_file_key_line(tmp_path, text, line, fragments):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(BadInput) as info:
        C.validate_file(path)
    message = str(info.value)
    assert "\n" not in message
    assert re.match(rf"{re.escape(str(path))}:{line}:\d+: ", message), message  # file:line:col
    for fragment in fragments:
        assert fragment in message
    result = kite("config", "validate", str(path))
    assert result.exit_code == 2
    assert message in error_line(result).replace("error: ", "", 1)
    as_json = kite("config", "validate", str(path), "--json")
    assert as_json.exit_code == 2
    doc = json.loads(as_json.stdout)
    assert doc["valid"] is False and doc["error"] == message


def test_bad_file_breaks_load_and_show(home):
    cfg_file(home, "features:\n  upcycle_compression_ratio: 0\n")
    with pytest.raises(BadInput):
        C.load_config(env={})
    result = kite("config", "show")
    assert result.exit_code == 2
    assert f"{home}/config.yaml:2:3: features.upcycle_compression_ratio = 0" in error_line(result)


def test_validate_missing_and_good_files(home, tmp_path):
    result = kite("config", "validate", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"path": str(home / "config.yaml"), "exists": False,
                                         "valid": True, "keys_set": []}
    missing = kite("config", "validate", str(tmp_path / "nope.yaml"))
    assert missing.exit_code == 2 and "no such config file" in error_line(missing)
    for text in ("# only a comment\n", "features:\n  # upcycle_yoco_fusion: true\n", ""):
        cfg_file(home, text)
        assert json.loads(kite("config", "validate", "--json").stdout)["keys_set"] == []
    cfg_file(home, "features:\n  yoco_min_hit_gain: 1e-3\n")
    doc = json.loads(kite("config", "validate", "--json").stdout)
    assert doc["valid"] and doc["keys_set"] == ["features.yoco_min_hit_gain"]


def test_not_utf8(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"server:\n  host: \xff\n")
    with pytest.raises(BadInput, match=r"c.yaml:2: not UTF-8"):
        C.validate_file(path)


# --------------------------------------------------------------------------- env and overrides

def test_bad_env_value_names_the_variable(home, monkeypatch):
    monkeypatch.setenv("KITE_FEATURES__UPCYCLE_COMPRESSION_RATIO", "2")
    result = kite("config", "show")
    assert result.exit_code == 2
    line = error_line(result)
    assert "environment variable KITE_FEATURES__UPCYCLE_COMPRESSION_RATIO" in line
    assert "out of range" in line and "<= 1" in line
    with pytest.raises(BadInput, match="KITE_SERVER__PORT: server.port = abc has the wrong type"):
        C.load_config(env={"KITE_SERVER__PORT": "abc"})


def test_unknown_env_variable_suggests():
    with pytest.raises(BadInput, match="KITE_SERVER__PRT: no such config key; did you mean "
                                       "'KITE_SERVER__PORT'"):
        C.load_config(env={"KITE_SERVER__PRT": "1"})
    C.load_config(env={"KITE_HOME": "/x", "KITE_DEBUG": "1", "KITE_CACHE": "/y"})  # not config


def test_bad_override():
    with pytest.raises(BadInput, match="command-line override: server.port = 0 is out of range"):
        C.load_config(env={}, overrides={"server": {"port": 0}})
    with pytest.raises(BadInput, match="did you mean 'server.port'"):
        C.load_config(env={}, overrides={"server.prot": 1})
    result = kite("config", "get", "server.port", "--set", "server.port")
    assert result.exit_code == 2 and "KEY=VALUE" in error_line(result)


def test_require_enabled_says_how():
    with pytest.raises(KiteError, match="kite config set features.upcycle_yoco_fusion true"):
        C.require_enabled(C.load_config(env={}), "features.upcycle_yoco_fusion", "the fused loop")


# --------------------------------------------------------------------------- set

def test_set_creates_the_file(home):
    result = kite("config", "set", "features.upcycle_yoco_fusion", "true")
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((home / "config.yaml").read_text()) == {
        "features": {"upcycle_yoco_fusion": True}}
    assert C.load_config(env={}).features.upcycle_yoco_fusion is True
    kite("config", "set", "hardware_watermark.gpu_mem.spike_threshold_gb", "4.5")
    kite("config", "set", "server.admin_token", "0123")
    cfg = C.validate_file(home / "config.yaml")
    assert cfg.hardware_watermark.gpu_mem.spike_threshold_gb == 4.5
    assert cfg.server.admin_token == "0123"


def test_set_keeps_comments_and_other_lines(home):
    original = EXAMPLE.read_text()
    path = cfg_file(home, original)
    for key, value in [("features.upcycle_yoco_fusion", "true"), ("server.port", "9001"),
                       ("server.state_dir", "/srv/states"), ("server.admin_token", "null")]:
        result = kite("config", "set", key, value, "--json")
        assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["key"] == "server.admin_token"
    new = path.read_text()
    changed = [(a, b) for a, b in zip(original.splitlines(), new.splitlines()) if a != b]
    assert len(new.splitlines()) == len(original.splitlines())
    assert changed == [("  upcycle_yoco_fusion: false", "  upcycle_yoco_fusion: true"),
                       ("  port: 8088", "  port: 9001"),
                       ("  state_dir: null", "  state_dir: /srv/states")]


def test_set_appends_nested_keys_under_their_section(home):
    path = cfg_file(home, "# mine\nfeatures:\n  # why\n  upcycle_yoco_fusion: true  # on\n"
                          "server:\n    port: 9000\n")
    assert kite("config", "set", "features.yoco_min_hit_gain", "0.01").exit_code == 0
    result = kite("config", "set", "hardware_watermark.gpu_mem.sampling_interval_ms", "50")
    assert result.exit_code == 0
    assert kite("config", "set", "server.host", "0.0.0.0").exit_code == 0
    assert path.read_text() == (
        "# mine\nfeatures:\n  # why\n  upcycle_yoco_fusion: true  # on\n"
        "  yoco_min_hit_gain: 0.01\n"
        "server:\n    port: 9000\n    host: 0.0.0.0\n"
        "hardware_watermark:\n  gpu_mem:\n    sampling_interval_ms: 50\n")
    C.set_value(path, "features.upcycle_yoco_fusion", False)  # the trailing comment stays
    assert "  upcycle_yoco_fusion: false  # on\n" in path.read_text()


def test_set_without_trailing_newline_and_quoted_values(home):
    path = cfg_file(home, 'server:\n  host: "127.0.0.1"  # quoted')
    C.set_value(path, "server.host", "0.0.0.0")
    C.set_value(path, "model.default", "my model: v2")
    assert path.read_text() == ("server:\n  host: 0.0.0.0  # quoted\n"
                                "model:\n  default: 'my model: v2'\n")
    assert kite("config", "get", "model.default").stdout == "my model: v2\n"


def test_set_fills_an_empty_section_and_rewrites_flow_style(home):
    path = cfg_file(home, "features:\n# later\nserver: {port: 9000}\n")
    C.set_value(path, "features.upcycle_yoco_fusion", "yes")
    assert path.read_text().startswith("features:\n  upcycle_yoco_fusion: true\n# later\n")
    C.set_value(path, "server.host", "::1")  # flow style: rewritten whole, still right
    cfg = C.validate_file(path)
    assert cfg.server.host == "::1" and cfg.server.port == 9000
    assert cfg.features.upcycle_yoco_fusion is True


def test_set_invalid_value_changes_nothing(home):
    path = cfg_file(home, "# keep\nfeatures:\n  upcycle_compression_ratio: 0.2\n")
    before = path.read_bytes()
    for args, fragment in [
        (("features.upcycle_compression_ratio", "1.5"), "out of range; allowed: a number > 0"),
        (("features.upcycle_yoco_fusion", "maybe"), "wrong type; allowed: true or false"),
        (("server.port", "http"), "wrong type"),
        (("features.yoco_min_hit_gain", "-1"), "out of range; allowed: a number >= 0"),
        (("features.upcycle_yoco_fuson", "true"), "did you mean 'features.upcycle_yoco_fusion'"),
    ]:
        result = kite("config", "set", *args)
        assert result.exit_code == 2
        assert fragment in error_line(result)
    assert path.read_bytes() == before
    assert sorted(p.name for p in home.iterdir()) == ["config.yaml"]


def test_set_refuses_when_the_rest_of_the_file_is_bad(home):
    path = cfg_file(home, "server:\n  port: 0\n")
    result = kite("config", "set", "server.host", "::1")
    assert result.exit_code == 2 and ":2:3: server.port = 0 is out of range" in error_line(result)
    assert path.read_text() == "server:\n  port: 0\n"


def test_set_is_atomic(home, monkeypatch):
    path = cfg_file(home, "server:\n  port: 9000\n")
    C.set_value(path, "server.port", "9001")
    assert sorted(p.name for p in home.iterdir()) == ["config.yaml"]  # no temp files left

    def crash(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        C.set_value(path, "server.port", "9002")
    assert path.read_text() == "server:\n  port: 9001\n"
    assert sorted(p.name for p in home.iterdir()) == ["config.yaml"]


def test_set_warns_when_env_shadows(home, monkeypatch):
    monkeypatch.setenv("KITE_SERVER__PORT", "7000")
    result = kite("config", "set", "server.port", "9000", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["shadowed_by"] == "KITE_SERVER__PORT"


# --------------------------------------------------------------------------- the example, imports

def test_example_config_documents_every_key_with_its_default():
    cfg = C.validate_file(EXAMPLE)
    text = EXAMPLE.read_text()
    for key in C.CONFIG_KEYS:
        assert C.config_source(cfg, key) == "file", f"{key} missing from configs/config.yaml"
        if key != "server.state_dir":
            assert C.get_value(cfg, key) == C.DEFAULTS[key], key
        line = int(C.config_origin(cfg, key).rsplit(":", 1)[1])
        assert text.splitlines()[line - 2].strip().startswith("#"), f"{key} has no comment"


def test_import_does_not_pull_torch():
    code = "import sys, kite.config; assert 'torch' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
