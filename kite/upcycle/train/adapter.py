"""The reader adapter: a peft LoRA that teaches the model to read decoded states, by distillation.

Teacher: the base model reading the full context; its distribution over every response token is
computed once (top ``top_k`` log-probabilities, enough for the KL of a peaked distribution) and
kept with the run. Student: the model with the LoRA on, reading the decoded state of the same
context (the state's KV is fixed input: only the LoRA weights learn). Loss: KL(teacher ‖ student)
on the response tokens at ``temperature``, times temperature².

The loop is deterministic for a seed (data order per epoch, dropout from the saved generator), and
checkpoints every ``checkpoint_every`` steps (:mod:`.checkpoint`), so a run resumed after a kill
ends on the same weights as one never interrupted.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kite.errors import BadInput
from kite.runtime.cache import KVPrefix, new_cache
from kite.runtime.generate import cache_kwarg
from kite.upcycle.capture import tokenize_document
from kite.upcycle.train.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from kite.upcycle.train.data import Pair
from kite.upcycle.train.stages import StageTimes

if TYPE_CHECKING:
    from kite.model import LoadedModel

Progress = Callable[[str, int, int], None]
LOSS_EVERY = 16     # steps whose losses wait on the device before the host reads them


@dataclass
class AdapterSettings:
    """LoRA shape and the distillation's knobs (``chosen_by`` says where the shape came from)."""

    target_modules: list[str]
    r: int
    lora_alpha: int
    lora_dropout: float = 0.05
    temperature: float = 1.0
    learning_rate: float = 5e-4
    epochs: int = 2
    top_k: int = 256
    checkpoint_every: int = 25
    pairs_per_step: int = 1      # pairs in one forward, backward and optimizer step (their mean loss)
    chosen_by: str = "custom"

    def to_dict(self) -> dict:
        return asdict(self)


# the projections that read a state: queries decide what of the prefix each new token attends to,
# the output projection what it takes from it (keys and values of the prefix are fixed input)
AUTO_MODULES = ("q_proj", "o_proj")


def auto_settings(model, train_tokens: int, **overrides) -> AdapterSettings:
    """The architecture's query and output projections, at a rank that grows with the response
    tokens to learn from (the seed's r 64 as the upper bound): few tokens, a small rank, so the
    adapter cannot memorize the training answers."""
    present = linear_module_names(model)
    targets = [m for m in AUTO_MODULES if any(n.endswith(m) for n in present)]
    if not targets:
        raise BadInput(f"auto mode knows no {' / '.join(AUTO_MODULES)} in this model; use --mode custom with "
                       f"adapter.target_modules from: {', '.join(sorted({n.rsplit('.', 1)[-1] for n in present}))}")
    r = 8 if train_tokens < 20_000 else 16 if train_tokens < 200_000 else 32 if train_tokens < 2_000_000 else 64
    why = (f"auto: {', '.join(targets)} (what reads the state; its keys and values are fixed), r {r} for "
           f"{train_tokens:,} response tokens (8 below 20K, 16 below 200K, 32 below 2M, else 64)")
    return AdapterSettings(**{"target_modules": targets, "r": r, "lora_alpha": 2 * r, "chosen_by": why,
                              **overrides})


