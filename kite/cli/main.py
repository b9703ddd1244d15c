"""`kite`: the root command and the seed's console-script aliases (kite-upcycle, kite-yoco, ...)."""

from __future__ import annotations

import sys

from kite.cli._common import new_app
from kite.cli import version as version_cmd

app = new_app(
    "KITE: reuse long-context KV caches as compressed, tagged states (Upcycle) and load them by rule "
    "(YOCO)."
)


@app.callback()
def _root() -> None:
    """KITE: reuse long-context KV caches as compressed, tagged states (Upcycle) and load them by
    rule (YOCO). Set KITE_DEBUG=1 for tracebacks; KITE_HOME moves ~/.kite."""


app.command("version", help="Version, build, torch/transformers, device, native runtime, config.")(
    version_cmd.version
)


def _register() -> None:
    """Attach every command group that exists. Heavy imports happen inside the commands."""
    import importlib

    groups = [
        ("config", "kite.cli.config_cmd", "Show, read, change and check ~/.kite/config.yaml."),
        ("model", "kite.cli.model", "Inspect models: geometry, KV bytes per token, fingerprint."),
        ("upcycle", "kite.cli.upcycle", "Turn a document's KV cache into a .upc state; inspect, evaluate, migrate."),
        ("yoco", "kite.cli.yoco", "Rules, signals and load decisions."),
        ("data", "kite.cli.data", "Synthetic contracts and benchmark cases."),
        ("bench", "kite.cli.bench", "Benchmark the fused pipeline against full prefill and baselines."),
        ("tune", "kite.cli.tune", "Sweep settings against measured results."),
    ]
    for name, module, help_text in groups:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:
                continue  # that group is not part of this build
            raise
        app.add_typer(mod.app, name=name, help=help_text)
    for name, module, attr, help_text in [
        ("generate", "kite.cli.generate", "generate", "Generate text, optionally from a .upc state."),
        ("serve", "kite.cli.serve", "serve", "Serve one model over HTTP (OpenAI-style)."),
        ("shadow", "kite.cli.shadow", "shadow", "Compare a candidate config against the golden one."),
        ("capacity-plan", "kite.cli.capacity", "capacity_plan", "Plan GPU capacity from results."),
    ]:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:
                continue
            raise
        app.command(name, help=help_text)(getattr(mod, attr))


_register()


def main() -> None:
    """`kite` and `kite-cli`."""
    app(prog_name="kite")


def _alias(group: str, prog: str) -> None:
    sys.argv[1:1] = [group]
    app(prog_name=prog)


def upcycle_main() -> None:
    _alias("upcycle", "kite-upcycle")


def yoco_main() -> None:
    _alias("yoco", "kite-yoco")


def bench_main() -> None:
    _alias("bench", "kite-bench")


def tune_main() -> None:
    _alias("tune", "kite-tune")


def capacity_main() -> None:
    _alias("capacity-plan", "kite-capacity-plan")


def shadow_main() -> None:
    _alias("shadow", "kite-shadow")


if __name__ == "__main__":
    main()
