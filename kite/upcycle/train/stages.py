"""What each stage of a training run costs: seconds, and what they were spent on (documents, states,
pairs, steps), so a report says per state and per pair where the time went.

The clock waits for the device at each stage's edges (a GPU's work is queued: without the wait its
seconds would land on whichever stage next reads a result). The edges are few per document, so the
waits cost little next to the work they measure.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

# the stages in the order a run reaches them, with what their count is of
UNITS = {
    "calibrate_capture": "document",   # prefill of a training document for the regenerator's sums
    "calibrate_fit": "document",       # adding its KV to the sums, and the eigendecompositions at the end
    "calibrate_choose": "layer grouping",   # --layer-group auto: a candidate's bases, its states measured
    "capture": "document",             # prefill of a document whose states or teacher the run needs
    "compress": "state",               # the codec and the state file, per document and ratio
    "load": "state",                   # the state's prefix decoded from its file onto the model's device
    "teacher": "pair",                 # the full-context model's top-k over each response token
    "adapter_steps": "step",           # forward, backward and optimizer step of the reader adapter
    "checkpoints": "checkpoint",       # the adapter's checkpoints (resume)
    "report": "held-out pair",         # the held-out report (PPL three ways, greedy answers twice)
    "write": "file",                   # the adapter folders and the loss plot
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StageTimes:
    """Seconds and counts per stage (:data:`UNITS`); :meth:`stage` times a block, adding to its stage."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    @contextmanager
    def stage(self, name: str, count: int = 1):
        if name not in UNITS:
            raise ValueError(f"unknown stage {name!r}")
        _sync(self.device)
        t = time.perf_counter()
        try:
            yield
        finally:
            _sync(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
            self.counts[name] = self.counts.get(name, 0) + count

    def add_count(self, name: str, count: int) -> None:
        """Units a timed stage did, known only after it ran (``stage(name, 0)`` then this)."""
        self.counts[name] = self.counts.get(name, 0) + count

    def to_dict(self) -> dict[str, dict]:
        """Per stage run: seconds, count, unit and seconds per unit (the stages in run order)."""
        out = {}
        for name, unit in UNITS.items():
            if name in self.seconds:
                s, n = self.seconds[name], self.counts[name]
                out[name] = {"seconds": round(s, 3), "count": n, "unit": unit,
                             "per_unit_s": round(s / n, 4) if n else None}
        return out

    def total(self, *names: str) -> float:
        return sum(self.seconds.get(n, 0.0) for n in names)


STATE_STAGES = ("calibrate_capture", "calibrate_fit", "calibrate_choose", "capture", "compress", "load")


def summary(times: StageTimes, states: int, pairs: int, epochs: int, total_s: float) -> dict:
    """The two figures a run's speed is judged by: seconds per training state (every stage before
    the teacher over the states: the documents' prefills, the regenerator's sums and bases, the
    codec and the files, the prefixes rebuilt on the device) and seconds per training pair and
    epoch of the whole run."""
    state_s = times.total(*STATE_STAGES)
    return {"states": states, "seconds_per_state": round(state_s / states, 4) if states else None,
            "pair_epochs": pairs * epochs,
            "seconds_per_pair_epoch": round(total_s / (pairs * epochs), 4) if pairs else None}
