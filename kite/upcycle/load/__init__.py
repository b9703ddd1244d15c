"""Loading states: which parts (selection), staging into the pinned hot tier, the rebuild on a device,
the caches keyed by file version, and `load_prefix`, the one entry point callers use (`load_prefixes`:
several whole states, their recomputed tails run together); the resident
forms a load is held in for the batch (`RESIDENT_FORMS`: raw, or coded again into nibble lanes)."""

from kite.upcycle.load.caches import flush_records, forget_verified
from kite.upcycle.load.fidelity import FAR_LAYER_SHARE, load_warnings
from kite.upcycle.load.hot_tier import HotState, HotTier, default_tier
from kite.upcycle.load.parts import check_parts
from kite.upcycle.load.prefix import (LOAD_PRECISIONS, HostRebuild, LoadReport, check_fingerprints, check_geometry,
                                      load_prefix, load_prefixes, open_rebuild)
from kite.upcycle.load.rebuild import load_staged, rebuild_layer
from kite.upcycle.load.lanes import lanes_for, lanes_of, load_lanes
from kite.upcycle.load.resident_forms import (RESIDENT_FORMS, LanesResident, RawResident, ResidentForm, check_resident,
                                             resident_form)
from kite.upcycle.load.selection import SINK_TOKENS, Selection, select, select_clusters
from kite.upcycle.load.staging import prepare_state, stage_state, supports_state
from kite.upcycle.load.tail import Tail, recompute_tail, recompute_tails
from kite.upcycle.load.tables import forget_tables, tables_dir

__all__ = ["FAR_LAYER_SHARE", "LOAD_PRECISIONS", "RESIDENT_FORMS", "SINK_TOKENS", "HostRebuild", "HotState", "HotTier", "LanesResident",
           "LoadReport", "RawResident", "ResidentForm", "Selection", "Tail", "check_fingerprints", "check_parts", "check_resident", "check_geometry", "default_tier", "flush_records", "forget_tables", "forget_verified",
           "lanes_for", "lanes_of", "load_lanes", "load_prefix", "load_prefixes", "load_staged", "load_warnings", "open_rebuild", "prepare_state", "rebuild_layer", "recompute_tail", "recompute_tails", "resident_form", "select", "select_clusters",
           "stage_state", "supports_state", "tables_dir"]
