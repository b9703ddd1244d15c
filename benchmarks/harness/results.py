"""The result of one benchmark run, in the envelope every result file shares (schema
``kite.bench.result/1``): one JSON file under benchmarks/results/ named
``<benchmark>_<machine>_<YYYYMMDD>_<commit7>.json`` and one line in benchmarks/results/index.jsonl.

    res = Result("gpu_speed", device=args.device)
    res.row("prefill 16K", 812.0, "ms", floor="2 x params x tokens FLOPs at 989.5 TFLOP/s", floor_value=140.1)
    res.row("state load", 9.1, "ms", baseline="prefill 16K")          # a row's name: its value is the baseline
    res.raw["settings"] = vars(args)
    finish(res, args)          # prints every row with x baseline and x floor, writes the file (or --out)

Rows: ``x_baseline`` = value / baseline value (for a rate, a unit ending in "/s", > 1 is better than
the baseline); ``x_floor`` = value / floor value, times and sizes only (the floor is the least the
hardware allows, so x_floor >= 1 is how far off it the run is).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import platform
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from kite.bench.results import SCHEMA, attached_name, index_entry, result_from_dict, result_name, validate

from .floors import measured_cpu_limits

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
# when this run's command started (the harness is imported as a benchmark starts): a result made at
# the end of a long run is dated by its start, not by when its rows were written
STARTED_AT = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
_START_COMMIT: list[tuple[str | None, bool | None]] = []     # (commit, dirty) when the run parsed its flags


def note_start() -> None:
    """Record the commit (and whether the tree differed from it) the run starts from: a result made
    at the end of a long run names the code that ran, not a commit made meanwhile."""
    _START_COMMIT[:] = [git_commit()]
TIME_UNITS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3, "min": 6e4}


def is_rate(unit: str) -> bool:
    """A throughput (tokens/s, GB/s): more is better."""
    return unit.endswith("/s")



def dumps(envelope: dict) -> str:
    """A result file's text: the envelope a key a line (rows one field a line, so a diff reads), its
    ``raw`` section on one line (a GPU serving run's requests ran to 110,000 lines and 2.5 MB)."""
    head = json.dumps({k: v for k, v in envelope.items() if k != "raw"}, indent=1)
    if "raw" not in envelope:
        return head + "\n"
    return head[:-2] + ',\n "raw": ' + json.dumps(envelope["raw"], separators=(",", ":")) + "\n}\n"


class Result:
    """One run: its rows, everything else it recorded (``raw``), where and when it ran."""

    def __init__(self, benchmark: str, device=None, command: list[str] | None = None):
        if not re.fullmatch(r"[a-z0-9_]+", benchmark):
            raise ValueError(f"benchmark name {benchmark!r}: lower-case letters, digits and _ only")
        self.benchmark = benchmark
        self.command = " ".join(["benchmarks/" + Path(sys.argv[0]).name, *sys.argv[1:]]
                                if command is None else command)
        self.started_at = STARTED_AT
        self.commit, self.dirty = _START_COMMIT[0] if _START_COMMIT else git_commit()
        self.machine = machine(device)
        self.slug = machine_slug(self.machine)
        self.rows: list[dict] = []
        self.raw: dict = {}
        self.attached: dict[str, object] = {}

    def row(self, name: str, value: float, unit: str, baseline: str | None = None,
            baseline_value: float | None = None, floor: str | None = None, floor_value: float | None = None,
            no_floor: str | None = None, **extra) -> dict:
        """Add a row. ``baseline``: the name of an earlier row (its value is the baseline) or a
        description with ``baseline_value``. ``floor``: what the floor is (e.g. "weights read once at
        4.8 TB/s") with ``floor_value`` in the row's unit. ``no_floor``: why a time has no hardware
        floor (a process start, a loopback round trip, a wait): the row's floor text says so and its
        x_floor stays empty. ``extra`` goes into the row as it is."""
        if not unit or not isinstance(unit, str):
            raise ValueError(f"row {name!r}: no unit")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"row {name!r}: value {value!r} is not a finite number")
        if any(r["name"] == name for r in self.rows):
            raise ValueError(f"row {name!r}: a row of that name exists")
        x_base = None
        if baseline is not None:
            if baseline_value is None:
                ref = next((r for r in self.rows if r["name"] == baseline), None)
                if ref is None:
                    raise ValueError(f"row {name!r}: baseline {baseline!r} is no earlier row and has no value")
                if ref["unit"] != unit:
                    raise ValueError(f"row {name!r} ({unit}): baseline {baseline!r} is in {ref['unit']}")
                baseline_value = ref["value"]
            x_base = _ratio(value, baseline_value, name, "baseline")
        elif baseline_value is not None:
            raise ValueError(f"row {name!r}: a baseline value needs its baseline's name or description")
        x_floor = None
        if floor is not None or floor_value is not None:
            if floor is None or floor_value is None:
                raise ValueError(f"row {name!r}: a floor needs both its description and its value")
            if is_rate(unit):
                raise ValueError(f"row {name!r}: a rate ({unit}) has no floor; give the floor as a time")
            x_floor = _ratio(value, floor_value, name, "floor")
        if no_floor is not None:
            if floor is not None or floor_value is not None or not str(no_floor).strip():
                raise ValueError(f"row {name!r}: no_floor says why there is no floor; give it alone and not empty")
            floor = f"none: {no_floor}"
        r = {"name": name, "value": float(value), "unit": unit, "baseline": baseline, "x_baseline": x_base,
             "floor": floor, "x_floor": x_floor, **({"floor_value": float(floor_value)} if x_floor else {}),
             **extra}
        self.rows.append(r)
        return r

    def timing(self, name: str, t, baseline: str | None = None, baseline_value: float | None = None,
               floor: str | None = None, floor_value: float | None = None, no_floor: str | None = None,
               **extra) -> dict:
        """A row of a :class:`~.timing.Timing`: its median in ms, p10 and p90 beside it."""
        return self.row(name, t.median_ms, "ms", baseline, baseline_value, floor, floor_value, no_floor,
                        p10_ms=round(t.p10_ms, 4), p90_ms=round(t.p90_ms, 4), samples=len(t.samples_ms), **extra)

    def attach(self, name: str, data) -> None:
        """Keep ``data`` (JSON: a serving run's every request, megabytes of it) beside the result file
        rather than in it: written gzipped as ``<file's stem>.<name>.json.gz``, named in
        ``raw["attached"]``, read back with :func:`kite.bench.results.load_attached`."""
        if not re.fullmatch(r"[a-z0-9_]+", name):
            raise ValueError(f"attachment name {name!r}: lower-case letters, digits and _ only")
        self.attached[name] = data

    def to_dict(self) -> dict:
        """The envelope; where this process measured the CPU's limits (a CPU floor), ``raw["cpu_limits"]``
        holds them and how they were measured."""
        raw = self.raw
        if (cpu := measured_cpu_limits()) is not None and "cpu_limits" not in raw:
            raw = {**raw, "cpu_limits": cpu}
        return {"schema": SCHEMA, "benchmark": self.benchmark, "command": self.command, "commit": self.commit,
                "dirty": self.dirty, "commit_source": "recorded", "machine": self.machine,
                "started_at": self.started_at, "started_at_source": "recorded", "rows": self.rows,
                "raw": raw}

    def file_name(self, label: str | None = None) -> str:
        return result_name(self.benchmark, self.slug, self.started_at, self.commit, label)

    def write(self, path: Path | None = None, label: str | None = None) -> Path:
        """Write the envelope to ``path`` (default: benchmarks/results/, a ``_2``, ``_3`` ... suffix where
        a file of that name exists) and, under benchmarks/results/, its line in index.jsonl."""
        if path is None:
            RESULTS.mkdir(parents=True, exist_ok=True)
            path = RESULTS / self.file_name(label)
            n = 2
            while path.exists():
                path = RESULTS / self.file_name(f"{label}_{n}" if label else str(n))
                n += 1
        path = Path(path)
        envelope = json.loads(json.dumps(self.to_dict(), default=str))
        if self.attached:
            envelope["raw"]["attached"] = {name: attached_name(path, name) for name in self.attached}
        validate(envelope, str(path))          # the library's reader takes back what is written here
        path.parent.mkdir(parents=True, exist_ok=True)
        for name, data in self.attached.items():
            text = json.dumps(data, default=str, separators=(",", ":")).encode("utf-8")
            (path.parent / attached_name(path, name)).write_bytes(gzip.compress(text, mtime=0))
        path.write_text(dumps(envelope), encoding="utf-8")
        if path.resolve().parent == RESULTS.resolve():
            with open(RESULTS / "index.jsonl", "a", encoding="utf-8") as fh:
                fh.write(json.dumps(index_entry(result_from_dict(envelope, str(path)), path.name)) + "\n")
        return path

    def table(self) -> str:
        """Every row: value, unit, x baseline (and of what), x floor (and what the floor is)."""
        if not self.rows:
            return f"{self.benchmark}: no rows"
        w = max(len(r["name"]) for r in self.rows)
        lines = [f"{'row':<{w}}  {'value':>12} {'unit':<8} {'x base':>8} {'x floor':>8}  baseline / floor"]
        for r in self.rows:
            xb = f"{r['x_baseline']:.3g}" if r["x_baseline"] is not None else "-"
            xf = f"{r['x_floor']:.3g}" if r["x_floor"] is not None else "-"
            notes = "; ".join(x for x in (r["baseline"] and f"vs {r['baseline']}",
                                          r["floor"] and f"floor {r['floor']}") if x)
            lines.append(f"{r['name']:<{w}}  {r['value']:>12.6g} {r['unit']:<8} {xb:>8} {xf:>8}  {notes}")
        return "\n".join(lines)


