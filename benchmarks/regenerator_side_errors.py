"""Per layer and side, what each candidate basis costs a document: plain squared error, the
weighted regenerator's diagonal weighted error, and the attention-output error of the document's
last 256 queries (through o_proj) -- the diagnosis behind the attention probe (docs/PERFORMANCE.md
"Training", session 8; issue 14).

Candidates: ``doc`` (the document's own PCA basis), and per regenerator NAME=DIR given, ``NAME:rpca``
(its basis) and, for a weighted one, ``NAME:pcaw`` (the document's weighted PCA). Each side is coded
alone at the ratio (the other side exact), the document as one part.

    .venv/bin/python benchmarks/regenerator_side_errors.py GPL-3 16 W=/tmp/reg_w U=/tmp/reg_u > out.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kite.model import load_model  # noqa: E402
from kite.upcycle import codec as C  # noqa: E402
from kite.upcycle import codec_settings, tokenize_document  # noqa: E402
from kite.upcycle import capture_kv as capture  # noqa: E402
from kite.upcycle.codec import PROBE_ROWS as ROWS  # noqa: E402
from kite.upcycle.codec import AttentionProbe, Regenerator, coder  # noqa: E402


def main() -> None:
    torch.set_num_threads(2)
    doc, ratio = sys.argv[1], float(sys.argv[2])
    regs = {n: Regenerator.load(p) for n, p in (a.split("=") for a in sys.argv[3:])}
    lm = load_model(None)
    text = Path("/usr/share/common-licenses", doc).read_text()
    ids, _ = tokenize_document(lm.tokenizer, text)
    ctx = min(2048, len(ids) - 512)
    cap = capture(lm, "", ids=ids[:ctx], query_rows=ROWS)   # the probe's queries: the last ROWS tokens
    probe = AttentionProbe(lm, cap.query_tail, ctx)
    geo = lm.geometry
    d, H = geo.head_dim, geo.n_kv_heads
    T = ctx
    s = codec_settings(ratio)

    for layer in range(geo.n_layers):
        K, V = cap.keys_pre[layer], cap.values[layer]
        attn_cost = probe.metric(layer, K, V)
        row = {"layer": layer}
        cands = [("doc", None, "pca", None)]
        for rn, reg in regs.items():
            w = reg.weights(layer)
            cands.append((rn + ":rpca", reg, "rpca", w))
            if w is not None:
                cands.append((rn + ":pcaw", reg, "pca", w))
        for side, X in (("k", K), ("v", V)):
            for name, reg, mode, w in cands:
                t, m = {}, {"settings": s.to_json(), "H": H, "d": d}
                given = reg.side(layer, side) if mode == "rpca" else None
                coder(mode).fit(side, X, s, t, m, pca=given, weights=None if w is None else w[side])
                lc = C.LayerCodec(t, m)
                if mode == "rpca":
                    C.attach_regenerator(lc, {side: given[2]}, sides=(side,))
                c = coder(mode)
                Xh = c.decode(lc, side, c.encode(lc, side, X, torch.arange(T)))
                e = {"plain": float((X - Xh).pow(2).sum())}
                for reg2 in regs.values():
                    if reg2.weights(layer) is not None:
                        wb = reg2.weights(layer)[side]
                        e["w"] = float(((X - Xh).permute(1, 0, 2).reshape(T, -1).pow(2).sum(0) * wb[0]).sum())
                e["attn"] = attn_cost(side, X, Xh)
                row[f"{side}:{name}"] = e
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
