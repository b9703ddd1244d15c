"""Why `kite serve` runs all model work on its batch's thread, and keeps the batch's rows packed: two
measurements behind docs/PERFORMANCE.md "Continuous batching" (embedded model, this CPU).

1. Steps of 8 plain rows (`BatchDecoder.step`) from one thread, against the same steps from a second
   thread after the main thread has run torch too: with two OpenMP teams libgomp sees more of its
   threads than cores, and stops letting idle workers spin. Each mode runs in a fresh process
   (OpenMP teams live as long as their threads).
2. One layer's keys and values of 8 rows as a slice of the batch buffers against a gather of 7 of
   them (a gap in the taken rows), for every layer and side of a step (60 tensors of 8 x 3 x 1,100 x 64
   fp32, 870 slots read).

Medians; the one-thread step and the slice are the baselines. The step's floor is the larger of the
weights + the 8 rows' KV read once at this CPU's measured memory bandwidth and 2 x parameters x 8
FLOPs at its measured fp32 rate; the gather's, its bytes read and written once at that bandwidth; the
slice is a view (no bytes move), so it has none.

    .venv/bin/python benchmarks/batch_step_threads.py
    (set OMP_WAIT_POLICY=ACTIVE in the environment to see spinning teams compete instead)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import Result, Timing, finish, parse, parser, time_ms  # noqa: E402
from harness.floors import cpu_bytes_ms, cpu_forward_floor, cpu_limits, cpu_mem_text  # noqa: E402

MODES = ("main", "worker", "second")


def step_ms(mode: str, reps: int = 3, new_tokens: int = 40) -> dict:
    """ms per step of 8 plain rows, `reps` times (``ms``): `main` (all in the main thread), `worker` (all
    in one other thread; the main thread never runs torch), `second` (the main thread loads the model and
    steps once, then the steps run in a second thread); with the step's floor (``floor``: text, ms)."""
    from kite.model import load_model
    from kite.runtime.batch_decode import BatchDecoder

    torch.set_num_threads(2)
    out: dict = {}

    def load():
        out["lm"] = load_model(None)

    def run() -> float:
        lm = out["lm"]
        plain = lm.tokenizer("Write a detailed description of a small mountain village, its people. " * 2)["input_ids"]
        dec = BatchDecoder(lm, 8)
        for _ in range(8):
            dec.add(plain, prefix=None, max_new_tokens=new_tokens, stop_ids=set())
        dec.step()   # the prompts
        rows, kv = len(dec), dec.cache.bytes_in_use()       # the least a timed step reads
        ms = time_ms(dec.step, repeat=new_tokens - 1, warmup=0).median_ms
        out["floor"] = cpu_forward_floor(lm, rows, kv_bytes=kv, what=f"a step of {rows} rows")
        return ms

    def in_thread(fn):
        th = threading.Thread(target=lambda: out.__setitem__("r", fn()))
        th.start()
        th.join()
        return out["r"]

    if mode == "main":
        load()
        ms = [run() for _ in range(reps)]
    elif mode == "worker":
        ms = in_thread(lambda: (load(), [run() for _ in range(reps)])[1])
    else:
        load()
        run()
        ms = in_thread(lambda: [run() for _ in range(reps)])
    return {"ms": ms, "floor": out["floor"], "cpu_limits": cpu_limits().to_dict()}


def gather_ms(repeat: int, warmup: int) -> tuple[dict[str, Timing], int]:
    """The slice's and the gather's times; the bytes the gather reads and writes."""
    torch.set_num_threads(2)
    bufs = [torch.randn(8, 3, 1100, 64) for _ in range(60)]
    idx = torch.tensor([0, 1, 3, 4, 5, 6, 7])
    moved = 2 * sum(b[idx, :, :870].nbytes for b in bufs)
    return {name: time_ms(lambda f=f: [f(b) for b in bufs], repeat, warmup)
            for name, f in (("slice of 8 rows", lambda b: b[0:8, :, :870]),
                            ("gather of 7 rows", lambda b: b[idx, :, :870]))}, moved


def main(argv=None) -> int:
    ap = parser(__doc__, timing=True, repeat=3, warmup=1, device="cpu")
    ap.add_argument("--mode", choices=MODES, help="one mode, in this process (the run starts one process a mode)")
    args = parse(ap, argv)
    if args.mode:
        print(json.dumps(step_ms(args.mode, args.repeat)))
        return 0
    res = Result("batch_step_threads", device="cpu")
    steps: dict[str, list[float]] = {}
    floors: dict[str, list] = {}
    for mode in MODES + MODES:   # each twice, alternating (a shared machine drifts)
        r = subprocess.run([sys.executable, __file__, "--mode", mode, "--repeat", str(args.repeat)],
                           capture_output=True, text=True, check=True)
        got = json.loads(r.stdout.strip().splitlines()[-1])
        steps.setdefault(mode, []).extend(got["ms"])
        # the floor at the best bandwidth and rate any of the processes measured: the least of them
        floors[mode] = min(floors.get(mode, got["floor"]), got["floor"], key=lambda f: f[1])
        res.raw.setdefault("cpu_limits_of_each_process", []).append(got["cpu_limits"])
    for mode in MODES:
        res.row(f"decode step of 8 rows, {mode} thread", statistics.median(steps[mode]), "ms",
                baseline=None if mode == "main" else "decode step of 8 rows, main thread", samples=steps[mode],
                floor=floors[mode][0], floor_value=floors[mode][1])
    kv, moved = gather_ms(args.repeat, args.warmup)
    res.timing("one step's KV, slice of 8 rows", kv["slice of 8 rows"],
               no_floor="a view of the buffers: no bytes move, so no hardware floor")
    res.timing("one step's KV, gather of 7 rows", kv["gather of 7 rows"], baseline="one step's KV, slice of 8 rows",
               floor=f"{moved / 1e6:.3g} MB read and written once {cpu_mem_text()}", floor_value=cpu_bytes_ms(moved))
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
