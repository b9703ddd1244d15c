"""The model's own hidden states, as the tagger reads them: per layer, pooled over texts.

Hidden-state index `h` is the output of decoder layer `h` (0 is the token embeddings), taken
before the final norm; `hidden_states_at` runs only the layers it needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kite.errors import BadInput
from kite.runtime.batch import right_padded

MAX_TEXT_TOKENS = 256  # a clause is 40-150 tokens; longer texts are cut (embedding cost)


def _decoder_layers(model):
    for path in ("model.layers", "base_model.model.model.layers", "model.model.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            return obj
        except AttributeError:
            continue
    return None


def num_layers(model) -> int:
    """How many decoder layers the model has (a LoRA-wrapped model's too)."""
    layers = _decoder_layers(model)
    return len(layers) if layers is not None else int(model.config.num_hidden_layers)


class _Stop(Exception):
    pass


@torch.no_grad()
def hidden_states_at(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     wanted: Sequence[int]) -> dict[int, torch.Tensor]:
    """Hidden states {index: [B, T, D]} at `wanted` indices, running only the layers needed.

    Index 0 is the embedding output, `h` the output of decoder layer `h` (before the final norm).
    """
    wanted = sorted(set(wanted))
    layers = _decoder_layers(model)
    got: dict[int, torch.Tensor] = {}
    hooks = []
    if layers is None:  # unknown layout: run everything
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                    use_cache=False)
        return {h: out.hidden_states[h] for h in wanted}
    last = wanted[-1]

    def grab(h):
        def hook(_mod, args, output):
            hs = output[0] if isinstance(output, tuple) else output
            got[h] = hs.float()
            if h == last:
                raise _Stop
        return hook

    if 0 in wanted:
        emb = model.get_input_embeddings()
        hooks.append(emb.register_forward_hook(grab(0)))
    for h in wanted:
        if h > 0:
            hooks.append(layers[h - 1].register_forward_hook(grab(h)))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except _Stop:
        pass
    finally:
        for hk in hooks:
            hk.remove()
    return got


def mean_hidden_states(model, tokenizer, texts: list[str], layers: Sequence[int],
                       batch_size: int) -> dict[int, torch.Tensor]:
    """Mean-pooled hidden states {layer: [n, D]} of standalone texts (batched, right-padded)."""
    device = next(model.parameters()).device
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][:MAX_TEXT_TOKENS] for t in texts]
    for k, seq in enumerate(ids):
        if not seq:
            raise BadInput(f"tagging text {k} has no tokens")
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths batch together
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = {h: torch.zeros(len(ids), _hidden_size(model)) for h in layers}
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        inp, mask = right_padded([ids[i] for i in idx], pad)
        hs = hidden_states_at(model, inp.to(device), mask.to(device), layers)
        m = mask.to(device)[..., None].float()
        for h in layers:
            out[h][idx] = ((hs[h] * m).sum(1) / m.sum(1)).cpu()
    return out


def mean_hidden_states_in_context(model, tokenizer, texts: list[str], labels: list[int],
                                  layers: Sequence[int],
                                  per_doc: int = 8) -> dict[int, torch.Tensor]:
    """Mean hidden states of each text pooled from inside a pseudo-document of `per_doc` texts.

    Texts are dealt round-robin by label (deterministic, from the sorted examples), so a
    pseudo-document mixes clause types like a contract; pieces are joined by a blank line.
    """
    device = next(model.parameters()).device
    by_label: dict[int, list[int]] = {}
    for i, lab in enumerate(labels):
        by_label.setdefault(lab, []).append(i)
    order: list[int] = []
    queues = [list(v) for _, v in sorted(by_label.items())]
    while any(queues):
        for q in queues:
            if q:
                order.append(q.pop(0))
    sep = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    out = {h: torch.zeros(len(texts), _hidden_size(model)) for h in layers}
    for b in range(0, len(order), per_doc):
        ids: list[int] = []
        spans: list[tuple[int, int, int]] = []
        for i in order[b:b + per_doc]:
            piece = tokenizer(texts[i], add_special_tokens=False)["input_ids"][:MAX_TEXT_TOKENS]
            if ids:
                ids += sep
            spans.append((i, len(ids), len(ids) + len(piece)))
            ids += piece
        hs = hidden_states_at(model, torch.tensor([ids], device=device), None, layers)
        for i, a, e in spans:
            for h in layers:
                out[h][i] = hs[h][0, a:e].mean(0).cpu()
    return out


def _hidden_size(model) -> int:
    return int(model.config.hidden_size)
