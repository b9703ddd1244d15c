"""`kite model info`: geometry, RoPE, raw KV bytes per token, fingerprint."""

from __future__ import annotations

from typing import Annotated

import typer

from kite.cli._common import JsonOpt, ModelOpt, console, emit_json, model_spec, new_app

app = new_app("Inspect models: geometry, KV bytes per token, fingerprint.")


@app.command("info")
def info(
    model: Annotated[str | None, ModelOpt] = None,
    adapter: Annotated[str | None, typer.Option(help="A peft adapter folder to include in the fingerprint.")] = None,
    json_out: bool = JsonOpt,
) -> None:
    """Architecture, layers, heads, KV heads, head_dim, context, RoPE, KV bytes/token, fingerprint.

    Example: kite model info --model ./Qwen2-7B --json
    """
    from pathlib import Path

    from kite.model.fingerprint import fingerprints, short
    from kite.model.geometry import DTYPE_BYTES, geometry_from_config
    from kite.model.loader import load_config_only

    model = model_spec(model)
    from kite.cli._progress import say

    source, folder, config = load_config_only(model, progress=say)   # stderr: not in --json stdout
    geo = geometry_from_config(config)
    fps = fingerprints(folder, Path(adapter) if adapter else None)
    report = {
        "model": source.spec,
        "source": source.kind,
        "path": str(source.path),
        "folder": str(folder),
        **geo.to_dict(),
        "kv_bytes_per_token": {dt: geo.kv_bytes_per_token(dt) for dt in DTYPE_BYTES},
        "fingerprint": fps.combined,
        "fingerprints": fps.to_dict(),
    }
    if json_out:
        emit_json(report)
        return
    out = console()
    out.print(f"[bold]{source.spec}[/] ({source.kind}: {source.path})")
    for key in ("architecture", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_size",
                "vocab_size", "context_length", "rope"):
        out.print(f"  {key:<16} {report[key]}", highlight=False)
    kv = ", ".join(f"{dt} {int(b):,} B" if b == int(b) else f"{dt} {b:,} B"
                   for dt, b in report["kv_bytes_per_token"].items())
    out.print(f"  {'kv bytes/token':<16} {kv}", highlight=False)
    out.print(f"  {'fingerprint':<16} {fps.combined}  (short {short(fps.combined)})", highlight=False)
