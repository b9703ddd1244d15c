"""GPU speed of KITE's native runtime on Qwen2-7B geometry: build, check, time, in one run.

    python benchmarks/gpu_speed.py [--tokens 16384] [--out out/gpu_speed.json] [--no-build]

Random-weight Qwen2-7B (28 layers, 28 query / 4 KV heads, head_dim 128, bf16, sdpa) and a
random-token document. Figures (CUDA events, median of repeats after a warm-up):

* prefill of the document (the work a state replaces);
* compress = remove RoPE + cluster spans (k-means++ seeding in torch, Lloyd iterations native)
  + factorize (per (layer, head, K|V) Gram + batched eigendecomposition, one launch)
  + project and quantize the coefficients (per-column groups of 256 tokens, bit packing);
* load into a bf16 KV cache from pinned host memory (one copy; and pipelined per layer), and
  from a file in the page cache (threaded reads into pinned memory, pipelined per layer);
* time to first token from the state (load + cache assembly + the query's forward) vs prefill.

Each figure is printed with its ratio to the prefill it replaces and to its hardware floor:
bytes moved over HBM bandwidth (4.8 TB/s) or PCIe (55 GB/s) for host tiers, FLOPs over the bf16
matrix rate (790 TFLOP/s measured on these H200s) for prefill. The state here is one part per
layer (the whole document) with a fixed bit allocation (K: 32 components at 4 bits, 32 at 3,
32 at 2; V: 64 at 4, 32 at 3, 32 at 2) standing in for the codec's greedy one; the file is the
state's raw tensor bytes (no .upc header / checksums). Random weights make the KV far from low
rank, so reconstruction error here says nothing about quality.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HBM_BPS, PCIE_BPS, BF16_FLOPS = 4.8e12, 55e9, 790e12
GEOMETRY = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6)
K_CLASSES = ((4, 32), (3, 32), (2, 32))   # (bits, components) per head, in component order
V_CLASSES = ((4, 64), (3, 32), (2, 32))
GROUP = 256
SPAN, CLUSTERS, QUERY = 64, 8, 16


DEV = "cuda"
PIN = True


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


class _NoEvent:
    def record(self, *a):
        pass


def event():
    return torch.cuda.Event() if DEV == "cuda" else _NoEvent()


def wait(ev) -> None:
    if DEV == "cuda":
        torch.cuda.current_stream().wait_event(ev)


def on_stream(st):
    import contextlib

    return torch.cuda.stream(st) if DEV == "cuda" else contextlib.nullcontext()


def cuda_ms(fn, reps: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() in ms, timed with CUDA events around each call."""
    if DEV != "cuda":
        return host_ms(fn, reps, warmup)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def host_ms(fn, reps: int = 5, warmup: int = 1) -> float:
    """Median of host-clock times (fn synchronises itself)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


class Report:
    def __init__(self):
        self.rows: list[tuple] = []
        self.data: dict = {}

    def row(self, name: str, ms: float, floor_ms: float | None = None, vs_prefill: bool = True, note: str = ""):
        self.rows.append((name, ms, floor_ms, vs_prefill, note))
        self.data[name] = {"ms": ms, "floor_ms": floor_ms, "note": note}
        print(f"  {name}: {ms:.3f} ms {note}", flush=True)

    def table(self, prefill_ms: float | None) -> str:
        lines = [f"{'figure':58s} {'ms':>9s} {'/prefill':>9s} {'floor ms':>9s} {'x floor':>8s}  note"]
        for name, ms, floor, vs, note in self.rows:
            pre = f"{ms / prefill_ms:9.3f}" if prefill_ms and vs else f"{'':9s}"
            fl = f"{floor:9.3f} {ms / floor:8.1f}" if floor else f"{'':9s} {'':8s}"
            lines.append(f"{name:58s} {ms:9.3f} {pre} {fl}  {note}")
        return "\n".join(lines)


def build(report: Report) -> None:
    t = time.perf_counter()
    r = subprocess.run(["make", "-C", str(ROOT), "build-runtime"], capture_output=True, text=True)
    print(r.stdout[-1500:], r.stderr[-3000:], flush=True)
    report.data["build"] = {"rc": r.returncode, "s": round(time.perf_counter() - t, 1)}
    if r.returncode:
        raise SystemExit("make build-runtime failed")


def check_kernels(report: Report) -> None:
    """CUDA kernels vs their torch fallbacks on fresh random inputs."""
    from kite.kernels import eigh, kmeans, quant

    dev = "cuda"
    res = {}
    x = torch.nn.functional.normalize(torch.randn(2048, 512, device=dev), dim=1)
    init = x[torch.randperm(2048, device=dev)[:12]].clone()
    a1, c1, _ = kmeans.lloyd_cosine(x, init, 30)
    a2, c2, _ = kmeans.lloyd_cosine_torch(x, init, 30)
    res["kmeans_assign_mismatch"] = int((a1 != a2).sum())
    res["kmeans_centroid_maxdiff"] = float((c1 - c2).abs().max())
    X = torch.randn(64, 512, 128, device=dev) * torch.linspace(3, 0.05, 128, device=dev)
    G = X.transpose(1, 2) @ X / 512
    ev, U = eigh.eigh_desc(G)
    ev_ref = torch.linalg.eigh(G.double())[0].flip(-1)
    res["eigh_eval_relerr"] = float(((ev.double() - ev_ref).abs().max() / ev_ref.abs().max()))
    res["eigh_residual_rel"] = float(((G @ U - U * ev[:, None, :]).abs().max() / G.abs().max()))
    res["eigh_orth_err"] = float((U.transpose(1, 2) @ U - torch.eye(128, device=dev)).abs().max())
    # reference: quant.py's arithmetic on the CPU (torch's own CUDA division by a scalar multiplies
    # by the reciprocal, so torch-on-GPU is itself an ulp off now and then)
    g = torch.randn(4096, GROUP, device=dev)
    for bits in (2, 3, 4):
        got, want = quant.quantize_groups(g, bits), quant.quantize_groups_torch(g.cpu(), bits)
        res[f"quant_int{bits}_minmax_bit_exact"] = all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
        got, want = quant.quantize_groups(g, bits, "mse"), quant.quantize_groups_torch(g.cpu(), bits, "mse")
        same = (got[1].cpu() == want[1]) & (got[2].cpu() == want[2])
        res[f"quant_int{bits}_mse_same_grid"] = float(same.float().mean())
    report.data["checks"] = res
    print("checks:", json.dumps(res), flush=True)


def make_model(T: int, small: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    geo = dict(GEOMETRY, **(dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                 num_attention_heads=4, vocab_size=1000) if small else {}))
    cfg = Qwen2Config(**geo)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(DEV):
        model = Qwen2ForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    return cfg, model


def state_layout(H: int, d: int, classes, T: int):
    """Per (layer, side): column bits [R], per-block offsets, PcaLayout (one part of T tokens)."""
    from kite.kernels.load import pca_layout

    per_head = [b for b, n in classes for _ in range(n)]
    colbits = per_head * H
    r = len(per_head)
    blk_off = torch.arange(H + 1, dtype=torch.long) * r
    return colbits, blk_off, pca_layout(colbits, T, GROUP), r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "gpu_speed.json")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU: checks the script runs")
    args = ap.parse_args()
    global DEV, PIN
    if args.cpu_smoke:
        DEV, PIN = "cpu", False
    warnings.filterwarnings("ignore")
    report = Report()
    report.data["device"] = torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu"
    report.data["torch"] = torch.__version__
    if not args.no_build:
        build(report)
    from kite.kernels import backends, eigh, kmeans, load, native, quant
    from kite.upcycle.rope import remove_rope

    report.data["backends"] = backends(DEV)
    report.data["cuda_runtime"] = native.cuda().kite_cuda_version().decode() if native.cuda() else None
    print("backends:", report.data["backends"], report.data["cuda_runtime"], flush=True)
    if not args.skip_checks and DEV == "cuda":
        try:
            check_kernels(report)
        except Exception:  # noqa: BLE001 - keep timing the rest
            traceback.print_exc()
    T = args.tokens
    cfg, model = make_model(T, args.cpu_smoke)
    L, H, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    n_body = sum(p.numel() for p in model.model.layers.parameters())
    n_params = n_body + cfg.vocab_size * cfg.hidden_size          # bytes a decode step reads (+ lm_head)
    ids = torch.randint(cfg.vocab_size, (1, T + QUERY), device=DEV)
    doc, query = ids[:, :T], ids[:, T:]
    hidden = {}
    hook = model.model.layers[L // 2].register_forward_hook(
        lambda m, i, o: hidden.__setitem__("h", (o[0] if isinstance(o, tuple) else o)))

    # ---- prefill (document + query: what a request without a state pays) ------------------
    def prefill(x):
        with torch.inference_mode():
            return model(x, use_cache=True, logits_to_keep=1)

    prefill_ms = cuda_ms(lambda: prefill(ids), reps=3)
    attn_flops = 2 * 2 * L * cfg.num_attention_heads * d * (T + QUERY) ** 2 / 2
    flops = 2 * n_body * (T + QUERY) + attn_flops
    report.row(f"prefill {T}+{QUERY} tokens (TTFT without a state)", prefill_ms, flops / BF16_FLOPS * 1e3,
               note=f"{flops / 1e12:.0f} TFLOP")
    with torch.inference_mode():
        out = prefill(doc)
    hook.remove()
    cache = out.past_key_values
    K = torch.stack([cache.layers[layer].keys[0] for layer in range(L)])     # [L, H, T, d] bf16, post-RoPE
    V = torch.stack([cache.layers[layer].values[0] for layer in range(L)])
    span_h = hidden["h"][0].float()                                           # [T, hidden]
    del out, cache
    raw_bytes = K.numel() * 2 * 2
    report.data["raw_kv_bytes"] = raw_bytes
    pos = torch.arange(T, device=DEV)
    with torch.inference_mode():
        cos, sin = model.model.rotary_emb(torch.zeros(1, device=DEV), pos[None])
    cos, sin = cos[0].float().contiguous(), sin[0].float().contiguous()   # [T, d]

    # raw KV between pinned host memory and the GPU (the baseline a state must beat on the wire)
    host_raw = torch.empty(raw_bytes, dtype=torch.uint8, pin_memory=PIN)
    dev_raw = torch.empty(raw_bytes, dtype=torch.uint8, device=DEV)
    ms = cuda_ms(lambda: dev_raw.copy_(host_raw, non_blocking=True), reps=5)
    report.row("copy raw bf16 KV pinned host -> GPU", ms, raw_bytes / PCIE_BPS * 1e3,
               note=f"{raw_bytes / 1e6:.0f} MB, {raw_bytes / ms / 1e6:.1f} GB/s")
    host_raw = dev_raw = None  # free 1.8 GB

    # ---- compress ---------------------------------------------------------------------------
    kcls = tuple((b, n * d // 128) for b, n in K_CLASSES)   # per 128 dims (the smoke model has 64)
    vcls = tuple((b, n * d // 128) for b, n in V_CLASSES)
    kc = state_layout(H, d, kcls, T)
    vc = state_layout(H, d, vcls, T)

    def remove():
        return remove_rope(K.float(), cos, sin)

    def cluster():
        n = T // SPAN
        emb = torch.nn.functional.normalize(span_h[: n * SPAN].view(n, SPAN, -1).mean(1), dim=1)
        gen = torch.Generator(device=DEV).manual_seed(0)
        cent = emb[torch.randint(n, (1,), device=DEV, generator=gen)]
        for _ in range(1, CLUSTERS):   # k-means++ (as kite/upcycle/cluster.py)
            d2 = (1 - emb @ cent.T).clamp_min(0).min(dim=1).values
            cent = torch.cat([cent, emb[torch.multinomial(d2 / d2.sum(), 1, generator=gen)]])
        return kmeans.lloyd_cosine(emb, cent, 30)

    def factorize(k_pre, use_native=True):
        X = torch.stack([k_pre, V.float()]).reshape(2 * L * H, T, d)          # [2LH, T, d]
        mean = X.mean(dim=1)
        Xc = X - mean[:, None]
        Gm = Xc.transpose(1, 2) @ Xc / T
        ev, U = eigh.eigh_desc(Gm) if use_native else eigh.eigh_desc_torch(Gm)
        return X, mean, U.float()

    def quantize(X, mean, U):
        """Coefficients per class, quantized in groups of GROUP tokens along each column."""
        XU = X.view(2, L, H, T, d)
        mean = mean.view(2, L, H, d)
        U = U.view(2, L, H, d, d)
        parts = {}
        for s, (colbits, blk_off, layout, r) in ((0, kc), (1, vc)):
            C = (XU[s] - mean[s][:, :, None]) @ U[s][..., :r]                # [L, H, T, r]
            col = 0
            codes, scales, mins = {}, {}, {}
            for bits, ncols in (kcls if s == 0 else vcls):
                # class columns of every head, ordered head-major as the layout expects
                g = C[..., col:col + ncols].permute(0, 1, 3, 2).reshape(-1, GROUP)
                p, sc, mn = quant.quantize_groups(g.contiguous(), bits, "mse")
                codes[bits], scales[bits], mins[bits] = p.view(L, -1), sc.view(L, -1), mn.view(L, -1)
                col += ncols
            order = sorted(codes)  # the layout stores bit classes in ascending width
            parts[s] = dict(codes=torch.cat([codes[b] for b in order], 1),
                            scale=torch.cat([scales[b] for b in order], 1),
                            mn=torch.cat([mins[b] for b in order], 1),
                            basis_t=U[s][..., :r].transpose(-1, -2).reshape(L, H * r, d).contiguous(),
                            mean=mean[s].contiguous())
        return parts

    def compress():
        k_pre = remove()
        assign, _, iters = cluster()
        X, mean, U = factorize(k_pre)
        parts = quantize(X, mean, U)
        return parts, iters

    timings = {}
    for name, fn in (("remove RoPE", remove), ("cluster (k-means++ + Lloyd)", cluster)):
        timings[name] = cuda_ms(fn, reps=5)
    k_pre = remove()
    timings["factorize (Gram + eigh kernel)"] = cuda_ms(lambda: factorize(k_pre), reps=5)
    X, mean, U = factorize(k_pre)
    timings["project + quantize (mse, packed)"] = cuda_ms(lambda: quantize(X, mean, U), reps=5)
    total = host_ms(compress, reps=3)
    kv_floor = (raw_bytes + raw_bytes * 2) / HBM_BPS * 1e3   # read bf16 KV + fp32 working copy, once
    report.row(f"compress {T} tokens (total)", total, kv_floor, note="target <= 50 ms, <= 10% of prefill")
    for name, ms in timings.items():
        report.row(f"  {name}", ms)
    try:
        ms = cuda_ms(lambda: factorize(k_pre, use_native=False), reps=2)
        report.row("  factorize with torch.linalg.eigh (fallback)", ms, note="for comparison")
        Xj = k_pre.permute(0, 2, 1, 3).reshape(L, T, H * d)
        Gj = (Xj - Xj.mean(1, keepdim=True)).transpose(1, 2) @ (Xj - Xj.mean(1, keepdim=True)) / T
        ms = cuda_ms(lambda: torch.linalg.eigh(Gj), reps=2)
        report.row(f"  joint-heads keys: torch eigh of {L} x {H * d}x{H * d}", ms, note="codec default; > 128: no kernel")
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    parts, iters = compress()
    report.data["kmeans_iters"] = iters

    # ---- the state as one pinned host buffer (per layer: K then V tensors, 256-byte aligned) --
    names = ("codes", "scale", "mn", "basis_t", "mean")
    layer_chunks, offsets, cursor = [], [], 0
    for layer in range(L):
        start = cursor
        offs = {}
        for s in (0, 1):
            for nm in names:
                t = parts[s][nm][layer]
                nb = t.numel() * t.element_size()
                offs[(s, nm)] = (cursor, t.dtype, tuple(t.shape), nb)
                cursor += (nb + 255) // 256 * 256
        layer_chunks.append((start, cursor))
        offsets.append(offs)
    state_bytes = cursor
    report.data["state_bytes"] = state_bytes
    report.data["ratio_vs_bf16"] = raw_bytes / state_bytes
    host = torch.empty(state_bytes, dtype=torch.uint8, pin_memory=PIN)
    for layer in range(L):
        for (s, nm), (off, dt, shape, nb) in offsets[layer].items():
            src = parts[s][nm][layer].contiguous().view(-1).view(torch.uint8)
            host[off:off + nb].copy_(src.cpu())
    staging = torch.empty(state_bytes, dtype=torch.uint8, device=DEV)
    Kc = torch.empty(L, H, T, d, dtype=torch.bfloat16, device=DEV)
    Vc = torch.empty_like(Kc)
    lay = {0: kc[2].to(DEV), 1: vc[2].to(DEV)}
    boff = {0: kc[1].to(DEV), 1: vc[1].to(DEV)}

    def view(layer, s, nm):
        off, dt, shape, nb = offsets[layer][(s, nm)]
        return staging[off:off + nb].view(dt).view(shape)

    launchers = [[load.prepare_pca_load(dst[layer], view(layer, s, "codes"), view(layer, s, "scale"),
                                        view(layer, s, "mn"), lay[s], boff[s], view(layer, s, "basis_t"),
                                        view(layer, s, "mean"), T, cos=cos if s == 0 else None,
                                        sin=sin if s == 0 else None)
                  for s, dst in ((0, Kc), (1, Vc))] for layer in range(L)]

    def decode_layer(layer):
        for launch in launchers[layer]:
            launch()

    def load_one_copy():
        staging.copy_(host, non_blocking=True)
        for layer in range(L):
            decode_layer(layer)

    copy_stream = torch.cuda.Stream() if DEV == "cuda" else None

    def load_pipelined(src=host):
        events = []
        with on_stream(copy_stream):
            for a, b in layer_chunks:
                staging[a:b].copy_(src[a:b], non_blocking=True)
                ev = event()
                ev.record(copy_stream)
                events.append(ev)
        for layer in range(L):
            wait(events[layer])
            decode_layer(layer)

    wire_floor = state_bytes / PCIE_BPS * 1e3
    note = f"state {state_bytes / 1e6:.1f} MB = 1/{raw_bytes / state_bytes:.2f} of bf16 KV"
    report.row("load from pinned host (one copy, then decode)", cuda_ms(load_one_copy, reps=10), wire_floor, note=note)
    report.row("load from pinned host (pipelined per layer)", cuda_ms(load_pipelined, reps=10), wire_floor,
               note="target <= 10 ms")
    staging.copy_(host)
    report.row(f"  decode only ({2 * L} fused kernels, HBM-resident)",
               cuda_ms(lambda: [decode_layer(layer) for layer in range(L)], reps=10),
               (state_bytes + raw_bytes) / HBM_BPS * 1e3, note="dequant + reconstruct + RoPE -> bf16")
    # correctness of the GPU load against the torch fallback on one layer
    lc = min(3, L - 1)
    ref_k = load.pca_load_torch(torch.empty(H, T, d, dtype=torch.bfloat16, device=DEV), view(lc, 0, "codes"),
                                view(lc, 0, "scale"), view(lc, 0, "mn"), lay[0], boff[0], view(lc, 0, "basis_t"),
                                view(lc, 0, "mean"), T, cos=cos, sin=sin)
    report.data["load_vs_fallback_maxdiff"] = float((Kc[lc].float() - ref_k.float()).abs().max())
    report.data["load_vs_fallback_maxref"] = float(ref_k.float().abs().max())
    report.data["recon_rel_err_k_layer3"] = float((Kc[lc].float() - K[lc].float()).norm() / K[lc].float().norm())

    # ---- from a file in the page cache ----------------------------------------------------------
    path = Path(tempfile.gettempdir()) / "kite_gpu_speed.state"
    with open(path, "wb") as f:
        f.write(host.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    hostf = torch.empty(state_bytes, dtype=torch.uint8, pin_memory=PIN)
    buf = hostf.numpy()
    pool = ThreadPoolExecutor(8)

    def read_chunk(a, b):
        mv = memoryview(buf)[a:b]
        got = 0
        while got < b - a:
            got += os.preadv(fd, [mv[got:]], a + got)

    def load_file():
        futures = [pool.submit(read_chunk, a, b) for a, b in layer_chunks]
        for layer, (a, b) in enumerate(layer_chunks):
            futures[layer].result()
            with on_stream(copy_stream):
                staging[a:b].copy_(hostf[a:b], non_blocking=True)
                ev = event()
                ev.record(copy_stream)
            wait(ev)
            decode_layer(layer)

    load_file()
    report.row("load from file in page cache (8 read threads, pipelined)", host_ms(load_file, reps=7),
               wire_floor, note="target <= 40 ms")
    os.close(fd)
    path.unlink()

    # ---- time to first token from the state ----------------------------------------------------
    from transformers import DynamicCache

    def ttft_state():
        load_pipelined()
        c = DynamicCache(config=cfg)
        for layer in range(L):
            c.update(Kc[layer][None], Vc[layer][None], layer)
        with torch.inference_mode():
            o = model(query, past_key_values=c, position_ids=(T + torch.arange(QUERY, device=DEV))[None],
                      logits_to_keep=1)
        return o.logits.argmax(-1), c

    def assemble():
        c = DynamicCache(config=cfg)
        for layer in range(L):
            c.update(Kc[layer][None], Vc[layer][None], layer)
        return c

    ms_ttft = host_ms(lambda: ttft_state(), reps=5)
    ms_asm = cuda_ms(assemble, reps=5)

    def first_forward():
        c = assemble()
        with torch.inference_mode():
            model(query, past_key_values=c, position_ids=(T + torch.arange(QUERY, device=DEV))[None],
                  logits_to_keep=1)

    ms_fwd = cuda_ms(first_forward, reps=5) - ms_asm
    report.row("TTFT from state (load + cache + 16-token forward)", ms_ttft, note=f"{prefill_ms / ms_ttft:.1f}x "
               "faster than prefill; target >= 8x")
    report.row("  cache assembly (DynamicCache.update copies)", ms_asm, raw_bytes * 2 / HBM_BPS * 1e3)
    report.row("  first forward, 16 query tokens at 16K context", ms_fwd,
               (2 * n_params + raw_bytes) / HBM_BPS * 1e3, note="floor: bf16 weights + KV read once")
    _, c = ttft_state()
    nxt = query[:, :1]

    def one_token():
        with torch.inference_mode():
            model(nxt, past_key_values=c, position_ids=torch.tensor([[T + QUERY]], device=DEV), logits_to_keep=1)
        try:
            c.crop(T + QUERY)   # transformers <= 5.2x: keep this many tokens
        except ValueError:
            c.crop(-1)          # newer: remove this many

    report.row("  eager 1-token decode step at 16K (for reference)", cuda_ms(one_token, reps=5),
               (2 * n_params + raw_bytes) / HBM_BPS * 1e3, vs_prefill=False)

    text = report.table(prefill_ms)
    report.data["table"] = text
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report.data, indent=1, default=str))
    print(json.dumps({k: v for k, v in report.data.items() if k not in ("table",) and not isinstance(v, dict)
                      or k in ("checks", "build")}, default=str))
    print(text)


if __name__ == "__main__":
    main()
