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
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kite.model import load_model  # noqa: E402
from kite.upcycle import codec as C  # noqa: E402
from kite.upcycle import codec_settings, tokenize_document  # noqa: E402
from kite.upcycle.capture import capture  # noqa: E402
from kite.upcycle.codec.coders import coder  # noqa: E402
from kite.upcycle.rope import apply_rope, rope_cos_sin  # noqa: E402
from kite.upcycle.train.regenerator import Regenerator  # noqa: E402


def main() -> None:
    torch.set_num_threads(2)
    doc, ratio = sys.argv[1], float(sys.argv[2])
    regs = {n: Regenerator.load(p) for n, p in (a.split("=") for a in sys.argv[3:])}
    lm = load_model(None)
    text = Path("/usr/share/common-licenses", doc).read_text()
    ids, _ = tokenize_document(lm.tokenizer, text)
    ctx = min(2048, len(ids) - 512)
    qs: dict[int, list] = {}
    hooks = []
    for name, m in lm.model.named_modules():
        mt = re.search(r"layers\.(\d+)\.self_attn\.q_proj$", name)
        if mt:
            hooks.append(m.register_forward_hook(
                lambda mod, i, o, layer=int(mt.group(1)): qs.setdefault(layer, []).append(o.detach()[0].float())))
    cap = capture(lm, "", ids=ids[:ctx])
    for h in hooks:
        h.remove()
    geo = lm.geometry
    Hq = lm.model.config.num_attention_heads
    d, H = geo.head_dim, geo.n_kv_heads
    rep = Hq // H
    T = ctx
    cos, sin = rope_cos_sin(lm.model, torch.arange(T))
    S = 256  # query rows: the last S tokens
    s = codec_settings(ratio)
    o_proj = [m for n, m in lm.model.named_modules() if re.search(r"layers\.\d+\.self_attn\.o_proj$", n)]

    def attn_out(q, K, V):  # q [Hq, S, d] post-RoPE, K post-RoPE [H, T, d], V [H, T, d]
        sc = q @ K.repeat_interleave(rep, 0).transpose(1, 2) / d ** 0.5
        pos = torch.arange(T - S, T)[:, None]
        sc = sc.masked_fill(torch.arange(T)[None, :] > pos, float("-inf"))
        return torch.softmax(sc, -1) @ V.repeat_interleave(rep, 0)

    for layer in range(geo.n_layers):
        K, V = cap.keys_pre[layer], cap.values[layer]
        q = torch.cat(qs[layer]).reshape(T, Hq, d).permute(1, 0, 2)[:, T - S:]
        q = apply_rope(q, cos[T - S:], sin[T - S:])
        Kpost = apply_rope(K, cos, sin)
        Wo = o_proj[layer].weight.float()
        ref = attn_out(q, Kpost, V)

        def oerr(Kh, Vh):
            o = attn_out(q, apply_rope(Kh, cos, sin), Vh)
            return float(((o - ref).permute(1, 0, 2).reshape(S, -1) @ Wo.T).pow(2).sum())

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
                e["attn"] = oerr(Xh, V) if side == "k" else oerr(K, Xh)
                row[f"{side}:{name}"] = e
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
