"""What embedding states in a GGUF costs (`kite gguf embed`, kite/store/gguf.py): bytes and time.

For each `.upc` given (made with the embedded SmolLM2-135M: its GGUF is the model file), one row:
the state's bytes, its zstd frame, the base64 text the GGUF holds and that over the state; the time
to embed it into a copy of the model file (state checks, encode, the 98 MB copy), to open the output
with `gguf`'s reader, to extract the state back (checked byte for byte), and the metadata pass of
transformers' GGUF loader on the output and on the model file (it reads every string element by
element: why KITE converts a GGUF with states from a copy without them). Median of `--repeats` runs.

    .venv/bin/python benchmarks/gguf_embed.py doc.upc [doc2.upc ...] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def timed(fn, repeats: int) -> tuple[str, object]:
    """('wall (cpu)' ms, the last result) of `fn`, medians of `repeats` runs."""
    walls, cpus, out = [], [], None
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        walls.append((time.perf_counter() - t) * 1e3)
        cpus.append((time.process_time() - c) * 1e3)
    return f"{statistics.median(walls):.0f} ({statistics.median(cpus):.0f})", out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("states", nargs="+", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from kite.model.gguf import open_gguf
    from kite.model.sources import embedded_gguf_path
    from kite.store import embed_states, extract_state

    model = embedded_gguf_path("smollm2-135m")
    open_model_ms, _ = timed(lambda: open_gguf(model), args.repeats)
    hf_model_ms, _ = timed(lambda: load_gguf_checkpoint(str(model)), args.repeats)
    print(f"model file {model.name}: {model.stat().st_size:,} B; gguf reader open {open_model_ms} ms; "
          f"transformers metadata pass {hf_model_ms} ms")
    print("| state | .upc bytes | zstd frame | in the GGUF (base64) | ×.upc | embed ms | open ms | extract ms | "
          "transformers metadata ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for path in args.states:
            out = Path(tmp) / "out.gguf"
            embed_ms, report = timed(lambda: embed_states(model, [("s", path)], out), args.repeats)
            state = report.added[0]
            frame = state.stored_bytes * 3 // 4  # base64: 4 characters per 3 bytes (less padding)
            open_ms, _ = timed(lambda: open_gguf(out), args.repeats)
            back = Path(tmp) / "back.upc"
            extract_ms, _ = timed(lambda: extract_state(out, "s", back), args.repeats)
            assert back.read_bytes() == path.read_bytes()
            hf_ms, _ = timed(lambda: load_gguf_checkpoint(str(out)), 1)
            print(f"| {path.name} | {state.upc_bytes:,} | ~{frame:,} | {state.stored_bytes:,} | "
                  f"{state.stored_bytes / state.upc_bytes:.3f} | {embed_ms} | {open_ms} | {extract_ms} | {hf_ms} |")


if __name__ == "__main__":
    main()
