"""The bench's whole-state and YOCO figures on the embedded model, as one result file.

Runs `kite bench run` (the product's command: the bundled cases, configs/bench_cases.jsonl, full
prefill as the reference) with --baselines state, one torch thread, a fresh $KITE_HOME (the run's
history line stays out of the user's), and writes its overall figures as rows: PPL delta and bytes
ratio of the whole state and of YOCO's fused loads, the fused path's TTFT speedup over full prefill,
and the yoco_min_hit_gain the run used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Result, finish, parse, parser  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--baselines", default="state")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-cases", type=int, default=None)
    ap.add_argument("--bench-output", type=Path, default=None, help="keep kite bench's results.json here")
    args = parse(ap, argv)

    res = Result("bench_points", device=args.device,       # started now: before the bench runs
                 command=["benchmarks/bench_points.py", *(argv if argv is not None else sys.argv[1:])])
    kite = Path(sys.executable).with_name("kite")
    with tempfile.TemporaryDirectory() as tmp:
        out = args.bench_output or Path(tmp) / "results.json"
        cmd = [str(kite), "bench", "run", "--cases", "configs/bench_cases.jsonl", "--upcycle", f"{tmp}/states",
               "--yoco-rules", "rules/yoco_rules.yaml", "--thresholds", "configs/bench.yaml",
               "--baselines", args.baselines, "--max-new-tokens", str(args.max_new_tokens), "--threads", "1",
               "--device", args.device, "--output", str(out),
               *(["--max-cases", str(args.max_cases)] if args.max_cases else [])]
        env = {**os.environ, "KITE_HOME": f"{tmp}/home", "OMP_NUM_THREADS": "1"}
        rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode   # 1 when a threshold fails: the figures stand
        if not out.exists():
            print(f"kite bench run wrote no results (exit {rc})", file=sys.stderr)
            return rc or 1
        run = json.loads(out.read_text())
    overall = (run.get("summary") or {}).get("overall") or {}
    cases = len(run.get("cases") or [])
    res.raw.update(kite_bench_command=" ".join(["kite", *cmd[1:]]).replace(tmp, "$TMP"), exit_code=rc,
                   cases=cases, config=run.get("config"), overall=overall, model=run.get("model"))
    for method, label in (("state", "the whole state"), ("fused", "YOCO's loads")):
        f = overall.get(method) or {}
        for key, name, unit in (("ppl_delta", "PPL delta", "ppl"), ("compression_ratio", "bytes ratio", "x")):
            if isinstance(f.get(key), (int, float)):
                res.row(f"{cases} cases, {label}: {name}", f[key], unit)
    fused = overall.get("fused") or {}
    if isinstance(fused.get("ttft_speedup"), (int, float)):
        res.row(f"{cases} cases, YOCO's loads: TTFT speedup over full prefill", fused["ttft_speedup"], "x")
    gain = (run.get("config") or {}).get("yoco_min_hit_gain")
    if isinstance(gain, (int, float)):
        res.row(f"{cases} cases: yoco_min_hit_gain", gain, "fraction")
    return finish(res, args)


if __name__ == "__main__":
    sys.exit(main())
