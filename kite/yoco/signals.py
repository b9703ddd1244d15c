"""The signals rules may read: their names, types and units (the schema), and `Signals`, one
request's values.

A rule's condition names a field by its dotted path (`hardware_watermark.gpu_mem`); the checker
looks each one up in `SIGNAL_FIELDS` when the rules load, so a typo never reaches a request.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from kite.errors import BadInput

SignalType = Literal["number", "string", "bool"]


@dataclass(frozen=True, slots=True)
class SignalField:
    """One field of the schema: its dotted name, type, unit/range and meaning."""

    name: str
    type: SignalType
    unit: str
    doc: str


SIGNAL_FIELDS: dict[str, SignalField] = {
    f.name: f
    for f in [
        SignalField("intent_entropy", "number", "bits",
                    "mean next-token entropy of the model over the query tokens"),
        SignalField("query_novelty", "number", "0-1",
                    "1 - similarity (normalized edit distance) to the most similar recent query"),
        SignalField("query_label", "string", "label",
                    "the query's clause type, by the same tagger as the state's clusters"),
        SignalField("label_entropy", "number", "bits",
                    "entropy of the tagger's label distribution for the query (its ambiguity)"),
        SignalField("state_health_score", "number", "0-1",
                    "the state's measured health (mean over its clusters, from the health store)"),
        SignalField("hardware_watermark.gpu_mem", "number", "fraction 0-1",
                    "device memory in use / total (host memory when there is no GPU)"),
        SignalField("hardware_watermark.gpu_mem_gb", "number", "GB",
                    "device memory in use (host memory when there is no GPU)"),
        SignalField("hardware_watermark.pcie_util", "number", "fraction 0-1",
                    "PCIe throughput (rx + tx) / link bandwidth; 0 where unknown"),
        SignalField("hardware_watermark.nvlink_util", "number", "fraction 0-1",
                    "NVLink throughput / link bandwidth; 0 where unknown or absent"),
        SignalField("hardware_watermark.cpu_queue", "number", "tasks per core",
                    "runnable tasks per CPU core (the decode threads' queue)"),
        SignalField("hardware_watermark.spike", "bool", "bool",
                    "memory grew more than spike_threshold_gb over consecutive samples"),
    ]
}


def suggest(name: str, choices: list[str] | tuple[str, ...] | Any) -> str | None:
    """The closest of `choices` to a mistyped `name`, or None."""
    choices = list(choices)
    hits = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    if not hits:  # a bare leaf name (`gpu_mem`) still finds its dotted field
        leaf = {c.rsplit(".", 1)[-1]: c for c in choices}
        leaf_hits = difflib.get_close_matches(name.rsplit(".", 1)[-1], list(leaf), n=1, cutoff=0.75)
        hits = [leaf[leaf_hits[0]]] if leaf_hits else []
    return hits[0] if hits else None


@dataclass(slots=True)
class HardwareWatermark:
    """The hardware's load when the request arrives (see `kite.yoco.watermark`)."""

    gpu_mem: float = 0.0
    gpu_mem_gb: float = 0.0
    pcie_util: float = 0.0
    nvlink_util: float = 0.0
    cpu_queue: float = 0.0
    spike: bool = False


@dataclass(slots=True)
class Signals:
    """One request's signals. `state_health_score=None` lets the engine take it from the state.

    Compiled rules read attributes directly (`s.hardware_watermark.gpu_mem`); `flat()` is the
    dotted-key view used for JSON, reasons and `from_mapping`.
    """

    intent_entropy: float = 0.0
    query_novelty: float = 0.0
    query_label: str = ""
    label_entropy: float = 0.0
    state_health_score: float | None = None
    hardware_watermark: HardwareWatermark = field(default_factory=HardwareWatermark)

    def get(self, name: str) -> Any:
        """The value of a dotted field (`hardware_watermark.spike`)."""
        obj: Any = self
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj

    def flat(self) -> dict[str, Any]:
        """Every schema field by its dotted name."""
        return {name: self.get(name) for name in SIGNAL_FIELDS}

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str = "signals") -> "Signals":
        """Build from nested (`{"hardware_watermark": {"gpu_mem": 0.9}}`) or dotted keys.

        Missing fields keep their defaults. Unknown fields and wrong types raise BadInput, with a
        "did you mean" for typos.
        """
        if not isinstance(data, Mapping):
            raise BadInput(f"{where}: expected a JSON object of signals, got {type(data).__name__}")
        flat: dict[str, Any] = {}
        for key, value in data.items():
            if key == "hardware_watermark" and isinstance(value, Mapping):
                for sub, v in value.items():
                    flat[f"hardware_watermark.{sub}"] = v
            else:
                flat[str(key)] = value
        sig = cls()
        for name, value in flat.items():
            spec = SIGNAL_FIELDS.get(name)
            if spec is None:
                hint = suggest(name, SIGNAL_FIELDS)
                raise BadInput(f"{where}: unknown signal {name!r}"
                               + (f"; did you mean {hint!r}?" if hint else ""))
            if name == "state_health_score" and value is None:
                continue
            _set(sig, name, _coerce(value, spec, where))
        return sig


def _coerce(value: Any, spec: SignalField, where: str) -> Any:
    ok = {
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "string": isinstance(value, str),
        "bool": isinstance(value, bool),
    }[spec.type]
    if not ok:
        raise BadInput(f"{where}: {spec.name} must be a {spec.type}, got {value!r}")
    if spec.type == "number":
        value = float(value)
        if not math.isfinite(value):
            raise BadInput(f"{where}: {spec.name} must be finite, got {value!r}")
    return value


def _set(sig: Signals, name: str, value: Any) -> None:
    head, _, leaf = name.rpartition(".")
    setattr(sig.get(head) if head else sig, leaf, value)
