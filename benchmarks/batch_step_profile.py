"""What one batched decode step costs on this CPU, and where it goes (embedded model, fp32).

Times `BatchDecoder.step` for 8 plain rows, for 8 rows of which 4 follow an 808-token document's KV
(the serve_concurrency burst's mix), and for one row; then torch's profiler over 10 mixed steps
(the ops that take the time: the weights' matrix products, attention, the rest).

Each step is timed over --repeat steps (median, after --warmup); the 8-row figures have the one-row
step as their baseline; the floor is the larger of the weights + every row's KV read once at this CPU's
measured memory bandwidth and the step's matmuls (2 x parameters x rows FLOPs; attention left out) at
its measured fp32 rate (harness.floors.cpu_forward_floor).

    .venv/bin/python benchmarks/batch_step_profile.py [--repeat 20]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kite.data.contracts import generate_contracts  # noqa: E402
from kite.model import load_model  # noqa: E402
from kite.runtime.batch_decode import BatchDecoder  # noqa: E402
from kite.runtime.cache import KVPrefix, cache_layers, new_cache  # noqa: E402
from kite.runtime.generate import forward_tokens  # noqa: E402
from harness import Result, finish, parse, parser, time_ms  # noqa: E402
from harness.floors import cpu_forward_floor  # noqa: E402


def main(argv=None) -> int:
    ap = parser(__doc__, timing=True, repeat=20, warmup=1, device="cpu")
    ap.add_argument("--threads", type=int, default=2)
    args = parse(ap, argv)
    torch.set_num_threads(args.threads)
    lm = load_model(None)
    ids = lm.tokenizer(generate_contracts(1, tokens=900, seed=7)[0]["text"])["input_ids"][:808]
    cache = new_cache(lm.model)
    with torch.inference_mode():
        forward_tokens(lm.model, ids, cache, 0)
    prefix = KVPrefix(keys=[k[0].clone() for k, _ in cache_layers(cache)],
                      values=[v[0].clone() for _, v in cache_layers(cache)], next_position=len(ids))
    plain = lm.tokenizer("Write a detailed description of a small mountain village, its people, their work "
                         "and their food. " * 2)["input_ids"]
    question = lm.tokenizer(" Question: who pays?\nAnswer:", add_special_tokens=False)["input_ids"]

    def decoder(with_state: bool, rows: int) -> BatchDecoder:
        dec = BatchDecoder(lm, rows)
        for i in range(rows):
            state = with_state and i % 2
            dec.add(question if state else plain, prefix=prefix if state else None, max_new_tokens=200,
                    stop_ids=set())
        dec.step()   # the prompts
        dec.step()
        return dec

    res = Result("batch_step_profile", device="cpu")

    def timed(dec: BatchDecoder) -> dict:
        """The step's timing and its floor (the KV in use before the timed steps: the least a step read)."""
        rows, kv = len(dec), dec.cache.bytes_in_use()
        t = time_ms(dec.step, args.repeat, args.warmup)
        text, ms = cpu_forward_floor(lm, rows, kv_bytes=kv, what=f"a step of {rows} row{'s' * (rows > 1)}")
        return {"t": t, "floor": text, "floor_value": ms}

    res.timing("decode step, 1 row", **timed(decoder(False, 1)))
    res.timing("decode step, 8 plain rows", **timed(decoder(False, 8)), baseline="decode step, 1 row")
    res.timing(f"decode step, 8 rows, 4 after a {len(ids)}-token document", **timed(decoder(True, 8)),
               baseline="decode step, 1 row")
    from torch.profiler import ProfilerActivity, profile

    dec = decoder(True, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            dec.step()
    top = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    print(top)
    res.raw.update(threads=torch.get_num_threads(), document_tokens=len(ids), profile=top)
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
