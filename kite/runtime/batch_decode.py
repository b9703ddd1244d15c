"""Batched decoding: many sequences, each after its own loaded state, advanced one token per step.

`BatchDecoder` is the engine a server's scheduler drives at step boundaries: `add` a request
(it takes a row of the `BatchKVCache`, seeded with the request's prefix: kite.runtime.resident), `step` to advance
every active sequence by one token, `cancel` to drop one. A finished or cancelled sequence leaves
at once and frees its row for the next request; `step` returns its `GenerationResult`, with the same
fields, text and tokens as `generate()` gives for the same request alone (greedy, or sampled with
the same seed: each sequence samples through its own `SequenceDecode`).

A step runs up to four forwards: the prompts of the requests added since the last step, together,
right-padded to the longest (their prefill gives each its first token), then one token for every
sequence that was already decoding. A burst of long prompts is prefilled in several forwards of the
same step, each at most PREFILL_TOKENS padded tokens. Prefill and decode are kept apart because a decode row padded
to a prompt's length would cost as much as a prefill. Each of the two runs once with the model's
reader adapter off and once with it on, for the sequences whose state was made for it (the adapter
is a switch on the whole model, so one forward cannot mix them); a group with no sequence is
skipped.

A sequence under a memory budget (a `RowMemory`, e.g. kite.upcycle.BudgetRow) feeds its prompt
one chunk a step and, after every forward, hands its row's older slots to its memory, which keeps
them coded and gives them back to each attention.

Time to first token and total time count from `add`: the wait for the next step is part of what
a client sees.

On a GPU, decode steps of the same greedy rows run one ahead of the host: once a graphed decode
step is launched, the next is launched too, each row fed its argmax on the device
(kite.runtime.kernel_step, KernelStep.again), and the host takes the first step's tokens (stop
rules, streaming, results) while the second runs; the next `step` takes the second's and launches a
third. A step that admits newcomers, a row that ended or was cancelled or moved, a sampled row, or
the reader adapter's two groups end the run ahead: that step takes the launched step's tokens for
the rows still active (a row that ended meanwhile had its extra token computed and dropped) and goes
on as usual. The tokens are the ones the steps one at a time give.

Streamed text goes out in one hand-over a step (``deliver``: every row's piece at once). A decode
step's pieces go out while the next decode step runs on the GPU (its launch returns at once), so the
detokenizing and the handing-over of many rows overlap the device's work instead of following it;
a prefill's first tokens go out at once (time to first token), and so does everything left when no
decode step follows (``flush_text``); the last text of the sequences that ended goes out in one
hand-over before the step that reports them returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kite.runtime.attention import BATCH_KWARG
from kite.runtime.batch import right_padded
from kite.runtime.batch_cache import BatchFull, BatchKVCache, round_capacity
from kite.runtime.resident import ResidentPrefix
from kite.runtime.decoding import (GenerationResult, SequenceDecode, check_request, nll_bits,
                                   prompt_nll_nats)
from kite.runtime.generate import cache_kwarg
from kite.runtime.kernel_step import KernelStep
from kite.runtime.row_memory import RowMemory

__all__ = ["BatchDecoder", "BatchFull", "BatchKVCache", "forward_rows"]


@torch.inference_mode()
def forward_rows(model, cache: BatchKVCache, rows: list[int], tokens: list[list[int]],
                 positions: list[int], memories: dict[int, RowMemory] | None = None) -> list[torch.Tensor]:
    """One forward over `rows` of `cache`: row rows[b] feeds tokens[b] (≥ 1) at positions
    positions[b]…; returns each row's logits [len(tokens[b]), vocab] (fp32).

    The rows' new tokens are right-padded to the longest; padded positions are not written to
    the cache and their logits are dropped. Each new token sees its own row's filled slots of each
    layer, what its row's memory holds (`memories`, by batch index) and the row's new tokens up to
    itself, nothing else.
    """
    counts = [len(t) for t in tokens]
    logits = _model_step(model, cache, rows, tokens, positions, memories).logits
    return [logits[b, :n].float() for b, n in enumerate(counts)]


def _model_step(model, cache: BatchKVCache, rows, tokens, positions, memories, **kwargs):
    """The model's forward over `rows` of `cache` feeding `tokens` (right-padded) inside an open step."""
    device = next(model.parameters()).device
    ids, _ = right_padded(tokens, pad=0)
    pos = torch.as_tensor(positions, dtype=torch.long)[:, None] + torch.arange(ids.shape[1])[None, :]
    step = cache.open_step(rows, [len(t) for t in tokens], memories)
    try:
        out = model(input_ids=ids.to(device), position_ids=pos.to(device),
                    attention_mask=step.placeholder_mask(), use_cache=True,
                    **{cache_kwarg(model): cache, BATCH_KWARG: step}, **kwargs)
    except BaseException:
        cache.close_step(commit=False)
        raise
    cache.close_step()
    return out


