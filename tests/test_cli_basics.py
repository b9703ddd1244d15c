"""The CLI's contract: exit codes, --json, one-line errors, typo suggestions, a fast `version`."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
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
    assert {"kite", "kite-cli", "kite-upcycle", "kite-yoco", "kite-bench", "kite-shadow", "kite-capacity-plan",
            "kite-tune"} <= names


def test_every_console_script_in_pyproject_points_at_a_function_that_exists():
    import importlib
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    scripts = project["project"]["scripts"]
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr, None)), f"{name} = {target}"


def test_every_registered_command_module_imports_and_help_lists_exactly_them():
    import importlib
    import re

    from kite.cli import main

    for name, module, _ in main.GROUPS:
        assert hasattr(importlib.import_module(module), "app"), name
    for name, module, attr, _ in main.COMMANDS:
        assert callable(getattr(importlib.import_module(module), attr)), name
    registered = {"version"} | {g[0] for g in main.GROUPS} | {c[0] for c in main.COMMANDS}
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    commands_panel = result.output[result.output.index("Commands"):]
    listed = set(re.findall(r"^│ ([a-z][a-z-]*)  ", commands_panel, flags=re.M))
    assert listed == registered, result.output


def test_a_missing_command_module_fails_loudly():
    import pytest

    from kite.cli._common import new_app
    from kite.cli.main import register

    with pytest.raises(ModuleNotFoundError, match="kite.cli.no_such_group"):
        register(new_app("x"), groups=[("nope", "kite.cli.no_such_group", "A group that was not built.")],
                 commands=[])
    with pytest.raises(ModuleNotFoundError, match="kite.cli.no_such_command"):
        register(new_app("x"), groups=[], commands=[("nope", "kite.cli.no_such_command", "run", "Not built.")])


ALIASES = [("kite-upcycle", "inspect"), ("kite-yoco", "validate"), ("kite-bench", "run"), ("kite-shadow", None),
           ("kite-capacity-plan", None), ("kite-tune", "auto"), ("kite-cli", "version")]


def _run_script(name: str, args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """Run the installed console script `name` in this process, as the shell would start it."""
    from importlib import metadata

    entry = next(ep for ep in metadata.entry_points(group="console_scripts") if ep.name == name)
    monkeypatch.setattr(sys, "argv", [f"/venv/bin/{name}", *args])
    with pytest.raises(SystemExit) as exited:
        entry.load()()
    out = capsys.readouterr()
    return exited.value.code, out.out, out.err


def _usage(text: str) -> str:
    return " ".join(next(line for line in text.splitlines() if "Usage:" in line).split())


@pytest.mark.parametrize("script, command", ALIASES)
def test_alias_scripts_show_the_usage_that_works(script, command, monkeypatch, capsys):
    code, out, _ = _run_script(script, ["--help"], monkeypatch, capsys)
    assert code == 0
    assert _usage(out).startswith(f"Usage: {script} [OPTIONS]"), out  # not `kite-upcycle upcycle ...`
    if command is not None:
        code, out, _ = _run_script(script, [command, "--help"], monkeypatch, capsys)
        assert code == 0 and _usage(out).startswith(f"Usage: {script} {command} [OPTIONS]"), out


def test_alias_scripts_run_their_commands_under_the_one_error_boundary(monkeypatch, capsys, tmp_path):
    code, _, err = _run_script("kite-upcycle", ["inspect", str(tmp_path / "nope.upc")], monkeypatch, capsys)
    assert code == 2 and err.startswith("error:") and "nope.upc" in err
    code, _, err = _run_script("kite-yoco", ["valdate"], monkeypatch, capsys)
    assert code == 2 and "kite-yoco --help" in err and "Did you mean 'validate'" in err
    code, out, _ = _run_script("kite-cli", ["version", "--json"], monkeypatch, capsys)
    assert code == 0 and parse_json(out)["version"]


def _failing_app(error: BaseException | None = None):
    """An app whose `boom` raises ``error`` (default: RuntimeError("kaput"))."""
    from kite.cli._common import new_app

    failing = new_app("test")

    @failing.command("boom")
    def boom() -> None:
        raise error or RuntimeError("kaput")

    failing.command("noop")(lambda: None)
    return failing


def test_the_debug_hint_only_when_debug_is_off(monkeypatch):
    res = runner.invoke(_failing_app(), ["boom"])
    assert res.exit_code == 1 and "error: RuntimeError: kaput (set KITE_DEBUG=1 for the traceback)" in res.stderr
    monkeypatch.setenv("KITE_DEBUG", "1")
    res = runner.invoke(_failing_app(), ["boom"])
    assert res.exit_code == 1 and "Traceback" in res.stderr and "RuntimeError: kaput" in res.stderr
    assert "set KITE_DEBUG=1" not in res.stderr


def test_an_error_message_is_printed_as_written_not_as_markup():
    from kite.errors import KiteError

    res = runner.invoke(_failing_app(KiteError("kite serve needs fastapi: pip install 'kite[serve]' ([bold]not "
                                               "bold[/])")), ["boom"])
    assert res.exit_code == 1
    assert "pip install 'kite[serve]' ([bold]not bold[/])" in res.stderr


def _listed(help_text: str, option: str) -> list[str]:
    """The `a|b|c` list an option's help gives."""
    flat = " ".join(help_text.replace("│", " ").split())
    after = flat[flat.index(option) + len(option):]
    return re.search(r"([a-z0-9]+(?:\|[a-z0-9]+)+)", after)[1].split("|")


