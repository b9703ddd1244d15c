"""`run_tune`: a sweep. Each point is one `kite.bench.runner.run_bench` call (full prefill and the
fused pipeline on the same cases), sharing what does not change between points:

* the loaded model, the tagger and full prefill's answer to every case (`kite.bench.reuse`):
  full prefill is the reference and depends on no tuned parameter, so it runs once per case;
* every state already made at the same compression settings (`kite.bench.states.ensure_state`
  in one states folder): points that differ only in request parameters (the minimum gain, a
  rule's threshold) reuse the states of the points before them, and states of earlier sweeps or
  `kite bench run`s at the same settings are reused too.

The time each reuse saved is the time the same work took when it was done (`reuse` in the
results). The results file is rewritten after every point; `--resume` reads the points it holds.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kite.errors import BadInput
from kite.tune.constraints import Constraint
from kite.tune.objective import Objective, figures_of
from kite.tune.results import FORMAT, file_sha256, finished_points, point_id, read_results, write_results
from kite.tune.space import BUDGET, Range

Progress = Callable[[str, int, int], None]


@dataclass
class TuneSettings:
    cases: str
    output: str  # best_config.yaml
    results: str  # the results JSON
    workdir: str  # per-point bench results and the configs written for points
    ranges: list[Range]
    objectives: list[Objective]
    constraints: list[Constraint] = field(default_factory=list)
    plot: str | None = None
    search: str = "grid"
    trials: int | None = None
    seed: int = 0
    resume: bool = False
    reuse: bool = True  # False: each point loads the model, prefills and makes its states afresh
    model: str | None = None
    upcycle_dir: str = "bench-states"  # the states folder (shared with `kite bench run`)
    rules: str | None = None
    upcycle_config: str | None = None
    families: list[str] | None = None
    per_family: int | None = None
    max_cases: int | None = None
    max_new_tokens: int = 32
    device: str | None = None
    kept_fraction: float | None = None  # the KITE config's features.upcycle_compression_ratio
    min_hit_gain: float | None = None  # the KITE config's features.yoco_min_hit_gain
    record_history: bool = True  # each point is a bench run: recorded in `kite bench history`
    ray: bool = False  # measure a grid's points at once on Ray's workers (kite.tune.on_ray)
    ray_address: str | None = None  # an existing Ray cluster (None: a local head on 127.0.0.1)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class Sweep:
    """The state of one sweep: its points so far, the reuse ledger, the results document."""

    def __init__(self, s: TuneSettings, context: dict, base_values: dict):
        self.s = s
        self.points: dict[str, dict] = {}
        self.state_cost_ms: dict[str, float] = {}  # state file → what making it took (this sweep)
        self.ledger = {"model_loads": 0, "model_load_first_s": 0.0, "references": 0, "reference_s": 0.0,
                       "prefills": 0, "prefill_s": 0.0, "states_made": 0, "state_build_s": 0.0,
                       "states_reused": 0, "state_reused_s": 0.0, "states_reused_unknown": 0}
        self.doc = {"kite_tune": FORMAT, "started_at": _now(), "finished_at": None, "complete": False,
                    "interrupted": False, "error": None, "context": context, "base": base_values,
                    "settings": {k: v for k, v in asdict(s).items() if k not in ("ranges", "objectives", "constraints")},
                    "space": [r.to_dict() for r in s.ranges], "search": {"kind": s.search, "trials": s.trials,
                                                                         "seed": s.seed},
                    "objectives": [o.to_dict() for o in s.objectives],
                    "constraints": [c.text for c in s.constraints], "points": [], "skipped": [],
                    "reuse": self.ledger, "wall_s": 0.0}
        self.t0 = time.perf_counter()

    def add(self, record: dict) -> None:
        self.points[record["id"]] = record
        self.doc["points"].append(record)

    def account(self, bench: dict) -> dict:
        """What this point's bench run reused, and made, with the time it stands for."""
        led = self.ledger
        r = bench.get("reuse") or {}
        if r.get("model"):
            led["model_loads"] += 1
            led["model_load_first_s"] = r["model_load_ms"] / 1e3
        led["references"] += r.get("references", 0)
        led["reference_s"] += r.get("reference_ms", 0.0) / 1e3
        led["prefills"] += r.get("prefills", 0)
        led["prefill_s"] += r.get("prefill_ms", 0.0) / 1e3
        states = {row["state"]["file"]: row["state"] for row in bench.get("cases", [])}
        made = reused = 0
        for name, st in states.items():
            if st["reused"]:
                reused += 1
                led["states_reused"] += 1
                if name in self.state_cost_ms:
                    led["state_reused_s"] += self.state_cost_ms[name] / 1e3
                else:
                    led["states_reused_unknown"] += 1
            else:
                made += 1
                led["states_made"] += 1
                led["state_build_s"] += st["build_ms"] / 1e3
                self.state_cost_ms[name] = st["build_ms"]
        for k, v in led.items():
            if isinstance(v, float):
                led[k] = round(v, 2)
        # A model load is counted, not timed: the first one (the only one measured) also pays the
        # process's one-time imports and caches, which a second load would not.
        led["saved_s"] = round(led["reference_s"] + led["prefill_s"] + led["state_reused_s"], 2)
        return {"states_made": made, "states_reused": reused, "reuse": r}

    def write(self) -> None:
        from kite.tune.judge import judge

        self.doc["wall_s"] = round(time.perf_counter() - self.t0, 1)
        self.doc["finished_at"] = _now()
        judge(self.doc, self.s.objectives, self.s.constraints)
        write_results(self.s.results, self.doc)


