"""Would a per-document residual basis pay on top of the regenerator's? The codec's expected error
(:func:`kite.upcycle.codec.bits.expected_error`, the bit allocation's own model) of one held-out
document, per layer and side, for: the document's own basis (stored), the regenerator's (not
stored), and the regenerator's with its leading ``m`` components (by the document's variance on
them) rotated to the document's principal axes within their span, the m x m rotation stored at the
basis' format and paid from the same byte budget. Figures relative to the regenerator's.

    .venv/bin/python benchmarks/regenerator_rotation.py --regenerator U --document GPL-3 --ratio 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kite.upcycle.codec import (INT_FORMATS, PcaSide, RegenSide, allocate_bits, blocks, expected_error,  # noqa: E402
                               layer_budget_bits, settings_for)

LICENSES = Path("/usr/share/common-licenses")


def rotated_error(X: torch.Tensor, U: torch.Tensor, m: int, s, budget: float) -> float:
    """Expected error with the leading m regenerator components (by the document's variance) rotated to
    the document's axes within their span; the rotation (m x m, the basis format) paid from ``budget``."""
    Xb = blocks(X.float(), s.joint_heads)
    Xc = Xb - Xb.mean(dim=1, keepdim=True)
    Z = Xc @ U.float()                                  # [B, T, D] on the regenerator's basis
    S = Z.transpose(1, 2) @ Z / Z.shape[1]
    dv = torch.diagonal(S, dim1=1, dim2=2)
    evs = []
    for b in range(S.shape[0]):
        o = torch.argsort(dv[b], descending=True)
        lead = torch.linalg.eigvalsh(S[b][o[:m]][:, o[:m]]).flip(0).clamp_min(0)
        evs.append(torch.cat([lead, dv[b][o[m:]]]))
    ev = torch.stack(evs)
    entry_bits = INT_FORMATS.get(s.basis_fmt, 16)
    cost = S.shape[0] * (m * m * entry_bits + m * 32)   # entries + a scale per column
    bits = allocate_bits(ev, budget - cost, Xb.shape[1], Xb.shape[2], s, basis_stored=False)
    return expected_error(ev, bits, s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--regenerator", type=Path, required=True)
    ap.add_argument("--document", default="GPL-3", help="a license name under /usr/share/common-licenses")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ratio", type=float, default=4.0)
    ap.add_argument("--ranks", type=int, nargs="*", default=[8, 16, 32, 64, 128])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kite.model import load_model
    from kite.upcycle import Regenerator
    from kite.upcycle import capture_kv as capture

    lm = load_model(None)
    reg = Regenerator.load(args.regenerator)
    reg.check_model(lm)
    ids = lm.tokenizer((LICENSES / args.document).read_text(), add_special_tokens=False)["input_ids"][:args.tokens]
    cap = capture(lm, "", ids=ids)
    s = settings_for(args.ratio)
    totals: dict[str, dict[str, float]] = {"k": {}, "v": {}}
    best_layer: dict[str, float] = {"k": 1.0, "v": 1.0}
    for layer in range(lm.geometry.n_layers):
        for side, X in (("k", cap.keys_pre[layer]), ("v", cap.values[layer])):
            H, T, d = X.shape
            mean, evals, U = reg.side(layer, side)
            B, D = U.shape[0], U.shape[1]
            budget = layer_budget_bits(s.k_bits if side == "k" else s.v_bits, H, T, d, B, D, s)
            row = {"document": PcaSide().fit(side, X, s, {}, {}),
                   "regenerator": RegenSide().fit(side, X, s, {}, {}, pca=(mean, evals, U))}
            for m in args.ranks:
                row[f"rotated {m}"] = rotated_error(X, U, min(m, D), s, budget)
            for key, err in row.items():
                totals[side][key] = totals[side].get(key, 0.0) + err
            best_layer[side] = min(best_layer[side], *(row[k] / row["regenerator"] for k in row if k.startswith("rot")))
    result = {"document": args.document, "tokens": len(ids), "ratio": args.ratio, "regenerator": reg.fingerprint,
              "relative_to_regenerator": {side: {k: round(v / t["regenerator"], 4) for k, v in t.items()}
                                          for side, t in totals.items()},
              "best_rotation_in_any_layer": {side: round(v, 4) for side, v in best_layer.items()}}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