@pytest.mark.parametrize("command", ["compress", "eval"])
def test_precision_help_lists_exactly_what_is_accepted(command, monkeypatch, tmp_path):
    from kite.upcycle import UpcycleConfig, compress_settings
    from kite.upcycle.codec import PRESETS

    monkeypatch.setenv("COLUMNS", "200")
    res = runner.invoke(app, ["upcycle", command, "--help"])
    listed = _listed(res.stdout, "--precision")
    assert listed == list(PRESETS)
    for name in listed:
        assert compress_settings(UpcycleConfig(), precision=name).codec.name == name
    doc = tmp_path / "doc.txt"
    doc.write_text("The supplier shall deliver the goods.\n")
    res = runner.invoke(app, ["upcycle", command, "--input", str(doc), "--precision", "int9",
                              *(["--output", str(tmp_path / "x.upc")] if command == "compress" else [])])
    assert res.exit_code == 2 and "int9" in res.stderr


def test_generate_precision_help_lists_the_load_precisions(monkeypatch):
    from kite.upcycle import LOAD_PRECISIONS

    monkeypatch.setenv("COLUMNS", "200")
    res = runner.invoke(app, ["generate", "--help"])
    assert _listed(res.stdout, "--precision") == list(LOAD_PRECISIONS)


def test_a_reader_that_goes_away_ends_the_command_quietly(monkeypatch):
    """`kite ... | head`: a BrokenPipeError under a command's output ends it with exit 1 and no
    error line (click does the same for --help)."""
    import kite.data.traffic

    def closed(*a, **k):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(kite.data.traffic, "generate_traffic", closed)
    result = CliRunner().invoke(app, ["data", "traffic", "--n", "5"])
    assert result.exit_code == 1
    assert result.output == ""


def test_piping_into_head_leaves_no_traceback():
    """The real pipe: the reader of `kite data traffic` is gone before the first write (as after
    `| head -n 1` has its line): exit 1, nothing on stderr."""
    import subprocess
    import sys

    kite = [sys.executable, "-m", "kite.cli.main", "data", "traffic", "--n", "50"]
    producer = subprocess.Popen(kite, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    producer.stdout.close()                      # the reader goes away before kite writes
    _, err = producer.communicate(timeout=120)
    assert producer.returncode == 1
    assert err == b""
