"""Hardware floors: the time to move N bytes at a GPU's HBM bandwidth or over its host link, and to
do F FLOPs at its dense bf16 tensor rate; on the CPU, to move N bytes at this machine's memory
bandwidth and to do F FLOPs at its fp32 matmul rate. The GPU limits come from the library's GPU table
(kite.tune.gpus) through :func:`gpu_limits` alone: the one place that reads it; the CPU's are measured
once per process by :func:`cpu_limits` (a short copy and matmul probe) and recorded in the result's
``raw["cpu_limits"]`` with how they were measured."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kite.tune.gpus import GpuLimits

DEFAULT_GPU = "H200"     # the GPU the project's figures are taken on: the floors where no GPU is present


def gpu_limits(name: str = DEFAULT_GPU) -> GpuLimits:
    """The limits of GPU ``name`` (the table's names and aliases: "H200", "H100", ...): the one place
    benchmarks/ reads the library's GPU table. ValueError for a GPU without bandwidth or bf16 rate."""
    from kite.tune.gpus import gpu_limits as table_limits

    lim = table_limits(name)
    if not (lim.hbm_bytes_per_s and lim.bf16_flops and lim.host_link_bytes_per_s):
        raise ValueError(f"GPU {name}: the table has no bandwidth or bf16 rate for it")
    return lim


def this_gpu() -> str:
    """The table's name of this machine's first CUDA device; DEFAULT_GPU without one."""
    try:
        import torch
    except ImportError:
        return DEFAULT_GPU
    return gpu_name(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else DEFAULT_GPU


def gpu_name(device_name: str | None) -> str:
    """The table's name for a torch device name ("NVIDIA H200" -> "H200", "NVIDIA H100 80GB HBM3" ->
    "H100-80G"); DEFAULT_GPU when there is none or the table does not know it."""
    for word in reversed((device_name or "").upper().replace("NVIDIA", "").split()):
        try:
            return gpu_limits(word).name
        except Exception:  # noqa: BLE001 - not a name the table knows: the next word
            continue
    return DEFAULT_GPU


def _check(n: float, what: str) -> float:
    if not n >= 0:
        raise ValueError(f"{what} must be >= 0, got {n}")
    return float(n)


def bytes_ms(n_bytes: float, gpu: str | None = None) -> float:
    """ms to move ``n_bytes`` once at the GPU's HBM bandwidth (``gpu``: a table name; default this
    machine's GPU, the H200 without one)."""
    return _check(n_bytes, "bytes") / gpu_limits(gpu or this_gpu()).hbm_bytes_per_s * 1e3


def flops_ms(flops: float, gpu: str | None = None) -> float:
    """ms to do ``flops`` at the GPU's dense bf16 tensor rate."""
    return _check(flops, "FLOPs") / gpu_limits(gpu or this_gpu()).bf16_flops * 1e3


def host_link_ms(n_bytes: float, gpu: str | None = None) -> float:
    """ms to move ``n_bytes`` one way over the GPU's host link (PCIe)."""
    return _check(n_bytes, "bytes") / gpu_limits(gpu or this_gpu()).host_link_bytes_per_s * 1e3


def hbm_text(gpu: str | None = None) -> str:
    """"at 4.8 TB/s (H200 HBM)": the bandwidth a bytes floor assumes, for a row's floor text."""
    gpu = gpu or this_gpu()
    return f"at {gpu_limits(gpu).hbm_bytes_per_s / 1e12:g} TB/s ({gpu} HBM)"


def bf16_text(gpu: str | None = None) -> str:
    gpu = gpu or this_gpu()
    return f"at {gpu_limits(gpu).bf16_flops / 1e12:g} TFLOP/s ({gpu} dense bf16)"


def host_link_text(gpu: str | None = None) -> str:
    gpu = gpu or this_gpu()
    return f"at {gpu_limits(gpu).host_link_bytes_per_s / 1e9:g} GB/s ({gpu} host link, one way)"


# ---------------------------------------------------------------- this CPU, measured

COPY_MIB = 256          # the bandwidth probe's buffer: past the caches, a copy and a read of it
MATMUL_N = 2048         # the compute probe: an fp32 n x n matmul on every thread torch uses
PROBE_CALLS = 3         # calls of each probe at least; the best one counts
PROBE_S = 0.3           # seconds each probe goes on calling while it lasts


@dataclass(frozen=True)
class CpuLimits:
    """This machine's memory bandwidth (bytes/s) and fp32 matmul rate (FLOP/s), measured by
    :func:`cpu_limits`; each with what it was measured by, where and when (``*_source``)."""

    bytes_per_s: float
    fp32_flops: float
    bytes_source: str
    flops_source: str
    threads: int

    def to_dict(self) -> dict:
        return {"bytes_per_s": self.bytes_per_s, "fp32_flops": self.fp32_flops, "bytes_source": self.bytes_source,
                "flops_source": self.flops_source, "threads": self.threads}


_CPU: CpuLimits | None = None


def cpu_limits() -> CpuLimits:
    """This CPU's limits, measured once per process (1-2 s; cached): the memory bandwidth is
    the better of a 256 MiB fp32 copy (bytes read + written over its time) and a 256 MiB sum (bytes read
    over its time), the compute rate a 2048 x 2048 fp32 matmul (2 n^3 FLOPs over its time) on every
    thread torch uses; each the best of the calls that fit in ``PROBE_S`` (at least ``PROBE_CALLS``). A
    floor from them is what the machine showed it can do, not a datasheet figure; on a shared machine,
    what it could do at that moment (the run's timings share that load)."""
    global _CPU
    if _CPU is None:
        _CPU = _measure_cpu()
    return _CPU


def measured_cpu_limits() -> dict | None:
    """The limits as a result's ``raw["cpu_limits"]`` when this process measured them, else None."""
    return _CPU.to_dict() if _CPU is not None else None


def _best_s(fn, budget_s: float) -> tuple[float, int]:
    """(the fastest call's seconds, calls made): ``fn`` called at least ``PROBE_CALLS`` times and on
    while ``budget_s`` lasts (a shared machine's load only slows a call down: more calls, a better best)."""
    from .timing import clock

    best, calls, start = float("inf"), 0, clock()
    while calls < PROBE_CALLS or clock() - start < budget_s:
        t = clock()
        fn()
        best, calls = min(best, clock() - t), calls + 1
    return best, calls


def _measure_cpu() -> CpuLimits:
    import torch

    from .results import cpu_model

    day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    cpu, cores = cpu_model()
    threads = torch.get_num_threads()
    where = f"{day} on {cpu}, {threads} torch threads of {cores} cores"
    n = COPY_MIB * 2**20 // 4
    src, dst = torch.empty(n), torch.empty(n)
    src.fill_(1.0)
    copy_s, copies = _best_s(lambda: dst.copy_(src), PROBE_S)
    read_s, reads = _best_s(lambda: src.sum(), PROBE_S)
    copy, read = 2 * n * 4 / copy_s, n * 4 / read_s
    how = (f"{COPY_MIB} MiB copy (read + written), best of {copies}" if copy >= read else
           f"{COPY_MIB} MiB sum (read), best of {reads}")
    bw = max(copy, read)
    bytes_source = (f"measured: {how}: {bw / 1e9:.3g} GB/s (copy {copy / 1e9:.3g}, read {read / 1e9:.3g}), {where}")
    a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
    mm_s, mms = _best_s(lambda: a @ b, PROBE_S)
    flops = 2 * MATMUL_N**3 / mm_s
    flops_source = (f"measured: {MATMUL_N} x {MATMUL_N} fp32 matmul, best of {mms}: {flops / 1e9:.3g} GFLOP/s, "
                    f"{where}")
    return CpuLimits(bw, flops, bytes_source, flops_source, threads)


def cpu_bytes_ms(n_bytes: float) -> float:
    """ms to move ``n_bytes`` once at this CPU's measured memory bandwidth (:func:`cpu_limits`)."""
    return _check(n_bytes, "bytes") / cpu_limits().bytes_per_s * 1e3


def cpu_flops_ms(flops: float) -> float:
    """ms to do ``flops`` at this CPU's measured fp32 matmul rate (:func:`cpu_limits`)."""
    return _check(flops, "FLOPs") / cpu_limits().fp32_flops * 1e3


def cpu_mem_text() -> str:
    """"at 9.6 GB/s (this CPU's memory, measured)": the bandwidth a CPU bytes floor assumes."""
    return f"at {cpu_limits().bytes_per_s / 1e9:.3g} GB/s (this CPU's memory, measured)"


def cpu_fp32_text() -> str:
    """"at 86 GFLOP/s (this CPU's fp32 matmul, measured)": the rate a CPU FLOPs floor assumes."""
    return f"at {cpu_limits().fp32_flops / 1e9:.3g} GFLOP/s (this CPU's fp32 matmul, measured)"


def cpu_floor(n_bytes: float = 0, flops: float = 0, what_bytes: str | None = None,
              what_flops: str | None = None) -> tuple[str, float]:
    """(text, ms): the larger of two CPU floors, ``n_bytes`` moved once at the memory bandwidth and
    ``flops`` done at the fp32 rate; the text names the one that bounds and says it is the larger
    (``what_bytes`` / ``what_flops``: what the bytes and FLOPs are, e.g. "weights + KV read once")."""
    b, f = cpu_bytes_ms(n_bytes), cpu_flops_ms(flops)
    by_bytes = b >= f
    text = (f"{what_bytes or f'{n_bytes / 1e6:.4g} MB read once'} {cpu_mem_text()}" if by_bytes else
            f"{what_flops or f'{flops / 1e9:.4g} GFLOP'} {cpu_fp32_text()}")
    if n_bytes and flops:
        text += ", above its FLOPs' floor" if by_bytes else ", above its bytes' floor"
    return text, max(b, f)


def cpu_forward_floor(lm, tokens: int = 1, kv_tokens: float = 0, what: str | None = None,
                      kv_bytes: float | None = None) -> tuple[str, float]:
    """(text, ms): the CPU floor of a forward of ``tokens`` new tokens per row over ``lm`` (a loaded
    model: ``.model``, ``.geometry``) with ``kv_tokens`` cached tokens in all (every row's together):
    the larger of its weights + that KV read once at the memory bandwidth and its matmuls
    (2 x parameters x tokens FLOPs; attention's left out) at the fp32 rate. ``tokens`` counts every
    row's new tokens (a decode step of 8 rows: 8). ``kv_bytes``: the KV's bytes where the caller knows
    them (a batch cache's bytes in use), instead of ``kv_tokens`` at the parameters' dtype."""
    model = getattr(lm, "model", lm)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    elem = params[0].element_size() if params else 4
    if kv_bytes is None:
        kv_bytes = lm.geometry.kv_bytes_per_token("fp32") * elem / 4 * kv_tokens
    what = what or f"{tokens} token{'s' * (tokens != 1)}' forward"
    kv = (f" + KV of {kv_tokens:.0f} tokens ({kv_bytes / 1e6:.3g} MB)" if kv_tokens else
          f" + KV ({kv_bytes / 1e6:.3g} MB)" if kv_bytes else "")
    return cpu_floor(weight_bytes + kv_bytes, 2 * n_params * tokens,
                     f"{what}: weights ({weight_bytes / 1e6:.3g} MB){kv} read once",
                     f"{what}: 2 x {n_params / 1e6:.0f}M parameters x {tokens} tokens")


def model_shape(spec: str | None = None):
    """A stand-in for a loaded model of ``spec`` whose weights are never read: ``.model`` on torch's meta
    device (its parameters' counts and dtype, no memory), ``.geometry``, ``.tokenizer``; for the floors
    of a script that talks to a server holding the model (:func:`cpu_forward_floor` takes it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kite.model import geometry_from_config, load_config_only

    _, folder, config = load_config_only(spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return type("ModelShape", (), {"model": model, "geometry": geometry_from_config(config),
                                   "tokenizer": AutoTokenizer.from_pretrained(folder)})()