HEAD_CHUNK = 2048     # prompt positions a long prompt's NLL makes logits for at once


@torch.inference_mode()
def forward_prompt_rows(model, cache: BatchKVCache, rows: list[int], tokens: list[list[int]],
                        positions: list[int], targets: list[list[int]],
                        memories: dict[int, RowMemory] | None = None) -> tuple[torch.Tensor, list[float]]:
    """A prefill's forward (:func:`forward_rows`) that keeps no logits beyond what it needs: each row's
    last position's logits [B, vocab] (fp32) and the summed NLL (nats) of ``targets[b]`` (the tokens
    row b's positions predict, at most len(tokens[b])), the head run over the final hidden states
    HEAD_CHUNK positions at a time. A 16K-token prompt's logits would be 10 GB in fp32 (Qwen2's
    152K vocabulary). Models without a final norm to read (not Llama-family) get forward_rows'."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    norm = getattr(getattr(base, "model", None), "norm", None)
    if norm is None:
        logits = forward_rows(model, cache, rows, tokens, positions, memories)
        return (torch.stack([lg[-1] for lg in logits]),
                [prompt_nll_nats(lg, t) for lg, t in zip(logits, targets)])
    seen = []
    hook = norm.register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        _model_step(model, cache, rows, tokens, positions, memories, logits_to_keep=1)
    finally:
        hook.remove()
    hidden, head = seen[-1], base.get_output_embeddings()
    ends = torch.tensor([len(t) - 1 for t in tokens], device=hidden.device)
    last = head(hidden[torch.arange(len(tokens), device=hidden.device), ends]).float()
    nll = []
    for b, want in enumerate(targets):
        total = 0.0
        for at in range(0, len(want), HEAD_CHUNK):
            total += prompt_nll_nats(head(hidden[b, at:at + HEAD_CHUNK]), want[at:at + HEAD_CHUNK])
        nll.append(total)
    return last, nll


@dataclass
class _Ahead:
    """A decode step launched before the host had the tokens it feeds (KernelStep.again): its
    sequences and their rows, in the step's order, and the graph whose ``out`` holds its logits."""

    seqs: list
    rows: list[int]
    graph: object


@dataclass
class _Sequence:
    """One request in the batch: where it sits and how far it has come."""

    handle: int
    prompt_ids: list[int]
    prefix: ResidentPrefix | None
    decode: SequenceDecode
    row: int
    position: int                # where the next token fed goes
    reader: bool                 # its state was made for the reader adapter
    next_token: int | None = None   # sampled, not yet fed
    prompt_nll_bits: float | None = None
    reader_on: bool = False
    prefilled: bool = False
    worst_length: int = 0        # slots its row may need by its last token
    memory: RowMemory | None = None   # where its older tokens go (a budgeted sequence)
    fed: int = 0                 # prompt tokens fed so far
    prompt_nll_nats: float = 0.0  # summed over the prompt's chunks

    def ends_now(self) -> bool:
        """Whether the token the next forward's logits give is this sequence's last by its length."""
        d = self.decode
        return len(d.new) + 1 >= d.max_new_tokens

    def next_chunk(self) -> list[int]:
        """The prompt tokens the next step feeds (all of them, or one chunk for a budgeted row)."""
        n = self.memory.prefill_chunk if self.memory is not None else len(self.prompt_ids)
        return self.prompt_ids[self.fed:self.fed + n]


