"""`kite capacity-plan`: GPUs for a load, raw and with compressed states, and the compression
setting to run under a PPL tolerance (kite.tune.capacity; docs/capacity.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from kite.cli._common import JsonOpt, console, emit_json, user_config
from kite.errors import BadInput


def capacity_plan(
    qps: Annotated[float, typer.Option("--qps", help="Requests per second to serve.")],
    avg_tokens: Annotated[int, typer.Option("--avg-tokens", help="Prompt tokens per request (document + question).")],
    gpu: Annotated[str, typer.Option("--gpu", help="H200, H200-NVL, H100-80G, H100-PCIE, H100-NVL, A100-80G, "
                                     "A100-40G, L40S, L4, A10; another name needs --gpu-mem-gb.")],
    ppl_tolerance: Annotated[float, typer.Option("--ppl-tolerance", help="Largest PPL Δ against full prefill "
                                                 "the recommended setting may reach (its interval's top).")],
    output_tokens: Annotated[int, typer.Option("--output-tokens", help="Tokens generated per request.")] = 256,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="HF folder, .gguf or embedded name whose "
                                                 "config sizes the plan (default: config model.default).")] = None,
    geometry: Annotated[Optional[Path], typer.Option("--geometry", help="A model's config.json (or its folder) "
                                                     "instead of --model: no weights needed.")] = None,
    gpu_mem_gb: Annotated[Optional[float], typer.Option("--gpu-mem-gb", help="The GPU's memory in GB (replaces "
                                                        "the table's; needed for a GPU not in it).")] = None,
    gpu_hbm_tbps: Annotated[Optional[float], typer.Option("--gpu-hbm-tbps", help="Memory bandwidth, TB/s "
                                                          "(for a GPU not in the table).")] = None,
    gpu_bf16_tflops: Annotated[Optional[float], typer.Option("--gpu-bf16-tflops", help="Dense bf16 rate, "
                                                             "TFLOP/s (for a GPU not in the table).")] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", help="GPUs available: exit 1 when the load needs more.")] = None,
    ttft_ms: Annotated[Optional[float], typer.Option("--ttft-ms", help="Largest time to first token, ms.")] = None,
    kv_budget_gb: Annotated[Optional[float], typer.Option("--kv-budget-gb", help="KV memory per GPU, GB (default: "
                                                          "--mem-util of the GPU less the weights and a prefill's "
                                                          "activations).")] = None,
    mem_util: Annotated[float, typer.Option("--mem-util", help="Fraction of the GPU's memory to use.")] = 0.9,
    reuse: Annotated[float, typer.Option("--reuse", help="Fraction of requests whose document already has a state "
                                         "(loaded instead of prefilled).")] = 0.0,
    history: Annotated[Optional[Path], typer.Option("--history", help="Results history to fit on (default "
                                                    "$KITE_HOME/results/bench.jsonl, `kite bench history`).")] = None,
    no_reference: Annotated[bool, typer.Option("--no-reference", help="Fit on the history alone, not on this "
                                               "project's measurements (the packaged quality calibration).")] = False,
    json_out: bool = JsonOpt,
) -> None:
    """KV bytes per token raw and compressed, weights, sequences per GPU at each setting, prefill
    and decode times (roofline corrected by this project's H200 measurements), GPUs for the load,
    and the recommended upcycle_compression_ratio, precision and yoco_min_hit_gain with their
    predicted memory saving and PPL Δ fitted on measured runs. Exit 1 when no setting meets the
    tolerance, no way meets --ttft-ms, or --gpus is too few.

    Example: kite capacity-plan --qps 2 --avg-tokens 16384 --gpu H200 --geometry ./Qwen2-7B/config.json --ppl-tolerance 0.5
    """
    from kite.bench.history import read_history
    from kite.tune.capacity import CapacityRequest, plan_capacity
    from kite.tune.gpus import gpu_spec

    req = CapacityRequest(qps=qps, avg_tokens=avg_tokens, ppl_tolerance=ppl_tolerance, output_tokens=output_tokens,
                          ttft_ms=ttft_ms, gpus=gpus, kv_budget_gb=kv_budget_gb, reuse=reuse, mem_util=mem_util,
                          use_reference=not no_reference, lane_bits=user_config().server.lane_bits)
    for flag, value in (("--gpu-mem-gb", gpu_mem_gb), ("--gpu-hbm-tbps", gpu_hbm_tbps),
                        ("--gpu-bf16-tflops", gpu_bf16_tflops)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise BadInput(f"{flag} {value}: must be a finite number above 0")
    spec = gpu_spec(gpu, gpu_mem_gb, gpu_hbm_tbps, gpu_bf16_tflops)
    name, shape = _model_shape(model, geometry)
    if history is not None and not history.is_file():
        raise BadInput(f"--history {history}: no such file")
    plan = plan_capacity(req, shape, spec, model=name, history=read_history(history),
                         default_min_hit_gain=user_config().features.yoco_min_hit_gain)
    if json_out:
        emit_json(plan.to_dict())
    else:
        _print(plan.to_dict())
    if not plan.meets:
        raise typer.Exit(1)


def _model_shape(model: str | None, geometry: Path | None):
    from kite.tune.roofline import shape_from_config

    if model is not None and geometry is not None:
        raise BadInput("--model and --geometry: give one of them")
    if geometry is not None:
        path = geometry / "config.json" if geometry.is_dir() else geometry
        where = f"--geometry {geometry}"
        if not path.is_file():
            raise BadInput(f"{where}: no such file" + (" (the folder has no config.json)" if geometry.is_dir() else ""))
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise BadInput(f"{where}: not UTF-8 text (expected a model's config.json)") from None
        except json.JSONDecodeError as exc:
            raise BadInput(f"{path}:{exc.lineno}:{exc.colno}: not JSON ({exc.msg}); expected a model's "
                           "config.json") from None
        if not isinstance(data, dict):
            raise BadInput(f"{where}: not a model config (a JSON object with num_hidden_layers, ...)")
        return str(geometry), shape_from_config(data, where)
    from kite.cli._common import model_spec
    from kite.cli._progress import say
    from kite.model import load_config_only

    spec = model_spec(model)
    source, _, config = load_config_only(spec, progress=say)
    return source.spec, shape_from_config(config, f"--model {spec}")


def _gb(x: float | None) -> str:
    return "—" if x is None else f"{x / 1e9:,.2f} GB"


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x:,.1f}"


def _span(lo, hi, fmt: str) -> str:
    if lo is None and hi is None:
        return "—"
    if lo is None or hi is None:
        return f"≥ {format(lo, fmt)}" if hi is None else f"≤ {format(hi, fmt)}"
    return format(lo, fmt) if abs(hi - lo) < 1e-9 else f"{format(lo, fmt)} … {format(hi, fmt)}"


def _print(d: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    out = console()
    m, g, load = d["model"], d["gpu"], d["load"]
    geo = m["geometry"]
    out.print(f"[bold]kite capacity-plan[/]: {escape(m['name'])} ({geo['n_layers']} layers, {geo['n_heads']} heads / "
              f"{geo['n_kv_heads']} KV heads × {geo['head_dim']}; {m['params'] / 1e9:.2f} B parameters, weights "
              f"{_gb(m['weights_bytes'])} bf16) on {escape(g['name'])}", highlight=False)
    rates = (f"{g['hbm_tbps']:g} TB/s, {g['bf16_tflops']:g} TFLOP/s bf16 dense" if g["hbm_tbps"] and g["bf16_tflops"]
             else "no rates")
    out.print(f"  gpu       {g['mem_gb']:g} GB, {rates} ({escape(g['source'])})", highlight=False)
    out.print(f"  load      {load['qps']:g} req/s × {load['avg_tokens']:,} prompt + {load['output_tokens']:,} output "
              f"tokens; reuse {load['reuse']:g}", highlight=False)
    kv = d["kv_bytes_per_token"]["raw_bf16"]
    out.print(f"  KV        raw bf16 {kv:,} B/token; budget {_gb(d['kv_budget_bytes_per_gpu'])} per GPU "
              f"({escape(d['kv_budget'])}); {d['tensor_parallel']} GPU(s) per replica", highlight=False)
    t = d["times"]
    if t:
        c = d["calibration"]
        whose = "measured on this GPU" if c["own"] else "borrowed from the H200"
        out.print(f"  times     prefill {load['avg_tokens']:,} tokens {_ms(t['prefill_ms']['predicted'])} ms "
                  f"(roofline {_ms(t['prefill_ms']['floor'])}); decode step, batch 1: "
                  f"{_ms(t['decode_step_batch1_ms']['predicted'])} ms (roofline {_ms(t['decode_step_batch1_ms']['floor'])})"
                  + (f"; TTFT from a state {_ms(t['ttft_from_state_ms']['predicted'])} ms" if "ttft_from_state_ms" in t
                     else ""), highlight=False)
        out.print(f"            corrected by {escape(c['source'])} ({whose})", highlight=False)
    fits = {s["setting"]: s for s in d["settings"]}
    table = Table(box=None, title="sequences per replica and GPUs for the load", title_justify="left")
    for col in ("setting", "mode", "KV B/token", "memory saving", "sequences", "TTFT ms", "decode step ms",
                "GPU-s/request", "GPUs", "PPL Δ", "fit on"):
        table.add_column(col, justify="left" if col in ("setting", "mode", "fit on") else "right")
    for r in d["rows"]:
        s = fits.get(r["setting"]) if r["setting"] else None
        if r["mode"] == "lanes":   # the loaded state's codec, then lanes: bytes by arithmetic, quality not fitted
            lanes = r["seq_bytes"] - load["output_tokens"] * kv
            saving, ppl, basis = f"{(1 - lanes / (load['avg_tokens'] * kv)) * 100:.1f} %", "setting's + lanes'", "not fitted"
            bpt = f"{lanes / load['avg_tokens']:,.0f}"
        elif s is None:
            saving, ppl, basis, bpt = "—", "+0", "exact", f"{kv:,}"
        else:
            ms = s["memory_saving"]
            saving = _span(ms["low"] and ms["low"] * 100, ms["high"] and ms["high"] * 100, ".1f") + " %"
            p = s["ppl_delta"]
            ppl = _span(p["low"], p["high"], "+.3f")
            basis = f"{p['basis']} ({p['n']})" if p["n"] else "analytic"
            bpt = f"{kv / s['ratio_point']:,.0f}" if r["mode"] == "resident" else f"{kv:,} (state {kv / s['ratio_point']:,.0f})"
        seqs = f"{r['sequences']:,}"
        if r["sequences_range"] and tuple(r["sequences_range"]) != (r["sequences"],) * 2:
            seqs += f" ({r['sequences_range'][0]:,}–{r['sequences_range'][1]:,})"
        table.add_row(escape(r["name"] if r["mode"] == "lanes" else r["setting"] or "raw bf16"), r["mode"], bpt, saving, seqs, _ms(r["ttft_ms"]),
                      _ms(r["decode_step_ms"]), "—" if r["gpu_s_per_request"] is None else f"{r['gpu_s_per_request']:.3f}",
                      "—" if r["gpus"] is None else str(r["gpus"]), ppl, basis)
    out.print(table)
    f = d["fit"]
    out.print(f"fit: {f['history_runs']} run(s) in the history ({f['history_points']} measured points"
              + (f", models {', '.join(f['history_models'])}" if f["history_models"] else "") + ")"
              + (f"; this project's measurements: {f['reference_points']} points ({f['reference']}: the "
                 "embedded model; GPU bytes at Qwen2-7B geometry)"
                 if f["reference_used"] else "; this project's measurements not used (--no-reference)")
              + "; 'analytic' = no measured run: bounds only", highlight=False)
    rec = d["recommendation"]
    hit = rec["yoco_min_hit_gain"]
    if rec["setting"] is None:
        out.print(f"[bold red]no setting recommended[/]: {escape(rec['why'])}", highlight=False)
    else:
        ms, p = rec["memory_saving"], rec["ppl_delta"]
        ucr = rec["upcycle_compression_ratio"]
        out.print(f"[bold]recommended[/]: {escape(rec['precision'])} ({rec['flag']}"
                  + (f"; features.upcycle_compression_ratio: {ucr:g}" if ucr else "") + ")", highlight=False)
        out.print(f"  memory saving {_span(ms['low'] * 100, ms['high'] * 100, '.1f')} % ({ms['basis']}, {ms['n']} points); "
                  f"PPL Δ {_span(p['low'], p['high'], '+.3f')} ({p['basis']}: {escape(p['how'])})", highlight=False)
    out.print(f"  features.yoco_min_hit_gain: {hit['value']:g} ({escape(hit['how'])})", highlight=False)
    plan = d["plan"]
    if plan is not None:
        gp = f"{plan['gpus']} GPU(s)" if plan["gpus"] is not None else f"{plan['sequences']:,} sequences per replica"
        short = "" if load["gpus"] is None or plan["gpus"] is None else (
            f"; {load['gpus']} available: " + ("enough" if plan["gpus"] <= load["gpus"] else "[bold red]too few[/]"))
        out.print(f"[bold]plan[/]: {escape(plan['name'])}, {gp}" + short, highlight=False)
    elif load["ttft_ms"] is not None:
        out.print(f"[bold red]no way meets --ttft-ms {load['ttft_ms']:g}[/]", highlight=False)
    for note in d["notes"]:
        out.print(f"[yellow]note[/]: {escape(note)}", highlight=False)
