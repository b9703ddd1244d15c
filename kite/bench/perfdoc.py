"""docs/PERFORMANCE.md's tables rendered from result files, so that every figure in it is backed.

A spec (benchmarks/performance_rows.yaml) names each table and, per row, what it measures, the
result file and the row of that file it shows (and, optionally, the command that reproduces it when
the run did not record one, and whether it waits to be measured again on the current code). The
doc holds each table between `<!-- table:NAME -->` and `<!-- /table:NAME -->`; the prose around
them is written by hand. `check_doc` lists what does not hold: a row whose file is missing, has no
commit or lacks the row, a table that differs from its rendering, and any table row outside the
rendered tables (a figure nobody backs)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from kite.bench.results import BadResult, Result, load_result
from kite.errors import BadInput

_OPEN = re.compile(r"<!-- table:([a-z0-9_-]+) -->")
_CLOSE = "<!-- /table:{} -->"
TIMES = ("ms", "s", "us")


@dataclass(frozen=True, slots=True)
class DocRow:
    what: str
    result: str
    row: str
    command: str | None = None
    remeasure: bool = False


def load_spec(path: str | Path) -> dict[str, list[DocRow]]:
    """{table name: its rows} from the YAML spec; BadInput (one line) when it is malformed."""
    p = Path(path)
    try:
        obj = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise BadInput(f"{p}: not a readable YAML spec ({e})".replace("\n", " ")) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("tables"), dict):
        raise BadInput(f"{p}: the spec needs a 'tables' mapping")
    tables: dict[str, list[DocRow]] = {}
    for name, t in obj["tables"].items():
        if not re.fullmatch(r"[a-z0-9_-]+", str(name)) or not isinstance(t, dict) or not isinstance(t.get("rows"), list):
            raise BadInput(f"{p}: table {name!r} needs a lower-case name and a list of rows")
        rows = []
        for i, r in enumerate(t["rows"]):
            if not (isinstance(r, dict) and all(isinstance(r.get(k), str) and r[k] for k in ("what", "result", "row"))):
                raise BadInput(f"{p}: table {name} row {i} needs what, result and row")
            rows.append(DocRow(r["what"], r["result"], r["row"], r.get("command", t.get("command")),
                               bool(r.get("remeasure", False))))
        tables[str(name)] = rows
    return tables


def _num(v: float, unit: str) -> str:
    if unit == "x":
        return _times(v)
    if isinstance(v, int) or float(v).is_integer() and abs(v) >= 100:
        text = f"{int(v):,}"
    elif abs(v) >= 1000:
        text = f"{v:,.0f}"
    elif abs(v) >= 100:
        text = f"{v:.1f}"
    elif abs(v) >= 10:
        text = f"{v:.2f}"
    elif abs(v) >= 0.01 or v == 0:
        text = f"{v:.3f}"
    else:
        text = f"{v:.3g}"
    return f"{text} {unit}" if unit else text


def _x_baseline(x: float | None, unit: str) -> str:
    if x is None:
        return "—"
    if unit in TIMES and 0 < x < 1:
        return f"{x:.3f} ({1 / x:.1f}× faster)"
    return _times(x)


def _times(x: float) -> str:
    """A multiple in three significant figures (2.50×, 12.0×), whole from 100 on (105×, not 105.×)."""
    return f"{x:,.0f}×" if abs(x) >= 100 else f"{x:#.3g}×"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_row(row: DocRow, result: Result) -> str:
    """One markdown table row: what, the figure, × baseline, × floor, command, machine, date, file."""
    r = result.row(row.row)
    what = f"{row.what} (to be re-measured)" if row.remeasure else row.what
    command = result.command or row.command
    return "| " + " | ".join([
        _cell(what), _num(r.value, r.unit), _x_baseline(r.x_baseline, r.unit),
        "—" if r.x_floor is None else _times(r.x_floor),
        f"`{_cell(command)}`" if command else "—", _cell(result.machine["name"]), result.date,
        f"[{row.result}](../benchmarks/results/{row.result})"]) + " |"


HEADER = ("| figure | value | × baseline | × floor | command | machine | date | result |\n"
          "|---|---:|---:|---:|---|---|---|---|")


def _backed(row: DocRow, results: Path, cache: dict[str, Result]) -> Result:
    if row.result not in cache:
        cache[row.result] = load_result(results / row.result)
    res = cache[row.result]
    if not res.commit:
        raise BadResult(f"{row.result}: no commit recorded for {row.what!r}")
    res.row(row.row)
    return res


def render_table(rows: list[DocRow], results: Path, cache: dict[str, Result] | None = None) -> str:
    """The table's markdown; BadResult when a row is not backed."""
    cache = {} if cache is None else cache
    return "\n".join([HEADER, *(render_row(r, _backed(r, results, cache)) for r in rows)])


def _spans(text: str) -> dict[str, tuple[int, int]]:
    """{table name: (start, end) of the text between its markers}."""
    spans = {}
    for m in _OPEN.finditer(text):
        close = _CLOSE.format(m.group(1))
        end = text.find(close, m.end())
        if end < 0:
            raise BadInput(f"table {m.group(1)}: no closing marker {close}")
        spans[m.group(1)] = (m.end(), end)
    return spans


def render_doc(text: str, spec: dict[str, list[DocRow]], results: Path) -> str:
    """`text` with every table of `spec` rendered between its markers."""
    cache: dict[str, Result] = {}
    for name, (start, end) in sorted(_spans(text).items(), key=lambda kv: -kv[1][0]):
        if name in spec:
            text = text[:start] + "\n" + render_table(spec[name], results, cache) + "\n" + text[end:]
    return text


def check_doc(text: str, spec: dict[str, list[DocRow]], results: Path) -> list[str]:
    """What keeps the doc from being backed (an empty list when every figure is)."""
    problems: list[str] = []
    try:
        spans = _spans(text)
    except BadInput as e:
        return [str(e)]
    cache: dict[str, Result] = {}
    for name, rows in spec.items():
        for row in rows:
            try:
                _backed(row, results, cache)
            except BadInput as e:
                problems.append(f"table {name}, row {row.what!r}: {e}")
        if name not in spans:
            problems.append(f"table {name}: no <!-- table:{name} --> marker in the doc")
    problems += [f"table {n}: in the doc, not in the spec" for n in spans if n not in spec]
    if problems:
        return problems
    for name, (start, end) in spans.items():
        if text[start:end].strip("\n") != render_table(spec[name], results, cache):
            problems.append(f"table {name}: differs from its rendering (run scripts/render_performance.py)")
    inside = [range(s, e) for s, e in spans.values()]
    pos = 0
    for n, line in enumerate(text.splitlines(keepends=True), 1):
        if line.lstrip().startswith("|") and not any(pos in r for r in inside):
            problems.append(f"line {n}: a table row outside the rendered tables: {line.strip()[:80]}")
        pos += len(line)
    return problems