def linear_module_names(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def check_targets(model, targets: list[str]) -> None:
    """BadInput naming the modules that exist when a target matches none."""
    names = linear_module_names(model)
    for t in targets:
        if not any(n == t or n.endswith("." + t) for n in names):
            short = sorted({".".join(n.split(".")[-2:]) for n in names if "layers." in n})
            raise BadInput(f"adapter.target_modules: {t!r} is no module of this model; it has: {', '.join(short)}")


@dataclass
class Example:
    """One pair, tokenized, with the teacher's top-k over each response token."""

    doc: str
    prompt_ids: list[int]
    response_ids: list[int]
    teacher_idx: torch.Tensor = field(repr=False)    # [n, k] int64
    teacher_logp: torch.Tensor = field(repr=False)   # [n, k] float32 (log-probabilities, T = 1)
    # [n] float32: the log-probability of each response token after the full context (None: not computed)
    full_logp: torch.Tensor | None = field(default=None, repr=False)


def tokenize_pair(tokenizer, pair: Pair, ctx: list[int] | None = None) -> tuple[list[int], list[int], list[int]]:
    """(context, prompt, response) token ids; ``ctx``: the context's ids when the caller has them."""
    if ctx is None:
        ctx, _ = tokenize_document(tokenizer, pair.context)
    p = tokenizer(pair.prompt, add_special_tokens=False)["input_ids"]
    r = tokenizer(pair.response, add_special_tokens=False)["input_ids"]
    return ctx, p, r


def distill_loss(student_logits: torch.Tensor, ex: Example, temperature: float) -> torch.Tensor:
    """KL(teacher ‖ student) over the teacher's top-k, mean over response tokens, × T²."""
    t = temperature
    q = torch.softmax(ex.teacher_logp / t, dim=-1)                                   # [n, k]
    logs = torch.log_softmax(student_logits.float() / t, dim=-1).gather(1, ex.teacher_idx)
    kl = (q * (torch.log(q.clamp_min(1e-12)) - logs)).sum(-1)
    return kl.mean() * t * t


def student_logits(model, prefix: KVPrefix, ex: Example) -> torch.Tensor:
    """The (LoRA) model's logits over the response tokens, reading ``prefix`` (grad through the LoRA)."""
    device = next(model.parameters()).device
    ids = torch.tensor(ex.prompt_ids + ex.response_ids[:-1], device=device)[None]
    start = prefix.next_position
    pos = torch.arange(start, start + ids.shape[1], device=device)[None]
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = model(input_ids=ids, position_ids=pos, use_cache=True, **{cache_kwarg(base): new_cache(base, prefix)})
    return out.logits[0, len(ex.prompt_ids) - 1:]


def student_batch_logits(model, prefixes: list[KVPrefix], exs: list[Example]) -> list[torch.Tensor]:
    """Each example's response logits reading its own prefix, every row in one forward (grad through
    the LoRA): the prefixes left-padded to the longest and the padding masked out, the new tokens
    right-padded (causal attention keeps a row's tokens from its padding), each row at its own
    positions. A row's logits are those :func:`student_logits` gives it alone, up to summation order.
    Prefixes must hold the same tokens in every layer (a whole state's load)."""
    from transformers import DynamicCache

    if len(prefixes) == 1:
        return [student_logits(model, prefixes[0], exs[0])]
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    lens = []
    for p in prefixes:
        per_layer = set(p.tokens_per_layer())
        if len(per_layer) != 1:
            raise ValueError("a batch of pairs reads whole states (the same tokens in every layer)")
        lens.append(per_layer.pop())
    B, P = len(exs), max(lens)
    seqs = [ex.prompt_ids + ex.response_ids[:-1] for ex in exs]
    n = max(len(q) for q in seqs)
    ids = torch.zeros(B, n, dtype=torch.long)
    mask = torch.zeros(B, P + n, dtype=torch.long)
    pos = torch.zeros(B, n, dtype=torch.long)
    for i, (q, p) in enumerate(zip(seqs, prefixes)):
        ids[i, :len(q)] = torch.tensor(q)
        mask[i, P - lens[i]:P + len(q)] = 1
        pos[i] = torch.arange(p.next_position, p.next_position + n)
    cache = DynamicCache(config=base.config)
    for layer in range(prefixes[0].n_layers):
        keys, values = (torch.zeros(B, *t[layer].shape[:-2], P, t[layer].shape[-1], device=device, dtype=dtype)
                        for t in (prefixes[0].keys, prefixes[0].values))
        for i, p in enumerate(prefixes):
            keys[i, :, P - lens[i]:] = p.keys[layer]
            values[i, :, P - lens[i]:] = p.values[layer]
        cache.update(keys, values, layer)
    out = model(input_ids=ids.to(device), position_ids=pos.to(device), attention_mask=mask.to(device), use_cache=True,
                **{cache_kwarg(base): cache})
    return [out.logits[i, len(ex.prompt_ids) - 1:len(q)] for i, (ex, q) in enumerate(zip(exs, seqs))]


class PrefixCache:
    """Decoded states by document on the model's device, in the model's dtype, as plain tensors
    (autograd refuses the inference tensors a load returns): all of them while they fit in
    ``budget_bytes``, else the most recently used (the rest are loaded again when asked for).
    ``load_many``: loads several documents' states at once (:meth:`fetch`; their tails run together)."""

    def __init__(self, load: Callable[[str], KVPrefix], budget_bytes: int, device, dtype: torch.dtype,
                 load_many: Callable[[list[str]], list[KVPrefix]] | None = None):
        self.load, self.load_many, self.budget, self.device, self.dtype = load, load_many, budget_bytes, device, dtype
        self.items: OrderedDict[str, KVPrefix] = OrderedDict()
        self.nbytes, self.loads = 0, 0

    def __call__(self, doc: str) -> KVPrefix:
        if doc not in self.items:
            self._keep(doc, self.load(doc))
        self.items.move_to_end(doc)
        return self.items[doc]

    def fetch(self, docs: list[str]) -> None:
        """Load those of ``docs`` not held, together where ``load_many`` is given."""
        missing = [d for d in dict.fromkeys(docs) if d not in self.items]
        if self.load_many is None or len(missing) < 2:
            for doc in missing:
                self(doc)
            return
        for doc, p in zip(missing, self.load_many(missing)):
            self._keep(doc, p)

    def _keep(self, doc: str, p: KVPrefix) -> None:
        self.loads += 1
        self.items[doc] = p = KVPrefix([k.to(self.device, self.dtype).clone() for k in p.keys],
                                       [v.to(self.device, self.dtype).clone() for v in p.values], p.next_position)
        self.nbytes += p.nbytes()
        while len(self.items) > 1 and self.nbytes > self.budget:
            self.nbytes -= self.items.popitem(last=False)[1].nbytes()


def memory_budget(device, share: float) -> int:
    """Bytes a run may keep of something on ``device``: ``share`` of the GPU memory free now, or of
    4 GiB on the host."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * share)
    return int((4 << 30) * share)


def attach_lora(lm: LoadedModel, s: AdapterSettings):
    """The peft model wrapping ``lm.model`` (the LoRA layers go into lm.model itself: on by default,
    off inside ``peft_model.disable_adapter()``)."""
    from peft import LoraConfig, get_peft_model

    check_targets(lm.model, s.target_modules)
    cfg = LoraConfig(r=s.r, lora_alpha=s.lora_alpha, lora_dropout=s.lora_dropout, target_modules=s.target_modules,
                     bias="none", task_type="CAUSAL_LM")
    return get_peft_model(lm.model, cfg)


def train_adapter(peft_model, examples: list[Example], prefixes: Callable[[str], KVPrefix], s: AdapterSettings,
                  out_dir: Path, *, seed: int, resume: bool, progress: Progress | None = None,
                  stop_after: int | None = None, times: StageTimes | None = None) -> dict:
    """Train the LoRA of ``peft_model`` on ``examples``; returns the history (loss per step, tokens/s).

    ``resume``: continue from the newest checkpoint in ``out_dir`` (else start over).
    ``stop_after``: return after that many steps in this call (tests of an interrupted run).
    A step reads ``s.pairs_per_step`` pairs of the epoch's order in one forward
    (:func:`student_batch_logits`) and steps on their mean loss.
    ``times``: where the steps' and the checkpoints' seconds are added (stages ``adapter_steps``,
    ``checkpoints``). The losses stay on the device until a checkpoint or every ``LOSS_EVERY``
    steps, so the host does not wait for each step before queueing the next.
    """
    times = times or StageTimes(next(peft_model.parameters()).device)
    params = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(list(params.values()), lr=s.learning_rate, weight_decay=0.0)
    per_step = max(1, s.pairs_per_step)
    steps_per_epoch = -(-len(examples) // per_step)
    total = s.epochs * steps_per_epoch
    progress_state = {"step": 0, "loss": [], "tokens": 0, "seconds": 0.0}
    torch.manual_seed(seed)
    ck = load_checkpoint(out_dir) if resume else None
    resumed_from = ck.step if ck is not None else 0
    if ck is not None:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(ck.params[n])
        opt.load_state_dict(ck.optimizer)
        torch.set_rng_state(ck.rng)
        progress_state = ck.progress
    peft_model.train()
    step, ran = progress_state["step"], 0
    pending: list[torch.Tensor] = []
    orders: dict[int, list[int]] = {}

    def flush() -> None:
        if pending:
            progress_state["loss"] += [round(v, 6) for v in torch.stack(pending).tolist()]
            pending.clear()

    t0 = time.perf_counter()
    while step < total:
        ran_before = ran
        with times.stage("adapter_steps", 0):
            while step < total:
                epoch, at = divmod(step, steps_per_epoch)
                if epoch not in orders:
                    orders[epoch] = list(range(len(examples)))
                    random.Random(f"kite-train:{seed}:{epoch}").shuffle(orders[epoch])
                batch = [examples[i] for i in orders[epoch][at * per_step:(at + 1) * per_step]]
                if per_step == 1:
                    loss = distill_loss(student_logits(peft_model, prefixes(batch[0].doc), batch[0]), batch[0],
                                        s.temperature)
                else:
                    rows = student_batch_logits(peft_model, [prefixes(ex.doc) for ex in batch], batch)
                    loss = torch.stack([distill_loss(lg, ex, s.temperature) for lg, ex in zip(rows, batch)]).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                ran += 1
                pending.append(loss.detach())
                progress_state["step"] = step
                progress_state["tokens"] += sum(len(ex.response_ids) for ex in batch)
                checkpoint = step % s.checkpoint_every == 0 or step == total
                stop = stop_after is not None and ran >= stop_after
                if len(pending) >= LOSS_EVERY or checkpoint or stop:
                    flush()
                if progress and progress_state["loss"]:
                    tps = progress_state["tokens"] / max(1e-9, progress_state["seconds"] + time.perf_counter() - t0)
                    recent = progress_state["loss"][-20:]
                    progress(f"train adapter · loss {sum(recent) / len(recent):.4f} · {tps:.0f} tok/s", step, total)
                if checkpoint or stop:
                    break
        times.counts["adapter_steps"] += ran - ran_before
        if checkpoint:
            progress_state["seconds"] += time.perf_counter() - t0
            with times.stage("checkpoints"):
                save_checkpoint(out_dir, Checkpoint(step, {n: p.detach() for n, p in params.items()},
                                                    opt.state_dict(), torch.get_rng_state(), progress_state))
            t0 = time.perf_counter()
        if stop:
            break
    peft_model.eval()
    seconds = progress_state["seconds"] + time.perf_counter() - t0
    return {"steps": step, "resumed_from": resumed_from, "loss": progress_state["loss"],
            "response_tokens": progress_state["tokens"],
            "seconds": round(seconds, 1),
            "tokens_per_s": round(progress_state["tokens"] / seconds, 1) if seconds else None,
            "final_loss": (sum(progress_state["loss"][-20:]) / len(progress_state["loss"][-20:])
                           if progress_state["loss"] else math.nan)}
