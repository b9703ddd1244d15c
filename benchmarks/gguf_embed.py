"""What embedding states in a GGUF costs (`kite gguf embed`, kite/store/gguf.py): bytes and time.

For each `.upc` given (made with the embedded SmolLM2-135M: its GGUF is the model file), one row:
the state's bytes, its zstd frame, the base64 text the GGUF holds and that over the state; the time
to embed it into a copy of the model file (state checks, encode, the 98 MB copy), to open the output
with `gguf`'s reader, to extract the state back (checked byte for byte), and the metadata pass of
transformers' GGUF loader on the output and on the model file (it reads every string element by
element: why KITE converts a GGUF with states from a copy without them). Median of `--repeat` runs;
opening and reading the output have the model file's as their baseline. Floors, at this CPU's measured
memory bandwidth (the files sit in the page cache after the first run): embedding, the model file and
the state read and the output written once; extracting, the stored base64 read and the state written
once; opening the output and its metadata pass, the stored base64 read once. Opening the model file
and its metadata pass read an amount of metadata the script does not know: those say so.

    .venv/bin/python benchmarks/gguf_embed.py doc.upc [doc2.upc ...] [--repeat 3]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import Result, cpu_bytes_ms, cpu_mem_text, finish, parse, parser, time_ms  # noqa: E402


def main(argv=None) -> int:
    ap = parser(__doc__, timing=True, repeat=3, warmup=0, device="cpu")
    ap.add_argument("states", nargs="+", type=Path)
    args = parse(ap, argv)

    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from kite.model.gguf import open_gguf
    from kite.model.sources import embedded_gguf_path
    from kite.store import embed_states, extract_state

    model = embedded_gguf_path("smollm2-135m")
    res = Result("gguf_embed", device="cpu")

    def timed(name, fn, repeat=None, **kw):
        out = []
        res.timing(name, time_ms(lambda: out.append(fn()), repeat or args.repeat, args.warmup), **kw)
        return out[-1]

    def moved(n: int, what: str) -> dict:
        return {"floor": f"{what} ({n / 1e6:.4g} MB) once {cpu_mem_text()}", "floor_value": cpu_bytes_ms(n)}

    unknown = "reads the file's metadata, of a size the script does not know: no floor"
    timed("model file: gguf reader open", lambda: open_gguf(model), size_bytes=model.stat().st_size, no_floor=unknown)
    timed("model file: transformers metadata pass", lambda: load_gguf_checkpoint(str(model)), no_floor=unknown)
    with tempfile.TemporaryDirectory() as tmp:
        for path in args.states:
            out = Path(tmp) / "out.gguf"
            report = embed_states(model, [("s", path)], out)
            state = report.added[0]
            copy = model.stat().st_size + path.stat().st_size + model.stat().st_size + state.stored_bytes
            timed(f"{path.name}: embed", lambda: embed_states(model, [("s", path)], out),
                  **moved(copy, "the model file and the state read, the output written"))
            stored = moved(state.stored_bytes, "the stored base64 read")
            timed(f"{path.name}: gguf reader open", lambda: open_gguf(out), baseline="model file: gguf reader open",
                  **stored)
            back = Path(tmp) / "back.upc"
            timed(f"{path.name}: extract", lambda: extract_state(out, "s", back),
                  **moved(state.stored_bytes + path.stat().st_size, "the stored base64 read, the state written"))
            assert back.read_bytes() == path.read_bytes()
            timed(f"{path.name}: transformers metadata pass", lambda: load_gguf_checkpoint(str(out)), repeat=1,
                  baseline="model file: transformers metadata pass", **stored)
            res.row(f"{path.name}: in the GGUF (base64)", state.stored_bytes, "B", baseline=f"{path.name}: .upc",
                    baseline_value=state.upc_bytes, zstd_frame_bytes=state.stored_bytes * 3 // 4)
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
