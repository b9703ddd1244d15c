"""Why `kite serve` runs all model work on its batch's thread, and keeps the batch's rows packed: two
measurements behind docs/PERFORMANCE.md "Continuous batching", session 8 (embedded model, this CPU).

1. Steps of 8 plain rows (`BatchDecoder.step`) from one thread, against the same steps from a second
   thread after the main thread has run torch too: with two OpenMP teams libgomp sees more of its
   threads than cores, and stops letting idle workers spin. Each mode runs in a fresh process
   (OpenMP teams live as long as their threads).
2. One layer's keys and values of 8 rows as a slice of the batch buffers against a gather of 7 of
   them (a gap in the taken rows), for every layer and side of a step (60 tensors of 8 x 3 x 1,100 x 64
   fp32, 870 slots read).

    .venv/bin/python benchmarks/batch_step_threads.py [--json OUT]
    (set OMP_WAIT_POLICY=ACTIVE in the environment to see spinning teams compete instead)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODES = ("main", "worker", "second")


def step_ms(mode: str, reps: int = 3, new_tokens: int = 40) -> list[float]:
    """ms per step of 8 plain rows, `reps` times: `main` (all in the main thread), `worker` (all in one
    other thread; the main thread never runs torch), `second` (the main thread loads the model and
    steps once, then the steps run in a second thread)."""
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
        t0, n = time.perf_counter(), 0
        while len(dec):
            dec.step()
            n += 1
        return (time.perf_counter() - t0) / n * 1e3

    def in_thread(fn):
        th = threading.Thread(target=lambda: out.__setitem__("r", fn()))
        th.start()
        th.join()
        return out["r"]

    if mode == "main":
        load()
        return [run() for _ in range(reps)]
    if mode == "worker":
        return in_thread(lambda: (load(), [run() for _ in range(reps)])[1])
    load()
    run()
    return in_thread(lambda: [run() for _ in range(reps)])


def gather_ms(reps: int = 3) -> dict[str, float]:
    torch.set_num_threads(2)
    bufs = [torch.randn(8, 3, 1100, 64) for _ in range(60)]
    idx = torch.tensor([0, 1, 3, 4, 5, 6, 7])
    out = {}
    for name, f in (("slice of 8 rows", lambda b: b[0:8, :, :870]), ("gather of 7 rows", lambda b: b[idx, :, :870])):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for b in bufs:
                f(b)
            times.append((time.perf_counter() - t0) * 1e3)
        out[name] = round(min(times), 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)   # one mode, in this process
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(step_ms(args.mode)))
        return 0
    result = {"step_ms_8_rows": {}, "kv_per_step_ms": gather_ms()}
    for mode in MODES + MODES:   # each twice, alternating (a shared machine drifts)
        r = subprocess.run([sys.executable, __file__, "--mode", mode], capture_output=True, text=True, check=True)
        result["step_ms_8_rows"].setdefault(mode, []).extend(json.loads(r.stdout.strip().splitlines()[-1]))
        print(mode, " ".join(f"{x:.1f}" for x in result["step_ms_8_rows"][mode][-3:]), "ms a step", flush=True)
    print(json.dumps(result["kv_per_step_ms"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
