"""What every command shares: JSON output, the consoles and their width, exit codes, Ctrl-C, typo
suggestions."""

from __future__ import annotations

from pathlib import Path

import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Mapping
from os import PathLike
from typing import Any

import typer
from typer import exceptions as typer_exc
from typer.core import TyperGroup

from kite.errors import BadInput

_console = None
_err_console = None


# Off a terminal (a CI log, a file, a pipe) rich would wrap and cut at 80 columns: there lines
# are not wrapped (tables take the width their values need) unless COLUMNS gives a width.
OFF_TTY_WIDTH = 10_000
# typer draws help and usage errors in boxes as wide as the console: off a terminal, this wide
# (every option's help fits unwrapped words; COLUMNS or TERMINAL_WIDTH still win).
OFF_TTY_HELP_WIDTH = 120


def _columns_given() -> bool:
    import os

    return os.environ.get("COLUMNS", "").strip().isdigit()


def _make_console(stderr: bool):
    from rich.console import Console

    c = Console(stderr=stderr)
    if not c.is_terminal and not _columns_given():
        c.width = OFF_TTY_WIDTH
    c.push_render_hook(_FoldTables())
    return c


class _FoldTables:
    """A rich render hook: table cells fold a value too long for its column onto the next line,
    never cut it with an ellipsis (rich's default), at whatever width the console has."""

    def process_renderables(self, renderables):
        from rich.table import Table

        for r in renderables:
            if isinstance(r, Table):
                for col in r.columns:
                    if col.overflow == "ellipsis":
                        col.overflow = "fold"
        return renderables


def console():
    """The stdout console (rich), made on first use in each command run."""
    global _console
    if _console is None:
        _console = _make_console(stderr=False)
    return _console


def err_console():
    """The stderr console: errors, warnings, progress."""
    global _err_console
    if _err_console is None:
        _err_console = _make_console(stderr=True)
    return _err_console


def print_warnings(warnings: list[str]) -> None:
    """Each warning a line on stderr (``warning: ...``), so that --json stdout holds the JSON alone."""
    from rich.markup import escape

    for text in warnings:
        err_console().print(f"[bold yellow]warning:[/] {escape(text)}", highlight=False, soft_wrap=True)


@contextlib.contextmanager
def _help_width() -> Iterator[None]:
    """Typer's help and usage errors off a terminal: OFF_TTY_HELP_WIDTH wide, not 80."""
    import typer.rich_utils as rich_utils

    before = rich_utils.MAX_WIDTH
    if before is None and not _columns_given() and not sys.stdout.isatty():
        rich_utils.MAX_WIDTH = OFF_TTY_HELP_WIDTH
    try:
        yield
    finally:
        rich_utils.MAX_WIDTH = before


def emit_json(obj: Any) -> None:
    """Print one JSON document to stdout (for `--json`)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def _silence_stdout() -> None:
    """Point stdout's descriptor at /dev/null, so the interpreter's flush at exit cannot raise the
    broken pipe a second time. A stdout without a descriptor (a test runner's buffer) is left be."""
    import io
    import os

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


class SuggestingGroup(TyperGroup):
    """A command group (typer suggests "did you mean" for typos) whose errors are one red line."""

    def main(self, *args, **kwargs):
        # `kite ...` and typer's CliRunner both enter here: each run makes its consoles for the
        # streams and COLUMNS in force now.
        global _console, _err_console
        _console = _err_console = None
        with _help_width():
            return super().main(*args, **kwargs)

    def invoke(self, ctx):
        # Every command's errors become one red line and an exit code, the same under
        # `kite` and under typer's CliRunner in the tests.
        try:
            return super().invoke(ctx)
        except (typer_exc.TyperException, typer_exc.Exit, typer_exc.Abort):
            raise
        except KeyboardInterrupt as exc:
            report_interrupt(exc, " ".join(filter(None, (ctx.command_path.strip(), ctx.invoked_subcommand))))
            raise typer.Exit(130)
        except BrokenPipeError:
            # the reader of our output went away (`kite ... | head`): stop quietly with exit 1, as
            # click does for --help; point stdout at /dev/null so the exit's flush cannot fail again
            _silence_stdout()
            raise typer.Exit(1) from None
        except Exception as exc:  # noqa: BLE001 - this is the one place errors are reported
            raise typer.Exit(report_error(exc))


def new_app(help: str, cls: type[SuggestingGroup] = SuggestingGroup) -> typer.Typer:
    """A Typer app with KITE's conventions: no rich tracebacks, typo suggestions."""
    return typer.Typer(
        help=help,
        cls=cls,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
        rich_markup_mode="rich",
    )


def report_error(exc: BaseException) -> int:
    """Print `exc` as one red line (the traceback too under KITE_DEBUG=1); return the exit code."""
    import os
    import traceback

    from kite.errors import KiteError

    debug = os.environ.get("KITE_DEBUG") == "1"
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, KiteError):
        text, code = str(exc), exc.exit_code
    else:
        text, code = f"{type(exc).__name__}: {exc}" + ("" if debug else " (set KITE_DEBUG=1 for the traceback)"), 1
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    from rich.markup import escape

    # the message is text, not markup: "pip install 'kite[serve]'" keeps its brackets
    err_console().print(f"[bold red]error:[/] {escape(first)}", highlight=False, markup=True, soft_wrap=True)
    return code


