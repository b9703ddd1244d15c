"""The watermark sampler with a fake NVML: readings, spikes, micro-sampling, the interval switch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kite.yoco.watermark import GB, HostBackend, NvmlBackend, WatermarkSampler

from tests.waiting import wait_until


class NVMLError(Exception):
    pass


class FakeNvml:
    """The slice of pynvml the backend uses. `used_gb` is what the next memory query returns."""

    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 4
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139

    def __init__(self, total_gb=80.0, used_gb=10.0, nvlink=False, fail_memory=False):
        self.total_gb, self.used_gb, self.nvlink, self.fail_memory = total_gb, used_gb, nvlink, fail_memory
        self.pcie_kbs = {0: 0, 1: 0}
        self.nvlink_kib = 0
        self.inited = 0

    def nvmlInit(self):
        self.inited += 1

    def nvmlShutdown(self):
        self.inited -= 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("gpu", i)

    def nvmlDeviceGetMemoryInfo(self, h):
        if self.fail_memory:
            raise NVMLError("GPU is lost")
        return SimpleNamespace(used=int(self.used_gb * GB), total=int(self.total_gb * GB))

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return 5

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return 16

    def nvmlDeviceGetPcieThroughput(self, h, counter):
        return self.pcie_kbs[counter]

    def nvmlDeviceGetNvLinkState(self, h, link):
        if not self.nvlink:
            raise NVMLError("Not Supported")
        return self.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkVersion(self, h, link):
        return 4

    def nvmlDeviceGetFieldValues(self, h, ids):
        half = self.nvlink_kib // 2
        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(ullVal=half)) for _ in ids]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def sampler(nvml, **kw) -> tuple[WatermarkSampler, Clock]:
    clock = Clock()
    return WatermarkSampler(NvmlBackend(0, nvml=nvml), clock=clock, torch_peak=False, **kw), clock


def test_reading_from_nvml_names_its_source():
    s, _ = sampler(FakeNvml(total_gb=80, used_gb=20))
    r = s.sample_once()
    assert r.source == "nvml:0" and r.total_gb == pytest.approx(80)
    assert r.watermark.gpu_mem == pytest.approx(0.25) and r.watermark.gpu_mem_gb == pytest.approx(20)
    assert s.latest() is r and not r.watermark.spike


def test_pcie_util_from_the_slow_loop_and_nvlink_unsupported():
    nv = FakeNvml()
    s, _ = sampler(nv)
    nv.pcie_kbs = {0: 31_504_000, 1: 1_000}  # ~half of gen5 x16 (63 GB/s) one way
    s.sample_links()
    r = s.sample_once()
    assert r.watermark.pcie_util == pytest.approx(0.5, abs=0.01)
    assert r.watermark.nvlink_util == 0.0  # not supported by this fake: 0, never an error


def test_nvlink_util_from_counter_deltas(monkeypatch):
    nv = FakeNvml(nvlink=True)
    backend = NvmlBackend(0, nvml=nv)
    assert backend._nvlink_gbs == pytest.approx(4 * 25.0)
    t = [10.0]
    monkeypatch.setattr("kite.yoco.watermark.time.monotonic", lambda: t[0])
    assert backend.nvlink_util() == 0.0  # first call only sets the baseline
    nv.nvlink_kib += int(100e9 / 1024)  # 100 GB (tx + rx) in one second = 50 GB/s a direction
    t[0] += 1.0
    assert backend.nvlink_util() == pytest.approx(0.5, rel=1e-3)


def test_spike_over_consecutive_samples_and_hold():
    nv = FakeNvml(used_gb=10)
    s, clock = sampler(nv, spike_threshold_gb=3.0, spike_samples=3, spike_hold_s=1.0)
    for used in (10, 11, 12):  # +2 GB over three samples: no spike
        nv.used_gb = used
        clock.t += 0.01
        assert not s.sample_once().watermark.spike
    nv.used_gb = 14.5  # 12 -> 14.5 and 11 -> 14.5 in the window: +3.5 GB
    clock.t += 0.01
    assert s.sample_once().watermark.spike
    for _ in range(3):  # flat again: the spike holds for spike_hold_s
        clock.t += 0.1
        assert s.sample_once().watermark.spike
    clock.t += 1.0
    assert not s.sample_once().watermark.spike


def test_slow_growth_is_not_a_spike():
    nv = FakeNvml(used_gb=0)
    s, clock = sampler(nv, spike_threshold_gb=3.0, spike_samples=3)
    for step in range(20):  # +1 GB a sample: 2 GB over any 3 consecutive samples
        nv.used_gb = step
        clock.t += 0.2
        assert not s.sample_once().watermark.spike


def test_micro_sampling_switches_the_interval_on_and_off():
    s, clock = sampler(FakeNvml(), interval_ms=200, micro_interval_ms=10, micro_window_s=2.0)
    assert s.current_interval_ms() == 200 and not s.micro_sampling
    s.enable_micro_sampling()
    assert s.micro_sampling and s.current_interval_ms() == 10
    r = s.sample_once()
    assert r.micro_sampling and r.interval_ms == 10
    clock.t += 1.5
    s.enable_micro_sampling(window_s=1.0)  # extends to t+2.5, never shortens
    clock.t += 0.9
    assert s.micro_sampling
    clock.t += 0.2
    assert not s.micro_sampling and s.current_interval_ms() == 200
    assert s.sample_once().interval_ms == 200


def test_thread_wakes_for_micro_sampling_and_survives_driver_errors():
    nv = FakeNvml()
    s = WatermarkSampler(NvmlBackend(0, nvml=nv), interval_ms=10_000, micro_interval_ms=5,
                         link_interval_ms=10_000, torch_peak=False)
    with s:
        wait_until(lambda: s.samples >= 1, 2, 0.005, "the first sample")
        assert s.samples == 1  # then it waits 10 s ...
        s.enable_micro_sampling(window_s=0.5)  # ... unless a risky query wakes it
        wait_until(lambda: s.samples >= 4, 2, 0.01, "micro samples")
        nv.fail_memory = True
        wait_until(lambda: s.last_error, 2, 0.01, "the driver error")
        assert "GPU is lost" in (s.last_error or "")
        nv.fail_memory = False
        n = s.samples
        s.enable_micro_sampling(window_s=0.5)
        wait_until(lambda: s.samples > n, 2, 0.01, "a sample after the error")
    assert nv.inited == 0  # closed with the sampler


def test_host_backend_reads_memory_and_cpu_queue():
    s = WatermarkSampler(HostBackend(), torch_peak=False)
    r = s.sample_once()
    assert r.source.startswith("host:") and r.total_gb > 0
    assert 0 < r.watermark.gpu_mem < 1 and r.watermark.cpu_queue >= 0


def _gpu_present() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return False


@pytest.mark.skipif(not _gpu_present(), reason="needs an NVIDIA GPU (the real NVML path)")
def test_real_nvml_sees_an_allocation_spike_and_torch_peak():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    torch.cuda.init()
    s = WatermarkSampler(NvmlBackend(0), spike_threshold_gb=3.0, spike_samples=3,
                         link_interval_ms=100)
    try:
        before = s.sample_once()
        assert before.source == "nvml:0+torch" and before.total_gb > 10
        blocks = [torch.empty(int(2.5 * GB), dtype=torch.uint8, device="cuda") for _ in range(2)]
        torch.cuda.synchronize()
        after = s.sample_once()
        assert after.watermark.gpu_mem_gb - before.watermark.gpu_mem_gb > 4.5
        assert after.watermark.spike and after.torch_peak_gb >= 5.0
        s.sample_links()  # the blocking PCIe counters and NVLink fields where supported
        assert 0.0 <= s.sample_once().watermark.pcie_util <= 1.0
        del blocks
    finally:
        s.close()
        torch.cuda.empty_cache()
