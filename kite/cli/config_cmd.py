"""`kite config show|get|set|path|validate`: a thin shell over kite.config."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from kite.cli._common import JsonOpt, console, emit_json, err_console, new_app

app = new_app(
    "Show, read, change and check the layered config: defaults < $KITE_HOME/config.yaml < "
    "KITE_* env < flags.\n\nExamples:\n\n  kite config show\n\n"
    "  kite config set features.upcycle_yoco_fusion true\n\n"
    "  KITE_SERVER__PORT=9000 kite config get server.port --json"
)

SetOpt = Annotated[Optional[list[str]], typer.Option(
    "--set", metavar="KEY=VALUE", help="Override a key for this command only (the flags layer).")]


def _overrides(pairs: list[str] | None) -> dict[str, str]:
    from kite.errors import BadInput

    out: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise BadInput(f"--set {pair!r}: expected KEY=VALUE")
        out[key.strip()] = value
    return out


def _plain(value: Any) -> Any:
    """A value as JSON-ready data."""
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return str(value) if isinstance(value, Path) else value


@app.command(epilog="Examples: kite config show --json | jq .config.server;  "
                     "KITE_SERVER__PORT=9000 kite config show --set model.default=/models/qwen")
def show(json_out: bool = JsonOpt, overrides: SetOpt = None) -> None:
    """The effective config and where each value came from (default, file:line, env, override).

    The admin token is masked; `kite config get server.admin_token` prints it.
    """
    from kite import config as C
    from kite.paths import config_path

    cfg = C.load_config(overrides=_overrides(overrides))
    rows = []
    for key in C.CONFIG_KEYS:
        value = _plain(C.get_value(cfg, key))
        if C.is_secret(key) and value is not None:
            value = "***"
        rows.append((key, value, C.config_source(cfg, key), C.config_origin(cfg, key)))
    if json_out:
        config = cfg.model_dump(mode="json")
        for key, value, *_ in rows:  # masked values replace the secrets
            *parents, leaf = key.split(".")
            node = config
            for part in parents:
                node = node[part]
            node[leaf] = value
        emit_json({"config_path": str(config_path()), "config": config,
                   "sources": {k: {"layer": layer, "origin": origin}
                               for k, _, layer, origin in rows}})
        return
    from rich.table import Table

    table = Table(title=f"config ({config_path()})", title_justify="left", box=None)
    table.add_column("key", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_column("source", overflow="fold")
    for key, value, layer, origin in rows:
        shown = value if isinstance(value, str) else C.render_value(value)
        if layer == "file":  # the title names the file
            origin = f"line {origin.rpartition(':')[2]}"
        table.add_row(key, shown, layer + (f" {origin}" if origin and origin != layer else ""))
    console().print(table)


@app.command(epilog="Examples: kite config get server.port;  kite config get features --json")
def get(
    key: Annotated[str, typer.Argument(help="Dotted key, e.g. features.upcycle_yoco_fusion.")],
    json_out: bool = JsonOpt,
    overrides: SetOpt = None,
) -> None:
    """Print one effective value (a leaf, or a whole section)."""
    from kite import config as C

    cfg = C.load_config(overrides=_overrides(overrides))
    value = C.get_value(cfg, key)
    if json_out:
        leaf = key in C.CONFIG_KEYS
        emit_json({"key": key, "value": _plain(value),
                   "layer": C.config_source(cfg, key) if leaf else None,
                   "origin": C.config_origin(cfg, key) if leaf else None})
        return
    text = C.render_value(_plain(value))
    console().print(value if isinstance(value, str) else text, highlight=False, markup=False,
                    soft_wrap=True)


@app.command("set", context_settings={"ignore_unknown_options": True},  # `set KEY -1` works
             epilog="Examples: kite config set features.upcycle_yoco_fusion true;  "
                    "kite config set server.state_dir /data/kite-states")
def set_(
    key: Annotated[str, typer.Argument(help="Dotted key, e.g. server.port.")],
    value: Annotated[str, typer.Argument(help="New value, read like a YAML scalar.")],
    json_out: bool = JsonOpt,
) -> None:
    """Write KEY: VALUE into $KITE_HOME/config.yaml (validated first, atomic, comments kept)."""
    from kite import config as C
    from kite.paths import config_path

    path = config_path()
    C.set_value(path, key, value)
    written = C.get_value(C.validate_file(path), key)
    shadowed = next((n for n in C.env_vars_for(key) if os.environ.get(n)), None)
    if json_out:
        emit_json({"path": str(path), "key": key, "value": _plain(written),
                   "shadowed_by": shadowed})
        return
    shown = "***" if C.is_secret(key) else C.render_value(_plain(written))
    console().print(f"set {key} = {shown} in {path}", highlight=False, markup=False)
    if shadowed:
        err_console().print(f"[yellow]note:[/] {shadowed} is set and overrides this value",
                            highlight=False)


@app.command()
def path(json_out: bool = JsonOpt) -> None:
    """Where the config file is ($KITE_HOME/config.yaml; KITE_HOME defaults to ~/.kite)."""
    from kite.paths import config_path, kite_home

    target = config_path()
    if json_out:
        emit_json({"path": str(target), "exists": target.exists(), "kite_home": str(kite_home())})
        return
    console().print(str(target), highlight=False, markup=False, soft_wrap=True)


@app.command(epilog="Example: kite config validate configs/config.yaml --json")
def validate(
    file: Annotated[Optional[Path], typer.Argument(
        help="Config file to check (default: $KITE_HOME/config.yaml).")] = None,
    json_out: bool = JsonOpt,
) -> None:
    """Check a config file: exit 0 if valid, 2 with one line (file:line, key, allowed) if not."""
    from kite import config as C
    from kite.errors import BadInput
    from kite.paths import config_path

    target = file if file is not None else config_path()
    if file is None and not target.exists():
        if json_out:
            emit_json({"path": str(target), "exists": False, "valid": True, "keys_set": []})
        else:
            console().print(f"{target} does not exist: the defaults are in effect",
                            highlight=False, markup=False)
        return
    try:
        cfg = C.validate_file(target)
    except BadInput as exc:
        if json_out:  # scripts get a document; the error line and exit code 2 still follow
            emit_json({"path": str(target), "exists": target.exists(), "valid": False,
                       "error": str(exc)})
        raise
    keys = [k for k in C.CONFIG_KEYS if C.config_source(cfg, k) == "file"]
    if json_out:
        emit_json({"path": str(target), "exists": True, "valid": True, "keys_set": keys})
        return
    console().print(f"{target}: valid ({len(keys)} key{'s' if len(keys) != 1 else ''} set)",
                    highlight=False, markup=False)