def context_of(s: TuneSettings, rules_path: Path, cfg_path: Path | None) -> dict:
    """The conditions a point's figures depend on besides its parameters (see kite.tune.results)."""
    return {"cases": str(Path(s.cases).resolve()), "cases_sha256": file_sha256(s.cases),
            "model": s.model, "families": s.families, "per_family": s.per_family, "max_cases": s.max_cases,
            "max_new_tokens": s.max_new_tokens, "device": s.device,
            "rules_sha256": file_sha256(rules_path), "upcycle_config_sha256": file_sha256(cfg_path),
            "kept_fraction": s.kept_fraction, "min_hit_gain": s.min_hit_gain}


def run_tune(s: TuneSettings, progress: Progress | None = None) -> dict:
    """Run the sweep; returns the results document (also written to `s.results`), judged: each
    point's feasibility and broken constraints, the best point, the Pareto front.

    Everything the input can get wrong is checked before the first point. A point's bench run
    failing, or Ctrl-C, still writes the points finished (`error` / `interrupted`) and re-raises."""
    from kite.bench.cases import load_cases
    from kite.bench.reuse import BenchReuse
    from kite.bench.runner import BenchSettings, run_bench
    from kite.config import DEFAULT_MIN_HIT_GAIN
    from kite.tune.search import make_search
    from kite.upcycle import compress_settings, load_upcycle_config
    from kite.yoco.rules import default_rules_path, load_rules

    load_cases(s.cases, s.families, s.per_family)
    cfg, cfg_path = load_upcycle_config(s.upcycle_config)
    rules_path = Path(s.rules) if s.rules else default_rules_path()
    load_rules(rules_path)
    base_values = {"min_span_tokens": cfg.compression.min_span_tokens,
                   "max_span_tokens": cfg.compression.max_span_tokens}
    search = make_search(s.search, s.ranges, s.objectives, s.trials, s.seed, base_values)
    _check_points(s, cfg, search)
    compress_settings(cfg, kept_fraction=s.kept_fraction)
    context = context_of(s, rules_path, cfg_path)
    finished: dict[str, dict] = {}
    if s.resume:
        finished = finished_points(read_results(s.results), context, s.results)
    workdir = Path(s.workdir)
    sweep = Sweep(s, context, base_values)
    for point, why in getattr(search, "skipped", []):
        sweep.doc["skipped"].append({"params": point, "why": why})
    done = 0
    if hasattr(search, "add_known"):  # Optuna: the points read back count among its trials
        for rec in finished.values():
            if search.add_known(rec["params"], _values(rec["figures"], s.objectives),
                                [c.violation(rec["figures"]) for c in s.constraints]):
                sweep.add({**rec, "status": "resumed"})
                done += 1
    reuse = BenchReuse() if s.reuse else None
    record = _history_recorder() if s.record_history else None
    base = BenchSettings(cases=s.cases, output="", model=s.model, upcycle_dir=s.upcycle_dir, rules=str(rules_path),
                         upcycle_config=s.upcycle_config, baselines=["full"], families=s.families,
                         per_family=s.per_family, max_cases=s.max_cases, max_new_tokens=s.max_new_tokens,
                         kept_fraction=s.kept_fraction,
                         min_hit_gain=DEFAULT_MIN_HIT_GAIN if s.min_hit_gain is None else s.min_hit_gain,
                         device=s.device)
    total = search.total
    measure_with = run_bench
    if s.ray:
        measure_with = _measured_on_ray(s, search, finished, base, cfg, cfg_path, rules_path, workdir, record,
                                        progress)
    if progress:
        progress(_stage(sweep, s), 0, total)
    try:
        for params in search:
            pid = point_id(params)
            if pid in sweep.points:  # Optuna proposed it again: the same figures
                rec = sweep.points[pid]
                rec["proposed"] = rec.get("proposed", 1) + 1
            elif pid in finished:
                rec = {**finished[pid], "status": "resumed"}
                sweep.add(rec)
            else:
                rec = _measure(s, sweep, params, pid, base, cfg, cfg_path, rules_path, workdir, reuse, record,
                               progress, measure_with)
                sweep.add(rec)
            search.tell(params, _values(rec["figures"], s.objectives),
                        [c.violation(rec["figures"]) for c in s.constraints])
            done += 1
            sweep.write()
            if progress:
                progress(_stage(sweep, s), done, total)
    except KeyboardInterrupt:
        sweep.doc["interrupted"] = True
        sweep.doc["error"] = "interrupted (Ctrl-C)"
        sweep.write()
        raise
    except Exception as exc:
        sweep.doc["error"] = f"{type(exc).__name__}: {exc}"
        sweep.write()
        raise
    for point, why in getattr(search, "skipped", [])[len(sweep.doc["skipped"]):]:
        sweep.doc["skipped"].append({"params": point, "why": why})
    sweep.doc["complete"] = True
    sweep.write()
    return sweep.doc


