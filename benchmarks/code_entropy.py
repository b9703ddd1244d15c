"""What an entropy coder of the quantized coefficients would save (KVTC's last stage, not built):
the states' code bytes against their empirical entropy, on the held-out documents.

Each held-out document (GPL-3, Apache-2.0, ``--held-out-contracts`` contracts of the held-out seed;
the first ``context_tokens(n)`` tokens) is compressed at each ratio of ``--ratios`` (on
``--regenerator DIR`` when given, e.g. one with a basis for the whole state), and every part's codes
are read back class by class (a class: the columns of one width). Per state:

* ``codes``: the bytes the parts' codes take (each class packed at its width, as stored);
* ``class entropy``: the codes' empirical entropy with one distribution per (part, class), what a
  static coder with a 2^bits table per class would need (tables not counted);
* ``column entropy``: one distribution per column of a part (a bound for finer models);
* ``zstd``: the parts' code bytes through zstd (level 19), a coder one can use today.

Rows per ratio, means over the documents: each saving as a share of the whole file (what the state
could spend on more bits at the same size). No timing: nothing here has a floor.

    python benchmarks/code_entropy.py --regenerator DIR --ratios 4 8 16 20
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kite.model import load_model  # noqa: E402
from kite.upcycle import CompressSettings, Regenerator, StateFile, codec, codec_settings, compress_document  # noqa: E402
from kite.upcycle import tokenize_document  # noqa: E402
from kite.upcycle.codec import PcaSide  # noqa: E402
from kite.upcycle.format import class_layout  # noqa: E402
from kite.upcycle.study import context_tokens, held_out_docs  # noqa: E402
from harness import Result, clock, finish, parse, parser  # noqa: E402

WHY = "a share of a state's bytes, not a time"


def entropy_bits(codes: torch.Tensor, levels: int) -> float:
    """Bits the codes need at their empirical distribution (n x H)."""
    n = codes.numel()
    if not n:
        return 0.0
    p = torch.bincount(codes.reshape(-1).long(), minlength=levels).double() / n
    p = p[p > 0]
    return float(-(p * p.log2()).sum()) * n


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The first ``n`` codes of ``bits`` bits packed LSB first (the parts' layout)."""
    b = np.unpackbits(packed.numpy(), bitorder="little")[:n * bits].reshape(n, bits).astype(np.int64)
    return torch.from_numpy(b @ (1 << np.arange(bits, dtype=np.int64)))


def state_codes(path: Path) -> dict[str, float]:
    """A state's code bytes, their entropies and zstd, and its file bytes."""
    import zstandard

    out = {"file": float(path.stat().st_size), "codes": 0.0, "class": 0.0, "column": 0.0, "zstd": 0.0}
    z = zstandard.ZstdCompressor(level=19)
    with StateFile(path) as sf:
        layer_codecs = {}
        for key in sf.index:
            if not key.startswith("c"):
                continue
            _, layer, side = key.split("/")
            if layer not in layer_codecs:
                layer_codecs[layer] = codec.from_bytes(sf.read(layer), codec.LayerCodec)
            lc = layer_codecs[layer]
            blob = codec.from_bytes(sf.read(key))
            if "codes" not in blob.tensors:
                continue
            s = lc.settings
            T = int(blob.meta["T"])
            colbits = PcaSide.part_widths(lc, side.lower(), blob)
            data = blob.tensors["codes"]
            out["codes"] += data.numel()
            out["zstd"] += len(z.compress(data.numpy().tobytes()))
            at = 0
            for bw in sorted(set(colbits.tolist()) - {0}):
                ncols = int((colbits == bw).sum())
                meta, nb, _ = class_layout(T, ncols, bw, s.group_size, s.even_groups)
                codes = unpack(data[at:at + nb], bw, meta["n"]).view(ncols, -1)      # [column, padded tokens]
                at += nb
                out["class"] += entropy_bits(codes, 1 << bw) / 8
                out["column"] += sum(entropy_bits(col, 1 << bw) for col in codes) / 8
    return out


def main(argv=None) -> int:
    ap = parser(__doc__, device="cpu")
    ap.add_argument("--ratios", type=float, nargs="*", default=[4, 8, 16, 20])
    ap.add_argument("--regenerator", type=Path, help="code the states on this regenerator folder")
    ap.add_argument("--held-out-contracts", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = parse(ap, argv)
    torch.set_num_threads(args.threads)
    t0 = clock()
    lm = load_model(None)
    reg = Regenerator.load(args.regenerator) if args.regenerator else None
    res = Result("code_entropy", device="cpu")
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in held_out_docs(args.held_out_contracts).items():
            ids = tokenize_document(lm.tokenizer, text)[0]
            ids = ids[:context_tokens(len(ids))]
            for ratio in args.ratios:
                path = Path(tmp) / f"{name}_{ratio:g}.upc"
                compress_document(lm, "", path, CompressSettings(codec=codec_settings(ratio)), ids=ids, regenerator=reg)
                got = state_codes(path)
                cells.append({"document": name, "ratio": ratio, "tokens": len(ids), **got})
                print(f"{name} {ratio:g}x: codes {got['codes'] / got['file']:.1%} of the file, class entropy saves "
                      f"{(got['codes'] - got['class']) / got['file']:.1%}, zstd {(got['codes'] - got['zstd']) / got['file']:.1%}",
                      file=sys.stderr, flush=True)
    for ratio in args.ratios:
        at = [c for c in cells if c["ratio"] == ratio]
        mean = lambda f: sum(f(c) for c in at) / len(at)   # noqa: E731
        res.row(f"{ratio:g}x: the codes' share of the file", round(mean(lambda c: c["codes"] / c["file"]), 4), "fraction",
                no_floor=WHY)
        for what, key in (("one distribution per class", "class"), ("one distribution per column", "column"),
                          ("zstd -19 on the codes", "zstd")):
            res.row(f"{ratio:g}x: file bytes an entropy coder saves, {what}",
                    round(mean(lambda c, k=key: (c["codes"] - c[k]) / c["file"]), 4), "fraction", no_floor=WHY,
                    largest=round(max((c["codes"] - c[key]) / c["file"] for c in at), 4))
    res.raw.update(cells=cells, regenerator=None if reg is None else {"fingerprint": reg.fingerprint,
                                                                      "layer_groups": reg.meta.get("layer_groups")},
                   seconds=round(clock() - t0, 1))
    return finish(res, args)


if __name__ == "__main__":
    raise SystemExit(main())
