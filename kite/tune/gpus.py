"""The GPUs `kite capacity-plan` knows: memory, bandwidth and bf16 rate from the vendors' datasheets,
and the H200 figures this project measured, which correct the roofline.

Every datasheet figure is the dense one: NVIDIA's tensor rates are printed "with sparsity"; dense
is half. Memory is the datasheet's GB (1e9 B). `host_link_gbps` is one direction of the host link
(PCIe Gen5 x16 128 GB/s bidirectional = 64 GB/s each way).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kite.errors import BadInput


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU model: HBM in GB, HBM bandwidth in TB/s, dense bf16 tensor rate in TFLOP/s, host
    link in GB/s (one way), and where the figures come from."""

    name: str
    mem_gb: float
    hbm_tbps: float | None
    bf16_tflops: float | None
    host_link_gbps: float | None
    source: str

    @property
    def has_rates(self) -> bool:
        return bool(self.hbm_tbps and self.bf16_tflops)

    def to_dict(self) -> dict:
        return asdict(self)


_H = "NVIDIA H200 Tensor Core GPU datasheet"
_H1 = "NVIDIA H100 Tensor Core GPU datasheet"
_A1 = "NVIDIA A100 Tensor Core GPU datasheet"

GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("H200", 141, 4.8, 989.5, 64,
            f"{_H}, H200 SXM: 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with sparsity; PCIe Gen5 128 GB/s"),
    GpuSpec("H200-NVL", 141, 4.8, 835.5, 64,
            f"{_H}, H200 NVL: 141 GB HBM3e, 4.8 TB/s, BF16 1,671 TFLOPS with sparsity; PCIe Gen5 128 GB/s"),
    GpuSpec("H100-80G", 80, 3.35, 989.5, 64,
            f"{_H1}, H100 SXM: 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with sparsity; PCIe Gen5 128 GB/s"),
    GpuSpec("H100-PCIE", 80, 2.0, 756.5, 64,
            f"{_H1}, H100 PCIe: 80 GB HBM2e, 2.0 TB/s, BF16 1,513 TFLOPS with sparsity; PCIe Gen5 128 GB/s"),
    GpuSpec("H100-NVL", 94, 3.9, 835.5, 64,
            f"{_H1}, H100 NVL: 94 GB HBM3, 3.9 TB/s, BF16 1,671 TFLOPS with sparsity; PCIe Gen5 128 GB/s"),
    GpuSpec("A100-80G", 80, 2.039, 312, 32,
            f"{_A1}, A100 80GB SXM: 80 GB HBM2e, 2,039 GB/s, BF16 312 TFLOPS (624 with sparsity); "
            "PCIe Gen4 64 GB/s"),
    GpuSpec("A100-40G", 40, 1.555, 312, 32,
            f"{_A1}, A100 40GB SXM: 40 GB HBM2, 1,555 GB/s, BF16 312 TFLOPS (624 with sparsity); "
            "PCIe Gen4 64 GB/s"),
    GpuSpec("L40S", 48, 0.864, 362.05, 32,
            "NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, BF16 733 TFLOPS with sparsity; PCIe Gen4 x16 "
            "64 GB/s bidirectional"),
    GpuSpec("L4", 24, 0.3, 121, 32,
            "NVIDIA L4 Tensor Core GPU datasheet: 24 GB GDDR6, 300 GB/s, BF16 242 TFLOPS with sparsity; "
            "PCIe Gen4 x16 64 GB/s"),
    GpuSpec("A10", 24, 0.6, 125, 32,
            "NVIDIA A10 Tensor Core GPU datasheet: 24 GB GDDR6, 600 GB/s, BF16 250 TFLOPS with sparsity; "
            "PCIe Gen4 64 GB/s"),
)}
ALIASES = {"H200-SXM": "H200", "H100": "H100-80G", "H100-SXM": "H100-80G", "A100": "A100-80G",
           "A100-80GB": "A100-80G", "A100-40GB": "A100-40G", "H100-80GB": "H100-80G"}


def gpu_spec(name: str, mem_gb: float | None = None, hbm_tbps: float | None = None,
             bf16_tflops: float | None = None) -> GpuSpec:
    """The table's GPU `name` (case-insensitive), its memory replaced by `mem_gb` when given. A GPU
    not in the table needs `mem_gb` (memory figures only) and, for times, `hbm_tbps` and
    `bf16_tflops`; without `mem_gb` it is refused (BadInput) with the names the table has."""
    key = name.strip().upper()
    key = ALIASES.get(key, key)
    spec = GPUS.get(key)
    if spec is None:
        if mem_gb is None:
            raise BadInput(f"--gpu {name}: not in the GPU table ({', '.join(GPUS)}); give its memory with "
                           "--gpu-mem-gb (and --gpu-hbm-tbps, --gpu-bf16-tflops for times)")
        return GpuSpec(name.strip(), float(mem_gb), hbm_tbps, bf16_tflops, 32,
                       "given on the command line; host link taken as PCIe Gen4 x16 (32 GB/s each way)")
    changed = {k: v for k, v in (("mem_gb", mem_gb), ("hbm_tbps", hbm_tbps), ("bf16_tflops", bf16_tflops))
               if v is not None}
    if not changed:
        return spec
    told = ", ".join(f"{k} {v:g}" for k, v in changed.items())
    return GpuSpec(**{**asdict(spec), **changed, "source": f"{spec.source}; {told} given on the command line"})