# What Ctrl-C keeps when a command says nothing more (invariant 4: kite.atomic).
KEPT_BY_DEFAULT = "no file is left half-written (KITE writes each file whole, then renames it)"


def report_interrupt(exc: KeyboardInterrupt, what: str) -> None:
    """Ctrl-C's one line on stderr: what was interrupted and what was kept (the notes `kept_on_interrupt`
    added, else KEPT_BY_DEFAULT)."""
    from rich.markup import escape

    kept = "; ".join(getattr(exc, "__notes__", None) or [KEPT_BY_DEFAULT])
    err_console().print(f"[bold yellow]interrupted[/] (Ctrl-C): {escape(what)}: {escape(kept)}",
                        highlight=False, soft_wrap=True)


@contextlib.contextmanager
def kept_on_interrupt(kept: str | Callable[[], str]) -> Iterator[None]:
    """Inside, Ctrl-C's line says `kept` (what the command kept, how to resume or undo) instead of
    the default; a callable is asked when the interrupt comes."""
    try:
        yield
    except KeyboardInterrupt as exc:
        try:
            note = kept() if callable(kept) else kept
        except Exception:  # noqa: BLE001 - a note that cannot be made must not hide the interrupt
            note = None
        if note:
            exc.__notes__ = [*getattr(exc, "__notes__", ()), note]  # add_note, on Python 3.10 too
        raise


@contextlib.contextmanager
def rule_errors_reported(path: str | PathLike[str]) -> Iterator[None]:
    """Inside, a rule set that does not load (RuleSetError) prints its full report to stderr (every
    error as `file:line:col: message`, the line and a caret) and becomes one BadInput line that
    names `path` and counts the errors."""
    from kite.yoco.rules import RuleSetError

    try:
        yield
    except RuleSetError as exc:
        err_console().print(exc.report(), markup=False, highlight=False, soft_wrap=True)
        n = len(exc.errors)
        raise BadInput(f"{path}: {n} error{'s' if n != 1 else ''} in the rule set "
                       f"(first: {exc.errors[0].header})") from None


_loaded_config: tuple[Any, Any] | None = None  # (what it was loaded from, the config)


