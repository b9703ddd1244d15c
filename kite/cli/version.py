"""`kite version`: answers without importing torch or transformers (< 0.5 s)."""

from __future__ import annotations

import typer

from kite.cli._common import JsonOpt, console, emit_json


def version(json_out: bool = JsonOpt) -> None:
    """Answers even when the config is broken (it is the tool you run to diagnose): the config's
    one error line is shown as `config_error` (null when it loads); the exit code stays 0."""
    from kite.buildinfo import build_info
    from kite.cli._common import user_config
    from kite.errors import KiteError

    info = build_info()
    try:
        user_config()
        info["config_error"] = None
    except KiteError as exc:
        info["config_error"] = str(exc)
    if json_out:
        emit_json(info)
        return
    out = console()
    out.print(f"[bold]kite[/] {info['version']}")
    for key in ("build_date", "git_commit", "python", "torch", "transformers", "device",
                "native_runtime", "config_path"):
        out.print(f"  {key:<15} {info[key]}", highlight=False)
    if info["config_error"]:
        from rich.markup import escape

        out.print(f"  {'config':<15} [bold red]broken:[/] {escape(info['config_error'])}",
                  highlight=False, soft_wrap=True)


__all__ = ["version", "typer"]
