"""`kite`: the root command and the seed's console-script aliases (kite-upcycle, kite-yoco, ...)."""

from __future__ import annotations

import sys

from kite.cli._common import SuggestingGroup, new_app, user_config
from kite.cli import version as version_cmd

# Commands that read the config themselves: `version` reports a broken one, `config` shows,
# checks and edits it.
OWN_CONFIG = ("version", "config")


class KiteRoot(SuggestingGroup):
    """The `kite` group: the layered config is loaded before any other command runs, so a broken
    file or KITE_* variable stops every command with one `file:line:col` line (exit 2), whatever
    the command reads. `--help` still answers."""

    def resolve_command(self, ctx, args):
        name, cmd, rest = super().resolve_command(ctx, args)
        if name not in OWN_CONFIG and "--help" not in rest and not ctx.resilient_parsing:
            user_config()
        return name, cmd, rest


app = new_app(
    "KITE: reuse long-context KV caches as compressed, tagged states (Upcycle) and load them by rule "
    "(YOCO).", cls=KiteRoot,
)


@app.callback()
def _root() -> None:
    """KITE: reuse long-context KV caches as compressed, tagged states (Upcycle) and load them by
    rule (YOCO). Set KITE_DEBUG=1 for tracebacks; KITE_HOME moves ~/.kite."""


app.command("version", help="Version, build, torch/transformers, device, native runtime, config.")(
    version_cmd.version
)


# (name, module, help): command groups, each module's `app`.
GROUPS = (
    ("config", "kite.cli.config_cmd", "Show, read, change and check ~/.kite/config.yaml."),
    ("model", "kite.cli.model", "Inspect models: geometry, KV bytes per token, fingerprint."),
    ("upcycle", "kite.cli.upcycle", "Turn a document's KV cache into a .upc state; inspect, evaluate, migrate, retune."),
    ("yoco", "kite.cli.yoco", "Rules, signals and load decisions."),
    ("data", "kite.cli.data", "Synthetic contracts and benchmark cases."),
    ("bench", "kite.cli.bench", "Benchmark the fused pipeline against full prefill and baselines."),
    ("gguf", "kite.cli.gguf", "Embed .upc states in a GGUF model file; list and extract them."),
    ("tune", "kite.cli.tune", "Sweep compression, clusters and rule thresholds through the bench; pick the best."),
    ("report", "kite.cli.report", "Reports across bench runs: regenerate rate against hit rate."),
    ("store", "kite.cli.store", "The tiered state store (memory, disk, Redis, S3): ls, get, put, sync, gc, stats."),
)
# (name, module, function, help): single commands.
COMMANDS = (
    ("generate", "kite.cli.generate", "generate", "Generate text, optionally from a .upc state."),
    ("demo", "kite.cli.demo", "demo", "Ask the demo's questions from a contract's state; each answer beside the contract's fact (exit 1 when one disagrees)."),
    ("serve", "kite.cli.serve", "serve", "Serve one model over HTTP (OpenAI-style)."),
    ("shadow", "kite.cli.shadow", "shadow", "Compare a candidate config against the golden one."),
    ("capacity-plan", "kite.cli.capacity", "capacity_plan", "GPUs for a load, raw and with compressed states; the setting to run."),
    ("monitor", "kite.cli.monitor", "monitor", "A live dashboard of a running server, from its /metrics."),
)


def register(root, groups=GROUPS, commands=COMMANDS) -> None:
    """Attach every listed group and command to `root`. A command is listed by the change that
    builds it; a listed module that does not import is an error here, never skipped. Heavy
    imports happen inside the commands."""
    import importlib

    for name, module, help_text in groups:
        root.add_typer(importlib.import_module(module).app, name=name, help=help_text)
    for name, module, attr, help_text in commands:
        root.command(name, help=help_text)(getattr(importlib.import_module(module), attr))


register(app)


def main() -> None:
    """`kite`, and `kite-cli` under its own name."""
    from pathlib import Path

    app(prog_name="kite-cli" if Path(sys.argv[0]).name == "kite-cli" else "kite")


def _alias(name: str, prog: str) -> None:
    """Run `kite NAME` as the program `prog`: `kite-upcycle inspect x.upc` is `kite upcycle inspect
    x.upc`, and its usage lines and errors say `kite-upcycle`, not `kite-upcycle upcycle`. The
    command runs under a root of `kite`'s kind (its checks, its one error boundary) that has no
    name of its own, so `prog` is the whole command path."""
    import typer

    root = typer.main.get_command(app)
    alias = type(root)(name="", commands={prog: root.commands[name]})
    alias.main(args=[prog, *sys.argv[1:]], prog_name="")


def upcycle_main() -> None:
    _alias("upcycle", "kite-upcycle")


def yoco_main() -> None:
    _alias("yoco", "kite-yoco")


def bench_main() -> None:
    _alias("bench", "kite-bench")


def shadow_main() -> None:
    _alias("shadow", "kite-shadow")


def tune_main() -> None:
    _alias("tune", "kite-tune")


def capacity_main() -> None:
    _alias("capacity-plan", "kite-capacity-plan")


if __name__ == "__main__":
    main()