def _measured_on_ray(s, search, finished, base, cfg, cfg_path, rules_path, workdir, record, progress):
    """Measure every point of the grid not finished yet on Ray; a run_bench stand-in that hands
    each point's result to `_measure` (and records it as run_bench would)."""
    from kite.tune.on_ray import measure_grid_ray
    from kite.tune.point import bench_settings

    if s.search != "grid":
        raise BadInput("--ray measures a grid's points at once; --search optuna proposes each point from "
                       "the ones before it")
    (workdir / "points").mkdir(parents=True, exist_ok=True)
    todo = [(point_id(p), p) for p in search if point_id(p) not in finished]

    def settings_of(pid, params):
        return bench_settings(base, params, cfg, cfg_path, rules_path, workdir, workdir / "points" / f"{pid}.json")

    results = measure_grid_ray(todo, settings_of, address=s.ray_address, progress=progress)
    by_output = {str(settings_of(pid, p).output): results[pid] for pid, p in todo}

    def measured(bs, progress=None, record=None, reuse=None):
        result = by_output[str(bs.output)]
        if record is not None:
            record(result)
        return result

    return measured


def _measure(s, sweep, params, pid, base, cfg, cfg_path, rules_path, workdir, reuse, record, progress,
             run_bench) -> dict:
    """Run one point's bench; its record."""
    import tempfile

    from kite.tune.point import bench_settings

    bs = bench_settings(base, params, cfg, cfg_path, rules_path, workdir, workdir / "points" / f"{pid}.json")
    (workdir / "points").mkdir(parents=True, exist_ok=True)
    fresh = None
    if reuse is None:  # every point as if alone: its own states folder, its own model load
        fresh = tempfile.TemporaryDirectory(prefix="kite-tune-states-")
        bs.upcycle_dir = fresh.name
    t0 = time.perf_counter()
    try:
        bench = run_bench(bs, progress, record=record, reuse=reuse)
    finally:
        if fresh is not None:
            fresh.cleanup()
    made = sweep.account(bench)
    subject = "budget" if BUDGET in params else "fused"
    return {"id": pid, "params": params, "status": "measured", "figures": figures_of(bench, subject),
            "method": subject,
            "wall_s": round(time.perf_counter() - t0, 2), "bench_output": bs.output,
            "upcycle_config": bs.upcycle_config, "rules": bs.rules, "ratio": bs.ratio,
            "cases": len(bench.get("cases", [])), **made}


def _values(figures: dict, objectives: list[Objective]) -> list[float] | None:
    vals = [figures.get(o.name) for o in objectives]
    return None if any(v is None for v in vals) else [float(v) for v in vals]


def _stage(sweep: Sweep, s: TuneSettings) -> str:
    """`points · best qps 3.21` (the best feasible point so far), for the progress bar."""
    from kite.tune.judge import best_point

    obj = s.objectives[0]
    best = best_point(list(sweep.points.values()), s.objectives, s.constraints)
    if best is None:
        return "points" + (" · none feasible yet" if sweep.points else "")
    return f"points · best {obj.name} {best['figures'][obj.name]:.4g}"


def _history_recorder():
    from kite.bench.history import append_run, record_of

    return lambda result: append_run(record_of(result, result["config"]["output"]))


def _check_points(s: TuneSettings, cfg, search) -> None:
    """Every value a point may take makes valid compression settings (before anything slow)."""
    from kite.upcycle import compress_settings

    for r in s.ranges:
        if r.name in ("ratio", "upcycle_compression_ratio") and r.values:
            for v in r.values:
                compress_settings(cfg, ratio=float(v) if r.name == "ratio" else 1 / float(v))
        if r.name == "precision":
            for v in r.values:
                compress_settings(cfg, precision=v)
    if search.total < 1:
        raise BadInput("the sweep has no point to run")
