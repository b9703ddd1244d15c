"""KITE's KV connector for vLLM's v1 API (``KVConnectorBase_V1``; docs/vllm-connector.md).

Turned on with ``--kv-transfer-config '{"kv_connector": "KiteConnector", "kv_connector_module_path":
"kite.integrations.vllm", "kv_role": "kv_both", "kv_connector_extra_config": {"states": FOLDER,
"model_fingerprint": FP}}'``. ``states`` is a folder of ``.upc`` states; ``model_fingerprint`` the
served model's combined fingerprint (``kite model info``), computed from the served model's folder
when absent.

The scheduler side is here: a request is offered the longest prefix of its prompt that one state of
the served model (and of the request's tenant) covers, found by content address (the state's token
digest over the prompt's first ``n_tokens`` ids, :func:`kite.serve.vllm_blocks.prompt_matches`), in
whole blocks, short of the prompt's last token; the allocated blocks become per-cluster slot runs
in the step's metadata. The worker side does not decode into the paged cache yet: every block a
load was planned for is reported as a load error, so vLLM recomputes it and never reads a block
KITE did not write.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from kite.errors import BadInput
from kite.serve.vllm_blocks import SlotRun, cluster_runs, covered_prefix, loadable_tokens, prompt_matches

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class IndexedState:
    """What the scheduler needs of a state's header: its address, the model and tenant it was made
    for, its document's token count and digest, and its clusters' token ranges."""

    address: str
    path: Path
    model: str
    tenant: str | None
    n_tokens: int
    tokens_sha256: str
    clusters: tuple[dict, ...]

    def matched(self, prompt_ids) -> int:
        return prompt_matches(prompt_ids, {"n_tokens": self.n_tokens, "tokens_sha256": self.tokens_sha256})

    def covered(self) -> int:
        return covered_prefix([r for c in self.clusters for r in c["token_ranges"]], self.n_tokens)


def index_states(folder: str | Path) -> list[IndexedState]:
    """The addressed states of ``folder`` (``*.upc``), headers checked on opening; a state without
    an address (it cannot be matched to a prompt) or one that fails its checks is left out."""
    from kite.upcycle import StateFile, check_address

    folder = Path(folder)
    if not folder.is_dir():
        raise BadInput(f"states folder {folder}: not a folder")
    out = []
    for path in sorted(folder.glob("*.upc")):
        try:
            with StateFile(path) as state:
                meta, version = state.meta, state.format_version
            addr = meta.get("address")
            if not addr:
                continue
            out.append(IndexedState(check_address(meta, version), path, addr["model"], addr.get("tenant"),
                                    int(meta["n_tokens"]), addr["tokens_sha256"],
                                    tuple({"id": int(c["id"]), "token_ranges": [list(r) for r in c["token_ranges"]]}
                                          for c in meta["clusters"])))
        except Exception as e:  # noqa: BLE001  a refused state is never offered; the others still are
            log.warning("KITE connector: state %s left out: %s", path, e)
    return out


@dataclass(frozen=True, slots=True)
class PlannedLoad:
    """One request's load: document tokens [start, end) of the state at ``address`` into its
    blocks, each cluster's tokens in the slot runs ``runs[cluster id]`` names."""

    request_id: str
    address: str
    path: str
    block_ids: tuple[int, ...]
    start: int
    end: int
    runs: dict[int, list[SlotRun]]


@dataclass
class KiteConnectorMetadata(KVConnectorMetadata):
    loads: list[PlannedLoad] = field(default_factory=list)


class KiteConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        if "states" not in extra:
            raise BadInput("KiteConnector: kv_connector_extra_config needs \"states\" (a folder of .upc states)")
        self.block_size = int(vllm_config.cache_config.block_size)
        self.model_fingerprint = extra.get("model_fingerprint") or _served_fingerprint(vllm_config)
        self.states = [s for s in index_states(extra["states"]) if s.model == self.model_fingerprint]
        self._offers: dict[str, tuple[IndexedState, int]] = {}   # request id -> (state, first token)
        self._planned: list[PlannedLoad] = []
        self._load_errors: set[int] = set()

    # ---- scheduler side ----

    def find(self, prompt_ids, kv_transfer_params: dict | None) -> IndexedState | None:
        """The state of the served model (and of the request's tenant) whose document is the
        longest prefix of the prompt; only the one the request names when it names one."""
        from kite.tenants import tenant_tag

        params = kv_transfer_params or {}
        wanted = params.get("kite_state")
        tenant = tenant_tag(params["kite_tenant"]) if params.get("kite_tenant") else None
        best = None
        for s in self.states:
            if (wanted and s.address != wanted) or s.tenant != tenant:
                continue
            if s.matched(prompt_ids) and (best is None or s.n_tokens > best.n_tokens):
                best = s
        return best

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = list(request.prompt_token_ids or [])
        state = self.find(prompt, getattr(request, "kv_transfer_params", None))
        if state is None:
            return 0, False
        n = loadable_tokens(state.covered(), len(prompt), self.block_size, num_computed_tokens)
        if n:
            self._offers[request.request_id] = (state, num_computed_tokens)
        return n, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        offer = self._offers.pop(request.request_id, None)
        if offer is None or num_external_tokens == 0:
            return
        state, start = offer
        block_ids = tuple(int(b) for b in blocks.get_block_ids()[0])
        end = start + num_external_tokens
        self._planned.append(PlannedLoad(request.request_id, state.address, str(state.path), block_ids, start, end,
                                         cluster_runs(state.clusters, block_ids, self.block_size, start, end)))

    def build_connector_meta(self, scheduler_output) -> KiteConnectorMetadata:
        meta, self._planned = KiteConnectorMetadata(list(self._planned)), []
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._offers.pop(request.request_id, None)
        return False, None

    # ---- worker side: no decode into the paged cache yet, so vLLM recomputes every planned block ----

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        for load in getattr(meta, "loads", []):
            first, last = load.start // self.block_size, -(-load.end // self.block_size)
            self._load_errors.update(load.block_ids[first:last])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None   # states are made by `kite upcycle compress`, not copied from vLLM's blocks

    def wait_for_save(self) -> None:
        return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


def _served_fingerprint(vllm_config) -> str:
    from kite.model.fingerprint import fingerprints

    folder = Path(vllm_config.model_config.model)
    if not folder.is_dir():
        raise BadInput(f"KiteConnector: model {folder} is not a local folder; give \"model_fingerprint\" "
                       "in kv_connector_extra_config")
    return fingerprints(folder).combined