def _ratio(value: float, ref: float, name: str, what: str) -> float:
    if isinstance(ref, bool) or not isinstance(ref, (int, float)) or not math.isfinite(ref) or ref <= 0:
        raise ValueError(f"row {name!r}: {what} value {ref!r} is not a positive number")
    return round(value / ref, 4)


COMMIT_ENV = "KITE_BENCH_COMMIT"   # the commit of a copied tree whose git metadata is not its own


def git_commit(root: Path = ROOT) -> tuple[str | None, bool | None]:
    """(HEAD's commit, whether the work tree differs from it); (None, None) outside a git checkout.
    ``KITE_BENCH_COMMIT`` names the commit instead, for a run on a copy of a clean tree whose ``.git``
    is not that tree's (a remote machine handed the working tree): the dirty flag is then unknown."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV].strip(), None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None, None
        st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                            capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    return head.stdout.strip(), bool(st.stdout.strip()) if st.returncode == 0 else None


def cpu_model() -> tuple[str, int]:
    """(model name from /proc/cpuinfo, or the platform's; logical cores this process may use)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return name, cores


def machine(device=None) -> dict:
    """{"name", "kind", "detail"}: the GPU (torch.cuda's name) when ``device`` is a CUDA one,
    else the CPU; the detail names the CPU, its cores and torch's version."""
    cpu, cores = cpu_model()
    detail = f"{cpu}, {cores} cores"
    try:
        import torch

        detail += f"; torch {torch.__version__}"
        if device is not None and str(device).startswith("cuda") and torch.cuda.is_available():
            name = torch.cuda.get_device_name(torch.device(device))
            detail += f"; CUDA {torch.version.cuda}"
            return {"name": name, "kind": "gpu", "detail": detail}
    except ImportError:
        pass
    return {"name": cpu, "kind": "cpu", "detail": detail}


def machine_slug(m: dict) -> str:
    """The machine in a file name: a GPU's model ("NVIDIA H200" -> "h200"), a CPU's cores ("cpu2")."""
    if m["kind"] == "cpu":
        cores = re.search(r"(\d+) cores", m["detail"])
        return f"cpu{cores.group(1) if cores else ''}"
    words = [w for w in re.split(r"[^a-z0-9]+", m["name"].lower()) if w and w not in ("nvidia", "tesla", "geforce")]
    return words[0] if words else "gpu"


def finish(result: Result, args, label: str | None = None) -> int:
    """The end of a run: print the rows (stderr when ``--json`` puts the JSON on stdout), write the file
    (``--out`` or benchmarks/results/), say where; 0."""
    as_json = getattr(args, "json", False)
    print(result.table(), file=sys.stderr if as_json else sys.stdout, flush=True)
    path = result.write(getattr(args, "out", None), label)
    print(f"result: {_shown(path)}", file=sys.stderr if as_json else sys.stdout, flush=True)
    if as_json:
        sys.stdout = getattr(args, "stdout", None) or sys.__stdout__      # parse() sent prints to stderr
        print(json.dumps(result.to_dict(), indent=1, default=str), flush=True)
    return 0


def _shown(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)
