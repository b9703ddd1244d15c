"""The fused pipeline's states: one `.upc` per document in --upcycle DIR, reused across runs
when the file matches the model (fingerprints), the document (token count) and the settings."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kite.errors import FingerprintMismatch

if TYPE_CHECKING:
    from kite.model import LoadedModel


@dataclass
class StateRef:
    path: Path
    state_bytes: int
    raw_kv_bytes: int
    n_tokens: int
    reused: bool
    build_ms: float  # 0 when reused

    @property
    def compression_ratio(self) -> float:
        return self.raw_kv_bytes / self.state_bytes if self.state_bytes else 0.0

    @property
    def regenerate_rate(self) -> float:
        """MB of .upc per 1,000 document tokens (the seed's upcycle_regenerate_rate)."""
        return self.state_bytes / 1e6 / (self.n_tokens / 1000) if self.n_tokens else 0.0


def settings_key(settings, tagger) -> str:
    from kite.upcycle import describe_tagger

    tagged = describe_tagger(tagger)
    if tagged is not None:  # the query head tags questions, not the state: states are reused
        tagged = {k: v for k, v in tagged.items() if k != "query_head"}
    blob = json.dumps([settings.codec.to_json(), settings.n_clusters, settings.min_span_tokens,
                       settings.max_span_tokens, tagged], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def _matches(path: Path, lm: LoadedModel, n_tokens: int, settings) -> bool:
    from kite.upcycle import StateFile, check_fingerprints

    try:
        with StateFile(path) as state:
            check_fingerprints(state, lm)
            meta = state.meta
    except FingerprintMismatch:
        return False
    except Exception:  # noqa: BLE001 - a damaged or foreign file is simply made again
        return False
    return meta.get("n_tokens") == n_tokens and meta.get("codec") == settings.codec.to_json()


def ensure_state(pipe, doc_key: str, ids: list[int], folder: Path, progress=None) -> StateRef:
    """The document's state in `folder`, made by ``pipe`` (a :class:`kite.upcycle.Pipeline`): reused
    when it matches, else made (written atomically, prepared for loading on a GPU; `progress` as
    compress reports it)."""
    lm, settings, tagger = pipe.lm, pipe.settings, pipe.tagger
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"bench-{doc_key}-{settings_key(settings, tagger)}.upc"
    raw = int(lm.geometry.kv_bytes_per_token("fp16") * len(ids))
    if path.is_file() and _matches(path, lm, len(ids), settings):
        return StateRef(path, path.stat().st_size, raw, len(ids), True, 0.0)
    t0 = time.perf_counter()
    made = pipe.compress("", path, source_name=f"bench:{doc_key}", ids=ids, progress=progress)
    return StateRef(path, made.state_bytes, made.raw_kv_bytes, made.n_tokens, False,
                    (time.perf_counter() - t0) * 1e3)
