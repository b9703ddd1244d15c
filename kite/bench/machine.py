"""Where a run happened and how much memory it took (peak RSS on the CPU, CUDA peak on a GPU)."""

from __future__ import annotations

import os
import platform
import resource
import sys


def memory_peak_gb(device) -> tuple[float, str]:
    """(GB, source). On CUDA: torch.cuda.max_memory_allocated since the last reset; on the CPU:
    the process's peak resident set size since it started (ru_maxrss)."""
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / 1e9, "torch.cuda.max_memory_allocated"
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return kb * scale / 1e9, "peak RSS (ru_maxrss)"


def reset_peak(device) -> None:
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)


def machine_info(device) -> dict:
    import torch
    import transformers

    info = {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpu": _cpu_name(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "transformers": transformers.__version__,
            "device": str(device)}
    try:
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
