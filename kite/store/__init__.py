"""Stores of states beyond one folder of `.upc` files: the tiered, content-addressed state store
(host memory, local disk, Redis, S3-compatible; docs/store.md), and states embedded in a GGUF model
file (`kite gguf embed`), a read-only store shipped with its model. The public face: code outside
`kite/store/` imports these names.

    url         open_store("mem://?max=2GB,file:///path,redis://...,s3://...") -> TieredStore
    tiered      TieredStore: read top-down, promote hits, write through/back, verify everything;
                for_tenant: one tenant's part of every tier
    tier        the Tier interface, its registry by URL scheme, TierError, sizes
    memory, disk, redis_tier, s3   the tiers
    compress    compress_to_store: a state the store holds is fetched, not compressed again
    verify      what is checked of every object (container, checksums, content address, tenant)
    counters    hits, misses, puts, errors by tier and operation (for /metrics)
    gguf        the keys states take in a GGUF; list, read and extract them, offer them to loaders
    gguf_embed  embed states (checked whole and against the file's model) into a copy of a GGUF
    ids    state ids (the names a server's store and a GGUF file give states)
    journal     missed writes: (tier, id) a tier failed to take, retried when it is back
    sync        sync_store: copy into each tier the states it misses (kite store sync)
"""

from kite.store.gguf import (EMBED_FORMAT, EMBED_VERSION, META_KEY, STATE_KEY, EmbeddedState, cached_state,
                             cached_states, embedded_states, extract_state, find_state, gguf_file, read_state,
                             state_path)
from kite.store.gguf_embed import EmbedReport, check_made_by, embed_states
from kite.store.ids import check_state_id
from kite.store.compress import StoredCompress, compress_to_store
from kite.store.counters import StoreCounters
from kite.store.disk import DiskTier
from kite.store.journal import Missed, MissedWrites
from kite.store.memory import MemoryTier
from kite.store.redis_tier import RedisTier
from kite.store.s3 import S3Tier
from kite.store.tier import MissingStore, ObjectStat, Tier, TierError, parse_size, register_tier, tier_schemes
from kite.store.tiered import PutReport, StoreError, TieredStore
from kite.store.url import open_store, split_url
from kite.store.sync import SyncReport, sync_store
from kite.store.verify import CorruptState, StateInfo, Unaddressed, WrongTenant, read_state_file, verify_state
from kite.upcycle import is_address

__all__ = [
    "EMBED_FORMAT", "EMBED_VERSION", "META_KEY", "STATE_KEY", "EmbedReport", "EmbeddedState", "cached_state",
    "cached_states", "check_made_by", "check_state_id", "embed_states", "embedded_states", "extract_state",
    "find_state", "gguf_file", "read_state", "state_path",
    "StoredCompress", "compress_to_store", "CorruptState", "DiskTier", "MemoryTier", "Missed", "MissedWrites", "MissingStore", "ObjectStat", "PutReport", "RedisTier", "S3Tier", "StateInfo",
    "StoreCounters", "StoreError", "Tier", "TierError", "TieredStore", "Unaddressed", "is_address", "open_store",
    "parse_size", "read_state_file", "register_tier", "split_url", "SyncReport", "sync_store", "tier_schemes",
    "verify_state", "WrongTenant",
]
