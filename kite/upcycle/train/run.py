"""`kite upcycle train`: pairs → regenerator → states → reader adapter → report, in one output folder.

    DIR/run.json                       what the run was asked (a later run into DIR must match it)
    DIR/regenerator/                   regenerator.safetensors + regenerator.json
    DIR/states/<doc>-r<R>.upc          every document's state at each training ratio (regenerator-coded)
    DIR/adapter/                       adapter_model.safetensors + adapter_config.json (peft)
    DIR/checkpoints/                   the adapter's checkpoints (resume)
    DIR/adapter-r<R>/, DIR/r<R>/checkpoints/
                                       the same per ratio, in a run of several ratios (one adapter each)
    DIR/train_report.json, loss.png    the run's figures (``stages``: each stage's seconds, count and
                                       seconds per unit; ``speed``: seconds per state and per pair)

Each stage reuses what an earlier (interrupted) run of the same inputs left: a resumed run skips the
regenerator and the states it finds and continues the adapter from its newest checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kite.atomic import write_text
from kite.errors import BadInput
from kite.model.fingerprint import short
from kite.upcycle.capture import iter_captures
from kite.upcycle.codec.layer_weights import LayerWeights
from kite.upcycle.codec.regenerator import Regenerator, RegeneratorFit, install
from kite.upcycle.codec.settings import settings_for
from kite.upcycle.codec.weights import model_value_weights
from kite.upcycle.settings import UpcycleConfig
from kite.upcycle.train.adapter import (AdapterSettings, attach_lora, auto_settings, memory_budget, tokenize_pair,
                                        train_adapter)
from kite.upcycle.train.data import Pair, split_pairs
from kite.upcycle.train.layer_group import candidate_groups, choose_layer_group, validation_documents
from kite.upcycle.compress import CompressSettings, captures_for
from kite.upcycle.pipeline import layer_weights_for, named_layer_weights
from kite.upcycle.train.documents import (CaptureStore, Prepared, codec_workers_for, compress_settings,
                                          prepare_documents)
from kite.upcycle.train.report import held_out_report, loss_plot
from kite.upcycle.train.stages import StageTimes, summary

if TYPE_CHECKING:
    from kite.model import LoadedModel

RUN = "run.json"


@dataclass
class TrainRequest:
    """What `kite upcycle train` is asked (the seed's flags plus KITE's)."""

    data_path: str
    output_dir: Path
    mode: str = "auto"                      # auto | custom
    seed: int = 0
    ratios: list[float] = field(default_factory=lambda: [8.0])
    eval_fraction: float = 0.1
    epochs: int = 2
    checkpoint_every: int = 25
    resume: bool = False
    overwrite: bool = False
    adapter: bool = True                    # train the reader adapter (else the regenerator only)
    regenerator: Path | None = None         # a regenerator folder to code the states with (else one is fitted)
    pairs_per_step: int = 1                 # the adapter's pairs per optimizer step (one forward, their mean loss)
    codec_workers: int | None = None        # host threads coding the states (None: codec_workers_for's choice)
    layer_group: int | str = 1              # layers a fitted regenerator's basis spans (kite.upcycle.codec.groups);
                                            # "auto": chosen by measured error (kite.upcycle.train.layer_group)

    def check(self, pairs: list[Pair]) -> tuple[list[Pair], list[Pair]]:
        """BadInput for a bad mode or ratio, or pairs too few to split; returns (train, held out)."""
        if self.mode not in ("auto", "custom"):
            raise BadInput(f"--mode {self.mode}: expected auto or custom")
        if not self.ratios or any(not (1 < r < math.inf) for r in self.ratios):
            raise BadInput("--ratio: each training ratio is a finite number > 1 (8 = an eighth of raw fp16 KV)")
        if self.epochs < 1:
            raise BadInput(f"--epochs {self.epochs}: at least 1")
        if self.pairs_per_step < 1:
            raise BadInput(f"--pairs-per-step {self.pairs_per_step}: at least 1")
        if self.checkpoint_every < 1:
            raise BadInput(f"--checkpoint-every {self.checkpoint_every}: at least 1")
        g = self.layer_group
        if g != "auto" and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise BadInput(f"--layer-group {g}: a whole number of layers, at least 1, or auto")
        if g != 1 and self.regenerator is not None:
            raise BadInput("--regenerator --layer-group: a given regenerator's layer groups are its own")
        if self.regenerator is not None:
            Regenerator.load(self.regenerator)      # BadInput for a missing or damaged folder
        train, held = split_pairs(pairs, self.eval_fraction, self.seed)
        if g == "auto":
            validation_documents(sorted({p.document_key for p in train}), self.seed)   # BadInput for too few
        return train, held

    def key(self, pairs: list[Pair], model_fp: str, cfg: UpcycleConfig, layer_weights=None) -> dict:
        """What must match for a run to continue in the same folder (``layer_weights``: those the
        states are coded with, or those the run's bases across layers are fitted with)."""
        data = hashlib.sha256(json.dumps([(p.context, p.prompt, p.response) for p in pairs]).encode()).hexdigest()
        key = {"model": model_fp, "data_sha256": data, "mode": self.mode, "seed": self.seed,
               "ratios": [float(r) for r in self.ratios], "eval_fraction": self.eval_fraction, "epochs": self.epochs,
               "adapter": self.adapter, "config": cfg.model_dump(mode="json"),
               "regenerator": None if self.regenerator is None else Regenerator.load(self.regenerator).fingerprint}
        if self.layer_group != 1:        # (runs of per-layer bases keep the key they had before groups)
            key["layer_group"] = self.layer_group
        if self.pairs_per_step != 1:     # (runs of one pair a step keep the key they had before batches)
            key["pairs_per_step"] = self.pairs_per_step
        if layer_weights is not None:
            key["layer_weights"] = layer_weights.fingerprint
        return key


def prepare_output(req: TrainRequest, key: dict) -> None:
    """Refuse a folder that holds another run unless told to resume it or overwrite it."""
    out = req.output_dir
    run = out / RUN
    if run.exists():
        try:
            old = json.loads(run.read_text())
        except (OSError, ValueError):
            old = None
        if req.overwrite:
            for name in ("regenerator", "states", "adapter", "checkpoints", *(p.name for p in out.glob("adapter-r*")),
                         *(p.name for p in out.glob("r*") if (p / "checkpoints").is_dir())):
                shutil.rmtree(out / name, ignore_errors=True)
        elif old != key:
            raise BadInput(f"--output-dir {out}: holds another run ({_differs(old, key)}); use another folder, or "
                           "--overwrite")
        elif not req.resume:
            raise BadInput(f"--output-dir {out}: holds this run already; --resume continues it, --overwrite "
                           "starts it again")
    elif out.exists() and any(out.iterdir()) and not req.overwrite:
        raise BadInput(f"--output-dir {out}: not empty and not a training run; use an empty or new folder")
    out.mkdir(parents=True, exist_ok=True)
    write_text(run, json.dumps(key, indent=1, sort_keys=True))


def _differs(old, key: dict) -> str:
    """What a folder's run key and this run's do not share, named as the flags and inputs are."""
    if not isinstance(old, dict):
        return "its run.json is unreadable"
    names = [k.removesuffix("_sha256").replace("_", "-") for k in sorted(set(old) | set(key)) if old.get(k) != key.get(k)]
    return f"its {', '.join(names)} differ{'s' if len(names) == 1 else ''}"


def fit_regenerator(lm: LoadedModel, train_pairs: list[Pair], cfg_codec, progress=None, weighted: bool = False,
                    times: StageTimes | None = None, keep: CaptureStore | None = None,
                    compress: CompressSettings | None = None, layer_group: int | str = 1,
                    layer_weights: LayerWeights | None = None, search: GroupSearch | None = None) -> Regenerator:
    """Calibrate on the training documents (each once), in the blocks the codec uses; ``weighted``:
    per-layer bases with attention-aware distortion weights (the documents' queries and the model's
    ``o_proj``; :mod:`kite.upcycle.codec.weights`). Off by default: on SmolLM2's held-out rows the
    weighted per-layer regenerator lost more often than it won (docs/PERFORMANCE.md "Training";
    measured 2026-12-01 at commit 42c8b7a). ``times``: where the prefills' and the sums' seconds are
    added. ``keep``: the documents' captures are offered to it, made as a compression with
    ``compress`` makes them (the hidden states its clusters read, the model's cache), for the states
    and the teacher to reuse. ``layer_group``: layers one basis spans (:mod:`kite.upcycle.codec.groups`);
    such bases always weigh each layer's features by what attention feels of them, and each layer
    by ``layer_weights`` when given (docs/compression.md "Bases across layers"). ``"auto"``: measured
    (:mod:`kite.upcycle.train.layer_group`, with ``search``); the regenerator's ``layer_group_choice``
    says what was measured."""
    times = times or StageTimes(lm.device)
    docs = {p.document_key: p for p in train_pairs}
    auto = layer_group == "auto"
    if auto:       # the widest grouping's sums: every candidate's are slices of them
        if search is None:
            raise ValueError("--layer-group auto measures its candidates with a GroupSearch")
        geo = lm.geometry
        candidates = candidate_groups(geo.n_layers, geo.n_kv_heads * geo.head_dim)
        layer_group = candidates[-1]
        auto = len(candidates) > 1        # a layer too wide for any group: per layer, nothing to measure
    if layer_group > 1 and weighted:
        raise BadInput("a regenerator with bases across layers is always attention-weighted; --weighted is for "
                       "per-layer bases")
    queries = weighted or layer_group > 1
    fit = RegeneratorFit(n_layers=lm.geometry.n_layers, joint_heads=cfg_codec.joint_heads, center=cfg_codec.center,
                         layer_group=layer_group)
    held_back = validation_documents(list(docs), search.seed) if auto else []
    value_weights = model_value_weights(lm) if queries else None

    def calibrate(keys: list[str], stage: str, made=None) -> None:
        """Add each document's capture to the sums (``made``: captures already made, in ``keys``' order)."""
        texts = [docs[k].context for k in keys]
        if made is not None:
            caps = iter(made)
        elif keep is None:
            caps = iter_captures(lm, texts, queries=queries)
        else:
            caps = captures_for(lm, texts, compress, keep_cache=True, queries=queries)
        for i, key in enumerate(keys):
            with times.stage("calibrate_capture", 0 if made is not None else 1):   # a batch's prefill falls to its first
                cap = next(caps)
            with times.stage("calibrate_fit"):
                fit.add(cap.keys_pre, cap.values, cap.ids, query_sq=cap.query_sq if queries else None)
            if keep is not None:
                keep.offer(key, cap)
            del cap
            if progress:
                progress(stage, i + 1, len(keys))

    def finish(f: RegeneratorFit) -> Regenerator:
        meta = {"model_fingerprint": lm.fingerprints.base, "geometry": lm.geometry.to_dict(),
                "calibration": {"source": "kite upcycle train"}}
        grouped = f.layer_group > 1
        return f.finish(meta, value_weights=value_weights if grouped or weighted else None,
                        layer_weights=layer_weights if grouped else None)

    calibrate([k for k in docs if k not in held_back], "regenerator (calibrate)")
    if not auto:
        with times.stage("calibrate_fit", 0):
            return finish(fit)
    # the measured documents are prefilled once: their captures (with the model's cache, which the
    # search continues for the full context's logits) are measured, then added to the calibration
    held = []
    with times.stage("calibrate_capture", len(held_back)):     # made as the states' are: the search codes them
        held.extend(captures_for(lm, [docs[k].context for k in held_back],
                                 compress or search.settings(layer_group, search.ratios[0]), keep_cache=True,
                                 queries=queries))
    with times.stage("calibrate_choose", 0):
        measured = []
        for key, cap in zip(held_back, held):
            _, prompt, response = tokenize_pair(lm.tokenizer, docs[key], cap.ids)
            measured.append((cap, prompt + response))
        choice = choose_layer_group(lm, fit, measured, search.ratios, finish, search.settings, progress)
    times.add_count("calibrate_choose", len(choice.candidates))      # the groupings measured
    if keep is None:
        for cap in held:
            cap.cache = None
    calibrate(held_back, "regenerator (calibrate the measured documents)", held)
    del held, measured
    with times.stage("calibrate_fit", 0):
        reg = finish(fit.regroup(choice.chosen))
    reg.meta["layer_group_choice"] = choice.to_dict()     # (before its fingerprint is first taken)
    return reg


@dataclass
class GroupSearch:
    """How ``--layer-group auto`` measures its candidates: the training ratios, each candidate's
    compression settings ``settings(layer group, ratio)`` (as the run codes its states) and the
    seed that draws the documents it measures on."""

    ratios: list[float]
    settings: Callable[[int, float], CompressSettings]
    seed: int = 0


def given_regenerator(lm: LoadedModel, req: TrainRequest) -> Regenerator:
    """``--regenerator DIR``: the adapter then learns to read states of that regenerator (the pairing it
    will be used with) and none is fitted. FingerprintMismatch naming it when it was made for another
    model; BadInput when its bases do not fit a training ratio's codec."""
    reg = Regenerator.load(req.regenerator)
    reg.check_model(lm)
    for ratio in req.ratios:
        codec = settings_for(ratio)
        if reg.joint_heads != codec.joint_heads:
            raise BadInput(f"--regenerator {req.regenerator}: {short(reg.fingerprint)} has "
                           f"{'joint-head' if reg.joint_heads else 'per-head'} bases; the codec of ratio {ratio:g} "
                           f"codes {'joint heads' if codec.joint_heads else 'per head'}")
    return reg


def train_upcycle(lm: LoadedModel, pairs: list[Pair], cfg: UpcycleConfig, req: TrainRequest, progress=None) -> dict:
    """Run every stage (see the module doc); returns the report (also written to train_report.json),
    with each stage's seconds (``stages``) and the run's speed per state and per pair (``speed``)."""
    t_start = time.perf_counter()
    train, held = req.check(pairs)
    auto = req.layer_group == "auto"
    if not auto and lm.geometry.n_layers % req.layer_group:
        raise BadInput(f"--layer-group {req.layer_group}: expected a whole number that divides the model's "
                       f"{lm.geometry.n_layers} layers")
    out = req.output_dir
    named = named_layer_weights(cfg)
    if auto:
        # the layer weights go into bases across layers, or weigh per-layer states: which, once measured
        fit_weights = weights = layer_weights_for(lm, *named)
    elif req.layer_group > 1:
        # bases across layers fitted here take the layer weights into the bases; their states are coded without
        fit_weights, weights = layer_weights_for(lm, *named), None
    else:
        given_grouped = req.regenerator is not None and Regenerator.load(req.regenerator).grouped
        fit_weights, weights = None, layer_weights_for(lm, *named, grouped=given_grouped)  # states as outside training
    prepare_output(req, req.key(pairs, lm.fingerprints.combined, cfg, weights if weights is not None else fit_weights))
    times = StageTimes(lm.device)
    timings: dict[str, float] = {}
    kept = CaptureStore(memory_budget(lm.device, 0.25 if torch.device(lm.device).type == "cuda" else 0.5))

    # 1. the regenerator: the one given (checked against the model), or fitted on the training documents
    #    (the codec of the first training ratio decides joint heads / centering)
    t = time.perf_counter()
    codec0 = settings_for(req.ratios[0])
    if req.regenerator is not None:
        reg = given_regenerator(lm, req)
        reg.save(out / "regenerator")
    elif (out / "regenerator" / "regenerator.json").exists():
        reg = Regenerator.load(out / "regenerator")
    else:
        search = GroupSearch(req.ratios, lambda g, ratio: compress_settings(cfg, ratio, weights if g == 1 else None),
                             req.seed) if auto else None
        reg = fit_regenerator(lm, train, codec0, progress, times=times, keep=kept,
                              compress=compress_settings(cfg, req.ratios[0], weights), layer_group=req.layer_group,
                              layer_weights=fit_weights, search=search)
        reg.save(out / "regenerator")
    if auto and reg.grouped:
        weights = None          # its bases weigh the layers; its states are coded without weights
    install(reg)
    timings["regenerator_s"] = round(time.perf_counter() - t, 1)

    # 2. each document once: its states at every training ratio, their prefixes on the device and
    #    its pairs' teacher (kite.upcycle.train.documents)
    workers = codec_workers_for(lm.device, reg, req.ratios) if req.codec_workers is None else req.codec_workers
    prep = prepare_documents(lm, pairs, train, held, reg, cfg, req.ratios, out, times, teacher=req.adapter,
                             progress=progress, kept=kept, codec_workers=workers, layer_weights=weights)
    timings["states_s"] = round(times.total("capture", "compress", "load"), 1)   # after the regenerator
    report: dict = {"kite_upcycle_train": 1, "model": lm.fingerprints.combined, "pairs": len(pairs),
                    "train_pairs": len(train), "held_out_pairs": len(held),
                    "train_documents": len({p.document_key for p in train}),
                    "held_out_documents": len({p.document_key for p in held}),
                    "regenerator": {"fingerprint": reg.fingerprint, "folder": str(out / "regenerator"),
                                    "calibration": reg.meta.get("calibration"),
                                    "layer_groups": reg.meta.get("layer_groups"),
                                    "layer_weights": reg.meta.get("layer_weights"),
                                    "layer_group_choice": reg.meta.get("layer_group_choice")},
                    "ratios": req.ratios, "timings": timings, "codec_workers": workers,
                    "layer_weights": None if weights is None else weights.fingerprint}
    if req.adapter:
        timings["teacher_s"] = round(times.total("teacher"), 1)
        report.update(_train_adapter(lm, train, held, cfg, req, prep, progress, timings, times))
    timings["total_s"] = round(time.perf_counter() - t_start, 1)
    report["stages"] = times.to_dict()
    if prep.compress_ms:       # within the compress stage, as compress_document times it (ms, all states)
        report["stages"]["compress"]["detail_ms"] = prep.compress_ms
    report["speed"] = summary(times, len(prep.states), len(train) if req.adapter else 0, req.epochs,
                              time.perf_counter() - t_start)
    report["speed"]["states_made"] = prep.made       # the rest were in the folder (a resumed run)
    write_text(out / "train_report.json", json.dumps(report, indent=1))
    return report


def adapter_folder(output_dir: Path, ratio: float, ratios: list[float]) -> Path:
    """Where a run keeps the reader adapter of ``ratio``: ``DIR/adapter`` in a run of one ratio,
    ``DIR/adapter-r<R>`` for each ratio of a run of several. One adapter per ratio: on its run's
    held-out split an adapter trained on a mix of 8x and 16x states read the 8x states little better
    than none (12 % of the gap, F1 worse), where one trained on 8x alone recovered all of it
    (docs/PERFORMANCE.md, "Training"; measured 2026-12-02 at commit 2d4995e)."""
    return output_dir / ("adapter" if len(ratios) == 1 else f"adapter-r{ratio:g}")


def _checkpoint_folder(output_dir: Path, ratio: float, ratios: list[float]) -> Path:
    """The folder whose ``checkpoints/`` hold the training of ``ratio``'s adapter."""
    return output_dir if len(ratios) == 1 else output_dir / f"r{ratio:g}"


def _at_ratio(stage: str, key: str) -> str:
    """A progress stage named for one ratio ("train adapter · loss …" → "train adapter 8× · loss …")."""
    name, sep, detail = stage.partition(" · ")
    return f"{name} {key}×{sep}{detail}"


def _train_adapter(lm: LoadedModel, train, held, cfg, req, prep: Prepared, progress, timings, times) -> dict:
    examples, held_examples = prep.examples, prep.held_examples
    train_tokens = sum(len(e.response_ids) for e in examples)
    a = cfg.adapter
    if req.mode == "custom":
        s = AdapterSettings(target_modules=list(a.target_modules), r=a.r, lora_alpha=a.lora_alpha,
                            lora_dropout=a.lora_dropout, temperature=a.temperature,
                            learning_rate=a.learning_rate, epochs=req.epochs,
                            checkpoint_every=req.checkpoint_every, pairs_per_step=req.pairs_per_step,
                            chosen_by="custom: upcycle_config adapter.*")
    else:
        s = auto_settings(lm.model, train_tokens, temperature=a.temperature, learning_rate=a.learning_rate,
                          epochs=req.epochs, checkpoint_every=req.checkpoint_every,
                          pairs_per_step=req.pairs_per_step)
    folders, histories, held_report = {}, {}, {}
    timings["adapter_s"] = timings["report_s"] = 0.0
    for ratio in req.ratios:
        key = f"{ratio:g}"
        torch.manual_seed(req.seed)   # the LoRA's initial weights (the same for every ratio)
        peft_model = attach_lora(lm, s)
        prefix_of = prep.prefixes[ratio]
        staged = None if progress is None else (
            lambda stage, done, total, key=key: progress(_at_ratio(stage, key), done, total))
        t = time.perf_counter()
        histories[key] = train_adapter(peft_model, examples, prefix_of, s,
                                       _checkpoint_folder(req.output_dir, ratio, req.ratios), seed=req.seed,
                                       resume=req.resume, progress=staged, times=times)
        timings["adapter_s"] = round(timings["adapter_s"] + time.perf_counter() - t, 1)
        folders[key] = str(adapter_folder(req.output_dir, ratio, req.ratios))
        with times.stage("write"):
            peft_model.save_pretrained(folders[key])
        t = time.perf_counter()
        if held:
            with times.stage("report", len(held_examples)):
                held_report.update(held_out_report(lm, peft_model, held, held_examples, {ratio: prefix_of}, staged))
        timings["report_s"] = round(timings["report_s"] + time.perf_counter() - t, 1)
        lm.model = peft_model.unload()     # the base model again, for the next ratio's LoRA
    with times.stage("write"):
        png = loss_plot({f"{k}×": h for k, h in histories.items()}, req.output_dir / "loss.png")
    return {"adapter": {"folders": folders, "settings": s.to_dict()},
            "training": {k: {n: v for n, v in h.items() if n != "loss"} for k, h in histories.items()},
            "loss": {k: h["loss"] for k, h in histories.items()},
            "loss_plot": str(png) if png else None, "held_out": held_report,
            "prefix_loads": {f"{r:g}": c.loads for r, c in prep.prefixes.items()}}
