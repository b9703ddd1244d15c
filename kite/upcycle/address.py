"""Content addresses of states: the same document, model and settings give the same id everywhere.

A state's address is sha256 over a canonical JSON encoding (sorted keys, no spaces, ASCII) of

    scheme          "kite-addr1" (this encoding)
    format_version  the .upc container version the state is written in
    model           the combined model fingerprint (weights, tokenizer, adapter)
    tokens_sha256   sha256 of the document's token ids as little-endian uint32
    settings        what the compression was asked to do: codec settings (fields added since at
                    their defaults left out, so older states keep their ids), clusters, span bounds,
                    prefill chunk, seed, per-label ratios, the tagger (method, layers, labels)
    regenerator     the regenerator's fingerprint, or null
    tenant          the tag of the tenant the state is made for (kite.tenants); absent without a
                    tenant, so a state made for no tenant keeps the address it had before tenants

Nothing in it depends on a path, a hostname, the time or PYTHONHASHSEED, so every process and
machine computes the same id. The state records these fields and the id in its header
(``meta["address"]``), so a reader recomputes and checks the id from the state's own bytes
(:func:`kite.upcycle.format.address.check_address`, run whenever a state opens). A state without that section (written before addresses, or migrated
to another model, which drops it) is *unaddressed*: its id cannot be recomputed from its bytes
because the header holds no token digest.
"""

from __future__ import annotations

import hashlib
import json
import struct

from kite.errors import BadInput
from kite.upcycle.codec.settings import ratio_of
from kite.upcycle.tail import recomputed_tail
from kite.tenants import tenant_tag
from kite.upcycle.format.address import (ADDRESS_RE, SCHEME, Address, AddressMismatch, canonical, check_address,
                                         is_address)

def tokens_digest(ids) -> str:
    """sha256 of token ids as little-endian uint32 (hex)."""
    ids = [int(t) for t in ids]
    if any(t < 0 or t >= 1 << 32 for t in ids):
        raise BadInput("token ids must lie in 0..2^32-1")
    return hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).hexdigest()


# What of a tagger's description an address covers: how it tags, not what its training measured
# (validation accuracy and the fitted temperature move in their last bits with the machine and
# its thread count; an address hashes what was asked for, never a result).
TAGGER_KEYS = ("method", "embedding_layers", "labels")


def settings_fields(settings, tagger_description: dict | None, n_tokens: int) -> dict:
    """The compression settings an address covers (a :class:`CompressSettings` and the tagger's
    description, :data:`TAGGER_KEYS` of it) for a document of ``n_tokens`` tokens, as plain JSON
    values (the recomputed tail as the count the state keeps: ``auto`` resolved)."""
    tail = recomputed_tail(n_tokens, getattr(settings, "recompute_tokens", 0), ratio_of(settings.codec))
    tagger = None if tagger_description is None else {k: tagger_description.get(k) for k in TAGGER_KEYS}
    return {
        "codec": settings.codec.address_json(),
        "n_clusters": settings.n_clusters,
        "min_span_tokens": settings.min_span_tokens,
        "max_span_tokens": settings.max_span_tokens,
        "chunk_tokens": settings.chunk_tokens,
        "seed": settings.seed,
        "label_ratios": dict(sorted(settings.label_ratios.items())),
        "tagger": tagger,
        # (only when set: states made without layer weights keep their addresses)
        **({"layer_weights": settings.layer_weights.fingerprint} if settings.layer_weights is not None else {}),
        **({"entropy_coding": True} if getattr(settings, "entropy_coding", False) else {}),
        **({"recompute_tokens": tail} if tail else {}),
    }


def address_for(model_fingerprint: str, ids, settings, tagger_description: dict | None,
                regenerator_fingerprint: str | None, tenant: str | None = None) -> Address:
    """The address of the state compressing token ids `ids` with `settings` on the model whose
    combined fingerprint is `model_fingerprint`, made for `tenant` (a name; None: no tenant)."""
    from kite.upcycle.format.container import FORMAT_VERSION

    fields = json.loads(canonical(settings_fields(settings, tagger_description, len(ids))))  # plain JSON types
    return Address(FORMAT_VERSION, model_fingerprint, tokens_digest(ids), fields, regenerator_fingerprint,
                   tenant_tag(tenant))



__all__ = ["ADDRESS_RE", "SCHEME", "TAGGER_KEYS", "Address", "AddressMismatch", "address_for", "canonical",
           "check_address", "is_address", "settings_fields", "tokens_digest"]
