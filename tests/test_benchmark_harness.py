"""benchmarks/harness: the one timer, the flag base, the floors read from the library's GPU table,
the result envelope and its index line; and, read statically, that no script under benchmarks/
keeps its own flag parser, timer or hardware limits, or imports the test suite."""

from __future__ import annotations

import ast
import json
import math
import re
import time
from pathlib import Path

import pytest

from benchmarks.harness import flags, floors, results, timing
from kite.bench import results as lib_results
from kite.tune.gpus import gpu_spec

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


# ---------------------------------------------------------------- timing

def test_the_cpu_timer_gives_the_median_and_spread_of_every_call_after_the_warmup():
    calls = []

    def work():
        calls.append(1)
        time.sleep(0.002 if len(calls) % 2 else 0.006)

    t = timing.time_ms(work, repeat=5, warmup=2)
    assert len(calls) == 7 and len(t.samples_ms) == 5
    assert t.p10_ms <= t.median_ms <= t.p90_ms
    assert 1.5 < min(t.samples_ms) and max(t.samples_ms) < 200
    assert t.median_ms == sorted(t.samples_ms)[2]


def test_quantiles_interpolate_between_samples_and_an_empty_run_is_refused():
    t = timing.Timing.of([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (t.median_ms, t.p10_ms, t.p90_ms) == (3.0, 1.4, 4.6)
    with pytest.raises(ValueError, match="no samples"):
        timing.Timing.of([])
    with pytest.raises(ValueError, match="repeat"):
        timing.time_ms(lambda: None, repeat=0)


def test_a_wall_span_holds_the_time_of_its_block():
    with timing.wall() as w:
        time.sleep(0.01)
    assert 9 <= w.ms < 500 and w.s == pytest.approx(w.ms / 1e3)


# ---------------------------------------------------------------- floors

def test_floors_are_the_gpu_tables_limits():
    spec = gpu_spec("H200")
    lim = floors.gpu_limits("H200")
    assert lim.hbm_bytes_per_s == spec.hbm_tbps * 1e12 and lim.bf16_flops == spec.bf16_tflops * 1e12
    assert lim.host_link_bytes_per_s == spec.host_link_gbps * 1e9 and lim.source.endswith(spec.source)
    assert floors.bytes_ms(spec.hbm_tbps * 1e12) == pytest.approx(1e3)              # a second's worth: 1 s
    assert floors.flops_ms(2 * spec.bf16_tflops * 1e12) == pytest.approx(2e3)
    assert floors.host_link_ms(spec.host_link_gbps * 1e9 / 1e3) == pytest.approx(1.0)
    assert floors.bytes_ms(0) == 0.0


def test_a_floor_of_negative_work_or_of_an_unknown_gpu_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        floors.bytes_ms(-1)
    with pytest.raises(Exception, match="not in the GPU table"):
        floors.gpu_limits("NO-SUCH-GPU")


def test_a_torch_device_name_maps_to_the_tables_name():
    assert floors.gpu_name("NVIDIA H200") == "H200"
    assert floors.gpu_name("NVIDIA H100 80GB HBM3") == "H100-80G"
    assert floors.gpu_name(None) == floors.DEFAULT_GPU


# ---------------------------------------------------------------- rows

def test_rows_carry_their_ratio_to_the_baseline_and_to_the_floor():
    res = results.Result("unit_bench", device="cpu", command=["benchmarks/unit_bench.py"])
    base = res.row("prefill", 800.0, "ms", floor="FLOPs at the bf16 rate", floor_value=200.0)
    assert base["x_floor"] == 4.0 and base["x_baseline"] is None and base["floor_value"] == 200.0
    load = res.row("load", 40.0, "ms", baseline="prefill", floor="bytes at HBM", floor_value=10.0)
    assert load["x_baseline"] == 0.05 and load["x_floor"] == 4.0
    fast = res.row("decode, lanes", 2100.0, "tokens/s", baseline="decode, raw", baseline_value=1000.0)
    assert fast["x_baseline"] == 2.1 and fast["floor"] is None and fast["x_floor"] is None
    t = timing.Timing.of([1.0, 2.0, 3.0])
    row = res.timing("step", t, baseline="load")
    assert row["value"] == 2.0 and row["p10_ms"] == 1.2 and row["samples"] == 3 and row["x_baseline"] == 0.05
    table = res.table()
    assert "x base" in table and "x floor" in table
    assert re.search(r"load\s+40 ms\s+0.05\s+4\s+vs prefill; floor bytes at HBM", table)


@pytest.mark.parametrize("kwargs, error", [
    (dict(value=1.0, unit=""), "no unit"),
    (dict(value=1.0, unit=None), "no unit"),
    (dict(value=float("nan"), unit="ms"), "not a finite number"),
    (dict(value="12", unit="ms"), "not a finite number"),
    (dict(value=1.0, unit="ms", baseline="missing"), "no earlier row"),
    (dict(value=1.0, unit="ms", baseline_value=2.0), "needs its baseline"),
    (dict(value=1.0, unit="ms", baseline="x", baseline_value=0.0), "not a positive number"),
    (dict(value=1.0, unit="ms", floor="bytes at HBM"), "both its description and its value"),
    (dict(value=1.0, unit="ms", floor_value=1.0), "both its description and its value"),
    (dict(value=1.0, unit="tokens/s", floor="peak", floor_value=3.0), "has no floor"),
    (dict(value=1.0, unit="s", baseline="first"), "is in ms"),
])
def test_a_bad_row_is_refused_with_what_is_wrong(kwargs, error):
    res = results.Result("unit_bench", device="cpu", command=[])
    res.row("first", 1.0, "ms")
    with pytest.raises(ValueError, match=error):
        res.row("second", **kwargs)
    assert [r["name"] for r in res.rows] == ["first"]


def test_two_rows_of_one_name_and_a_bad_benchmark_name_are_refused():
    res = results.Result("unit_bench", device="cpu", command=[])
    res.row("a", 1.0, "ms")
    with pytest.raises(ValueError, match="exists"):
        res.row("a", 2.0, "ms")
    with pytest.raises(ValueError, match="lower-case"):
        results.Result("Unit Bench", device="cpu")


# ---------------------------------------------------------------- the envelope

def test_a_result_made_at_the_end_of_a_run_is_dated_by_the_run_s_start(monkeypatch):
    """A benchmark makes its Result after minutes of work: ``started_at`` is when the command started
    (the harness's import), not when the rows were written."""
    monkeypatch.setattr(results, "STARTED_AT", "2026-01-02T03:04:05Z")
    assert results.Result("unit_bench", device="cpu", command=["x"]).started_at == "2026-01-02T03:04:05Z"


def test_a_result_names_the_commit_its_run_started_from(monkeypatch):
    """A commit made while a long run goes on is not the code that ran: the result names the commit
    the run's flags were parsed at."""
    calls = iter([("a" * 40, False), ("b" * 40, True)])
    monkeypatch.setattr(results, "git_commit", lambda: next(calls))
    monkeypatch.setattr(results, "_START_COMMIT", [])
    flags.parse(flags.parser("A unit benchmark."), [])
    assert results.Result("unit_bench", device="cpu", command=["x"]).commit == "a" * 40


def test_the_envelope_names_its_commit_machine_and_start_and_the_index_gets_its_line(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    res = results.Result("unit_bench", device="cpu", command=["benchmarks/unit_bench.py", "--tiny"])
    res.row("step", 2.5, "ms", floor="bytes at HBM", floor_value=0.5)
    res.raw["settings"] = {"tiny": True}
    path = res.write()
    env = json.loads(path.read_text())
    assert env["schema"] == "kite.bench.result/1" and env["benchmark"] == "unit_bench"
    assert env["command"] == "benchmarks/unit_bench.py --tiny"
    assert re.fullmatch(r"[0-9a-f]{40}", env["commit"]) and isinstance(env["dirty"], bool)
    assert env["commit_source"] == "recorded" and env["started_at_source"] == "recorded"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", env["started_at"])
    assert env["machine"]["kind"] == "cpu" and env["machine"]["name"]
    assert re.search(r"\d+ cores", env["machine"]["detail"])
    assert env["rows"][0]["x_floor"] == 5.0 and env["raw"] == {"settings": {"tiny": True}}
    day = env["started_at"][:10].replace("-", "")
    assert path.name == f"unit_bench_{res.slug}_{day}_{env['commit'][:7]}.json" and res.slug.startswith("cpu")
    again = res.write()                                  # a second run of the same day and commit
    assert again.name == path.name.replace(".json", "_2.json")
    lines = [json.loads(x) for x in (tmp_path / "index.jsonl").read_text().splitlines()]
    assert lines == [{"file": p.name, "benchmark": "unit_bench", "machine": env["machine"]["name"],
                      "started_at": env["started_at"], "commit": env["commit"]} for p in (path, again)]


def test_an_out_path_elsewhere_gets_the_envelope_and_no_index_line(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path / "results")
    res = results.Result("unit_bench", device="cpu", command=[])
    res.row("step", 1.0, "ms")
    out = res.write(tmp_path / "elsewhere" / "r.json")
    assert json.loads(out.read_text())["rows"][0]["value"] == 1.0
    assert not (tmp_path / "results" / "index.jsonl").exists()


def test_a_result_file_keeps_its_rows_a_field_a_line_and_its_raw_section_on_one(tmp_path):
    res = results.Result("unit_bench", device="cpu", command=[])
    res.row("step", 1.0, "ms")
    res.raw["requests"] = [{"ttft_ms": 1.5, "text": "é \" x"} for _ in range(1000)]
    out = res.write(tmp_path / "r.json")
    text = out.read_text()
    assert json.loads(text) == json.loads(json.dumps(res.to_dict(), default=str))
    raw_lines = [line for line in text.splitlines() if line.startswith(' "raw": ')]
    assert len(raw_lines) == 1 and text.count("\n") < 60
    assert '   "value": 1.0,' in text           # the rows as before, a field a line


def test_bulky_data_is_attached_beside_the_result_file_and_reads_back(tmp_path):
    res = results.Result("unit_bench", device="cpu", command=[])
    res.row("step", 1.0, "ms")
    recs = {"raw": {"4": [{"times_s": [0.1 * i for i in range(64)], "status": "ok"} for _ in range(500)]}}
    res.attach("records", recs)
    out = res.write(tmp_path / "r.json")
    side = tmp_path / "r.records.json.gz"
    assert side.exists() and side.stat().st_size < len(json.dumps(recs)) / 5     # gzipped
    assert "times_s" not in out.read_text()                                          # not in the envelope
    back = lib_results.load_result(out)
    assert back.raw["attached"] == {"records": "r.records.json.gz"}
    assert lib_results.load_attached(back, "records") == json.loads(json.dumps(recs))
    with pytest.raises(lib_results.BadResult, match="no attachment 'times'"):
        lib_results.load_attached(back, "times")
    side.write_bytes(b"not gzip")
    with pytest.raises(lib_results.BadResult, match="not a gzipped JSON attachment"):
        lib_results.load_attached(back, "records")
    side.unlink()
    with pytest.raises(lib_results.BadResult, match="no such attachment file"):
        lib_results.load_attached(back, "records")
    with pytest.raises(ValueError, match="attachment name"):
        res.attach("Records!", {})
    assert [e["file"] for e in lib_results.build_index(tmp_path)] == ["r.json"]    # the index lists results alone


def test_gpu_machines_are_named_by_their_model():
    assert results.machine_slug({"name": "NVIDIA H200", "kind": "gpu", "detail": ""}) == "h200"
    assert results.machine_slug({"name": "AMD EPYC", "kind": "cpu", "detail": "AMD EPYC, 2 cores"}) == "cpu2"


# ---------------------------------------------------------------- flags and the end of a run

def test_the_flag_base_has_the_common_flags_and_finish_prints_the_envelope_alone_with_json(tmp_path, capsys):
    ap = flags.parser("A unit benchmark.\n\nMore words.", timing=True, repeat=7)
    ap.add_argument("--size", type=int, default=3)
    args = flags.parse(ap, ["--out", str(tmp_path / "r.json"), "--json", "--device", "cpu", "--seed", "5"])
    assert (args.repeat, args.warmup, args.seed, args.size, args.device) == (7, 3, 5, 3, "cpu")
    print("the script's own line")
    res = results.Result("unit_bench", device=args.device, command=[])
    res.row("step", 1.0, "ms")
    assert results.finish(res, args) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["rows"][0]["name"] == "step"           # stdout: the JSON alone
    assert "the script's own line" in out.err and "x floor" in out.err
    assert json.loads((tmp_path / "r.json").read_text())["benchmark"] == "unit_bench"
    with pytest.raises(SystemExit):
        flags.parse(flags.parser("x", timing=True), ["--repeat", "0"])
    assert not hasattr(flags.parse(flags.parser("x"), []), "repeat")


# ---------------------------------------------------------------- the scripts, statically

LIMIT_NAME = re.compile(r"(HBM|PCIE|NVLINK|FLOPS|TFLOP|BPS|BANDWIDTH|PEAK|GBPS|TBPS)", re.I)
CLOCKS = {"perf_counter", "perf_counter_ns", "time", "time_ns"}   # (monotonic: deadlines, not timers)


def _scripts() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*.py") if "harness" not in p.relative_to(BENCH).parts)


def _numeric(node) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, (ast.Tuple, ast.List)):
        return any(_numeric(e) for e in node.elts)
    return isinstance(node, (ast.BinOp, ast.UnaryOp)) and all(
        _numeric(n) for n in ast.walk(node) if isinstance(n, ast.Constant))


def violations(path: Path) -> list[str]:
    """What a script keeps that the harness owns: its own ArgumentParser, a clock or CUDA timing
    events, module-level hardware limits, an import of the test suite."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [f"imports {a.name}" for a in node.names if a.name.split(".")[0] == "tests"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tests":
            out.append(f"imports from {node.module}")
        elif isinstance(node, ast.ImportFrom) and node.module == "time":
            out += [f"imports time.{a.name}" for a in node.names if a.name in CLOCKS]
        elif isinstance(node, ast.Attribute):
            if node.attr == "ArgumentParser":
                out.append(f"line {node.lineno}: its own argparse.ArgumentParser")
            elif node.attr in CLOCKS and isinstance(node.value, ast.Name) and node.value.id == "time":
                out.append(f"line {node.lineno}: its own clock (time.{node.attr})")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name == "Event" and any(k.arg == "enable_timing" for k in node.keywords):
                out.append(f"line {node.lineno}: its own CUDA timing events")
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        if any(LIMIT_NAME.search(n) for n in names) and node.value is not None and _numeric(node.value):
            out.append(f"line {node.lineno}: hardware limits of its own ({', '.join(names)})")
    return out


def test_no_script_keeps_its_own_flags_timer_or_hardware_limits_nor_imports_the_tests():
    scripts = _scripts()
    assert len(scripts) > 20
    found = {str(p.relative_to(ROOT)): v for p in scripts if (v := violations(p))}
    assert found == {}


def test_the_static_check_finds_each_thing_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import argparse\nimport time\nimport torch\nfrom tests.tiny_models import CORPUS\n"
                   "HBM_BPS, PCIE_BPS = 4.8e12, 55e9\nPEAK_TFLOPS = 989.5\n"
                   "ap = argparse.ArgumentParser()\nt = time.perf_counter()\n"
                   "e = torch.cuda.Event(enable_timing=True)\n")
    found = violations(bad)
    assert len(found) == 6, found
    for what in ("tests.tiny_models", "ArgumentParser", "time.perf_counter", "CUDA timing events",
                 "HBM_BPS", "PEAK_TFLOPS"):
        assert any(what in f for f in found), (what, found)
    good = tmp_path / "good.py"
    good.write_text("from harness import clock, parser\nGROUP = 256\nHBM = 'bytes moved once'\n"
                    "e = torch.cuda.Event()\nt = clock()\n")
    assert violations(good) == []


TIME_UNITS = {"ns", "us", "ms", "s", "min"}
# Scripts that time something and have no hardware floor for any of it; each with why. Empty: every
# timing script states a floor for its main rows (a row with none says why, through no_floor).
NO_FLOOR: dict[str, str] = {
    # its rows are training stages as train_upcycle reports them (forwards, backwards, codec fits and
    # Python work in one figure, none counted): no one hardware bound; each row says so (no_floor)
    "train_gpu.py": "training stages: no one bound",
}


def times(tree: ast.AST) -> bool:
    """Whether a script records a time: it calls the harness's timer (time_ms, .timing) or adds a row
    whose unit (third argument or ``unit=``) is a time unit."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if name in ("time_ms", "timing"):
            return True
        if name == "row":
            unit = node.args[2] if len(node.args) > 2 else next(
                (k.value for k in node.keywords if k.arg == "unit"), None)
            if isinstance(unit, ast.Constant) and unit.value in TIME_UNITS:
                return True
    return False


def passes_a_floor(tree: ast.AST) -> bool:
    """Whether a script gives some row a floor: a ``floor_value=`` argument or a "floor_value" key."""
    return any(isinstance(n, ast.keyword) and n.arg == "floor_value" or
               isinstance(n, ast.Constant) and n.value == "floor_value" for n in ast.walk(tree))


def test_every_script_that_times_gives_its_rows_a_floor():
    missing = []
    for path in _scripts():
        tree = ast.parse(path.read_text(), filename=str(path))
        if times(tree) and not passes_a_floor(tree) and path.name not in NO_FLOOR:
            missing.append(str(path.relative_to(ROOT)))
    assert missing == []
    assert all(why.strip() for why in NO_FLOOR.values())


def test_the_floor_check_tells_a_timing_script_without_a_floor(tmp_path):
    cases = {"res.timing('step', time_ms(f))\n": (True, False),
             "res.row('load', 3.0, 'ms', floor='bytes', floor_value=1.0)\n": (True, True),
             "res.row('load', 3.0, unit='s', **{'floor': 'x', 'floor_value': 1.0})\n": (True, True),
             "res.row('PPL', 3.0, 'PPL')\nt = clock()\n": (False, False)}
    for src, (timed, floored) in cases.items():
        tree = ast.parse(src)
        assert (times(tree), passes_a_floor(tree)) == (timed, floored), src


def test_no_test_imports_a_benchmark_script():
    imported = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            imported += [f"{path.name}: {m}" for m in mods
                         if m.split(".")[0] == "benchmarks" and m.split(".")[:2] != ["benchmarks", "harness"]]
    assert imported == []


def test_the_cpu_limits_are_measured_once_positive_and_recorded_in_the_result(monkeypatch):
    monkeypatch.setattr(floors, "_CPU", None)
    calls = []
    measure = floors._measure_cpu
    monkeypatch.setattr(floors, "_measure_cpu", lambda: calls.append(1) or measure())
    assert floors.measured_cpu_limits() is None
    res = results.Result("unit_bench", device="cpu", command=[])
    res.row("step", 1.0, "ms")
    assert "cpu_limits" not in res.to_dict()["raw"]          # nothing measured, nothing recorded
    lim = floors.cpu_limits()
    assert floors.cpu_limits() is lim and calls == [1]       # once per process
    assert lim.bytes_per_s > 1e8 and lim.fp32_flops > 1e8 and lim.threads >= 1
    assert math.isfinite(lim.bytes_per_s) and math.isfinite(lim.fp32_flops)
    for source in (lim.bytes_source, lim.flops_source):
        assert source.startswith("measured: ") and re.search(r"best of \d", source)
        assert re.search(r"\d{4}-\d\d-\d\d on ", source) and results.cpu_model()[0] in source
    assert "256 MiB" in lim.bytes_source and "2048 x 2048 fp32 matmul" in lim.flops_source
    assert floors.cpu_bytes_ms(lim.bytes_per_s) == pytest.approx(1e3)
    assert floors.cpu_flops_ms(2 * lim.fp32_flops) == pytest.approx(2e3)
    with pytest.raises(ValueError, match=">= 0"):
        floors.cpu_bytes_ms(-1)
    raw = res.to_dict()["raw"]["cpu_limits"]                  # a run that used a CPU floor says what it was
    assert raw == lim.to_dict() and raw["bytes_source"] == lim.bytes_source


def test_a_cpu_floor_is_the_larger_of_bytes_and_flops_and_says_which(monkeypatch):
    lim = floors.CpuLimits(10e9, 100e9, "measured: test", "measured: test", 2)
    monkeypatch.setattr(floors, "_CPU", lim)
    text, ms = floors.cpu_floor(1e9, 1e9, "weights read once", "2 x params FLOPs")
    assert ms == pytest.approx(100.0) and text.startswith("weights read once at 10 GB/s") and "above its FLOPs" in text
    text, ms = floors.cpu_floor(1e6, 1e12, "weights read once", "2 x params FLOPs")
    assert ms == pytest.approx(1e4) and text.startswith("2 x params FLOPs at 100 GFLOP/s")


def test_a_forward_floor_reads_the_weights_and_kv_of_the_model(monkeypatch):
    import torch

    from kite.model.geometry import Geometry

    monkeypatch.setattr(floors, "_CPU", floors.CpuLimits(1e9, 1e15, "m", "m", 1))
    model = torch.nn.Linear(1000, 1000, bias=False)                            # 4 MB of fp32 weights
    lm = type("LM", (), {"model": model, "geometry": Geometry("x", "llama", 2, 4, 2, 8, 32, 100, 512)})()
    text, ms = floors.cpu_forward_floor(lm, 1, kv_tokens=100)
    kv = 2 * 2 * 2 * 8 * 4 * 100                                              # K+V, layers, heads, dim, fp32
    assert ms == pytest.approx((4e6 + kv) / 1e9 * 1e3) and "weights (4 MB)" in text and "KV of 100 tokens" in text


def test_a_row_without_a_floor_says_why_and_has_no_ratio():
    res = results.Result("unit_bench", device="cpu", command=[])
    row = res.row("process start", 900.0, "ms", no_floor="a process start: no hardware bound")
    assert row["floor"] == "none: a process start: no hardware bound" and row["x_floor"] is None
    with pytest.raises(ValueError, match="no_floor"):
        res.row("wait", 1.0, "ms", no_floor="a wait", floor="x", floor_value=1.0)
    with pytest.raises(ValueError, match="no_floor"):
        res.row("wait 2", 1.0, "ms", no_floor=" ")


def test_a_named_commit_stands_for_a_copied_tree_whose_git_is_not_its_own(monkeypatch):
    monkeypatch.setenv(results.COMMIT_ENV, "d725280" + "0" * 33)
    assert results.git_commit() == ("d725280" + "0" * 33, None)
    monkeypatch.delenv(results.COMMIT_ENV)
    commit, _ = results.git_commit()
    assert commit is None or re.fullmatch(r"[0-9a-f]{40}", commit)


def test_what_the_writer_writes_the_library_reads_back(tmp_path):
    from kite.bench.results import load_result

    res = results.Result("demo_bench", device="cpu")
    res.row("base", 10.0, "ms")
    res.row("new", 2.5, "ms", baseline="base", floor="bytes at 1 GB/s", floor_value=1.0)
    back = load_result(res.write(tmp_path / "r.json"))
    assert back.row("new").x_baseline == 0.25 and back.row("new").x_floor == 2.5
    assert back.benchmark == "demo_bench" and back.machine["kind"] == "cpu"
