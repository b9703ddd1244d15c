"""`kite capacity-plan`: how many GPUs a load needs, raw and with compressed states, and which
compression setting to run under a PPL tolerance.

Memory is exact arithmetic on the model's geometry (KV bytes per token, weights) and the states'
measured sizes; times are the roofline of kite.tune.roofline corrected by this project's H200
measurements; the setting's PPL Δ and memory saving are intervals fitted on measured runs
(kite.tune.quality_fit). docs/capacity.md describes the model and what is measured.

Four ways to hold a request's context, each a row of the plan:
- ``raw``: bf16 KV on the GPU; every request prefills its document.
- a setting, resident: states held compressed on the GPU (more sequences fit), timed as the
  default joint-head states run: every decode step rebuilds each sequence's layers (launch-bound:
  the plan counts that cost); every request still prefills its document, then compresses it.
- a setting, loaded (with ``reuse`` > 0): the fraction ``reuse`` of requests find their document's
  state in pinned host memory and load it into raw KV instead of prefilling; the rest prefill
  and compress. Memory per sequence is raw.
- lanes, resident (``kite serve --resident lanes``, ``server.lane_bits``): each state loaded, then
  coded into nibble lanes that the lanes decode kernel reads (kite.kernels.lanes; its bytes by
  arithmetic, its speed from the H200 run); its quality is the loaded setting's plus the lanes'
  own, which the history does not measure, so the plan shows the row but never chooses it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from kite.config import parse_lane_bits
from kite.errors import BadInput, KiteError
from kite.tune.gpus import GpuSpec, measured_for
from kite.tune.quality_fit import (MinHitGain, QualityPoint, SettingFit, fit_settings, recommend, reference,
                                   recommend_min_hit_gain)
from kite.tune.roofline import ModelShape, Roofline, corrections

REBUILD_CHUNK = 8      # sequences rebuilt per layer at once: a transient of raw KV (gpu_speed.py --chunk)
TP_DEGREES = (1, 2, 4, 8)
# What the lanes cost in quality on top of a loaded state's codec (the lanes note cites it).
LANES_QUALITY = ("the embedded model, 4 bits, groups of 512, on the joint codec's decoded KV at 4x: KL to the "
                 "full context 0.0024 -> 0.0096, benchmarks/results/lanes_quality_cpu2_20261201_d38e9a7.json")


@dataclass(frozen=True, slots=True)
class CapacityRequest:
    """The load and its limits. `avg_tokens`: a request's prompt (document + question);
    `output_tokens`: generated per request; `kv_budget_gb`: KV memory per GPU (default: the GPU's
    memory × `mem_util` less the weights and a prefill's activations); `reuse`: the fraction of
    requests whose document has a state already; `gpus`: the GPUs there are (checked)."""

    qps: float
    avg_tokens: int
    ppl_tolerance: float
    output_tokens: int = 256
    ttft_ms: float | None = None
    gpus: int | None = None
    kv_budget_gb: float | None = None
    reuse: float = 0.0
    mem_util: float = 0.9
    use_reference: bool = True
    lane_bits: str = "4"               # server.lane_bits: the lanes row's bits ("B" or "K:V")

    def __post_init__(self) -> None:
        checks = (("--qps", self.qps, self.qps > 0, "above 0"),
                  ("--avg-tokens", self.avg_tokens, self.avg_tokens >= 1, "at least 1"),
                  ("--output-tokens", self.output_tokens, self.output_tokens >= 0, "0 or more"),
                  ("--ppl-tolerance", self.ppl_tolerance, self.ppl_tolerance >= 0, "0 or more"),
                  ("--ttft-ms", self.ttft_ms, self.ttft_ms is None or self.ttft_ms > 0, "above 0"),
                  ("--gpus", self.gpus, self.gpus is None or self.gpus >= 1, "at least 1"),
                  ("--kv-budget-gb", self.kv_budget_gb, self.kv_budget_gb is None or self.kv_budget_gb > 0, "above 0"),
                  ("--reuse", self.reuse, 0 <= self.reuse <= 1, "between 0 and 1"),
                  ("--mem-util", self.mem_util, 0 < self.mem_util <= 1, "in (0, 1]"))
        for flag, value, ok, what in checks:
            if not ok or (isinstance(value, float) and not math.isfinite(value)):
                raise BadInput(f"{flag} {value}: must be a finite number {what}"
                               if isinstance(value, float) else f"{flag} {value}: must be {what}")
        parse_lane_bits(self.lane_bits)

    @property
    def context(self) -> int:
        """Tokens a sequence holds at its end: prompt + output."""
        return self.avg_tokens + self.output_tokens


@dataclass(slots=True)
class ModeRow:
    """One way to hold the context: bytes per sequence, sequences per replica (the point and, for
    a setting, the range its ratio interval gives), and with rates the times and GPUs."""

    name: str
    setting: str | None
    mode: str                          # raw | resident | loaded | lanes
    seq_bytes: float
    sequences: int
    sequences_range: tuple[int, int] | None = None
    ttft_ms: float | None = None       # mean over the requests
    decode_step_ms: float | None = None
    decode_ms: float | None = None
    gpu_s_per_request: float | None = None
    gpus: int | None = None
    meets_ttft: bool | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class CapacityPlan:
    request: CapacityRequest
    model: str
    shape: ModelShape
    gpu: GpuSpec
    tp: int
    kv_budget_bytes: float             # per GPU
    kv_budget_how: str
    rows: list[ModeRow]
    fits: list[SettingFit]
    history_runs: int
    history_points: list[QualityPoint]
    recommended: SettingFit | None
    min_hit_gain: MinHitGain
    times: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)
    best: ModeRow | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def meets(self) -> bool:
        """A setting meets the PPL tolerance, a row meets the TTFT limit, and the GPUs given are enough."""
        if self.recommended is None or self.best is None:
            return False
        return self.request.gpus is None or self.best.gpus is None or self.best.gpus <= self.request.gpus

    def recommendation(self) -> dict:
        r = self.recommended
        if r is None:
            return {"setting": None, "upcycle_compression_ratio": None, "precision": None,
                    "yoco_min_hit_gain": self.min_hit_gain.to_dict(),
                    "why": f"no measured setting keeps the PPL Δ interval under {self.request.ppl_tolerance}"}
        is_ratio = r.setting.startswith("ratio=")
        lo, hi = r.saving
        return {"setting": r.setting,
                "upcycle_compression_ratio": round(1 / r.nominal, 6) if is_ratio else None,
                "flag": f"--ratio {r.nominal:g}" if is_ratio else f"--precision {r.setting}",
                "precision": r.setting if not is_ratio else f"{r.setting} (the PCA codec)",
                "yoco_min_hit_gain": self.min_hit_gain.to_dict(),
                "memory_saving": {"low": lo, "high": hi, "basis": r.ratio.basis, "n": r.ratio.n},
                "ppl_delta": r.ppl_delta.to_dict()}

    def to_dict(self) -> dict:
        req = self.request
        ref = {p.source for f in self.fits for p in f.points if not p.source.startswith("run ")}
        return {
            "model": {"name": self.model, **self.shape.to_dict()},
            "gpu": self.gpu.to_dict(), "calibration": self.calibration,
            "load": {"qps": req.qps, "avg_tokens": req.avg_tokens, "output_tokens": req.output_tokens,
                     "reuse": req.reuse, "ttft_ms": req.ttft_ms, "gpus": req.gpus},
            "kv_bytes_per_token": {"raw_bf16": self.shape.kv_bytes_per_token,
                                   **{f.setting: self.shape.kv_bytes_per_token / f.ratio_point()
                                      for f in self.fits if f.ratio_point()}},
            "weights_bytes": self.shape.weights_bytes, "tensor_parallel": self.tp,
            "kv_budget_bytes_per_gpu": self.kv_budget_bytes, "kv_budget": self.kv_budget_how,
            "times": self.times, "rows": [r.to_dict() for r in self.rows],
            "settings": [f.to_dict() for f in self.fits],
            "fit": {"history_runs": self.history_runs, "history_points": len(self.history_points),
                    "history_models": sorted({p.model for p in self.history_points}),
                    "reference_points": len(ref), "reference_used": req.use_reference,
                    "reference": reference().name if req.use_reference else None},
            "recommendation": self.recommendation(),
            "plan": self.best.to_dict() if self.best else None, "meets": self.meets, "notes": self.notes,
        }


def plan_capacity(req: CapacityRequest, shape: ModelShape, gpu: GpuSpec, *, model: str = "",
                  history: list[dict] | None = None, default_min_hit_gain: float = 0.005) -> CapacityPlan:
    """The plan for `req` on `gpu` for `shape`, with the settings fitted on `history` (the runs of
    `kite bench history`). Raises KiteError when the model cannot hold one sequence on 8 GPUs."""
    from kite.tune.quality_fit import points_from_history

    runs = history or []
    points = points_from_history(runs)
    fits = fit_settings(points, use_reference=req.use_reference)
    kvpt, raw_seq = shape.kv_bytes_per_token, shape.kv_bytes_per_token * req.context
    tp, budget, how = _tensor_parallel(req, shape, gpu, raw_seq)
    replica = budget * tp
    transient = REBUILD_CHUNK * 2 * shape.geometry.n_kv_heads * shape.geometry.head_dim * req.context * 2
    rows = [ModeRow("raw bf16", None, "raw", raw_seq, int(replica // raw_seq))]
    for f in fits:
        point = f.ratio_point()
        if not point:
            continue
        seq = _state_seq_bytes(req, kvpt, point)
        lo, hi = min(f.ratio.low or point, point), max(f.ratio.high or point, point)
        rng = tuple(max(0, int((replica - transient) // _state_seq_bytes(req, kvpt, r))) for r in (lo, hi))
        rows.append(ModeRow(f"{f.setting} resident", f.setting, "resident", seq,
                            max(0, int((replica - transient) // seq)), rng))
    recommended = recommend(fits, req.ppl_tolerance)
    if req.reuse > 0 and recommended is not None and recommended.ratio_point():
        rows.append(ModeRow(f"{recommended.setting} loaded", recommended.setting, "loaded", raw_seq, rows[0].sequences))
    lanes = lanes_state_bytes(req, shape)
    if isinstance(lanes, float):
        # while a load is coded into lanes its prompt's KV is held raw: one sequence's worth
        seq = lanes + req.output_tokens * kvpt
        rows.append(ModeRow(f"lanes {req.lane_bits} bits", None, "lanes", seq,
                            max(0, int((replica - req.avg_tokens * kvpt) // seq))))
    plan = CapacityPlan(req, model, shape, gpu, tp, budget, how, rows, fits, len(runs), points, recommended,
                        recommend_min_hit_gain(points, req.ppl_tolerance, default_min_hit_gain))
    if isinstance(lanes, str):
        plan.notes.append(f"no lanes row: {lanes}")
    if gpu.has_rates:
        _times(plan, {f.setting: f for f in fits})
    else:
        plan.notes.append(f"{gpu.name}: no bandwidth or bf16 rate known (--gpu-hbm-tbps, --gpu-bf16-tflops): "
                          "memory only, no times or GPU counts")
    limit = shape.geometry.context_length
    if limit and req.context > limit:
        plan.notes.append(f"{req.context:,} tokens per sequence exceed the model's context length ({limit:,})")
    plan.best = _best(plan)
    return plan


def lanes_state_bytes(req: CapacityRequest, shape: ModelShape) -> float | str:
    """Bytes of one prompt's state in lanes at ``req.lane_bits`` (kite serve --resident lanes'
    groups and sinks), or why this geometry has none."""
    from kite.upcycle import lanes_for
    from kite.upcycle.codec import lanes_nbytes

    g = shape.geometry
    try:
        k, v = (lanes_for(b, g.head_dim) for b in parse_lane_bits(req.lane_bits))
    except BadInput as exc:
        return str(exc)
    return float(g.n_layers * lanes_nbytes(req.avg_tokens, g.n_kv_heads, g.head_dim, k, v))


def _state_seq_bytes(req: CapacityRequest, kvpt: int, ratio: float) -> float:
    """A resident sequence: its prompt as a state, its output tokens raw."""
    return req.avg_tokens * kvpt / ratio + req.output_tokens * kvpt


def _tensor_parallel(req: CapacityRequest, shape: ModelShape, gpu: GpuSpec, raw_seq: int) -> tuple[int, float, str]:
    """(GPUs per replica, KV budget per GPU in bytes, how the budget was set): the fewest GPUs whose
    memory holds the weights, a prefill's activations and one raw sequence."""
    mem = gpu.mem_gb * 1e9
    fixed = shape.weights_bytes + shape.activation_bytes(req.avg_tokens)
    for tp in TP_DEGREES:
        if req.kv_budget_gb is not None:
            budget, how = req.kv_budget_gb * 1e9, "--kv-budget-gb"
            fits = fixed / tp + budget <= mem
        else:
            budget = mem * req.mem_util - fixed / tp
            how = f"{req.mem_util:g} x {gpu.mem_gb:g} GB less the weights and a prefill's activations"
            fits = budget > 0
        if fits and budget * tp >= raw_seq:
            return tp, budget, how + (f" (tensor parallel {tp})" if tp > 1 else "")
    raise KiteError(f"{gpu.name} ({gpu.mem_gb:g} GB): the weights ({shape.weights_bytes / 1e9:.1f} GB), a prefill's "
                    f"activations and one {req.context:,}-token sequence ({raw_seq / 1e9:.2f} GB of KV) do not fit "
                    f"on {TP_DEGREES[-1]} GPUs" + (" with --kv-budget-gb" if req.kv_budget_gb else ""))


