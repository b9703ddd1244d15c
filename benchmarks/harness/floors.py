"""Hardware floors: the time to move N bytes at a GPU's HBM bandwidth or over its host link, and to
do F FLOPs at its dense bf16 tensor rate. The limits come from the library's GPU table
(kite.tune.gpus) through :func:`gpu_limits` alone: the one place that reads it."""

from __future__ import annotations

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


def cpu_fp32_peak() -> tuple[float, str]:
    """This CPU's fp32 rate (FLOP/s) and how it is reckoned: cores x clock x 32 FLOP a cycle (two
    256-bit FMA a cycle: 2 x 8 lanes x 2 FLOP, as Zen 4 and most AVX2 / AVX-512 cores issue). The clock
    is the TSC's (bogomips / 2), 2.5 GHz where /proc/cpuinfo does not say."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ghz = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("bogomips"):
                    ghz = float(line.split(":")[1]) / 2000.0
                    break
    except OSError:
        pass
    ghz = ghz or 2.5
    return cores * ghz * 32 * 1e9, f"{cores} cores x {ghz:.2f} GHz x 32 FLOP/cycle (fp32 FMA)"


def cpu_flops_ms(flops: float) -> float:
    """ms to do ``flops`` at this CPU's fp32 rate (:func:`cpu_fp32_peak`)."""
    return _check(flops, "FLOPs") / cpu_fp32_peak()[0] * 1e3
