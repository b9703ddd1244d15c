"""Write kite/tune/calibration/quality_smollm2.json from result files under benchmarks/results:
a benchmarks/quality_points.py run (one ``eval`` point per text and setting), optionally a
benchmarks/bench_points.py run (the whole state's and YOCO's points), and the GPU-bytes point of the
H200 calibration (kite/tune/calibration/h200.json's ``hot_tier_bytes``, at Qwen2-7B geometry).

    python scripts/quality_calibration.py --eval quality_points_cpu2_20261202_84cdc51.json \\
        [--bench bench_points_cpu2_....json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kite.bench.results import load_result  # noqa: E402
from kite.tune.quality_fit import QUALITY_SCHEMA, parse_quality_calibration, setting_of  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "kite" / "tune" / "calibration" / "quality_smollm2.json"
MODEL = "smollm2-135m"
# Qwen2-7B's raw bf16 KV of the H200 calibration's 16,384 tokens: 28 layers x K and V x 4 KV heads x
# head_dim 128 x 2 bytes per token
RAW_KV_16K = 28 * 2 * 4 * 128 * 2 * 16384


def _cite(result, name: str) -> dict:
    return {"result": name, "commit": result.commit, "date": result.date}


def eval_points(name: str) -> list[dict]:
    res = load_result(RESULTS / name)
    cells: dict[str, dict] = {}
    for row in res.rows:
        for suffix, field in ((": PPL delta", "ppl_delta"), (": bytes ratio", "achieved_ratio")):
            if row.name.endswith(suffix):
                run = row.name[: -len(suffix)]
                cell = cells.setdefault(run, {"setting": run.rsplit(", ", 1)[1], "method": "eval",
                                              "model": MODEL, "run": f"kite upcycle eval, {run}", "rows": {}})
                cell[field] = row.value
                cell["rows"][field] = row.name
    return [{**c, **_cite(res, name)} for c in cells.values()]


def bench_points(name: str) -> list[dict]:
    res = load_result(RESULTS / name)
    setting = setting_of(res.raw.get("config") or {})
    if setting is None:
        raise SystemExit(f"{name}: the run's config names no setting")
    by_name = {r.name: r for r in res.rows}
    out = []
    for label, method in (("the whole state", "state"), ("YOCO's loads", "fused")):
        pre = f"{res.raw['cases']} cases, {label}: "
        p = {"setting": setting, "method": method, "model": MODEL, "run": f"kite bench run, {res.raw['cases']} "
             f"cases, {label}", "rows": {}}
        for field, row in (("ppl_delta", "PPL delta"), ("achieved_ratio", "bytes ratio")):
            if pre + row in by_name:
                p[field], p["rows"][field] = by_name[pre + row].value, pre + row
        if method == "fused":
            for field, row in (("ttft_speedup", f"{pre}TTFT speedup over full prefill"),
                               ("min_hit_gain", f"{res.raw['cases']} cases: yoco_min_hit_gain")):
                if row in by_name:
                    p[field], p["rows"][field] = by_name[row].value, row
        out.append({**p, **_cite(res, name)})
    return out


def gpu_point() -> dict:
    h200 = json.loads((ROOT / "kite" / "tune" / "calibration" / "h200.json").read_text())
    f = h200["figures"]["hot_tier_bytes"]
    return {"setting": f"ratio={h200['hot_tier_ratio_of']:g}", "method": "gpu-bytes", "model": "Qwen2-7B geometry",
            "run": f"a {h200['tokens']:,}-token state as staged on the H200", "raw_kv_bytes": RAW_KV_16K,
            "state_bytes": int(f["value"]), "rows": {"state_bytes": f["row"]}, "result": f["result"],
            "commit": f["commit"], "date": f["date"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--eval", required=True, help="a quality_points result file under benchmarks/results")
    ap.add_argument("--bench", help="a bench_points result file under benchmarks/results")
    args = ap.parse_args()
    points = eval_points(args.eval) + (bench_points(args.bench) if args.bench else []) + [gpu_point()]
    obj = {"schema": QUALITY_SCHEMA, "model": MODEL,
           "workload": "the embedded SmolLM2-135M on a CPU: kite upcycle eval (2,048 context tokens, or what the "
                       "text leaves, + 512 scored) on GPL-3, Apache-2.0 and a generated contract"
                       + ("; kite bench run on the bundled cases" if args.bench else "")
                       + "; the GPU-bytes point at Qwen2-7B geometry on the H200",
           "points": points}
    parse_quality_calibration(obj, str(OUT))        # what is written loads
    OUT.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{OUT.relative_to(ROOT)}: {len(points)} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