def user_config(overrides: Mapping[str, Any] | None = None):
    """The layered config every command runs with: defaults < $KITE_HOME/config.yaml < KITE_* env
    < `overrides` (the command's flags; None values are flags not given).

    Loaded once per process for the same file (path, size, mtime) and KITE_* environment. A broken
    file or variable raises BadInput with one line (`file:line:col: ...`); `kite` checks it before
    any command but `version` and `config` runs (see kite.cli.main)."""
    import os

    from kite.config import load_config
    from kite.paths import config_path

    global _loaded_config
    if overrides and any(v is not None for v in overrides.values()):
        return load_config(overrides=overrides)
    path = config_path()
    try:
        st = path.stat()
        stamp: Any = (st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        stamp = None
    key = (str(path), stamp, sorted((k, v) for k, v in os.environ.items() if k.startswith("KITE_")))
    if _loaded_config is None or _loaded_config[0] != key:
        _loaded_config = (key, load_config(path))
    return _loaded_config[1]


def rules_file(flag: str | Path | None) -> Path:
    """The rule file a command decides with: --rules / --yoco-rules, else the config's
    yoco.rules_file (found in the working folder, $KITE_HOME, or the checkout)."""
    from kite.yoco.rules import resolve_rules_path

    return resolve_rules_path(flag if flag is not None else user_config().yoco.rules_file)


def model_spec(flag: str | None) -> str:
    """The model a command runs: --model, else the config's model.default. Resolved now (no
    weights read), so a missing file or unknown name fails before anything slow, naming where
    the value came from (the flag, the config file's line, or the environment variable)."""
    from kite.config import config_origin
    from kite.model.sources import resolve

    if flag is not None:
        resolve(flag)
        return flag
    cfg = user_config()
    spec = cfg.model.default
    try:
        resolve(spec, what="model.default")
    except BadInput as exc:
        origin = config_origin(cfg, "model.default")
        if origin.startswith("KITE_"):
            origin = f"environment variable {origin}"
        raise BadInput(f"{origin}: {exc}" if origin else str(exc)) from None
    return spec


JsonOpt = typer.Option(False, "--json", help="Print one JSON document for scripts.")
ModelOpt = typer.Option("--model", "-m", help="HF folder, .gguf file or embedded name (default: config model.default).")
DtypeOpt = typer.Option("--dtype", help="The model's precision: fp32 | bf16 | fp16 (default fp32 on a CPU, bf16 on "
                        "CUDA).")
# every command that writes an output path: a missing folder is an error unless --mkdir (or the path
# lies under KITE_HOME / KITE_CACHE); kite.atomic.check_output checks it before any work
MkdirOpt = typer.Option(False, "--mkdir", help="Create the output path's missing folders (without it a missing "
                        "folder is an error).")
# the memory-budgeted mode's block settings (kite generate, kite serve; docs/kv-budget.md)
KvBudgetCodecOpt = typer.Option("--kv-budget-codec", help="With --kv-budget-tokens: the codec of the compressed "
                                "blocks (ratio=R, int4, int8, exact, ...; default ratio=8).")
KvBudgetBlockOpt = typer.Option("--kv-budget-block", help="With --kv-budget-tokens: tokens per compressed block "
                                "(default 256).")


def check_budget_flags(tokens: int | None, codec: str | None, block: int | None) -> None:
    """--kv-budget-codec / --kv-budget-block only mean something with --kv-budget-tokens. Raises BadInput."""
    if tokens is None and (codec is not None or block is not None):
        raise BadInput("--kv-budget-codec and --kv-budget-block set up --kv-budget-tokens; give it too")


def parse_layers(spec: str | None, n_layers: int) -> list[int] | None:
    """`all` → None (every layer); `12-18` → [12..18]; `1,3,5-7` → list. Raises BadInput for an
    empty list, a reversed range (`18-12`) or a layer outside 0..n_layers-1 (naming the first)."""
    if spec is None or spec.strip().lower() == "all":
        return None
    layers: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo_s, dash, hi_s = part.partition("-")
        try:
            lo, hi = int(lo_s), int(hi_s) if dash else int(lo_s)
        except ValueError:
            what = "an empty item" if not part else repr(part)
            raise BadInput(f"--layers {spec!r}: {what} is not a layer or a range; expected 'all', 'A-B' or a "
                           f"comma list like '1,3,5-7'") from None
        if lo > hi:
            raise BadInput(f"--layers {spec!r}: the range {part} runs backwards (write {hi}-{lo})")
        if lo < 0 or hi >= n_layers:
            first = lo if lo < 0 else max(lo, n_layers)
            raise BadInput(f"--layers {spec!r}: layer {first} is out of range 0-{n_layers - 1} (the model has "
                           f"{n_layers} layers)")
        layers.update(range(lo, hi + 1))
    return sorted(layers)


def parse_clusters(spec: str | None) -> list[str] | None:
    """`--clusters`: None (not given) → None, every cluster; `breach,2` → ['breach', '2'] (labels or
    ids). A value that names no cluster (`""`, `","`) is BadInput, not a load of everything."""
    if spec is None:
        return None
    names = [c.strip() for c in spec.split(",") if c.strip()]
    if not names:
        raise BadInput(f"--clusters {spec!r}: no cluster named; give labels or ids (comma-separated), or leave "
                       f"--clusters out to load every cluster")
    return names


def read_document(path: str) -> tuple[str, str]:
    """(text, name) from a file path or '-' (stdin). Non-UTF-8 and empty input are BadInput."""
    if path == "-":
        data, name = sys.stdin.buffer.read(), "stdin"
    else:
        try:
            data, name = Path(path).read_bytes(), Path(path).name
        except FileNotFoundError:
            raise BadInput(f"--input {path}: no such file")
        except IsADirectoryError:
            raise BadInput(f"--input {path}: is a folder, expected a text file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise BadInput(f"--input {path}:{line}: not UTF-8 text (byte {exc.start})")
    if not text.strip():
        raise BadInput(f"--input {path}: the document is empty")
    return text, name
