"""The hardware watermark: a background thread sampling device memory (NVML), the torch
allocator's peak beside it, or the host's memory and CPU queue where there is no GPU; PCIe and
NVLink throughput in a slower loop of their own (NVML's PCIe counter blocks ~20 ms per call).

Every reading names its source ("nvml:0", "nvml:0+torch", "host:psutil", "host:proc").
A spike is memory growth of more than `spike_threshold_gb` within the last `spike_samples`
consecutive samples; it stays raised for `spike_hold_s`. `enable_micro_sampling()` (a rule's
action for a risky query) switches the memory loop to `micro_interval_ms` (10 ms) for
`micro_window_s`, then back to `interval_ms`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable, Protocol

from kite.yoco.signals import HardwareWatermark

GB = 1e9
# PCIe bandwidth per lane and direction, GB/s, by generation (after line encoding).
_PCIE_LANE_GBS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
# NVLink bandwidth per link and direction, GB/s, by NVLink version (3: A100, 4: H100/H200).
_NVLINK_LINK_GBS = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}


class WatermarkBackend(Protocol):
    """Where readings come from. `pcie_util`/`nvlink_util` may block (~20 ms) and return None
    where unsupported; `memory` and `cpu_queue` must be cheap (they run every 10 ms)."""

    source: str
    has_links: bool

    def memory(self) -> tuple[float, float]:  # (used GB, total GB)
        ...

    def cpu_queue(self) -> float: ...

    def pcie_util(self) -> float | None: ...

    def nvlink_util(self) -> float | None: ...

    def close(self) -> None: ...


def _cpu_queue_reader() -> Callable[[], float]:
    """Runnable tasks per core: /proc/loadavg's instantaneous running count (less this sampler),
    else the 1-minute load average."""
    ncpu = os.cpu_count() or 1
    if os.path.exists("/proc/loadavg"):
        def read() -> float:
            with open("/proc/loadavg", "rb") as fh:
                running = int(fh.read().split()[3].split(b"/")[0])
            return max(0, running - 1) / ncpu
        return read
    return lambda: os.getloadavg()[0] / ncpu


class HostBackend:
    """Host memory and CPU queue: /proc/meminfo on Linux (two fields, read to the third line;
    about 4x cheaper than psutil's full parse), psutil elsewhere."""

    has_links = False

    def __init__(self) -> None:
        self._vm = None
        if os.path.exists("/proc/meminfo"):
            self.source = "host:proc"
        else:
            import psutil  # only where there is no /proc

            self._vm = psutil.virtual_memory
            self.source = "host:psutil"
        self.cpu_queue = _cpu_queue_reader()

    def memory(self) -> tuple[float, float]:
        if self._vm is not None:
            vm = self._vm()
            return (vm.total - vm.available) / GB, vm.total / GB
        total = avail = None
        with open("/proc/meminfo", "rb") as fh:
            for line in fh:
                if line.startswith(b"MemTotal:"):
                    total = int(line.split()[1]) * 1024
                elif line.startswith(b"MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                if total is not None and avail is not None:
                    break
        total = total or 0
        return (total - (avail or 0)) / GB, total / GB

    def pcie_util(self) -> float | None:
        return None

    def nvlink_util(self) -> float | None:
        return None

    def close(self) -> None:
        pass


class NvmlBackend:
    """One GPU through NVML (nvidia-ml-py's `pynvml`, or an injected module with its API)."""

    has_links = True

    def __init__(self, index: int = 0, nvml: Any = None) -> None:
        if nvml is None:
            import pynvml as nvml
        self.nvml, self.index = nvml, index
        nvml.nvmlInit()
        try:
            self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
            self.total_gb = nvml.nvmlDeviceGetMemoryInfo(self.handle).total / GB
        except Exception:
            nvml.nvmlShutdown()
            raise
        self.source = f"nvml:{index}"
        self.cpu_queue = _cpu_queue_reader()
        self._pcie_gbs = self._pcie_bandwidth()
        self._nvlink: tuple[float, float, float] | None = None  # (KiB tx+rx, time s, GB/s)
        self._nvlink_gbs = self._nvlink_bandwidth()

    def memory(self) -> tuple[float, float]:
        info = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
        return info.used / GB, info.total / GB

    def _pcie_bandwidth(self) -> float | None:
        try:
            gen = self.nvml.nvmlDeviceGetCurrPcieLinkGeneration(self.handle)
            width = self.nvml.nvmlDeviceGetCurrPcieLinkWidth(self.handle)
        except Exception:
            return None
        lane = _PCIE_LANE_GBS.get(int(gen))
        return lane * int(width) if lane and width else None

    def pcie_util(self) -> float | None:
        """max(tx, rx) / link bandwidth (one direction). Blocks ~20 ms per counter in NVML."""
        if self._pcie_gbs is None:
            return None
        n = self.nvml
        try:
            tx = n.nvmlDeviceGetPcieThroughput(self.handle, n.NVML_PCIE_UTIL_TX_BYTES)  # KB/s
            rx = n.nvmlDeviceGetPcieThroughput(self.handle, n.NVML_PCIE_UTIL_RX_BYTES)
        except Exception:
            return None
        return min(1.0, max(tx, rx) * 1e3 / GB / self._pcie_gbs)

    def _nvlink_bandwidth(self) -> float | None:
        n = self.nvml
        active, version = 0, None
        for link in range(getattr(n, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if n.nvmlDeviceGetNvLinkState(self.handle, link) == n.NVML_FEATURE_ENABLED:
                    active += 1
                    if version is None:
                        version = int(n.nvmlDeviceGetNvLinkVersion(self.handle, link))
            except Exception:
                break
        per_link = _NVLINK_LINK_GBS.get(version or 0)
        return per_link * active if active and per_link else None

    def nvlink_util(self) -> float | None:
        """(tx + rx) / 2 over this and the last call / the active links' bandwidth."""
        if self._nvlink_gbs is None:
            return None
        n = self.nvml
        try:
            vals = n.nvmlDeviceGetFieldValues(self.handle, [n.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                                                            n.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX])
            if any(v.nvmlReturn != 0 for v in vals):
                return None
            kib = float(sum(v.value.ullVal for v in vals))
        except Exception:
            return None
        now = time.monotonic()
        prev, self._nvlink = self._nvlink, (kib, now, self._nvlink_gbs)
        if prev is None or now <= prev[1]:
            return 0.0
        gbs = (kib - prev[0]) * 1024 / GB / (now - prev[1]) / 2
        return min(1.0, max(0.0, gbs / self._nvlink_gbs))

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:
            pass


def default_backend(index: int = 0) -> WatermarkBackend:
    """NVML where a GPU is present and nvidia-ml-py works, the host otherwise."""
    try:
        return NvmlBackend(index)
    except Exception:
        return HostBackend()


def _torch_peak_gb() -> float | None:
    """torch.cuda.max_memory_allocated in GB, only if torch is already imported and CUDA is up."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return torch.cuda.max_memory_allocated() / GB
    except Exception:
        pass
    return None


@dataclass(frozen=True, slots=True)
class WatermarkReading:
    """One sample: the fields rules read, plus where it came from and when (clock seconds)."""

    watermark: HardwareWatermark
    source: str
    sampled_at: float
    interval_ms: float
    micro_sampling: bool
    total_gb: float
    torch_peak_gb: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["watermark"] = asdict(self.watermark)
        return d


class WatermarkSampler:
    """Background sampler of the hardware watermark. `latest()` never blocks."""

    def __init__(self, backend: WatermarkBackend | None = None, *, interval_ms: float = 200.0,
                 spike_threshold_gb: float = 3.0, spike_samples: int = 3,
                 micro_interval_ms: float = 10.0, micro_window_s: float = 2.0,
                 spike_hold_s: float = 1.0, link_interval_ms: float = 1000.0,
                 cpu_interval_ms: float = 100.0, torch_peak: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_ms <= 0 or micro_interval_ms <= 0 or spike_samples < 2:
            raise ValueError("intervals must be > 0 and spike_samples >= 2")
        self.backend = backend if backend is not None else default_backend()
        self.interval_ms, self.micro_interval_ms = float(interval_ms), float(micro_interval_ms)
        self.spike_threshold_gb, self.spike_hold_s = float(spike_threshold_gb), spike_hold_s
        self.micro_window_s, self.link_interval_ms = micro_window_s, link_interval_ms
        self.torch_peak, self.clock = torch_peak, clock
        self._history: deque[float] = deque(maxlen=spike_samples)
        self._spike_until = float("-inf")
        self._micro_until = float("-inf")
        self._pcie = self._nvlink = 0.0
        # The CPU queue is read at most every cpu_interval_ms: micro-sampling is for memory.
        self.cpu_interval_s = cpu_interval_ms / 1000.0
        self._cpu_queue, self._cpu_due = 0.0, float("-inf")
        self._stop = threading.Event()
        # A held lock the memory loop waits on with a timeout; releasing it wakes the loop.
        # (Cheaper per wait than Event.wait, which builds a Condition waiter each time.)
        self._wake = threading.Lock()
        self._wake.acquire()
        self._threads: list[threading.Thread] = []
        self.samples = 0
        self.last_error: str | None = None
        self._latest = WatermarkReading(HardwareWatermark(), self.backend.source, clock(),
                                        self.interval_ms, False, 0.0)

    # -- what callers use ---------------------------------------------------------------------
    def latest(self) -> WatermarkReading:
        return self._latest

    def enable_micro_sampling(self, window_s: float | None = None) -> None:
        """Sample every `micro_interval_ms` for `window_s` (default `micro_window_s`) from now;
        a second call extends the window."""
        until = self.clock() + (self.micro_window_s if window_s is None else window_s)
        self._micro_until = max(self._micro_until, until)
        self._wakeup()  # leave the long wait now

    def _wakeup(self) -> None:
        try:
            self._wake.release()
        except RuntimeError:
            pass  # already released: a wake-up is pending

    @property
    def micro_sampling(self) -> bool:
        return self.clock() < self._micro_until

    def current_interval_ms(self) -> float:
        return self.micro_interval_ms if self.micro_sampling else self.interval_ms

    # -- one step of each loop (tests call these directly) ------------------------------------
    def sample_once(self) -> WatermarkReading:
        used, total = self.backend.memory()
        now = self.clock()
        self._history.append(used)
        if len(self._history) >= 2 and used - min(self._history) > self.spike_threshold_gb:
            self._spike_until = now + self.spike_hold_s
        micro = now < self._micro_until
        if now >= self._cpu_due:
            self._cpu_queue, self._cpu_due = self.backend.cpu_queue(), now + self.cpu_interval_s
        peak = _torch_peak_gb() if self.torch_peak else None
        wm = HardwareWatermark(
            gpu_mem=used / total if total > 0 else 0.0, gpu_mem_gb=used,
            pcie_util=self._pcie, nvlink_util=self._nvlink, cpu_queue=self._cpu_queue,
            spike=now < self._spike_until)
        source = self.backend.source + ("+torch" if peak is not None else "")
        reading = WatermarkReading(wm, source, now,
                                   self.micro_interval_ms if micro else self.interval_ms,
                                   micro, total, peak)
        self._latest = reading
        self.samples += 1
        return reading

    def sample_links(self) -> None:
        pcie = self.backend.pcie_util()
        nvlink = self.backend.nvlink_util()
        self._pcie = pcie if pcie is not None else 0.0
        self._nvlink = nvlink if nvlink is not None else 0.0

    # -- threads ------------------------------------------------------------------------------
    def start(self) -> "WatermarkSampler":
        if self._threads:
            return self
        self._stop.clear()
        self._threads = [threading.Thread(target=self._memory_loop, name="kite-watermark",
                                          daemon=True)]
        if self.backend.has_links:
            self._threads.append(threading.Thread(target=self._link_loop,
                                                  name="kite-watermark-links", daemon=True))
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._wakeup()
        for t in self._threads:
            t.join(timeout)
        self._threads = []

    def close(self) -> None:
        self.stop()
        self.backend.close()

    def __enter__(self) -> "WatermarkSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _memory_loop(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception as exc:  # a flaky driver call must not end sampling
                self.last_error = f"{type(exc).__name__}: {exc}"
            # Keep the period, not the gap: the next sample is due one interval after this
            # one was due (never in the past, so a stall does not cause a burst).
            now = time.monotonic()
            due = max(now, due + self.current_interval_ms() / 1000.0)
            if self._wake.acquire(timeout=due - now):
                due = time.monotonic()  # woken (micro-sampling switched on): sample now

    def _link_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_links()
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
            self._stop.wait(self.link_interval_ms / 1000.0)
