"""Upcycle: capture, compress and reload a document's KV cache as a reusable `.upc` state.

The public face: code outside ``kite/upcycle/`` imports only these names (the subpackages ``codec``
and ``format`` included, for benchmarks and tools that work on the codec or the container).

    pipeline   open_pipeline, compress_settings: config + flags -> model, tagger, settings
    compress   compress_document: text -> .upc (capture, spans, clusters, tags, codec, write);
               compress_capture: the same from KV already captured (a serving engine's)
    address    content addresses of states (sha256 of model, token ids, settings, format version)
    load       load_prefix: .upc -> KV prefix (fingerprints checked, parts chosen, CPU or GPU rebuild);
               load_prefixes: several whole states, their recomputed tails run together;
               open_rebuild: the host rebuild one layer at a time, for a model known by its config
    format     the container (StateFile, StateWriter), blob names, codec blob bytes, bit layout
    codec      settings and presets, side coders, per-layer codec, batched encoder, quantizer, and the
               regenerator (calibrated bases), distortion weights and attention probe loads and
               compression read
    tagging    the clause tagger
    train      `kite upcycle train`: calibrates the regenerator, trains the LoRA reader adapter
    budget     the memory-budgeted KV cache (coded blocks that stay in attention)
    label_ratios, recode  per-label ratios (config, flags) and clusters re-encoded at higher ones
               from the stored form (`kite upcycle retune`, kite.yoco.flywheel, decides them)
    migration, quality (what a setting loses), inspect, rope, capture (capture_kv: a document's K, V)
"""

from kite.upcycle import codec, format
from kite.upcycle.address import Address, AddressMismatch, address_for, check_address, is_address, tokens_digest
from kite.upcycle.budget import (DEFAULT_BLOCK_TOKENS, DEFAULT_CODEC, BudgetCache, BudgetRow, BudgetSettings, WindowCache,
                                 budget_cache, check_budget, kv_bytes_per_token, min_budget)
from kite.runtime.batch import BATCH_TOKENS as FORWARD_BATCH_TOKENS
from kite.upcycle.capture import Capture, token_offsets, tokenize_document
from kite.upcycle.capture import capture as capture_kv
from kite.upcycle.codec import CodecSettings, Regenerator, RegeneratorFit
from kite.upcycle.codec import settings_for as codec_settings
from kite.upcycle.compress import ClusterInfo, CompressResult, CompressSettings, compress_capture, compress_document
from kite.upcycle.recode import cluster_ratios, not_recodable, recode_clusters, state_ratio
from kite.upcycle.quality import (
    ANSWER_TOKENS,
    PASSKEY_DEPTHS,
    PROBES,
    EvalResult,
    check_probe,
    compare_logits,
    evaluate,
    full_logits,
    first_number,
    passkey_contexts,
    passkey_probe,
    qa_contexts,
    qa_probe,
    qa_question,
    run_probe,
    split_text,
)
from kite.upcycle.format import FORMAT_VERSION, StateFile, StateWriter, path_version
from kite.upcycle.inspect import describe_state
from kite.upcycle.load import (LOAD_PRECISIONS, RESIDENT_FORMS, SINK_TOKENS, HostRebuild, HotTier, LoadReport, ResidentForm,
                               check_fingerprints, check_resident, default_tier, lanes_for, lanes_of, load_lanes, load_prefix,
                               load_prefixes, open_rebuild,
                               prepare_state, resident_form, select_clusters)
from kite.upcycle.migration import MigrationReport, migrate, pending_migration, plan_migration, rollback
from kite.upcycle.label_ratios import FILE_NAME as LABEL_RATIOS_FILE
from kite.upcycle.label_ratios import parse_label_ratio_flags, read_label_ratios
from kite.upcycle.pipeline import Pipeline, compress_settings, open_pipeline
from kite.upcycle.rope import apply_rope, remove_rope, rope_cos_sin
from kite.upcycle.settings import UpcycleConfig, load_upcycle_config
from kite.upcycle.weigh import measure_layer_weights
from kite.upcycle.train import Pair, read_pairs, split_pairs
from kite.upcycle.train.documents import LOAD_TOGETHER as TRAIN_LOAD_TOGETHER
from kite.upcycle.train.run import TrainRequest, train_upcycle
from kite.upcycle.tagging import (ClauseTagger, QueryHead, TagResult, build_tagger, calibration_set,
                                  describe_tagger, evaluate_queries, evaluate_tagging)

__all__ = [
    "ANSWER_TOKENS", "DEFAULT_BLOCK_TOKENS", "DEFAULT_CODEC", "FORMAT_VERSION", "LOAD_PRECISIONS", "SINK_TOKENS", "BudgetCache", "BudgetRow",
    "BudgetSettings", "PASSKEY_DEPTHS", "PROBES", "ClauseTagger", "ClusterInfo", "CodecSettings", "CompressResult", "CompressSettings",
    "EvalResult", "HotTier", "LoadReport", "MigrationReport", "Pipeline", "QueryHead", "StateFile", "StateWriter",
    "TagResult", "UpcycleConfig", "WindowCache", "apply_rope", "budget_cache", "build_tagger", "kv_bytes_per_token", "min_budget", "calibration_set",
    "check_budget", "check_fingerprints", "check_probe", "first_number", "passkey_contexts", "passkey_probe", "qa_contexts", "qa_probe", "qa_question", "run_probe", "codec", "codec_settings", "compare_logits", "full_logits", "compress_document",
    "compress_settings", "default_tier", "describe_state", "describe_tagger", "evaluate", "evaluate_queries",
    "evaluate_tagging", "format", "lanes_for", "lanes_of", "load_lanes", "load_prefix", "load_prefixes", "load_upcycle_config", "measure_layer_weights", "migrate", "open_pipeline", "path_version", "pending_migration", "plan_migration",
    "Pair", "Regenerator", "RegeneratorFit", "TRAIN_LOAD_TOGETHER", "TrainRequest", "read_pairs", "split_pairs", "train_upcycle",
    "LABEL_RATIOS_FILE", "cluster_ratios", "not_recodable", "parse_label_ratio_flags", "read_label_ratios", "recode_clusters",
    "state_ratio",
    "Address", "AddressMismatch", "address_for", "check_address", "is_address", "tokens_digest",
    "prepare_state", "remove_rope", "rollback", "rope_cos_sin", "select_clusters", "tokenize_document",
    "RESIDENT_FORMS", "ResidentForm", "check_resident", "resident_form",
    "FORWARD_BATCH_TOKENS", "Capture", "capture_kv", "split_text", "HostRebuild", "compress_capture", "open_rebuild", "token_offsets",
]
