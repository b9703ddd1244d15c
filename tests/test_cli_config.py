"""Every command runs with the same layered config (defaults < $KITE_HOME/config.yaml < KITE_* env <
flags): a broken config stops every command with one `file:line:col` line, and every command that
takes a model runs `model.default` when it gets no --model."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kite.cli.main import OWN_CONFIG, app

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def clean_env(kite_home, monkeypatch) -> Path:
    for name in list(os.environ):
        if name.startswith("KITE_") and ("__" in name or name == "KITE_ADMIN_TOKEN"):
            monkeypatch.delenv(name)
    kite_home.mkdir(parents=True, exist_ok=True)
    return kite_home


def leaf_commands(group=None, path=()) -> list[tuple[str, ...]]:
    group = group or typer.main.get_command(app)
    out = []
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            out += leaf_commands(cmd, (*path, name))
        else:
            out.append((*path, name))
    return out


COMMANDS = [c for c in leaf_commands() if c[0] not in OWN_CONFIG]


def one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.output  # one line, never a traceback
    return lines[0]


BROKEN = [  # (config text, where the one line must point, what it must say)
    ("server:\n  port: [1\nmodel:\n  default: x\n", ":3:6: ", "YAML syntax error"),
    ("features:\n  upcycle_yoco_fuson: true\n", ":2:3: ", "unknown key 'features.upcycle_yoco_fuson'"),
    ("server:\n  port: eighty\n", ":2:3: ", "server.port = eighty has the wrong type"),
]


@pytest.mark.parametrize("text,where,what", BROKEN, ids=["yaml", "unknown-key", "type"])
def test_every_command_refuses_a_broken_config_file(clean_env, text, where, what):
    path = clean_env / "config.yaml"
    path.write_text(text)
    assert len(COMMANDS) > 20  # the walk found the command tree
    for command in COMMANDS:
        # no arguments at all: the config is checked before the command's own flags
        result = runner.invoke(app, list(command))
        assert result.exit_code == 2, (command, result.output)
        line = one_error_line(result)
        assert line.startswith(f"error: {path}{where}") and what in line, (command, line)


def test_every_command_refuses_a_bad_config_variable(monkeypatch):
    monkeypatch.setenv("KITE_SERVER__PORT", "abc")
    for command in COMMANDS:
        result = runner.invoke(app, list(command))
        assert result.exit_code == 2, (command, result.output)
        assert "environment variable KITE_SERVER__PORT: server.port = abc" in one_error_line(result)


def test_help_still_answers_with_a_broken_config(clean_env):
    (clean_env / "config.yaml").write_text("server: [\n")
    for command in COMMANDS[:: max(1, len(COMMANDS) // 8)] + [("upcycle",)]:
        result = runner.invoke(app, [*command, "--help"])
        assert result.exit_code == 0, (command, result.output)
        assert "Usage" in result.output


def test_version_answers_and_says_the_config_is_broken(clean_env):
    path = clean_env / "config.yaml"
    path.write_text("server:\n  port: eighty\n")
    result = runner.invoke(app, ["version", "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["config_error"].startswith(f"{path}:2:3: server.port = eighty")
    human = runner.invoke(app, ["version"])
    assert human.exit_code == 0 and "broken" in human.stdout
    path.write_text("server:\n  port: 9000\n")
    assert json.loads(runner.invoke(app, ["version", "--json"]).stdout)["config_error"] is None
    # `config path` finds the broken file; `config validate` and `show` report it
    path.write_text("server:\n  port: eighty\n")
    assert runner.invoke(app, ["config", "path"]).exit_code == 0
    assert runner.invoke(app, ["config", "validate"]).exit_code == 2
    assert runner.invoke(app, ["config", "show"]).exit_code == 2


# --------------------------------------------------------------------------- model.default

def _model_commands(tmp: Path, state: Path) -> dict[str, list[str]]:
    """Every command that takes a model, with the least input that reaches the model."""
    from kite.ports import free_port

    doc = tmp / "doc.txt"
    doc.write_text("A short document.\n\nIt has two paragraphs.\n")
    queries = tmp / "q.jsonl"
    queries.write_text('{"query": "who pays?"}\n')
    cases = ROOT / "configs" / "bench_cases.jsonl"
    golden = tmp / "golden.yaml"
    golden.write_text("method: full\n")
    rules = tmp / "rules.yaml"
    rules.write_text("rules:\n  - name: default\n    condition: true\n    action: {load_all_clusters: true}\n")
    return {
        "model info": ["model", "info"],
        "generate": ["generate", "--prompt", "hi"],
        "upcycle compress": ["upcycle", "compress", "--input", str(doc), "--output", str(tmp / "d.upc")],
        "upcycle eval": ["upcycle", "eval", "--input", str(doc)],
        "upcycle eval-tagging": ["upcycle", "eval-tagging", "--queries", str(queries)],
        "yoco decide": ["yoco", "decide", "--state", str(state), "--query", "who pays?", "--rules", str(rules)],
        "yoco analyze": ["yoco", "analyze", "--queries", str(queries)],
        "bench run": ["bench", "run", "--output", str(tmp / "b.json"), "--cases", str(cases)],
        "shadow": ["shadow", "--golden", str(golden), "--candidate", str(golden), "--cases", str(cases)],
        "serve": ["serve", "--port", str(free_port())],
    }


MODEL_COMMANDS = ["model info", "generate", "upcycle compress", "upcycle eval", "upcycle eval-tagging",
                  "yoco decide", "yoco analyze", "bench run", "shadow", "serve"]


class Loaded(Exception):
    pass


@pytest.fixture()
def loads(monkeypatch) -> list[str]:
    """The model specs the commands go on to load (each load stops the command)."""
    import kite.model
    import kite.model.loader

    seen: list[str] = []

    def record(spec=None, *a, **k):
        seen.append(str(spec))
        raise Loaded(f"would load {spec}")

    for module in (kite.model, kite.model.loader):
        monkeypatch.setattr(module, "load_model", record)
        monkeypatch.setattr(module, "load_config_only", record)
    return seen


@pytest.mark.parametrize("name", MODEL_COMMANDS)
def test_every_model_command_runs_model_default(name, tiny_contract_state, tiny_models, loads, tmp_path,
                                                clean_env, monkeypatch):
    tiny = str(tiny_models["llama"])
    args = _model_commands(tmp_path, tiny_contract_state[2])[name]
    (clean_env / "config.yaml").write_text(f"model:\n  default: {tiny}\n")
    result = runner.invoke(app, args)
    assert loads and loads[0] == tiny, (name, result.output)
    loads.clear()
    monkeypatch.setenv("KITE_MODEL__DEFAULT", str(tiny_models["qwen2"]))  # env beats the file
    runner.invoke(app, args)
    assert loads and loads[0] == str(tiny_models["qwen2"]), name
    loads.clear()
    runner.invoke(app, [*args, "--model", tiny])  # the flag beats both
    assert loads and loads[0] == tiny, name


@pytest.mark.parametrize("name", MODEL_COMMANDS)
def test_a_missing_model_default_fails_first_and_says_where_it_was_set(name, loads, tmp_path, clean_env,
                                                                       monkeypatch):
    args = _model_commands(tmp_path, tmp_path / "no-state.upc")[name]
    monkeypatch.setenv("KITE_MODEL__DEFAULT", "nosuchmodel")
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (name, result.output)
    line = one_error_line(result)
    assert "environment variable KITE_MODEL__DEFAULT: model.default nosuchmodel: no such file" in line, line
    monkeypatch.delenv("KITE_MODEL__DEFAULT")
    (clean_env / "config.yaml").write_text("model:\n  default: nosuchmodel\n")
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (name, result.output)
    assert re.search(r"config\.yaml:2: model\.default nosuchmodel", one_error_line(result))
    assert loads == []
