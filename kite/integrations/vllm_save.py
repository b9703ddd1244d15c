"""Prompts vLLM has prefilled → `.upc` states, off vLLM's critical path (docs/vllm-connector.md).

The connector copies a finished prompt's KV out of the paged cache (post-RoPE keys, values, one
[H, T, d] pair per layer) and hands it to a :class:`StateSaver`: one background thread with a
bounded queue that turns it into a state with KITE's own codec (:func:`kite.upcycle.compress_capture`),
written atomically into the states folder under its content address, where the scheduler's index
finds it (and a restart does). A full queue drops the prompt; a failure is logged; neither reaches
vLLM.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveJob:
    """One prompt to save: its token ids, tenant (None: no tenant) and each layer's (keys after
    RoPE, values), [H, T, d] on the host; ``ready``: the CUDA events their copies to the host
    recorded (the saver's thread waits on them, so the forward never does)."""

    ids: tuple[int, ...]
    tenant: str | None
    layers: tuple[tuple[object, object], ...]
    ready: tuple = ()


class StateSaver:
    """``model``: what compressing needs of the served model (:class:`kite.model.ModelFacts`);
    ``folder``: where states go; ``settings``: KITE's :class:`CompressSettings`."""

    def __init__(self, model, folder: Path, settings, max_waiting: int = 4):
        self.model, self.folder, self.settings = model, Path(folder), settings
        self.saved: list[Path] = []
        self.failed = 0
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(maxsize=max_waiting)
        self._thread = threading.Thread(target=self._run, name="kite-state-saver", daemon=True)
        self._thread.start()

    def address(self, ids, tenant: str | None) -> str:
        """The content address the state of ``ids`` will have."""
        from kite.upcycle import address_for, describe_tagger

        return address_for(self.model.fingerprints.combined, list(ids), self.settings, describe_tagger(None), None,
                           tenant).id

    def submit(self, job: SaveJob) -> bool:
        """Queue ``job``; False (and logged) when the queue is full: vLLM never waits on a save."""
        try:
            self._queue.put_nowait(job)
            return True
        except queue.Full:
            self.dropped += 1
            log.warning("KITE connector: save queue full; a prompt of %d tokens is not saved", len(job.ids))
            return False

    def join(self) -> None:
        """Wait until every queued job is done (tests, shutdown)."""
        self._queue.join()

    def close(self, timeout: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self.saved.append(self.save(job))
            except Exception as e:  # noqa: BLE001  a failed save is logged, never raised into vLLM
                self.failed += 1
                log.warning("KITE connector: a prompt of %d tokens was not saved: %s", len(job.ids), e)
            finally:
                self._queue.task_done()

    def save(self, job: SaveJob) -> Path:
        """Compress ``job`` into ``folder/<address>.upc`` (kept when it is there already)."""
        import torch

        from kite.upcycle import Capture, compress_capture, remove_rope, rope_cos_sin, token_offsets

        for event in job.ready:
            event.synchronize()
        out = self.folder / f"{self.address(job.ids, job.tenant)}.upc"
        if out.exists():
            return out
        ids = list(job.ids)
        T = len(ids)
        cos, sin = rope_cos_sin(self.model.model, torch.arange(T), device="cpu")
        keys_pre = [remove_rope(k.float(), cos, sin) for k, _ in job.layers]
        values = [v.float() for _, v in job.layers]
        mid = len(values) // 2
        # spans are clustered on each token's middle-layer values (vLLM hands over no hidden states)
        hidden = {mid: values[mid].permute(1, 0, 2).reshape(T, -1)}
        text, offsets = token_offsets(self.model.tokenizer, ids)
        cap = Capture(text=text, ids=ids, offsets=offsets, keys_pre=keys_pre, values=values, hidden=hidden)
        compress_capture(self.model, cap, out, self.settings, source_name="vllm", address=True, tenant=job.tenant)
        log.info("KITE connector: saved a prompt of %d tokens as %s", T, out.name)
        return out
