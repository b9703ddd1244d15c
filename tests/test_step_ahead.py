"""The batch engine's decode steps launched ahead of the host (kite.runtime.batch_decode with
KernelStep.again), on the CPU: a stand-in kernel step keeps KernelStep's contract over transformers'
forward (a decode step's logits [B, 1, vocab]; ``again`` feeds the same rows their argmax one
position further and answers a graph whose ``picks`` are the tokens it fed and whose ``out`` its
logits), so the engine's bookkeeping runs as on a GPU, where tests/test_kernel_step.py runs it on the
real graphs: rows joining, ending on an end token or by length, cancelled while a step is in flight,
rows moved down when a lower one frees. The tokens, stop reasons and texts are those of steps one at
a time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kite.runtime.batch_decode import BatchDecoder, forward_rows


class StandIn:
    """KernelStep's contract for the engine, over transformers' forward on the CPU."""

    def __init__(self, lm, cache):
        self.lm, self.cache = lm, cache
        self.ahead = 0
        self._last = None        # (rows, the positions fed, the logits [B, 1, vocab])

    def takes(self, tokens, memories: bool) -> bool:
        return not memories

    def logits(self, rows, tokens, positions, beside=None, reader_on=False):
        self._last = None
        out = forward_rows(self.lm.model, self.cache, rows, tokens, positions)
        T = max(len(t) for t in tokens)
        logits = torch.zeros(len(rows), T, out[0].shape[-1])
        for b, x in enumerate(out):
            logits[b, :len(x)] = x
        if T == 1:
            self._last = (list(rows), list(positions), logits)
        return logits

    def forget_last(self):
        self._last = None

    def again(self, rows):
        if self._last is None or self._last[0] != list(rows):
            return None
        rows, positions, last = self._last
        fed = last[:, 0].argmax(dim=-1).tolist()
        positions = [p + 1 for p in positions]
        out = forward_rows(self.lm.model, self.cache, rows, [[t] for t in fed], positions)
        logits = torch.stack([x[-1:] for x in out])
        self._last = (rows, positions, logits)
        self.ahead += 1
        return SimpleNamespace(out=logits, picks=lambda B: fed[:B])


@pytest.fixture(scope="module")
def lm(tiny_models):
    from kite.model import load_model

    return load_model(str(tiny_models["llama"]), device="cpu")


def _prompt(lm, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, lm.geometry.vocab_size, (n,), generator=g).tolist()


def drive(lm, requests, *, ahead: bool, cancel_at: tuple[int, int] | None = None):
    """Every request (prompt, max_new_tokens, stop ids) through one engine of 3 rows: the first two at
    once, the rest as rows free up; ``cancel_at`` (request, steps): cancelled after that many steps
    since it joined. {request: (token ids, stop reason, text)} and the engine."""
    from kite.runtime.decoding import SequenceDecode

    dec = BatchDecoder(lm, max_rows=3)
    dec.kernels = StandIn(lm, dec.cache) if ahead else None
    handles, results, waiting, steps, joined = {}, {}, list(range(len(requests))), 0, {}
    result = SequenceDecode.result

    def with_ids(self, **kw):
        out = result(self, **kw)
        out.ids = list(self.new)
        return out

    def keep(done):
        for h, r in done.items():
            results[handles[h]] = (r.ids, r.stop_reason, r.text)

    SequenceDecode.result = with_ids
    try:
        while waiting or len(dec):
            while waiting and dec.fits(len(requests[waiting[0]][0]), None, requests[waiting[0]][1]):
                i = waiting.pop(0)
                p, n, stop = requests[i]
                handles[dec.add(p, max_new_tokens=n, stop_ids=stop)] = i
                joined[i] = steps
            keep(dec.step())
            steps += 1
            if cancel_at is not None:
                i, at = cancel_at
                h = next((h for h, j in handles.items() if j == i), None)
                if h is not None and steps - joined[i] == at:
                    dec.cancel(h)
        keep(dec.step())
    finally:
        SequenceDecode.result = result
    return results, dec


def test_steps_launched_ahead_give_the_tokens_of_steps_one_at_a_time(lm):
    reqs = [(_prompt(lm, 5, i), 6 + 3 * i, set()) for i in range(6)]
    first, _ = drive(lm, reqs, ahead=False)
    reqs[1] = (reqs[1][0], reqs[1][1], {first[1][0][2]})     # its third token ends it (an end token)
    want, _ = drive(lm, reqs, ahead=False, cancel_at=(3, 4))
    got, dec = drive(lm, reqs, ahead=True, cancel_at=(3, 4))
    assert want[1][1] == "eos" and want[3][1] == "cancelled" and want[5][1] == "length"
    assert got == want
    assert dec.kernels.ahead > 0
    assert dec.cache.bytes_in_use() == 0


def test_a_sampled_row_keeps_its_steps_one_at_a_time(lm):
    """A sampled row (temperature > 0) needs its logits on the host: no step runs ahead of it."""
    dec = BatchDecoder(lm, max_rows=2)
    dec.kernels = StandIn(lm, dec.cache)
    dec.add(_prompt(lm, 4, 1), max_new_tokens=6, temperature=0.8, seed=3, stop_ids=set())
    dec.add(_prompt(lm, 4, 2), max_new_tokens=6, stop_ids=set())
    dec.drain()
    assert dec.kernels.ahead == 0