class BatchDecoder:
    """Decode up to `max_rows` sequences together on `lm` (a kite.model.LoadedModel).

    max_kv_bytes: budget for the batch's KV buffers; `add` refuses (BatchFull) a request whose
    worst case (prefix + prompt + max_new_tokens in its longest layer) would not fit beside the
    others'. Not thread-safe: call add, cancel and step from one thread.
    """

    def __init__(self, lm, max_rows: int = 8, *, max_kv_bytes: int | None = None):
        self.lm = lm
        self.cache = BatchKVCache(lm.model, max_rows, max_bytes=max_kv_bytes)
        self.kernels = KernelStep.build(lm.model, self.cache)   # a GPU: steps on KITE's kernels, decode graphed
        self._window = _sliding_window(lm.model)
        self._active: dict[int, _Sequence] = {}
        self._done: dict[int, GenerationResult] = {}
        self._next_handle = 0
        self._unstreamed: list[SequenceDecode] = []   # accepted tokens whose text has not gone out
        self._ends: list[tuple[Callable[[str], None], str]] = []   # ended sequences' last text
        self.deliver: Callable[[list[tuple[Callable[[str], None], str]]], None] = deliver_each
        self.last_step = "decode"   # what the last step ran: "prefill" (newcomers' prompts), "decode" or "mixed"
        self._ahead: _Ahead | None = None   # a decode step launched, its tokens not yet taken

    def reserve(self, tokens: int) -> None:
        """Allocate the rows' KV for ``tokens`` tokens each now (every row, or as many as the byte
        budget holds; BatchFull when not one does) and, on a GPU, capture the decode step of every
        batch size: rows that fit never regrow the buffers, so no request pays a regrowth or a capture."""
        cache = self.cache
        rows = cache.max_rows
        if cache.max_bytes is not None:
            rows = max(1, min(rows, cache.max_bytes // cache.bytes_for(1, tokens)))
        cache.reserve(rows, tokens)
        if self.kernels is not None:
            self.kernels.warm()

    # -- admission -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._active)

    @property
    def max_rows(self) -> int:
        return self.cache.max_rows

    def fits(self, prompt_tokens: int, prefix: ResidentPrefix | None = None, max_new_tokens: int = 128,
             memory: RowMemory | None = None) -> bool:
        """Whether `add` would take such a request now (a free row, and the KV budget)."""
        row = self.cache.next_row()
        if row is None:
            return False
        if self.cache.max_bytes is None:
            return True
        # the buffers never shrink: the rows already allocated stay, and every active sequence
        # may still grow to its own worst case
        worst = max([_worst_length(prompt_tokens, prefix, max_new_tokens, memory)]
                    + [s.worst_length for s in self._active.values()])
        rows = max(row + 1, self.cache.rows_allocated)
        capacity = max(self.cache.capacity, round_capacity(worst))
        return self.cache.bytes_for(rows, capacity) <= self.cache.max_bytes

    def add(self, prompt_ids: list[int], *, prefix: ResidentPrefix | None = None, max_new_tokens: int = 128,
            temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
            stop_ids: set[int] | None = None, on_text: Callable[[str], None] | None = None,
            memory: RowMemory | None = None) -> int:
        """Admit a request (the same arguments as generate()); returns its handle. Its prompt is
        prefilled by the next `step` (with a `memory`, one chunk a step: the memory takes the row's
        older tokens between forwards, so the row never holds more than ``memory.max_slots``).
        Raises BadInput for a bad request, BatchFull when there is no room now (see `fits`)."""
        t0 = time.perf_counter()
        start = prefix.next_position if prefix is not None else 0
        check_request(self.lm, prompt_ids, start, max_new_tokens)
        if self._window is not None and start + len(prompt_ids) + max_new_tokens > self._window:
            from kite.errors import BadInput

            raise BadInput(f"batched decoding does not apply the model's sliding window of {self._window} "
                           f"tokens: keep state + prompt + --max-new-tokens within it")
        if memory is not None and prefix is not None:
            raise ValueError("a row keeps its older tokens in a memory or starts from a state, not both")
        if not self.fits(len(prompt_ids), prefix, max_new_tokens, memory):
            raise BatchFull(f"no room in the batch for {len(prompt_ids)} prompt tokens + {max_new_tokens} new "
                            f"({len(self._active)} of {self.max_rows} rows active)")
        row = self.cache.take(prefix)
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        decode = SequenceDecode(self.lm.tokenizer, max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, seed=seed,
                                stop_ids=stop_ids if stop_ids is not None else self.lm.eos_ids(),
                                on_text=on_text, t0=t0)
        self._active[handle] = _Sequence(
            handle=handle, prompt_ids=list(prompt_ids), prefix=prefix, decode=decode, row=row, position=start,
            reader=bool(prefix is not None and prefix.reader),
            worst_length=_worst_length(len(prompt_ids), prefix, max_new_tokens, memory), memory=memory)
        return handle

    def cancel(self, handle: int) -> bool:
        """Drop an active sequence now (its row is freed); the next `step` reports it with
        stop_reason "cancelled" and the text it had. False when `handle` is not active."""
        seq = self._active.get(handle)
        if seq is None:
            return False
        seq.decode.cancel()
        self._finish(seq)
        return True

    # -- steps ---------------------------------------------------------------------------------
    def step(self) -> dict[int, GenerationResult]:
        """Advance every active sequence by one token (prefilling those added since the last step);
        returns the sequences that ended since the last step (finished or cancelled), by handle."""
        waiting = [s for s in self._active.values() if not s.prefilled]
        running = [s for s in self._active.values() if s.prefilled]
        self.last_step = "mixed" if waiting and running else "prefill" if waiting else "decode"
        groups = _by_reader(running)
        ahead_ok = not waiting and len(groups) == 1     # after this step the same rows decode again
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            running = self._take_ahead(ahead, running, ahead_ok)
            groups = _by_reader(running)
        padding = PREFILL_PADDING_CPU if self.cache.device.type == "cpu" else None
        for group in _by_reader(waiting):
            for part in _prefill_parts(group, PREFILL_TOKENS, padding):
                self._prefill(part)
        for group in groups:
            self._decode(group, ahead_ok)
        if not self._active:
            self.flush_text()
        self._hand_out_ends()
        done, self._done = self._done, {}
        return done

    def drain(self) -> dict[int, GenerationResult]:
        """Step until no sequence is active; every result, by handle."""
        results = self.step()
        while self._active:
            results.update(self.step())
        return results

    def flush_text(self) -> None:
        """Hand the text of every token accepted since the last flush to its sequence's ``on_text``, all
        in one call of ``deliver``."""
        pending, self._unstreamed = self._unstreamed, []
        pieces = [p for p in (d.pending_text() for d in pending) if p is not None]
        if pieces:
            self.deliver(pieces)

    def _hand_out_ends(self) -> None:
        """The last text of the sequences that ended since the last step, in one call of ``deliver``
        (before the step reports them)."""
        ends, self._ends = self._ends, []
        if ends:
            self.deliver(ends)

    def _prefill(self, group: list[_Sequence]) -> None:
        """Feed each waiting sequence its prompt (or its next chunk); those whose prompt is then
        whole get their first token (its text goes out at once)."""
        chunks = [s.next_chunk() for s in group]
        targets = [s.prompt_ids[s.fed + 1:s.fed + len(c) + 1] for s, c in zip(group, chunks)]
        with self._reading(group[0].reader) as on:
            last, nll = self._forward(group, chunks, on, targets)
        whole, whole_logits = [], []
        for b, (seq, chunk) in enumerate(zip(group, chunks)):
            seq.prompt_nll_nats += nll[b]
            seq.fed += len(chunk)
            seq.position += len(chunk)
            if seq.fed == len(seq.prompt_ids):
                seq.prompt_nll_bits = nll_bits(seq.prompt_nll_nats, len(seq.prompt_ids))
                seq.reader_on, seq.prefilled = bool(on), True
                whole.append(seq)
                whole_logits.append(last[b])
        if whole:
            self._advance(whole, torch.stack(whole_logits))
        self.flush_text()

    def _decode(self, group: list[_Sequence], ahead_ok: bool = False) -> None:
        with self._reading(group[0].reader) as on:
            out = self._forward(group, [[s.next_token] for s in group], on)
        for seq in group:
            seq.position += 1
        graph = self._launch_ahead(group) if ahead_ok else None
        # the last step's text goes out while this one runs (a GPU step is launched, not yet done)
        self.flush_text()
        if graph is not None:
            self._advance(group, picks=graph.picks(len(group)))
        else:
            self._advance(group, out[:, 0] if torch.is_tensor(out) else torch.stack([rows[-1] for rows in out]))

    def _launch_ahead(self, group: list[_Sequence]):
        """Launch the next decode step of ``group`` (every active row, greedy) before taking this one's
        tokens (KernelStep.again); the graph, or None when it does not apply (no graphed step to
        repeat, a sampled row, every row ending with this step's token)."""
        if (self.kernels is None or not all(s.decode.greedy for s in group)
                or all(s.ends_now() for s in group)):
            return None
        graph = self.kernels.again([s.row for s in group])
        if graph is not None:
            for seq in group:
                seq.position += 1
            self._ahead = _Ahead(list(group), [s.row for s in group], graph)
        return graph

    def _take_ahead(self, ahead: _Ahead, running: list[_Sequence], go_on: bool) -> list[_Sequence]:
        """Take the launched step's tokens: launching the one after it where ``go_on`` (no newcomer, one
        group) and its rows are still every running row where they were; else waiting for it, the
        rows that ended or left meanwhile dropped. The running rows it did not decode (to decode in
        this step as usual)."""
        seqs = ahead.seqs
        same = go_on and len(running) == len(seqs) and all(
            self._active.get(s.handle) is s and s.row == row for s, row in zip(seqs, ahead.rows))
        graph = self._launch_ahead(seqs) if same else None
        self.flush_text()
        if graph is not None:
            self._advance(seqs, picks=graph.picks(len(seqs)))
            return []
        # (_advance passes over the rows that ended or were cancelled since the launch)
        self._advance(seqs, picks=ahead.graph.out[:len(seqs), 0].argmax(dim=-1).tolist())
        taken = {id(s) for s in seqs}
        return [s for s in running if id(s) not in taken]

    def _forward(self, group: list[_Sequence], tokens: list[list[int]], reader_on: bool = False,
                 targets: list[list[int]] | None = None):
        """One forward of `group` feeding `tokens` (on KITE's kernels where they take the step,
        kite.runtime.kernel_step: logits [B, T, vocab], row b's first len(tokens[b]) its own; else a
        list, each row's [len(tokens[b]), vocab]); then the rows with a memory offer it their older tokens.
        With ``targets`` (a prefill: the tokens each row's positions predict), each row's last logits
        [B, vocab] and the summed NLL of its targets instead of the logits (:func:`forward_prompt_rows`)."""
        memories = {b: s.memory for b, s in enumerate(group) if s.memory is not None}
        if self.kernels is not None and self.kernels.takes(tokens, bool(memories)):
            beside = {b: self.cache.beside[s.row] for b, s in enumerate(group) if s.row in self.cache.beside}
            logits = self.kernels.logits([s.row for s in group], tokens, [s.position for s in group], beside,
                                         reader_on)
            if targets is None:
                return logits
            return (torch.stack([logits[b, len(t) - 1] for b, t in enumerate(tokens)]),   # at most MAX_QUERY a row
                    [prompt_nll_nats(logits[b], t) for b, t in enumerate(targets)])
        if self.kernels is not None:
            self.kernels.forget_last()
        rows, positions = [s.row for s in group], [s.position for s in group]
        out = (forward_rows(self.lm.model, self.cache, rows, tokens, positions, memories) if targets is None else
               forward_prompt_rows(self.lm.model, self.cache, rows, tokens, positions, targets, memories))
        for b in memories:
            self._offer(group[b], len(tokens[b]))
        return out

    def _offer(self, seq: _Sequence, fed: int) -> None:
        """Hand each layer's slots past the sinks to the sequence's memory; what it takes leaves."""
        memory, cache, row = seq.memory, self.cache, seq.row
        for layer in range(cache.n_layers):
            end = int(cache.lengths[layer, row])
            ns = min(memory.sink_tokens, end)
            taken = memory.offer(layer, cache.keys[layer][row, :, ns:end], cache.values[layer][row, :, ns:end])
            if taken:
                cache.drop_slots(row, layer, ns, taken)
        lengths = cache.row_lengths(row)
        memory.observe(seen=seq.position + fed, raw_tokens=lengths,
                       held_raw_bytes=sum(lengths) * cache.slot_bytes // cache.n_layers)

    def _advance(self, group: list[_Sequence], last: torch.Tensor | None = None,
                 picks: list[int] | None = None) -> None:
        """Sample each sequence's next token from its last logits (``last`` [B, vocab]), or take
        ``picks`` (greedy rows' argmax, taken already); the ended ones leave. The tokens' text waits
        for :meth:`flush_text`."""
        # greedy rows: the argmax where the logits are (B tokens to the host, not B x vocab floats)
        if picks is None and all(s.decode.greedy for s in group):
            picks = last.argmax(dim=-1).tolist()
        if picks is None:
            last = last.cpu()                     # one copy to the host, not one per row
        ended = []
        for b, seq in enumerate(group):
            if seq.handle not in self._active:   # cancelled meanwhile (from an on_text callback)
                continue
            d = seq.decode
            seq.next_token = d.accept(picks[b], stream=False) if picks is not None else d.take(last[b], stream=False)
            if seq.next_token is None:
                ended.append(seq)
            else:
                self._unstreamed.append(d)
        if ended:
            self._finish(*ended)

    def _finish(self, *seqs: _Sequence) -> None:
        """These sequences ended: their rows freed together (the rows that stay move down once), their
        results and last text kept for the step's report."""
        for seq in seqs:
            del self._active[seq.handle]
        moved = self.cache.free_many([seq.row for seq in seqs])
        if moved:         # the rows above the packed ones now sit in freed ones
            for s in self._active.values():
                if s.row in moved:
                    s.row = moved[s.row]
        for seq in seqs:
            self._done[seq.handle] = seq.decode.result(prompt_tokens=len(seq.prompt_ids), prefix=seq.prefix,
                                                       prompt_nll_bits=seq.prompt_nll_bits,
                                                       reader_adapter=seq.reader_on, stream=False)
            end = seq.decode.final_text()
            if end is not None:
                self._ends.append(end)

    def _reading(self, on: bool):
        return self.lm.reading(on) if hasattr(self.lm, "reading") else nullcontext(False)


def deliver_each(pieces: list[tuple[Callable[[str], None], str]]) -> None:
    """BatchDecoder.deliver's default: each piece to its on_text, in order."""
    for on_text, piece in pieces:
        on_text(piece)


PREFILL_TOKENS = 32768   # padded prompt tokens (rows x the longest) one prefill forward takes
PREFILL_PADDING_CPU = 0.25   # on a CPU, a prefill forward's padded tokens at most 1.25 x its own


def _prefill_parts(group: list[_Sequence], budget: int, padding: float | None = None) -> list[list[_Sequence]]:
    """The prefill forwards of ``group``: its rows in order of their next chunk's length, as many a
    forward as keep rows x the longest within ``budget`` tokens (always one). A burst of long prompts
    runs as several forwards in the same step, not one whose activations grow with every row (64
    prompts of 16K tokens: about 80 GB for one of Qwen2-7B's MLP products); short ones stay one forward.
    ``padding``: also no more padded tokens than (1 + padding) x the forward's own (on a CPU, where a
    prefill's cost is its padded tokens' products: prompts of 25 and 80 tokens go as two forwards)."""
    parts: list[list[_Sequence]] = []
    real = 0                            # the last part's own tokens
    for seq in sorted(group, key=lambda s: len(s.next_chunk())):
        n = len(seq.next_chunk())       # the longest of the part so far: rows are in ascending order
        padded = (len(parts[-1]) + 1) * n if parts else 0
        if parts and padded <= budget and (padding is None or padded <= (1 + padding) * (real + n)):
            parts[-1].append(seq)
            real += n
        else:
            parts.append([seq])
            real = n
    return [sorted(part, key=lambda s: s.row) for part in parts]


def _by_reader(seqs: list[_Sequence]) -> list[list[_Sequence]]:
    """The sequences split by reader-adapter setting (one forward each), rows in order."""
    groups = [sorted((s for s in seqs if s.reader == on), key=lambda s: s.row) for on in (False, True)]
    return [g for g in groups if g]


def _worst_length(prompt_tokens: int, prefix: ResidentPrefix | None, max_new_tokens: int,
                  memory: RowMemory | None = None) -> int:
    """Slots a row may fill: its longest prefix layer, the prompt and every new token but the last
    (which is sampled, never fed); with a memory, no more than the memory lets it hold."""
    # a state held beside the row fills none of its slots
    longest = max(prefix.slot_tokens(), default=0) if prefix is not None else 0
    worst = longest + prompt_tokens + max(max_new_tokens - 1, 0)
    return min(worst, memory.max_slots) if memory is not None else worst


def _sliding_window(model) -> int | None:
    """The model's attention window when some layer slides (batched attention does not apply it)."""
    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)
