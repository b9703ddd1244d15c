"""KITE's KV connector for vLLM's v1 API (``KVConnectorBase_V1``; docs/vllm-connector.md).

Turned on with ``--kv-transfer-config '{"kv_connector": "KiteConnector", "kv_connector_module_path":
"kite.integrations.vllm", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
"kv_connector_extra_config": {"states": FOLDER, "save": true}}'`` (the keys:
:class:`kite.integrations.vllm_settings.ConnectorSettings`).

Scheduler side: a request is offered the longest prefix of its prompt that one state of the served
model (and of the request's tenant) covers, found by content address (the state's token digest over
the prompt's first ``n_tokens`` ids, :func:`kite.serve.vllm_blocks.prompt_matches`), in whole
blocks, short of the prompt's last token; the allocated blocks become per-cluster slot runs in the
step's metadata. With ``save`` on, a prompt no state covers is marked for saving in the step its
prefill ends.

Worker side: ``start_load_kv`` opens each planned state (fingerprints, geometry, address checked)
and rebuilds it on the host one layer at a time on a background thread (decode, RoPE at each token's
position, the model's dtype: :func:`kite.upcycle.open_rebuild`); ``wait_for_layer_load`` writes that
layer's tokens into the request's blocks of vLLM's cache. ``save_kv_layer`` copies a finished
prompt's KV out of the blocks; ``wait_for_save`` hands it to the background saver
(:mod:`kite.integrations.vllm_save`). A state that fails a check, is torn, or fails mid-load has its
blocks reported by ``get_block_ids_with_load_errors``: vLLM recomputes them.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from kite.errors import BadInput
from kite.integrations.vllm_settings import ConnectorSettings
from kite.serve.vllm_blocks import (KV_PACKING, PagedLayer, SlotRun, cluster_runs, covered_prefix, loadable_tokens,
                                    prompt_matches, to_host)

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


def index_states(folder: str | Path, paths: list[Path] | None = None) -> list[IndexedState]:
    """The addressed states of ``folder`` (``*.upc``; only ``paths`` when given), headers checked
    on opening; a state without an address (it cannot be matched to a prompt) or one that fails
    its checks is left out."""
    from kite.upcycle import StateFile, check_address

    folder = Path(folder)
    if not folder.is_dir():
        raise BadInput(f"states folder {folder}: not a folder")
    out = []
    for path in paths if paths is not None else sorted(folder.glob("*.upc")):
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


class StateIndex:
    """The addressed states of a folder, read again when the folder changes (a state saved by a
    worker, or copied in, appears; one removed goes)."""

    def __init__(self, folder: Path, model_fingerprint: str):
        self.folder, self.model = Path(folder), model_fingerprint
        self._stamp: int | None = None
        self._by_path: dict[Path, tuple[tuple[int, int], IndexedState | None]] = {}
        self.states: list[IndexedState] = []
        self.refresh()

    def refresh(self) -> list[IndexedState]:
        stamp = self.folder.stat().st_mtime_ns
        if stamp == self._stamp:
            return self.states
        self._stamp = stamp
        seen: dict[Path, tuple[tuple[int, int], IndexedState | None]] = {}
        for path in sorted(self.folder.glob("*.upc")):
            st = path.stat()
            key = (st.st_mtime_ns, st.st_size)
            old = self._by_path.get(path)
            if old is not None and old[0] == key:
                seen[path] = old
                continue
            found = index_states(self.folder, [path])
            seen[path] = (key, found[0] if found else None)
        self._by_path = seen
        self.states = [s for _, s in seen.values() if s is not None and s.model == self.model]
        return self.states


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

    def blocks(self, block_size: int) -> set[int]:
        """The blocks this load writes: vLLM recomputes them when it fails."""
        return set(self.block_ids[self.start // block_size: -(-self.end // block_size)])


@dataclass(frozen=True, slots=True)
class PlannedSave:
    """A prompt whose prefill ends this step: its first ``len(ids)`` tokens, in ``block_ids``,
    become a state (for ``tenant``)."""

    request_id: str
    ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    tenant: str | None


@dataclass
class KiteConnectorMetadata(KVConnectorMetadata):
    loads: list[PlannedLoad] = field(default_factory=list)
    saves: list[PlannedSave] = field(default_factory=list)


@dataclass
class _Saving:
    ids: tuple[int, ...]
    tenant: str | None
    key: tuple[str, str | None]
    blocks: list[int] = field(default_factory=list)


class _Opened:
    """A planned load whose state passed its checks: its rebuild, the rows it writes (the rebuilt
    positions inside [start, end)) and the layers written so far."""

    def __init__(self, load: PlannedLoad, rebuild):
        self.load, self.rebuild = load, rebuild
        pos = rebuild.positions
        self.keep = (pos >= load.start) & (pos < load.end)
        self.positions = pos[self.keep].tolist()
        self.written: set[int] = set()
        self.failed = False


class _LoadStep:
    """One step's loads rebuilt layer by layer on a background thread; layer ``l``'s rows are ready
    when ``ready[l]`` is set."""

    def __init__(self, opened: list[_Opened], n_layers: int, pool: ThreadPoolExecutor):
        self.opened, self.n_layers = opened, n_layers
        self.ready = [threading.Event() for _ in range(n_layers)]
        self.rows: list[dict[int, tuple]] = [{} for _ in range(n_layers)]
        self.done = pool.submit(self._run)

    def _run(self) -> None:
        try:
            for layer in range(self.n_layers):
                for i, op in enumerate(self.opened):
                    if op.failed:
                        continue
                    try:
                        k, v = op.rebuild.layer(layer)
                        self.rows[layer][i] = (k[:, op.keep], v[:, op.keep])
                    except Exception as e:  # noqa: BLE001  reported as load errors: vLLM recomputes
                        op.failed = True
                        log.warning("KITE connector: state %s failed at layer %d: %s", op.load.path, layer, e)
                self.ready[layer].set()
        finally:
            for op in self.opened:     # a layer never ready would hang the forward: none is left waiting
                op.failed = op.failed or not all(e.is_set() for e in self.ready)
            for e in self.ready:
                e.set()


class KiteConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = ConnectorSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self._facts = None
        self.index = None
        if role == KVConnectorRole.SCHEDULER:
            fp = self.settings.model_fingerprint or self.facts.fingerprints.combined
            self.index = StateIndex(self.settings.states, fp)
        # scheduler side
        self._offers: dict[str, tuple[IndexedState, int]] = {}   # request id -> (state, first token)
        self._planned: list[PlannedLoad] = []
        self._saving: dict[str, _Saving] = {}
        self._save_digests: set[tuple[str, str | None]] = set()
        # worker side
        self._layers: dict[str, tuple[int, PagedLayer]] = {}
        self._unusable: str | None = "no KV cache registered"
        self._step: _LoadStep | None = None
        self._load_errors: set[int] = set()
        self._gathered: dict[str, dict[int, tuple]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.saver = None

    @property
    def states(self) -> list[IndexedState]:
        """The states offered (the scheduler's; none in a worker)."""
        return [] if self.index is None else self.index.refresh()

    @property
    def facts(self):
        """The served model as KITE's loads and saves need it (:class:`kite.model.ModelFacts`)."""
        if self._facts is None:
            from kite.model import ModelFacts

            mc = self._vllm_config.model_config
            self._facts = ModelFacts(_model_folder(self._vllm_config), dtype=mc.dtype)
        return self._facts

    # ---- scheduler side ----

    def find(self, prompt_ids, kv_transfer_params: dict | None) -> IndexedState | None:
        """The state of the served model (and of the request's tenant) whose document is the
        longest prefix of the prompt; only the one the request names when it names one."""
        from kite.tenants import tenant_tag

        params = kv_transfer_params or {}
        wanted = params.get("kite_state")
        try:
            tenant = tenant_tag(params["kite_tenant"]) if params.get("kite_tenant") else None
        except BadInput as e:
            log.warning("KITE connector: no state for a request with %s", e)
            return None
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
        if self.settings.save:
            self._plan_save(request, offer[0] if offer else None)
        if offer is None or num_external_tokens == 0:
            return
        state, start = offer
        block_ids = tuple(int(b) for b in blocks.get_block_ids()[0])
        end = start + num_external_tokens
        self._planned.append(PlannedLoad(request.request_id, state.address, str(state.path), block_ids, start, end,
                                         cluster_runs(state.clusters, block_ids, self.block_size, start, end)))

    def _plan_save(self, request, loaded: IndexedState | None) -> None:
        """Mark ``request``'s prompt (its first ``kite_n_tokens`` tokens when the request says how
        long its document is) for saving, unless it is short, is being saved already, or begins
        with a state's document (the rest is taken for a query) and names no longer document."""
        from kite.tenants import check_tenant
        from kite.upcycle import tokens_digest

        params = getattr(request, "kv_transfer_params", None) or {}
        prompt = list(request.prompt_token_ids or [])
        try:
            n = min(int(params.get("kite_n_tokens") or len(prompt)), len(prompt))
        except (TypeError, ValueError):
            return
        if n < self.settings.save_min_tokens or request.request_id in self._saving:
            return
        ids = tuple(prompt[:n])
        tenant = params.get("kite_tenant") or None
        try:
            check_tenant(tenant, "kite_tenant")
        except BadInput:
            return
        have = loaded or self.find(prompt, params)
        key = (tokens_digest(ids), tenant)
        if have is not None and (have.n_tokens >= n or not params.get("kite_n_tokens")) or key in self._save_digests:
            return
        self._save_digests.add(key)
        self._saving[request.request_id] = _Saving(ids, tenant, key)

    def _forget_save(self, request_id: str) -> None:
        """A marked prompt whose request ended before its prefill did: another request may save it."""
        sv = self._saving.pop(request_id, None)
        if sv is not None:
            self._save_digests.discard(sv.key)

    def build_connector_meta(self, scheduler_output) -> KiteConnectorMetadata:
        meta, self._planned = KiteConnectorMetadata(list(self._planned)), []
        if self._saving:
            meta.saves = self._due_saves(scheduler_output)
        return meta

    def _due_saves(self, out) -> list[PlannedSave]:
        """The saves whose prompts' prefill ends in this step (their block tables followed from
        step to step)."""
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        due = []
        for rid, groups, whole in _req_blocks(out):
            sv = self._saving.get(rid)
            if sv is None:
                continue
            if groups is not None:
                sv.blocks = list(groups[0]) if whole else sv.blocks + list(groups[0])
            if computed.get(rid, 0) + out.num_scheduled_tokens.get(rid, 0) >= len(sv.ids):
                due.append(PlannedSave(rid, sv.ids, tuple(int(b) for b in sv.blocks), sv.tenant))
                del self._saving[rid]
        for rid in out.finished_req_ids:
            self._forget_save(rid)
        return due

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._offers.pop(request.request_id, None)
        self._forget_save(request.request_id)
        return False, None

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict, packing: dict[str, str] | None = None) -> None:
        """Take vLLM's per-layer cache views ([blocks, heads, block_size, 2·head_size], any
        KVCacheLayout). ``packing``: each layer's K/V packing (kite.serve.vllm_blocks.KV_PACKING);
        None = from the layers' attention backends. A cache the connector cannot write (another
        backend, a quantized KV dtype, heads split by tensor parallelism, another geometry) turns
        loads into load errors and saves off, logged once."""
        self._layers, self._unusable = {}, None
        try:
            self._layers = self._paged_layers(kv_caches, packing)
        except BadInput as e:
            self._unusable = str(e)
            log.warning("KITE connector: loads and saves are off on this worker: %s", e)
            return
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kite-load")
        if self.settings.save:
            from kite.integrations.vllm_save import StateSaver
            from kite.upcycle import CompressSettings, codec_settings

            cs = CompressSettings(codec=codec_settings(self.settings.save_ratio), n_clusters=self.settings.save_clusters)
            self.saver = StateSaver(self.facts, self.settings.states, cs, self.settings.save_queue)

    def _paged_layers(self, kv_caches: dict, packing: dict[str, str] | None) -> dict[str, tuple[int, PagedLayer]]:
        from vllm.model_executor.models.utils import extract_layer_index
        from vllm.v1.kv_cache_interface import is_quantized_kv_cache

        cache_dtype = self._vllm_config.cache_config.cache_dtype
        if is_quantized_kv_cache(cache_dtype):
            raise BadInput(f"KV cache dtype {cache_dtype}: a quantized cache (with its scales) is not written")
        geo = self.facts.geometry
        fp = self.facts.fingerprints.combined     # hashed once here (cached on disk), not in a step
        if self.settings.model_fingerprint not in (None, fp):
            raise BadInput(f"model_fingerprint {self.settings.model_fingerprint[:21]}… is not the served model's "
                           f"({fp[:21]}…)")
        packing = packing or _backend_packing(self._vllm_config, list(kv_caches))
        out = {}
        for name, view in kv_caches.items():
            layer = extract_layer_index(name)
            if not 0 <= layer < geo.n_layers:
                raise BadInput(f"layer {name}: not one of the model's {geo.n_layers} layers")
            if view.dim() == 4 and view.shape[1] != geo.n_kv_heads:
                raise BadInput(f"layer {name} holds {view.shape[1]} of {geo.n_kv_heads} KV heads "
                               "(tensor parallelism is not supported)")
            if packing.get(name) is None:
                raise BadInput(f"layer {name}: attention backend without a known K/V packing "
                               f"(known: {', '.join(sorted(KV_PACKING))})")
            out[name] = (layer, PagedLayer.of(view, packing[name], geo.head_dim, self.block_size))
        if sorted(layer for layer, _ in out.values()) != list(range(geo.n_layers)):
            raise BadInput(f"the registered caches are not one per layer of the model's {geo.n_layers}")
        return out

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        loads = getattr(meta, "loads", [])
        if not loads:
            return
        if self._unusable is not None:
            for load in loads:
                self._load_errors |= load.blocks(self.block_size)
            return
        opened = []
        for load in loads:
            try:
                opened.append(_Opened(load, self._open(load)))
            except Exception as e:  # noqa: BLE001  a refused state is never written; vLLM recomputes
                log.warning("KITE connector: state %s refused: %s", load.path, e)
                self._load_errors |= load.blocks(self.block_size)
        if opened:
            self._step = _LoadStep(opened, self.facts.geometry.n_layers, self._pool)

    def _open(self, load: PlannedLoad):
        from kite.upcycle import StateFile, check_address, open_rebuild

        state = StateFile(load.path)
        try:
            if check_address(state.meta, state.format_version) != load.address:
                raise BadInput(f"{load.path}: not the state at {load.address[:12]} any more")
            wanted = [str(c) for c, runs in load.runs.items() if runs]
            return open_rebuild(state, self.facts, clusters=wanted)
        except BaseException:
            state.close()
            raise

    def wait_for_layer_load(self, layer_name: str) -> None:
        step = self._step
        if step is None or layer_name not in self._layers:
            return
        layer, paged = self._layers[layer_name]
        step.ready[layer].wait()
        for i, (k, v) in step.rows[layer].items():
            op = step.opened[i]
            if op.failed:
                continue
            try:
                paged.write(k, v, op.positions, op.load.block_ids)
                op.written.add(layer)
            except Exception as e:  # noqa: BLE001
                op.failed = True
                log.warning("KITE connector: state %s not written at layer %d: %s", op.load.path, layer, e)
        step.rows[layer] = {}

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        saves = getattr(self._get_connector_metadata(), "saves", [])
        if not saves or self.saver is None or layer_name not in self._layers:
            return
        layer, paged = self._layers[layer_name]
        for sv in saves:
            k, v = paged.read(range(len(sv.ids)), sv.block_ids)
            self._gathered.setdefault(sv.request_id, {})[layer] = (to_host(k), to_host(v))

    def wait_for_save(self) -> None:
        if not self._gathered:
            return
        from kite.integrations.vllm_save import SaveJob

        n_layers = self.facts.geometry.n_layers
        saves = {sv.request_id: sv for sv in getattr(self._get_connector_metadata(), "saves", [])}
        gathered, self._gathered = self._gathered, {}
        for rid, layers in gathered.items():
            sv = saves.get(rid)
            if sv is None or sorted(layers) != list(range(n_layers)):
                log.warning("KITE connector: prompt of request %s not saved: %d of %d layers seen", rid, len(layers),
                            n_layers)
                continue
            ready = ()
            if any(k.is_pinned() for k, _ in layers.values()):   # copies still on their way from the GPU
                import torch

                event = torch.cuda.Event()
                event.record()
                ready = (event,)
            self.saver.submit(SaveJob(sv.ids, sv.tenant, tuple(layers[i] for i in range(n_layers)), ready))

    def get_block_ids_with_load_errors(self) -> set[int]:
        step, self._step = self._step, None
        if step is not None:
            step.done.result()
            every = set(range(step.n_layers))
            for op in step.opened:
                op.rebuild.state.close()
                if op.failed or op.written != every:
                    self._load_errors |= op.load.blocks(self.block_size)
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        if self.saver is not None:
            self.saver.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        return False


def _req_blocks(scheduler_output):
    from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

    return yield_req_data(scheduler_output)


def _backend_packing(vllm_config, layer_names: list[str]) -> dict[str, str | None]:
    """Each layer's K/V packing, from the name of its attention backend (vLLM's
    ``get_current_attn_backends``)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    return {name: KV_PACKING.get(get_current_attn_backends(vllm_config, [name])[0].get_name()) for name in layer_names}


def _model_folder(vllm_config) -> Path:
    """The served model's local folder: the model path when it is a folder, else vLLM's copy in
    the Hugging Face cache."""
    mc = vllm_config.model_config
    folder = Path(mc.model)
    if folder.is_dir():
        return folder
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(mc.model, revision=getattr(mc, "revision", None), local_files_only=True))
    except Exception:  # noqa: BLE001
        raise BadInput(f"KiteConnector: model {mc.model} is neither a local folder nor in the Hugging Face cache "
                       "(KITE reads its config, tokenizer and fingerprint)") from None

