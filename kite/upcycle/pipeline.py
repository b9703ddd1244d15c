"""The Upcycle pipeline assembled in one place: the compression settings an upcycle config and a
command's flags ask for, the model, and the clause tagger the states are tagged with.

Every caller (the CLI's upcycle and yoco commands, the server, the bench, shadow, the benchmarks)
goes through :func:`compress_settings` and :func:`open_pipeline`, so the precedence of the knobs and
their checks are written once:

    --precision or --ratio (one of them: both is an error)
      >  features.upcycle_compression_ratio (KITE config, passed in as ``kept_fraction``; unset by default)
      >  compression.precision (upcycle config)  >  compression.svd_ratio (upcycle config)

The seed's names (``upcycle_compression_ratio``, ``svd_ratio``) are the fraction of the raw fp16 KV
kept (0-1); ``--ratio`` is how many times smaller (>= 1): ratio = 1 / fraction.

Span bounds and the cluster count come from the config (``clusters`` overrides the count).
Per-label ratios (:mod:`kite.upcycle.label_ratios`): the config's ``compression.label_ratios``,
with ``--label-ratio`` flags over it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kite.errors import BadInput
from kite.model.loader import DTYPES
from kite.upcycle.address import Address, address_for
from kite.upcycle.capture import tokenize_document
from kite.upcycle.codec.layer_weights import OFF as layer_weights_off
from kite.upcycle.codec.layer_weights import LayerWeights, shipped_for
from kite.upcycle.codec.regenerator import Regenerator, install
from kite.upcycle.codec.settings import PRESETS, ratio_of, settings_for
from kite.upcycle.compress import CompressResult, CompressSettings, Progress, compress_document
from kite.upcycle.label_ratios import check_ratios, read_label_ratios
from kite.upcycle.load.staging import prepare_state
from kite.upcycle.settings import UpcycleConfig, load_upcycle_config
from kite.upcycle.tail import parse_recompute
from kite.upcycle.tagging.build import build_tagger, describe_tagger

if TYPE_CHECKING:
    from kite.model import LoadedModel


def compress_settings(cfg: UpcycleConfig, *, ratio: float | None = None, precision: str | None = None,
                      clusters: int | None = None, kept_fraction: float | None = None,
                      label_ratios: dict[str, float] | None = None, config_path: Path | None = None,
                      entropy_coding: bool | None = None, recompute_tokens: int | str | None = None) -> CompressSettings:
    """The compression settings of an upcycle config and a command's flags (see the module doc).

    ``kept_fraction``: the user's default of ``ratio`` in the seed's spelling (the KITE config's
    ``features.upcycle_compression_ratio``, 0-1); None leaves the upcycle config's settings.
    ``label_ratios``: per-label ratios from the command line, over the config's
    ``compression.label_ratios`` (a map, or a file relative to ``config_path``). ``entropy_coding``:
    the command's choice over the config's ``compression.entropy_coding``; ``recompute_tokens`` (a
    count or ``auto``) over ``compression.recompute_tokens``.
    BadInput for both ``ratio`` and ``precision``, a ratio below 1, a fraction outside (0, 1], a
    precision that is not a preset, or label ratios with a preset.
    """
    c = cfg.compression
    if precision and ratio is not None:
        raise BadInput(f"--ratio {ratio:g} --precision {precision}: use one of --ratio or --precision "
                       "(a precision preset fixes the size itself)")
    if kept_fraction is not None and not 0 < kept_fraction <= 1:
        raise BadInput(f"features.upcycle_compression_ratio {kept_fraction:g}: the fraction of raw fp16 KV "
                       "kept is in (0, 1] (0.25 = --ratio 4)")
    try:
        if precision:
            if precision.strip().lower() not in PRESETS:
                raise BadInput(f"--precision {precision}: expected one of {', '.join(PRESETS)}")
            spec = settings_for(precision)
        elif ratio is not None:
            if not math.isfinite(ratio):
                raise BadInput(f"--ratio {ratio}: a compression ratio is a finite number ≥ 1 (4 = a quarter of raw "
                               "fp16 KV)")
            if ratio < 1:
                hint = f"; the fraction kept {ratio:g} is --ratio {1 / ratio:g}" if ratio > 0 else ""
                raise BadInput(f"--ratio {ratio:g}: a compression ratio is ≥ 1 (4 = a quarter of raw fp16 KV)"
                               + hint)
            spec = settings_for(float(ratio))
        elif kept_fraction is not None:
            spec = settings_for(1.0 / kept_fraction)
        elif c.precision:
            spec = settings_for(c.precision)
        else:
            spec = settings_for(1.0 / c.svd_ratio)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    if clusters is not None and clusters < 1:
        raise BadInput(f"--clusters {clusters}: at least one cluster")
    if recompute_tokens is not None:
        recompute_tokens = parse_recompute(recompute_tokens, "--recompute-tokens")
    if isinstance(c.label_ratios, str):
        ratios = read_label_ratios(cfg.resolve(c.label_ratios, config_path))
    else:
        ratios = check_ratios(dict(c.label_ratios), "compression.label_ratios")
    ratios.update(label_ratios or {})
    if ratio_of(spec) is not None and spec.joint_heads != c.joint_heads:
        spec = replace(spec, joint_heads=c.joint_heads)
    if ratios and ratio_of(spec) is None:
        raise BadInput(f"per-label ratios ({', '.join(sorted(ratios))}) need a compression ratio (--ratio R), "
                       f"not the {spec.name} preset")
    return CompressSettings(codec=spec, n_clusters=clusters or c.cluster_num,
                            min_span_tokens=c.min_span_tokens, max_span_tokens=c.max_span_tokens,
                            label_ratios=ratios,
                            entropy_coding=c.entropy_coding if entropy_coding is None else entropy_coding,
                            recompute_tokens=c.recompute_tokens if recompute_tokens is None else recompute_tokens)


@dataclass
class Pipeline:
    """A model with the tagger, the compression settings and the regenerator (None: each state
    stores its own bases) its states are made with."""

    lm: LoadedModel
    tagger: object | None
    settings: CompressSettings
    config: UpcycleConfig
    config_path: Path | None
    regenerator: Regenerator | None = None

    def compress(self, text: str, output: str | Path, *, source_name: str = "-", progress: Progress | None = None,
                 ids: list[int] | None = None, settings: CompressSettings | None = None,
                 tenant: str | None = None) -> CompressResult:
        """Write a state of ``text`` (or of the token ids ``ids``) to ``output``, its content address
        (made for ``tenant``, None: no tenant) in its header (:meth:`address_of`), and, with the model on a GPU, prepare it for loading there
        (:func:`kite.upcycle.load.prepare_state`)."""
        result = compress_document(self.lm, text, output, settings or self.settings, tagger=self.tagger,
                                   source_name=source_name, progress=progress, ids=ids,
                                   regenerator=self.regenerator, address=True, tenant=tenant)
        if torch.device(self.lm.device).type == "cuda":
            t = time.perf_counter()
            if prepare_state(output):
                result.timings_ms["prepare_load"] = round((time.perf_counter() - t) * 1e3, 1)
        return result

    def address_of(self, text: str | None = None, ids: list[int] | None = None,
                   settings: CompressSettings | None = None, tenant: str | None = None) -> Address:
        """The content address :meth:`compress` would give the state of ``text`` (or of ``ids``) made for
        ``tenant``, computed without compressing (a tokenization): what a store is asked for before the
        work is done."""
        if ids is None:
            ids, _ = tokenize_document(self.lm.tokenizer, text)
        regen = None if self.regenerator is None else self.regenerator.fingerprint
        return address_for(self.lm.fingerprints.combined, ids, settings or self.settings,
                           describe_tagger(self.tagger), regen, tenant)

    def load_tagger(self, progress=None) -> None:
        """Build (or read from the cache) the tagger the config asks for."""
        self.tagger = build_tagger(self.lm, self.config, self.config_path, progress=progress)


def named_layer_weights(cfg: UpcycleConfig, cfg_path: Path | None = None,
                        layer_weights: str | Path | None = None) -> tuple[bool, LayerWeights | None]:
    """Whether layer weights were named (``layer_weights``, else the config's ``layer_weights:``; a
    file, or ``none``), and the named file's weights (None for ``none``)."""
    named = str(layer_weights) if layer_weights is not None else cfg.layer_weights
    if named is None:
        return False, None
    if named.strip().lower() == layer_weights_off:
        return True, None
    return True, LayerWeights.load(Path(layer_weights) if layer_weights is not None
                                   else cfg.resolve(cfg.layer_weights, cfg_path))


