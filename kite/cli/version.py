"""`kite version`: answers without importing torch or transformers (< 0.5 s)."""

from __future__ import annotations

import typer

from kite.cli._common import JsonOpt, console, emit_json


def version(json_out: bool = JsonOpt) -> None:
    from kite.buildinfo import build_info

    info = build_info()
    if json_out:
        emit_json(info)
        return
    out = console()
    out.print(f"[bold]kite[/] {info['version']}")
    for key in ("build_date", "git_commit", "python", "torch", "transformers", "device",
                "native_runtime", "config_path"):
        out.print(f"  {key:<15} {info[key]}", highlight=False)


__all__ = ["version", "typer"]
