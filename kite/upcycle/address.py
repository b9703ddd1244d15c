"""Content addresses of states: the same document, model and settings give the same id everywhere.

A state's address is sha256 over a canonical JSON encoding (sorted keys, no spaces, ASCII) of

    scheme          "kite-addr1" (this encoding)
    format_version  the .upc container version the state is written in
    model           the combined model fingerprint (weights, tokenizer, adapter)
    tokens_sha256   sha256 of the document's token ids as little-endian uint32
    settings        what the compression was asked to do: codec settings, clusters, span bounds,
                    prefill chunk, seed, per-label ratios, the tagger (method, layers, labels)
    regenerator     the regenerator's fingerprint, or null

Nothing in it depends on a path, a hostname, the time or PYTHONHASHSEED, so every process and
machine computes the same id. The state records these fields and the id in its header
(``meta["address"]``), so a reader recomputes and checks the id from the state's own bytes
(:func:`check_address`). A state without that section (written before addresses, or migrated
to another model, which drops it) is *unaddressed*: its id cannot be recomputed from its bytes
because the header holds no token digest.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import asdict, dataclass
from typing import Any

from kite.errors import BadInput

SCHEME = "kite-addr1"
ADDRESS_RE = re.compile(r"[0-9a-f]{64}")


def is_address(text: str) -> bool:
    """Whether `text` has the form of a content address (64 lowercase hex digits)."""
    return isinstance(text, str) and ADDRESS_RE.fullmatch(text) is not None


def tokens_digest(ids) -> str:
    """sha256 of token ids as little-endian uint32 (hex)."""
    ids = [int(t) for t in ids]
    if any(t < 0 or t >= 1 << 32 for t in ids):
        raise BadInput("token ids must lie in 0..2^32-1")
    return hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).hexdigest()


def canonical(obj: Any) -> bytes:
    """The one byte encoding hashed: JSON, sorted keys, compact, ASCII, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


@dataclass(frozen=True, slots=True)
class Address:
    """The fields an address is computed from, and the id (``id``, 64 hex digits)."""

    format_version: int
    model: str
    tokens_sha256: str
    settings: dict
    regenerator: str | None

    @property
    def id(self) -> str:
        body = {"scheme": SCHEME, **asdict(self)}
        return hashlib.sha256(canonical(body)).hexdigest()

    def to_header(self) -> dict:
        """The header section: the fields, the scheme and the id."""
        return {"scheme": SCHEME, **asdict(self), "id": self.id}


# What of a tagger's description an address covers: how it tags, not what its training measured
# (validation accuracy and the fitted temperature move in their last bits with the machine and
# its thread count; an address hashes what was asked for, never a result).
TAGGER_KEYS = ("method", "embedding_layers", "labels")


def settings_fields(settings, tagger_description: dict | None) -> dict:
    """The compression settings an address covers (a :class:`CompressSettings` and the tagger's
    description, :data:`TAGGER_KEYS` of it), as plain JSON values."""
    tagger = None if tagger_description is None else {k: tagger_description.get(k) for k in TAGGER_KEYS}
    return {
        "codec": settings.codec.to_json(),
        "n_clusters": settings.n_clusters,
        "min_span_tokens": settings.min_span_tokens,
        "max_span_tokens": settings.max_span_tokens,
        "chunk_tokens": settings.chunk_tokens,
        "seed": settings.seed,
        "label_ratios": dict(sorted(settings.label_ratios.items())),
        "tagger": tagger,
    }


def address_for(model_fingerprint: str, ids, settings, tagger_description: dict | None,
                regenerator_fingerprint: str | None) -> Address:
    """The address of the state compressing token ids `ids` with `settings` on the model whose
    combined fingerprint is `model_fingerprint`."""
    from kite.upcycle.format.container import FORMAT_VERSION

    fields = json.loads(canonical(settings_fields(settings, tagger_description)))  # plain JSON types
    return Address(FORMAT_VERSION, model_fingerprint, tokens_digest(ids), fields, regenerator_fingerprint)


class AddressMismatch(BadInput):
    """A state's recorded address does not match what its own header says."""


def check_address(meta: dict, format_version: int, where: str = "state") -> str | None:
    """The state's address recomputed from its header `meta` (None: an unaddressed state).

    AddressMismatch (one line) when the recorded id is not the hash of the recorded fields, or the
    fields disagree with the rest of the header (model fingerprint, regenerator, format version)."""
    sec = meta.get("address")
    if sec is None:
        return None
    if not isinstance(sec, dict) or sec.get("scheme") != SCHEME:
        scheme = sec.get("scheme") if isinstance(sec, dict) else type(sec).__name__
        raise AddressMismatch(f"{where}: address section of unknown scheme {str(scheme)[:40]!r}")
    try:
        addr = Address(sec["format_version"], sec["model"], sec["tokens_sha256"], sec["settings"],
                       sec["regenerator"])
        recomputed = addr.id
    except (KeyError, TypeError, ValueError) as exc:
        raise AddressMismatch(f"{where}: malformed address section ({exc})") from None
    if sec.get("id") != recomputed:
        raise AddressMismatch(f"{where}: recorded address {str(sec.get('id'))[:16]}... is not the hash of its "
                              f"fields ({recomputed[:16]}...)")
    combined = (meta.get("fingerprints") or {}).get("combined")
    if addr.model != combined:
        raise AddressMismatch(f"{where}: address names model {str(addr.model)[:24]}, the header {str(combined)[:24]}")
    regen = (meta.get("regenerator") or {}).get("fingerprint")
    if addr.regenerator != regen:
        raise AddressMismatch(f"{where}: address names regenerator {addr.regenerator}, the header {regen}")
    if addr.format_version != format_version:
        raise AddressMismatch(f"{where}: address names format version {addr.format_version}, the file is "
                              f"{format_version}")
    if meta.get("n_tokens") != (meta.get("source") or {}).get("tokens", meta.get("n_tokens")):
        raise AddressMismatch(f"{where}: token counts disagree in the header")
    return recomputed