# --------------------------------------------------------------------------- measured on the H200

@dataclass(frozen=True, slots=True)
class Measured:
    """What `benchmarks/gpu_speed.py` measured on this project's H200 (Qwen2-7B geometry: 28 layers,
    28 query / 4 KV heads, head_dim 128, bf16; a 16,384-token document + a 16-token query; medians,
    ms). The planner turns them into corrections of its roofline (kite.tune.roofline). `source`
    names the run(s) every field comes from."""

    source: str
    gpu: str
    tokens: int                  # document tokens of every figure
    query_tokens: int
    prefill_ms: float            # document + query, TTFT without a state (sdpa)
    batch_step_ms: float         # one decode step of `batch_step_seqs` raw 16K sequences, KITE's path:
    batch_step_seqs: int         # fused layers, the whole forward, CUDA graph (what the step costs)
    query_forward_ms: float      # the 16 query tokens over the 16K state, CUDA graph (KITE's attention)
    hot_tier_load_ms: float      # the state from pinned host memory into the GPU, rebuilt
    hot_tier_bytes: int          # the bytes that load copies: the state as staged (ratio 4)
    hot_tier_ratio_of: float     # the nominal ratio of that state
    attention_step_ms: float     # attention of one decode step over `attention_seqs` raw sequences
    attention_seqs: int
    resident_step_ms: float      # the same over `resident_seqs` compressed states, rebuilt per layer
    resident_seqs: int
    compress_ms: float           # compress one document (codec default, ratio 4), wall
    steps_source: str            # the run of attention_step_ms and resident_step_ms
    # states resident in 4-bit nibble lanes (kite serve --resident lanes; benchmarks/lanes_decode.py):
    # the decode kernel over all layers of `lanes_seqs` states of `lanes_kernel_bytes` each, and
    # coding one state into lanes (its load's extra)
    lanes_kernel_ms: float
    lanes_seqs: int
    lanes_kernel_bytes: int
    lanes_encode_ms: float
    lanes_source: str

    def to_dict(self) -> dict:
        return asdict(self)


# Session 9 (docs/gpu_speed_h200_ff_session9.json): KITE's GPU path of today (the query's first
# forward through the split-KV kernel and fused layers). Its twin run on another machine start
# (docs/gpu_speed_h200_ff_session9_repeat.json) is what the planner is checked against. Those runs
# skipped the concurrency rows, so the batched attention step and the resident (rebuilt) step stay
# session 4's (docs/gpu_speed_h200_session4.json, run 13; session 5: 9.555 and 1,493.263 ms). The
# whole decode step is session 10's over 42 raw sequences with KITE's fused layers (until session
# 12 it was HF transformers' one-token static-cache step, 15.191 ms at batch 1: 11.6 ms of fixed
# cost that KITE's path does not spend); the lanes runs of sessions 11 and 13 measured it again.
# hot_tier_bytes: the staged state the hot-tier load copies (gpu_speed.py's `hot.nbytes`; the
# session-9 row's floor 4.4718 ms = 245,948,416 B / 55 GB/s), not the .upc file (237,642,762 B).
H200_MEASURED = Measured(
    source="docs/gpu_speed_h200_ff_session9.json (benchmarks/gpu_speed.py, H200, session 9: prefill, "
           "first forward with KITE attention (split-KV kernel + fused layers), hot-tier load, compress); the "
           "whole decode step over 42 raw sequences (fused layers) from docs/gpu_speed_h200_fused_steps_session10.json; "
           "batched attention and resident rebuild steps from docs/gpu_speed_h200_session4.json (session 4 run 13: "
           "the session-9 runs skipped the concurrency rows)",
    gpu="H200", tokens=16384, query_tokens=16,
    prefill_ms=490.268, batch_step_ms=13.595, batch_step_seqs=42, query_forward_ms=5.519,
    hot_tier_load_ms=7.724, hot_tier_bytes=245_948_416, hot_tier_ratio_of=4.0,
    attention_step_ms=9.398, attention_seqs=42, resident_step_ms=1642.454, resident_seqs=161,
    compress_ms=44.326,
    steps_source="docs/gpu_speed_h200_session4.json, session 4 run 13 (the attention and rebuild steps); "
                 "docs/gpu_speed_h200_fused_steps_session10.json (the whole decode step over 42 raw sequences)",
    lanes_kernel_ms=19.409, lanes_seqs=160, lanes_kernel_bytes=249_561_088,
    lanes_encode_ms=180.0,
    lanes_source="docs/lanes_decode_h200_session13_a.json (benchmarks/lanes_decode.py, H200, session 13: "
                 "4-bit lanes, groups of 512, 160 states at a 40 GB budget: kernel 19.41 ms, step 25.23 ms; raw bf16 "
                 "42 sequences 13.92 ms in the same run; coding a state's 28 layers into lanes 0.18 s, warm "
                 "(docs/lanes_decode_h200_session13_b.json, the twin run: 19.41 / 25.14 / 13.92 ms, 0.16 s))",
)
MEASURED: dict[str, Measured] = {"H200": H200_MEASURED}


def measured_for(spec: GpuSpec) -> tuple[Measured, bool]:
    """(the measurements that correct `spec`'s roofline, whether they were made on this GPU). A GPU
    this project has not measured borrows the H200's corrections (its efficiencies and fixed
    costs), which the plan says."""
    own = MEASURED.get(spec.name)
    return (own, True) if own is not None else (H200_MEASURED, False)
