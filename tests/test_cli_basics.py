"""The CLI's contract: exit codes, --json, one-line errors, typo suggestions, a fast `version`."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from kite.cli.main import app
from tests.conftest import parse_json

runner = CliRunner()


def test_version_json_fields():
    result = runner.invoke(app, ["version", "--json"])
    assert result.exit_code == 0, result.output
    info = parse_json(result.stdout)
    for key in ("version", "build_date", "git_commit", "torch", "transformers", "device",
                "native_runtime", "config_path"):
        assert info[key], key
    assert info["config_path"].endswith("config.yaml")


def test_version_does_not_import_torch():
    code = ("import sys; sys.argv=['kite','version','--json']\n"
            "from kite.cli.main import main\n"
            "try:\n main()\nexcept SystemExit: pass\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert '"version"' in proc.stdout


def test_typo_suggests_and_exits_2():
    result = runner.invoke(app, ["versoin"])
    assert result.exit_code == 2
    assert "Did you mean 'version'" in result.output


def test_unknown_option_exits_2():
    result = runner.invoke(app, ["version", "--bogus"])
    assert result.exit_code == 2


def test_bad_input_is_one_red_line_exit_2():
    result = runner.invoke(app, ["model", "info", "--model", "/no/such/model"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert "no such file or folder" in lines[0]


def test_debug_shows_traceback(monkeypatch):
    monkeypatch.setenv("KITE_DEBUG", "1")
    proc = subprocess.run([sys.executable, "-m", "kite.cli.main", "model", "info", "--model", "/nope"],
                          capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "KITE_DEBUG": "1"})
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr and "BadInput" in proc.stderr


def test_aliases_are_installed_console_scripts():
    from importlib import metadata

    names = {ep.name for ep in metadata.entry_points(group="console_scripts") if ep.value.startswith("kite.")}
    assert {"kite", "kite-cli", "kite-upcycle", "kite-yoco", "kite-bench", "kite-tune",
            "kite-capacity-plan", "kite-shadow"} <= names
