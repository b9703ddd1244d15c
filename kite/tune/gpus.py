"""The GPUs KITE knows: memory, bandwidth and bf16 rate from the vendors' datasheets (the one
definition of each hardware limit: `kite capacity-plan` and the benchmarks' floors read it, the
latter through `gpu_limits`), and the H200 figures this project measured (package data,
kite/tune/calibration/h200.json), which correct the planner's roofline.

Every datasheet figure is the dense one: NVIDIA's tensor rates are printed "with sparsity"; dense
is half. Memory is the datasheet's GB (1e9 B). `host_link_gbps` is one direction of the host link
(PCIe Gen5 x16 128 GB/s bidirectional = 64 GB/s each way; a pinned copy measures ~55 GB/s of it on
the H200, which the calibration's hot-tier load carries, not the limit).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from importlib import resources

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



@dataclass(frozen=True, slots=True)
class GpuLimits:
    """One GPU's hardware limits in SI units, for floors: `memory_bytes`, `hbm_bytes_per_s`,
    `bf16_flops` (dense, per second), `host_link_bytes_per_s` (one way) and `source` (where each
    comes from: all datasheet figures)."""

    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float
    host_link_bytes_per_s: float
    source: str


def gpu_limits(name: str) -> GpuLimits:
    """The limits of the table's GPU `name` (case-insensitive, aliases as `gpu_spec`); BadInput
    for a GPU the table does not have."""
    spec = gpu_spec(name)
    return GpuLimits(spec.name, spec.mem_gb * 1e9, spec.hbm_tbps * 1e12, spec.bf16_tflops * 1e12,
                     spec.host_link_gbps * 1e9, f"datasheet: {spec.source}")


# --------------------------------------------------------------------------- measured on the H200

CALIBRATION_SCHEMA = "kite.tune.calibration/1"
_FIGURES = {  # field -> the unit its figure is recorded in
    "prefill_ms": "ms", "query_forward_ms": "ms", "hot_tier_load_ms": "ms", "compress_ms": "ms",
    "batch_step_ms": "ms", "batch_step_seqs": "", "attention_step_ms": "ms", "attention_seqs": "",
    "resident_step_ms": "ms", "resident_seqs": "", "hot_tier_bytes": "B", "lanes_kernel_ms": "ms",
    "lanes_seqs": "", "lanes_kernel_bytes": "B", "lanes_encode_s": "s",
}
_RESULT = re.compile(r"[a-z0-9_]+_[a-z0-9-]+_\d{8}_[0-9a-f]{7}(?:_[A-Za-z0-9_-]+)?\.json")


@dataclass(frozen=True, slots=True)
class Cited:
    """One measured figure and the run behind it: a result file under benchmarks/results, its row,
    the commit and the day."""

    value: float
    unit: str
    result: str
    row: str
    commit: str
    date: str


@dataclass(frozen=True, slots=True)
class Measured:
    """What the benchmarks measured on one GPU (Qwen2-7B geometry: 28 layers, 28 query / 4 KV heads,
    head_dim 128, bf16; a 16,384-token document + a 16-token query; medians, ms). The planner turns
    them into corrections of its roofline (kite.tune.roofline). `figures` cites the run of each."""

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
    # states resident in 4-bit nibble lanes (kite serve --resident lanes; benchmarks/lanes_decode.py):
    # the decode kernel over all layers of `lanes_seqs` states of `lanes_kernel_bytes` each, and
    # coding one state into lanes (its load's extra)
    lanes_kernel_ms: float
    lanes_seqs: int
    lanes_kernel_bytes: int
    lanes_encode_ms: float
    figures: dict                # field -> Cited

    def _runs(self, *fields: str) -> str:
        cites = [self.figures[f] for f in (fields or self.figures)]
        files = list(dict.fromkeys(c.result for c in cites))
        return ", ".join(f"benchmarks/results/{f}" for f in files)

    @property
    def calibration(self) -> str:
        """The calibration by name: the GPU, the days and commits of its runs."""
        cites = self.figures.values()
        days = sorted({c.date for c in cites})
        commits = list(dict.fromkeys(c.commit[:7] for c in sorted(cites, key=lambda c: c.date)))
        span = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"
        return f"{self.gpu} calibration of {span} (commits {', '.join(commits)})"

    @property
    def source(self) -> str:
        return f"{self.calibration}: {self._runs()}"

    @property
    def steps_source(self) -> str:
        return self._runs("attention_step_ms", "resident_step_ms", "batch_step_ms")

    @property
    def lanes_source(self) -> str:
        return self._runs("lanes_kernel_ms", "lanes_encode_s")

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__slots__ if k != "figures"}
        d["figures"] = {k: asdict(c) for k, c in self.figures.items()}
        return {**d, "calibration": self.calibration, "source": self.source}


def _bad(where: str, why: str) -> BadInput:
    return BadInput(f"{where}: not a {CALIBRATION_SCHEMA} calibration: {why}")


def _positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def parse_calibration(obj, where: str = "calibration") -> Measured:
    """The measurements an envelope `obj` holds; BadInput (one line, starting with `where`) when it
    is not the schema: every figure of `_FIGURES` with a positive value in its unit, a result file
    name, its row, a git commit and a YYYY-MM-DD date."""
    if not isinstance(obj, dict) or obj.get("schema") != CALIBRATION_SCHEMA:
        raise _bad(where, "no schema line")
    if not isinstance(obj.get("gpu"), str) or obj["gpu"] not in GPUS:
        raise _bad(where, f"gpu {obj.get('gpu')!r} is not in the GPU table")
    for k in ("tokens", "query_tokens"):
        if not _positive_int(obj.get(k)):
            raise _bad(where, f"{k} must be a positive whole number")
    if not isinstance(obj.get("hot_tier_ratio_of"), (int, float)) or obj["hot_tier_ratio_of"] <= 0:
        raise _bad(where, "hot_tier_ratio_of must be a positive number")
    figs = obj.get("figures")
    if not isinstance(figs, dict):
        raise _bad(where, "figures must be an object")
    missing = [k for k in _FIGURES if k not in figs]
    if missing:
        raise _bad(where, f"figures lack {', '.join(missing)}")
    cited = {}
    for k, unit in _FIGURES.items():
        f = figs[k]
        if not isinstance(f, dict):
            raise _bad(where, f"figures.{k} must be an object")
        v = f.get("value")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise _bad(where, f"figures.{k}: value must be a positive number")
        if f.get("unit") != unit:
            raise _bad(where, f"figures.{k}: unit must be {unit!r}")
        if not (isinstance(f.get("result"), str) and _RESULT.fullmatch(f["result"])):
            raise _bad(where, f"figures.{k}: result must name a file of benchmarks/results")
        if not (isinstance(f.get("row"), str) and f["row"]):
            raise _bad(where, f"figures.{k}: row must name the result's row")
        if not (isinstance(f.get("commit"), str) and re.fullmatch(r"[0-9a-f]{40}", f["commit"])):
            raise _bad(where, f"figures.{k}: commit must be a full git hash")
        if not (isinstance(f.get("date"), str) and re.fullmatch(r"\d{4}-\d\d-\d\d", f["date"])):
            raise _bad(where, f"figures.{k}: date must be YYYY-MM-DD")
        cited[k] = Cited(float(v), unit, f["result"], f["row"], f["commit"], f["date"])
    val = {k: c.value for k, c in cited.items()}
    ints = ("batch_step_seqs", "attention_seqs", "resident_seqs", "lanes_seqs", "hot_tier_bytes", "lanes_kernel_bytes")
    for k in ints:
        if val[k] != int(val[k]):
            raise _bad(where, f"figures.{k}: value must be a whole number")
    return Measured(
        gpu=obj["gpu"], tokens=obj["tokens"], query_tokens=obj["query_tokens"],
        prefill_ms=val["prefill_ms"], batch_step_ms=val["batch_step_ms"], batch_step_seqs=int(val["batch_step_seqs"]),
        query_forward_ms=val["query_forward_ms"], hot_tier_load_ms=val["hot_tier_load_ms"],
        hot_tier_bytes=int(val["hot_tier_bytes"]), hot_tier_ratio_of=float(obj["hot_tier_ratio_of"]),
        attention_step_ms=val["attention_step_ms"], attention_seqs=int(val["attention_seqs"]),
        resident_step_ms=val["resident_step_ms"], resident_seqs=int(val["resident_seqs"]),
        compress_ms=val["compress_ms"], lanes_kernel_ms=val["lanes_kernel_ms"], lanes_seqs=int(val["lanes_seqs"]),
        lanes_kernel_bytes=int(val["lanes_kernel_bytes"]), lanes_encode_ms=val["lanes_encode_s"] * 1e3,
        figures=cited)


def read_packaged_calibration(name: str) -> tuple[object, str]:
    """The JSON of the packaged calibration kite/tune/calibration/<name>.json and that path (for
    messages); BadInput, one line, when it is missing or not JSON. Its schema is the caller's."""
    where = f"kite/tune/calibration/{name}.json"
    try:
        text = resources.files("kite.tune").joinpath("calibration", f"{name}.json").read_text()
    except (FileNotFoundError, OSError):
        raise BadInput(f"{where}: no such calibration") from None
    try:
        return json.loads(text), where
    except json.JSONDecodeError as e:
        raise BadInput(f"{where}: not a calibration: not JSON ({e})") from None


def load_calibration(name: str = "h200") -> Measured:
    """The packaged calibration kite/tune/calibration/<name>.json, validated (BadInput, one line,
    when missing or not the schema)."""
    return parse_calibration(*read_packaged_calibration(name))


H200_MEASURED = load_calibration("h200")
MEASURED: dict[str, Measured] = {"H200": H200_MEASURED}


def measured_for(spec: GpuSpec) -> tuple[Measured, bool]:
    """(the measurements that correct `spec`'s roofline, whether they were made on this GPU). A GPU
    this project has not measured borrows the H200's corrections (its efficiencies and fixed
    costs), which the plan says."""
    own = MEASURED.get(spec.name)
    return (own, True) if own is not None else (H200_MEASURED, False)
