"""Stores of states beyond one folder of `.upc` files. Today: states embedded in a GGUF model file
(`kite gguf embed`), a read-only store shipped with its model. The public face: code outside
`kite/store/` imports these names.

    gguf        the keys states take in a GGUF; list, read and extract them, offer them to loaders
    gguf_embed  embed states (checked whole and against the file's model) into a copy of a GGUF
    ids    state ids (the names a server's store and a GGUF file give states)
"""

from kite.store.gguf import (EMBED_FORMAT, EMBED_VERSION, META_KEY, STATE_KEY, EmbeddedState, cached_state,
                             cached_states, embedded_states, extract_state, find_state, gguf_file, read_state,
                             state_path)
from kite.store.gguf_embed import EmbedReport, check_made_by, embed_states
from kite.store.ids import check_state_id

__all__ = [
    "EMBED_FORMAT", "EMBED_VERSION", "META_KEY", "STATE_KEY", "EmbedReport", "EmbeddedState", "cached_state",
    "cached_states", "check_made_by", "check_state_id", "embed_states", "embedded_states", "extract_state",
    "find_state", "gguf_file", "read_state", "state_path",
]
