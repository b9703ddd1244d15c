"""`kite generate`: stream a completion, from a plain prompt or after a loaded .upc state."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kite.cli._common import (DtypeOpt, JsonOpt, KvBudgetBlockOpt, KvBudgetCodecOpt, check_budget_flags, console, emit_json,
                              model_spec, print_warnings)
from kite.cli.store import TenantOpt
from kite.errors import BadInput

if TYPE_CHECKING:
    from kite.model import LoadedModel


def read_text_input(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt from --prompt, --prompt-file (or '-'), or piped stdin. Raises BadInput."""
    if prompt is not None and prompt_file is not None:
        raise BadInput("give --prompt or --prompt-file, not both")
    if prompt is not None:
        text = prompt
    elif prompt_file is not None and str(prompt_file) != "-":
        try:
            text = prompt_file.read_bytes().decode("utf-8")
        except FileNotFoundError:
            raise BadInput(f"--prompt-file {prompt_file}: no such file")
        except UnicodeDecodeError as exc:
            raise BadInput(f"--prompt-file {prompt_file}: not UTF-8 text (byte {exc.start})")
    elif prompt_file is not None or not sys.stdin.isatty():
        try:
            text = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadInput(f"stdin: not UTF-8 text (byte {exc.start})")
    else:
        raise BadInput("no prompt: give --prompt TEXT, --prompt-file FILE, or pipe text on stdin")
    if not text.strip():
        raise BadInput("the prompt is empty")
    return text


def state_prompt_ids(lm: LoadedModel, text: str, *, chat: bool, system: str | None, with_state: bool) -> list[int]:
    """The prompt's ids. After a state the prompt continues the document: no BOS token again."""
    from kite.runtime.generate import encode_prompt

    return encode_prompt(lm.tokenizer, text, chat=chat, system=system,
                         add_special_tokens=not with_state)


def _from_store(upc: Path, flag: str | None, folder: tempfile.TemporaryDirectory, tenant: str | None = None) -> Path:
    """--upc as a path, or, when it is no file and a store is set, the state of that address (or
    unique prefix) fetched and verified from the store (the part of `tenant`, a checked name) into
    `folder` (exit 1 when no tier holds it)."""
    if upc.exists():
        return upc
    from kite.cli.store import open_cli_store, resolve_id
    from kite.errors import KiteError

    tiers = open_cli_store(flag, required=False, tenant=tenant, create=False)   # a read: a missing folder is an error
    ref = str(upc)
    if tiers is None or len(ref) < 8 or any(c not in "0123456789abcdef" for c in ref.lower()):
        return upc
    sid = resolve_id(tiers, ref)
    dest = Path(folder.name) / f"{sid}.upc"
    if tiers.get_file(sid, dest) is None:
        raise KiteError(f"--upc {ref}: no tier of the store holds a good copy of state {sid}")
    tiers.close()
    return dest


