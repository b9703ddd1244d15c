"""The `.upc` format, each part written once: the container (header + checksummed blobs), the
blob names, the codec blob bytes, the bit-class layout of a part, and file versions."""

from kite.upcycle.format.bitlayout import class_layout
from kite.upcycle.format.container import (FORMAT_VERSION, LARGE_BLOB, LARGE_MIN_SAVING, MIN_SAVING, BlobEntry,
                                           StateFile, StateWriter, check_state_bytes, rewrite_header)
from kite.upcycle.format.mutants import (MUTANT_KINDS, Mutant, assemble, make_mutant, mutants, resealed,
                                         without_content)
from kite.upcycle.format.signing import SigningPolicy, signing_policy, use_policy
from kite.upcycle.format.names import blob_key, layer_keys
from kite.upcycle.format.versions import (file_version, forget_record, path_version, record_verified,
                                          records_enabled, same_version, verified_record)

__all__ = ["FORMAT_VERSION", "MUTANT_KINDS", "Mutant", "assemble", "make_mutant", "mutants", "resealed", "without_content", "SigningPolicy", "signing_policy", "use_policy", "LARGE_BLOB", "LARGE_MIN_SAVING", "MIN_SAVING", "BlobEntry", "StateFile", "StateWriter",
           "blob_key", "check_state_bytes", "class_layout", "file_version", "forget_record", "layer_keys", "path_version", "record_verified", "records_enabled",
           "rewrite_header", "same_version", "verified_record"]