def _times(plan: CapacityPlan, fits: dict[str, SettingFit]) -> None:
    req, shape = plan.request, plan.shape
    m, own = measured_for(plan.gpu)
    fix = corrections(plan.gpu, m, own)
    roof = Roofline(shape, plan.gpu, fix, plan.tp)
    kvpt = shape.kv_bytes_per_token
    pf_floor, pf = roof.prefill(req.avg_tokens)
    compress = roof.compress(req.avg_tokens)
    plan.calibration = {"measured_on": m.gpu, "own": own, "name": m.calibration, "source": m.source,
                        **fix.to_dict()}
    plan.times = {"prefill_ms": {"floor": pf_floor, "predicted": pf}, "compress_ms": compress}
    if not own:
        plan.notes.append(f"{plan.gpu.name}: not measured by this project; its roofline borrows the H200's "
                          "corrections (efficiencies and fixed costs)")
    plan.notes.append("GPUs: the load at 100 % busy with no queueing, ideal tensor-parallel scaling: a lower bound")
    if any(r.mode == "resident" for r in plan.rows):
        plan.notes.append("resident states: timed as the default joint-head states, which every decode step "
                          f"rebuilds layer by layer ({fix.rebuild_ms:.3f} ms per sequence and layer, measured on "
                          f"{m.gpu}: {m.steps_source}); the extra sequences are memory, not throughput, "
                          "today; TTFT counts the compression of each new document, which kite serve runs "
                          "before its state answers")
    if any(r.mode == "lanes" for r in plan.rows):
        plan.notes.append(f"lanes rows: read by the lanes decode kernel at {fix.lanes_efficiency:.0%} of HBM "
                          f"bandwidth ({m.lanes_source}); TTFT counts the compression and the coding into lanes "
                          "that kite serve --resident lanes runs before the first token; quality is the loaded "
                          f"setting's plus the lanes' own ({LANES_QUALITY}), which the history does not measure: "
                          "the plan does not choose them")
    mid = req.avg_tokens + req.output_tokens / 2   # a sequence's mean context while it decodes
    for row in plan.rows:
        if row.sequences < 1:
            continue
        b = row.sequences
        if row.mode == "resident":
            ratio = fits[row.setting].ratio_point()
            kv_read = b * (req.avg_tokens * kvpt / ratio + req.output_tokens / 2 * kvpt)
            step = roof.decode_step(b, kv_read, rebuild_seqs=b)[1]
        elif row.mode == "lanes":
            lanes = row.seq_bytes - req.output_tokens * kvpt
            step = roof.decode_step(b, b * req.output_tokens / 2 * kvpt, lanes_bytes_read=b * lanes)[1]
        else:
            step = roof.decode_step(b, b * mid * kvpt)[1]
        first = pf + (compress if row.mode != "raw" else 0.0)
        if row.mode == "lanes":
            first += roof.lanes_encode(req.avg_tokens)
        if row.mode == "loaded":
            ratio = fits[row.setting].ratio_point()
            floor, from_state = roof.state_ttft(req.avg_tokens * kvpt / ratio, req.avg_tokens)
            plan.times["ttft_from_state_ms"] = {"floor": floor, "predicted": from_state}
            first = req.reuse * from_state + (1 - req.reuse) * first
            row.ttft_ms = req.reuse * from_state + (1 - req.reuse) * pf
            ok = from_state if req.reuse == 1 else max(from_state, pf)
        elif row.mode in ("lanes", "resident"):   # a new document is compressed before its state answers
            row.ttft_ms = ok = first
        else:
            row.ttft_ms = ok = pf
        row.decode_step_ms = step
        row.decode_ms = req.output_tokens * step
        row.gpu_s_per_request = (first + req.output_tokens * step / b) / 1e3
        row.gpus = plan.tp * max(1, math.ceil(req.qps * row.gpu_s_per_request))
        row.meets_ttft = None if req.ttft_ms is None else ok <= req.ttft_ms
    step1 = roof.decode_step(1, mid * kvpt)
    plan.times["decode_step_batch1_ms"] = {"floor": step1[0], "predicted": step1[1]}


def _best(plan: CapacityPlan) -> ModeRow | None:
    """The row with the fewest GPUs that meets the TTFT limit, among raw and the recommended
    setting's (memory only, without rates: the most sequences)."""
    rec = plan.recommended.setting if plan.recommended else None
    cands = [r for r in plan.rows if r.sequences >= 1 and r.mode != "lanes" and r.setting in (None, rec)
             and r.meets_ttft is not False]
    if not cands:
        return None
    if plan.gpu.has_rates:
        return min(cands, key=lambda r: (r.gpus, r.mode != "raw"))
    return max(cands, key=lambda r: r.sequences)