def layer_weights_for(lm: LoadedModel, named: bool, weights: LayerWeights | None,
                      grouped: bool = False) -> LayerWeights | None:
    """The layer weights states of ``lm`` are coded with: those named (:func:`named_layer_weights`),
    checked against the model, else the ones KITE ships for it, if any. ``grouped``: the states are
    coded on a regenerator whose bases span layers, which weighs its layers itself: none (BadInput
    when some were named)."""
    if grouped:
        if weights is not None:
            raise BadInput("layer weights weigh per-layer bases; a regenerator with bases across layers weighs its "
                           "layers itself (set layer_weights: none, or drop --layer-weights)")
        return None
    if not named:
        weights = shipped_for(lm.fingerprints.base)
    if weights is not None:
        weights.check(lm.geometry.n_layers, lm.fingerprints.base)
    return weights


def open_pipeline(model: str | None = None,
                  upcycle_config: str | Path | UpcycleConfig | tuple[UpcycleConfig, Path | None] | None = None, *,
                  ratio: float | None = None, precision: str | None = None, clusters: int | None = None,
                  kept_fraction: float | None = None, device: str | None = None, lm: LoadedModel=None, tagger: bool = True,
                  regenerator: str | Path | None = None, label_ratios: dict[str, float] | None = None,
                  layer_weights: str | Path | None = None, progress=None,
                  entropy_coding: bool | None = None, recompute_tokens: int | str | None = None,
                  dtype: str | None = None) -> Pipeline:
    """Config → settings (checked before anything slow) → model (``lm`` when given, else ``model``
    loaded with the config's adapter on ``device`` at ``dtype``, fp32 | bf16 | fp16, default the
    device's) → the config's tagger (``tagger=False``: none).
    ``ratio``, ``precision``, ``clusters``, ``kept_fraction``, ``label_ratios``, ``entropy_coding`` and
    ``recompute_tokens``: see :func:`compress_settings`.

    ``upcycle_config``: a path; None for ``configs/upcycle_config.yaml`` (else the defaults); a loaded
    config; or the (config, path) pair :func:`kite.upcycle.load_upcycle_config` returns (the path
    resolves the config's relative example files). ``regenerator``: a regenerator folder (default:
    the config's ``regenerator:``), read and checked against the model. ``layer_weights``: a layer
    weights file (`kite upcycle weigh`; default: the config's ``layer_weights:``, else the weights KITE
    ships for the model, if any; ``"none"``: none), read and checked against the model: the state-wide
    bit allocation weighs each layer side by it.
    """
    if isinstance(upcycle_config, UpcycleConfig):
        cfg, cfg_path = upcycle_config, None
    elif isinstance(upcycle_config, tuple):
        cfg, cfg_path = upcycle_config
    else:
        cfg, cfg_path = load_upcycle_config(upcycle_config)
    settings = compress_settings(cfg, ratio=ratio, precision=precision, clusters=clusters,
                                 kept_fraction=kept_fraction, label_ratios=label_ratios, config_path=cfg_path,
                                 entropy_coding=entropy_coding, recompute_tokens=recompute_tokens)
    regen_dir = Path(regenerator) if regenerator is not None else cfg.resolve(cfg.regenerator, cfg_path)
    regen = Regenerator.load(regen_dir) if regen_dir is not None else None   # a bad folder fails before the model
    named, weights = named_layer_weights(cfg, cfg_path, layer_weights)   # (a bad file, before the model)
    if dtype is not None and dtype not in DTYPES:
        raise BadInput(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if lm is None:
        from kite.model import load_model

        lm = load_model(model, adapter=cfg.resolve(cfg.adapter.path, cfg_path), device=device, dtype=dtype)
    settings = replace(settings, layer_weights=layer_weights_for(lm, named, weights,
                                                                 grouped=regen is not None and regen.grouped))
    if regen is not None:
        regen.check_model(lm)
        install(regen)
    pipe = Pipeline(lm=lm, tagger=None, settings=settings, config=cfg, config_path=cfg_path, regenerator=regen)
    if tagger:
        pipe.load_tagger(progress)
    return pipe