def generate(
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="The prompt text.")] = None,
    prompt_file: Annotated[Path | None, typer.Option(help="Read the prompt from a file ('-' = stdin).")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="HF folder, .gguf file or embedded name "
                                              "(default: config model.default).")] = None,
    chat: Annotated[bool, typer.Option(help="Wrap the prompt in the model's chat template.")] = False,
    system: Annotated[str | None, typer.Option(help="System message (with --chat).")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Most tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    dtype: Annotated[str | None, DtypeOpt] = None,
    adapter: Annotated[str | None, typer.Option(help="A peft adapter folder.")] = None,
    upc: Annotated[Path | None, typer.Option("--upc", help="Answer from this .upc state instead of prefilling the document "
                                             "(or, with --model X.gguf, the id of a state X.gguf embeds: kite gguf list).")] = None,
    clusters: Annotated[str | None, typer.Option(help="With --upc: load only these clusters (labels or ids, comma-separated).")] = None,
    layers: Annotated[str | None, typer.Option(help="With --upc: load into these layers only ('12-18', '0,2,4', 'all').")] = None,
    precision: Annotated[str | None, typer.Option(help="With --upc: hold the loaded KV at fp32|fp16|bf16|fp8|int8|int4.")] = None,
    kv_budget_tokens: Annotated[int | None, typer.Option(
        "--kv-budget-tokens", help="Hold at most N tokens' KV raw; older tokens are compressed in blocks "
        "and keep taking part in attention (see docs/kv-budget.md).")] = None,
    kv_budget_codec: Annotated[str | None, KvBudgetCodecOpt] = None,
    kv_budget_block: Annotated[int | None, KvBudgetBlockOpt] = None,
    store: Annotated[str | None, typer.Option("--store", help="With --upc ADDRESS: fetch the state from this store "
                                              "(tier URLs, see kite store; default: the config's store.url).")] = None,
    tenant: Annotated[str | None, TenantOpt] = None,
    json_out: bool = JsonOpt,
) -> None:
    """Generate text; streams to the terminal. --json gives text, token counts, ttft_ms, tokens/s.

    Examples:
      kite generate --chat --prompt "What is the capital of France?"
      echo "Once upon a time" | kite generate --max-new-tokens 40 --temperature 0.8 --seed 1
      kite generate --upc contract.upc --clusters breach --prompt "What is the penalty for breach?"
      kite generate --model model+states.gguf --upc contract --prompt "Who may terminate?"
      kite generate --store file:///var/kite/store --upc 36f597c14edb48d5 --prompt "Who may terminate?"
      kite generate --prompt-file long.txt --kv-budget-tokens 1024 --kv-budget-codec ratio=8 --json
    """
    from kite.cli._common import parse_clusters, parse_layers

    # Everything the request names is checked before the model loads (the slow part).
    if upc is None and (clusters or layers or precision):
        raise BadInput("--clusters, --layers and --precision restrict what --upc loads; give --upc")
    from kite.cli.store import store_tenant

    text = read_text_input(prompt, prompt_file)
    who = store_tenant(tenant)
    model = model_spec(model)
    budget = _budget_settings(kv_budget_tokens, kv_budget_codec, kv_budget_block, upc)
    state = load_kw = None
    fetched = tempfile.TemporaryDirectory(prefix="kite-store-")   # a state fetched from --store lies here
    if upc is not None:
        from kite.upcycle import LOAD_PRECISIONS, StateFile, select_clusters

        if precision is not None and precision not in LOAD_PRECISIONS:
            raise BadInput(f"--precision {precision}: expected one of {', '.join(LOAD_PRECISIONS)}")
        from kite.store import state_path

        upc = _from_store(upc, store, fetched, who)
        # a missing file, wrong magic or a bad header fails here; an id names a state the .gguf embeds
        state = StateFile(state_path(upc, model))
        wanted = parse_clusters(clusters)
        select_clusters(state, wanted)
        load_kw = {"clusters": wanted, "precision": precision,
                   "layers": parse_layers(layers, state.meta["model"]["geometry"]["n_layers"])}
    from kite.model import load_model
    from kite.runtime.generate import generate as run_generate

    lm = load_model(model, adapter=adapter, dtype=dtype)
    prefix = report = None
    if state is not None:
        from kite.upcycle import load_prefix

        with state:
            prefix, report = load_prefix(state, lm, **load_kw)
        if not json_out:
            print_warnings(report.warnings)   # far from what the state was made for, before the answer
    ids = state_prompt_ids(lm, text, chat=chat, system=system, with_state=prefix is not None)
    cache = None
    if budget is not None:
        from kite.upcycle import BudgetCache, check_budget

        cache = BudgetCache(lm.model, check_budget(budget, lm.geometry.context_length))
    stream = None if json_out else (lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
    result = run_generate(lm, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, seed=seed, on_text=stream, prefix=prefix, cache=cache,
                          prefill_chunk=budget.block_tokens if budget is not None else None)
    stats = cache.stats() if cache is not None else None
    if json_out:
        emit_json({"model": lm.source.spec, **result.to_dict(),
                   "state": report.to_dict() if report else None, "kv_budget": stats,
                   "warnings": report.warnings if report else []})
        return
    sys.stdout.write("\n")
    if stats is not None:
        console().print(
            f"[dim]kv budget {stats['budget_tokens']} tokens ({stats['codec']}): {stats['compressed_tokens']:,} "
            f"of {stats['tokens']:,} tokens compressed · KV {stats['kv_bytes']:,} B vs {stats['raw_kv_bytes']:,} B "
            f"raw 16-bit ({stats['ratio_to_raw']:.2f} of raw)[/]", highlight=False)
    if report is not None:
        console().print(f"[dim]state {upc}: clusters {', '.join(report.labels) or 'none'} · "
                        f"{len(report.layers)} layers · {report.tokens} tokens · "
                        f"{report.bytes_read:,} B read · load {report.load_ms:.0f} ms[/]", highlight=False)
    console().print(
        f"[dim]{result.prompt_tokens} prompt + {result.new_tokens} new tokens · ttft "
        f"{result.ttft_ms:.0f} ms · {result.tokens_per_s:.1f} tok/s · {result.stop_reason}[/]",
        highlight=False)


def _budget_settings(tokens: int | None, codec: str | None, block: int | None, upc: Path | None):
    """BudgetSettings from the --kv-budget-* flags (None without --kv-budget-tokens). Raises BadInput."""
    from kite.upcycle import DEFAULT_BLOCK_TOKENS, DEFAULT_CODEC, BudgetSettings, check_budget

    check_budget_flags(tokens, codec, block)
    if tokens is None:
        return None
    if upc is not None:
        raise BadInput("--kv-budget-tokens cannot be combined with --upc (a loaded state is its own compressed "
                       "prefix); use one or the other")
    return check_budget(BudgetSettings(budget_tokens=tokens, codec=codec or DEFAULT_CODEC,
                                       block_tokens=block if block is not None else DEFAULT_BLOCK_TOKENS))
