"""`kite upcycle`: compress a document into a .upc state; inspect, evaluate and migrate states."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kite.cli._common import (DtypeOpt, JsonOpt, MkdirOpt, ModelOpt, console, emit_json, kept_on_interrupt, model_spec,
                              new_app, print_warnings, read_document, user_config)
from kite.cli.store import StoreOpt, TenantOpt
from kite.errors import BadInput

app = new_app("Turn a document's KV cache into a .upc state; inspect, evaluate, migrate, retune.")

RegeneratorOpt = typer.Option("--regenerator", help="A regenerator folder (`kite upcycle train` makes DIR/regenerator): "
                              "code the state on its calibrated bases where that pays (default: upcycle_config "
                              "regenerator:).")
LayerWeightsOpt = typer.Option("--layer-weights", help="A layer weights file (`kite upcycle weigh` makes one): the "
                               "bit allocation weighs each layer's keys and values by it (default: upcycle_config "
                               "layer_weights:, else the weights KITE ships for the model, as for the embedded one; "
                               "'none': without).")


# Every preset `--precision` accepts (kite.upcycle.codec.PRESETS, which a test holds this list to;
# written out so that listing commands does not import the codec).
PRECISION_PRESETS = ("exact", "fp32", "fp16", "bf16", "fp8", "int8", "int4", "int3", "int2")
PrecisionOpt = typer.Option(help="A precision preset instead of --ratio: " + "|".join(PRECISION_PRESETS) + ".")
EntropyOpt = typer.Option("--entropy-coding/--no-entropy-coding", help="Entropy-code the quantized coefficients: at "
                          "a ratio, the bits saved are spent on more components (default: the config's "
                          "compression.entropy_coding).")
RecomputeOpt = typer.Option("--recompute-tokens", metavar="N|auto", help="Keep the document's last N tokens as "
                            "token ids, not coded: every load runs them through the model after the rest (exact "
                            "but for what they read), and the state's bytes go to the tokens before them; auto: "
                            "256 (at most an eighth of the document) at --ratio 16 and above, else none (default: "
                            "the config's compression.recompute_tokens, auto).")

@app.command("compress")
def compress(
    input: Annotated[str, typer.Option("--input", "-i", help="The document (text file, or '-' for stdin).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the .upc state.")],
    model: Annotated[str | None, ModelOpt] = None,
    config: Annotated[Path | None, typer.Option(help="upcycle_config.yaml (default configs/upcycle_config.yaml).")] = None,
    ratio: Annotated[float | None, typer.Option(help="Compression ratio against raw fp16 KV (4 = 4×; default: "
                                                "1 / config features.upcycle_compression_ratio when set, else the "
                                                "upcycle config's).")] = None,
    precision: Annotated[str | None, PrecisionOpt] = None,
    clusters: Annotated[int | None, typer.Option(min=1, help="Number of clusters (compression.cluster_num).")] = None,
    regenerator: Annotated[Path | None, RegeneratorOpt] = None,
    layer_weights: Annotated[Path | None, LayerWeightsOpt] = None,
    label_ratio: Annotated[list[str] | None, typer.Option(
        "--label-ratio", help="LABEL=R: the clusters of that clause label at ratio R (repeatable; over the "
        "config's compression.label_ratios).")] = None,
    entropy_coding: Annotated[bool | None, EntropyOpt] = None,
    recompute_tokens: Annotated[str | None, RecomputeOpt] = None,
    mkdir: bool = MkdirOpt,
    store: Annotated[str | None, StoreOpt] = None,
    tenant: Annotated[str | None, TenantOpt] = None,
    json_out: bool = JsonOpt,
) -> None:
    """Prefill a document, cluster and tag its spans, compress its KV cache into a .upc state.

    With a store (--store or the config's store.url), a document whose state (same model, tokens and
    settings: its content address) a tier holds is fetched instead of compressed again, and a new
    state is put into every tier. With a tenant (--tenant or the config's store.tenant), the content
    address is made for that tenant and the store is the tenant's part of each tier.

    Example: kite upcycle compress --input contract.txt --output contract.upc --ratio 4
    """
    from kite.atomic import check_output
    from kite.cli.store import open_cli_store, store_tenant

    text, name = read_document(input)   # before the heavy imports: a bad --input fails at once
    check_output(output, mkdir, "--output")
    who = store_tenant(tenant)
    tiers = open_cli_store(store, required=False, tenant=who)   # a bad URL fails before the model loads
    from kite.upcycle import parse_label_ratio_flags

    label_ratios = parse_label_ratio_flags(label_ratio)
    model = model_spec(model)
    from kite.cli._progress import progress_bar
    from kite.upcycle import open_pipeline

    kept = f"nothing written to {output} (a state is written whole, then renamed into place)"
    with kept_on_interrupt(kept), progress_bar() as progress:   # config and flags checked before the model loads
        pipe = open_pipeline(model, config, ratio=ratio, precision=precision, clusters=clusters, progress=progress,
                             kept_fraction=user_config().features.upcycle_compression_ratio, regenerator=regenerator,
                             label_ratios=label_ratios, layer_weights=layer_weights, entropy_coding=entropy_coding,
                             recompute_tokens=recompute_tokens)
        if tiers is None:
            result = pipe.compress(text, output, source_name=name, progress=progress, tenant=who)
        else:
            from kite.store import compress_to_store

            stored = compress_to_store(pipe, tiers, text, output, source_name=name, progress=progress)
            tiers.close()
            result = stored.result
    if tiers is not None and not stored.recompressed:
        if json_out:
            emit_json({"path": str(output), "address": stored.address, "store": stored.to_dict()})
            return
        console().print(f"[bold green]wrote[/] {output} from the store (tier {stored.found_in}): state "
                        f"{stored.address} is already there, not recompressed", highlight=False)
        return
    if json_out:
        print_warnings(result.warnings)
        emit_json({**result.to_dict(), **({"store": stored.to_dict()} if tiers is not None else {})})
        _fail_on_put(stored if tiers is not None else None)
        return
    out = console()
    out.print(f"[bold green]wrote[/] {output}: {result.n_tokens:,} tokens → {result.state_bytes:,} B "
              f"({result.compression_ratio:.2f}× smaller than raw fp16 KV {result.raw_kv_bytes:,} B)",
              highlight=False)
    for c in result.clusters:
        out.print(f"  cluster {c.id:>2}  {c.label:<22} conf {c.confidence:.2f}  {c.n_tokens:>6} tokens  "
                  f"[dim]{c.preview[:60]}[/]", highlight=False)
    if result.recomputed_tokens:
        out.print(_tail_line(result.recomputed_tokens), highlight=False)
    out.print("  " + "  ".join(f"{k} {v:.0f} ms" for k, v in result.timings_ms.items()), highlight=False)
    if pipe.regenerator is None and result.compression_ratio >= HIGH_RATIO:
        out.print(f"  [dim]at {result.compression_ratio:.0f}× a state that stores its own bases keeps far less than one "
                  "coded on a regenerator fitted to the model: `kite upcycle train --regenerator-only` fits one from "
                  "documents like yours (docs/training.md)[/]", highlight=False)
    print_warnings(result.warnings)
    if tiers is not None:
        out.print(f"  stored as {stored.address}: " + "  ".join(f"{t} {s}" for t, s in stored.put.tiers.items()),
                  highlight=False)
        _fail_on_put(stored)


def _tail_line(tokens: int) -> str:
    return f"  the last {tokens:,} tokens kept as ids: every load recomputes them"


HIGH_RATIO = 12     # from here on a state's own bases take a share of its bytes that a regenerator saves


def _fail_on_put(stored) -> None:
    """Exit 1 when a store tier failed to take the new state (never silent; the state file is written)."""
    if stored is not None and stored.put is not None and stored.put.failed:
        from kite.errors import KiteError

        raise KiteError(f"the state was written to its file but store tier(s) {', '.join(stored.put.failed)} "
                        f"failed to take it: " + "; ".join(stored.put.failed.values()))


@app.command("inspect")
def inspect(
    state: Annotated[Path, typer.Argument(help="A .upc state file.")],
    verify: Annotated[bool, typer.Option(help="Check every part's checksum.")] = False,
    json_out: bool = JsonOpt,
) -> None:
    """Header, fingerprints, clusters (label, confidence, tokens, preview), bytes per part, checksums."""
    from kite.upcycle import describe_state

    report = describe_state(state, verify=verify)
    if json_out:
        emit_json(report)
        if verify and report["checksums"]["failed"]:
            raise typer.Exit(1)
        return
    out = console()
    ratio = report["compression_ratio"]
    out.print(f"[bold]{state}[/]  format v{report['format_version']}  {report['file_bytes']:,} B  "
              f"{report['n_tokens']:,} tokens" + (f"  {ratio:.2f}× vs raw fp16 KV" if ratio else ""), highlight=False)
    fp = report["fingerprints"]
    combined = report["fingerprint"]
    if combined:   # the one `kite model info` prints and `kite upcycle migrate` takes
        out.print(f"  fingerprint {combined}  (short {combined.removeprefix('kite-fp1:')[:12]})", highlight=False)
    out.print(f"  model {fp.get('model')}\n  tokenizer {fp.get('tokenizer')}\n  adapter {fp.get('adapter')}",
              highlight=False)
    out.print(f"  geometry {report['geometry']}", highlight=False)
    out.print(f"  address {report['address']}" if report["address"] else
              "  address none (unaddressed: made before content addresses, or migrated; docs/store.md)",
              highlight=False)
    sig = report["signature"]
    out.print(f"  signed with key {sig['key_id']} ({'checked' if sig['checked'] else 'not checked: no security.state_key'})"
              if sig else "  unsigned (no keyed digest; docs/upc-format.md)", highlight=False)
    lw = report["layer_weights"]
    out.print(f"  codec {report['codec']['name']}  layer weights "
              f"{lw.removeprefix('kite-fp1:')[:12] if lw else 'none'}  created {report['created_at']}", highlight=False)
    for c in report["clusters"]:
        conf = f"{c['confidence']:.2f}" if c["confidence"] is not None else "  - "
        out.print(f"  cluster {c['id']:>2}  {c['label']:<22} conf {conf}  {c['n_tokens']:>6} tokens  "
                  f"{c['bytes']:>10,} B  [dim]{c['preview'][:50]}[/]", highlight=False)
    out.print(f"  shared per-layer codecs {report['bytes']['layer_codecs']:,} B, header {report['bytes']['header']:,} B",
              highlight=False)
    if report["entropy_coded"]:
        ec = report["entropy_coded"]
        out.print(f"  entropy coded: {ec['parts']} of {ec['of_parts']} parts, {ec['bytes_saved']:,} B saved", highlight=False)
    if report["recomputed_tokens"]:
        out.print(_tail_line(report["recomputed_tokens"]), highlight=False)
    if verify:
        ck = report["checksums"]
        colour = "green" if not ck["failed"] else "red"
        out.print(f"  checksums: [{colour}]{ck['ok']} ok, {len(ck['failed'])} failed[/] {ck['failed'][:5]}")
        if ck["failed"]:
            raise typer.Exit(1)


@app.command("eval")
def eval_cmd(
    input: Annotated[str, typer.Option("--input", "-i", help="A text file ('-' = stdin) long enough for both parts.")],
    model: Annotated[str | None, ModelOpt] = None,
    context_tokens: Annotated[int, typer.Option(min=1, help="Tokens compressed into the state.")] = 2048,
    continuation_tokens: Annotated[int, typer.Option(min=2, help="Tokens scored after it.")] = 512,
    ratio: Annotated[float | None, typer.Option(help="Compression ratio against raw fp16 KV (default: as for "
                                                "`kite upcycle compress`).")] = None,
    precision: Annotated[str | None, PrecisionOpt] = None,
    clusters: Annotated[int | None, typer.Option(min=1, help="Number of clusters.")] = None,
    config: Annotated[Path | None, typer.Option(help="upcycle_config.yaml.")] = None,
    regenerator: Annotated[Path | None, RegeneratorOpt] = None,
    layer_weights: Annotated[Path | None, LayerWeightsOpt] = None,
    entropy_coding: Annotated[bool | None, EntropyOpt] = None,
    recompute_tokens: Annotated[str | None, RecomputeOpt] = None,
    probe: Annotated[str | None, typer.Option(help="Also measure tasks on the state at this ratio (a comma list): "
                                              "'passkey' (one key at 10/30/50/70/90 % depth), 'keys' (3 keys in "
                                              "one context), 'qa' (F1 on held-out generated contracts).")] = None,
    qa_contracts: Annotated[int | None, typer.Option(min=1, help="With --probe qa: the held-out contracts asked "
                                                     "about, 8 questions each (default 2; one answer then moves F1 by "
                                                     "0.05-0.08: ask 6 or more to compare settings).")] = None,
    dtype: Annotated[str | None, DtypeOpt] = None,
    json_out: bool = JsonOpt,
) -> None:
    """What a setting loses on your text: PPL full vs state, delta, KL, top-1 agreement, bytes.

    Example: kite upcycle eval --input /usr/share/common-licenses/GPL-3 --ratio 8 --probe passkey,qa
    """
    text, _ = read_document(input)   # before the heavy imports: a bad --input fails at once
    model = model_spec(model)
    from kite.cli._progress import progress_bar
    from kite.upcycle import check_probe, evaluate, open_pipeline

    if "qa" not in check_probe(probe) and qa_contracts is not None:
        raise BadInput("--qa-contracts: only with --probe qa")
    with progress_bar() as progress:   # the config and the flags are checked before the model loads
        pipe = open_pipeline(model, config, ratio=ratio, precision=precision, clusters=clusters, progress=progress,
                             kept_fraction=user_config().features.upcycle_compression_ratio, regenerator=regenerator,
                             layer_weights=layer_weights, entropy_coding=entropy_coding,
                             recompute_tokens=recompute_tokens, dtype=dtype)
        result = evaluate(pipe.lm, text, context_tokens=context_tokens, continuation_tokens=continuation_tokens,
                          settings=pipe.settings, tagger=pipe.tagger, probe=probe, progress=progress,
                          regenerator=pipe.regenerator,
                          **({} if qa_contracts is None else {"qa_contracts": qa_contracts}))
    print_warnings(result.warnings)
    if json_out:
        emit_json(result.to_dict())
        return
    out = console()
    out.print(f"[bold]{result.codec}[/] on {result.context_tokens} context + {result.continuation_tokens} "
              f"continuation tokens", highlight=False)
    lo, hi = result.ppl_delta_interval
    out.print(f"  PPL full {result.ppl_full:.3f} · state {result.ppl_state:.3f} · delta "
              f"{result.ppl_delta:+.3f} (95 % of resamples of the continuation: {lo:+.3f} to {hi:+.3f}) · KL "
              f"{result.kl_mean:.4f} · top-1 {result.top1_agreement:.1%}", highlight=False)
    out.print(f"  state {result.state_bytes:,} B vs raw fp16 KV {result.raw_kv_bytes:,} B = "
              f"{result.compression_ratio:.2f}× (every byte counted: codecs, scales, header)", highlight=False)
    if result.recomputed_tokens:
        out.print(f"  its last {result.recomputed_tokens:,} tokens recomputed by the load "
                  f"({result.timings_ms.get('load', 0):.0f} ms in all)", highlight=False)
    for name, p in result.probes.items():
        if name == "qa":
            out.print(f"  qa: F1 full context {p['full_f1']:.3f} · state {p['state_f1']:.3f} · exact match "
                      f"{p['full_exact']:.0%} · {p['state_exact']:.0%} ({len(p['cases'])} questions, state "
                      f"{p['compression_ratio']:.2f}×)", highlight=False)
        else:
            out.print(f"  {name}: full context {p['full_accuracy']:.0%} · state {p['state_accuracy']:.0%} "
                      f"({len(p['cases'])} keys, state {p['compression_ratio']:.2f}×)", highlight=False)


@app.command("migrate")
def migrate_cmd(
    old_model_fingerprint: Annotated[str | None, typer.Option(help="Fingerprint the states were made with (short or full).")] = None,
    new_model_fingerprint: Annotated[str | None, typer.Option(help="Fingerprint to move them to.")] = None,
    upcycle_dir: Annotated[Path, typer.Option(help="The folder of .upc states.")] = Path("."),
    new_model: Annotated[str | None, typer.Option(help="The new model: checks its geometry and records all its fingerprints.")] = None,
    dry_run: Annotated[bool, typer.Option(help="Say what would happen; change nothing.")] = False,
    force: Annotated[bool, typer.Option(help="Migrate even when the new model's KV geometry differs.")] = False,
    rollback: Annotated[bool, typer.Option(help="Undo an interrupted migration recorded in the folder's journal.")] = False,
    json_out: bool = JsonOpt,
) -> None:
    """Move states to a new model fingerprint: rewrite headers and file names, journaled.

    Example: kite upcycle migrate --old-model-fingerprint 3f4a7011d963 --new-model-fingerprint 9b1c22e0aa41 \\
      --upcycle-dir ./states --new-model ./SmolLM2-ft
    """
    from kite.upcycle import migrate as migrate_states
    from kite.upcycle import rollback as rollback_migration
    from kite.yoco.health import HealthStore

    if rollback:
        with kept_on_interrupt(lambda: _rollback_kept(upcycle_dir)):
            report = rollback_migration(upcycle_dir)
    else:
        if not old_model_fingerprint or not new_model_fingerprint:
            raise BadInput("give --old-model-fingerprint and --new-model-fingerprint (or --rollback)")
        fps = geometry = None
        if new_model is not None:
            from kite.model.fingerprint import fingerprints
            from kite.model.geometry import geometry_from_config
            from kite.model.loader import load_config_only

            _, folder, config = load_config_only(new_model)
            fps, geometry = fingerprints(folder), geometry_from_config(config)
        resume = ["kite", "upcycle", "migrate", "--old-model-fingerprint", old_model_fingerprint,
                  "--new-model-fingerprint", new_model_fingerprint, "--upcycle-dir", str(upcycle_dir),
                  *(["--new-model", new_model] if new_model is not None else []), *(["--force"] if force else [])]
        with kept_on_interrupt(lambda: _migrate_kept(upcycle_dir, resume, dry_run)):
            report = migrate_states(upcycle_dir, old_model_fingerprint, new_model_fingerprint, new_fps=fps,
                                    new_geometry=geometry, force=force, dry_run=dry_run,
                                    health=None if dry_run else HealthStore())
    if json_out:
        emit_json(report.to_dict())
    else:
        out = console()
        verb = "would " if report.dry_run else ""
        for f in report.files:
            colour = {"migrate": "green", "refuse": "red", "done": "green"}.get(f.action, "dim")
            target = f" → {f.new_path}" if f.new_path != f.old_path else ""
            moved = [f"fingerprint {report.old} → {report.new}"] if f.action in ("migrate", "done", "rolled back") else []
            detail = "; ".join(moved + ([f.reason] if f.reason else []))
            out.print(f"[{colour}]{verb}{f.action}[/] {f.old_path}{target}" + (f"  {detail}" if detail else ""),
                      highlight=False, soft_wrap=True)
        if not report.files:
            out.print(f"no .upc states in {upcycle_dir}")
    if any(f.action == "refuse" for f in report.files):
        raise typer.Exit(1)


@app.command("retune")
def retune_cmd(
    upcycle_dir: Annotated[Path, typer.Option(help="The folder of .upc states (label_ratios.yaml is kept there).")],
    health_db: Annotated[Path | None, typer.Option(help="The health store YOCO records gains in (default: "
                                                   "KITE_HOME/health.sqlite).")] = None,
    config: Annotated[Path | None, typer.Option(help="upcycle_config.yaml: the ratio a label starts from "
                                                "(default configs/upcycle_config.yaml).")] = None,
    min_loads: Annotated[int, typer.Option(help="Loads of a label before its ratio moves.")] = 5,
    hold_health: Annotated[float, typer.Option(help="Health at or above which loads hold quality: compress further.")] = 0.75,
    poor_health: Annotated[float, typer.Option(help="Health at or below which the gain is poor: more bytes.")] = 0.5,
    step: Annotated[float, typer.Option(help="The factor a label's ratio moves by.")] = 1.5,
    min_ratio: Annotated[float, typer.Option(help="The lowest ratio a label is given.")] = 2.0,
    max_ratio: Annotated[float, typer.Option(help="The highest ratio a label is given.")] = 32.0,
    regenerator: Annotated[Path | None, typer.Option(help="The regenerator folder states coded on one were made "
                                                     "with (default: the copy kept under KITE_HOME).")] = None,
    dry_run: Annotated[bool, typer.Option(help="Say what would change; write nothing.")] = False,
    json_out: bool = JsonOpt,
) -> None:
    """Per-label ratios from the health store; re-encode the states to them, without the documents.

    Labels whose loads hold quality are compressed further, labels with poor measured gain get more
    bytes (for new states: old ones cannot get back what they no longer hold, and are listed).

    Example: kite upcycle retune --upcycle-dir ./states --health-db ~/.kite/health.sqlite
    """
    from kite.upcycle import compress_settings, load_upcycle_config
    from kite.upcycle.codec import ratio_of
    from kite.yoco.flywheel import RetunePolicy, retune
    from kite.yoco.health import HealthStore

    policy = RetunePolicy(min_loads=min_loads, hold_health=hold_health, poor_health=poor_health, step=step,
                          min_ratio=min_ratio, max_ratio=max_ratio).check()
    if health_db is not None and not health_db.is_file():
        raise BadInput(f"--health-db {health_db}: no such file")
    cfg, cfg_path = load_upcycle_config(config)
    settings = compress_settings(cfg, kept_fraction=user_config().features.upcycle_compression_ratio,
                                 config_path=cfg_path)
    default = ratio_of(settings.codec)
    if default is None:
        raise BadInput(f"the config compresses with the {settings.codec.name} preset: per-label ratios need a "
                       "compression ratio (compression.svd_ratio)")
    regen = None
    if regenerator is not None:
        from kite.upcycle import Regenerator

        regen = Regenerator.load(regenerator)
    from kite.cli._progress import progress_bar

    kept = "each state is replaced whole (written beside it, then renamed): none is left half re-encoded"
    with kept_on_interrupt(kept), progress_bar() as progress, HealthStore(health_db) as health:
        report = retune(upcycle_dir, health, policy=policy, default_ratio=default, regenerator=regen,
                        dry_run=dry_run, progress=progress)
    if json_out:
        emit_json(report.to_dict())
        return
    out = console()
    verb = "would " if dry_run else ""
    for d in report.labels:
        moved = f"{d.ratio_before:g}× → {d.ratio_after:g}×" if d.ratio_after != d.ratio_before else f"{d.ratio_before:g}×"
        out.print(f"  {d.label:<22} {moved:<14} {d.loads:>5} loads  gain {d.mean_gain:+.4f}  [dim]{d.why}[/]",
                  highlight=False)
    for st in report.states:
        if st.action == "retuned":
            what = ", ".join(f"{lab} {r:g}×" for lab, r in sorted(st.retuned.items()))
            size = f"{st.bytes_before:,} B → {st.bytes_after:,} B" if not dry_run else f"{st.bytes_before:,} B"
            out.print(f"[green]{verb}retune[/] {st.path}: {what} ({size})", highlight=False)
        elif st.action == "skipped":
            out.print(f"[yellow]skip[/] {st.path}: {st.reason}", highlight=False)
        if st.needs_document:
            what = ", ".join(f"{lab} {r:g}×" for lab, r in sorted(st.needs_document.items()))
            out.print(f"  [yellow]needs the document[/] for {what}: recompress {st.path} "
                      f"(kite upcycle compress) to give those clusters more bytes", highlight=False)
    if report.ratios_file:
        out.print(f"wrote {report.ratios_file} (name it in compression.label_ratios for new states)", highlight=False)


def _migrate_kept(folder: Path, resume: list[str], dry_run: bool) -> str:
    """What an interrupted migration left, from the folder's journal, and how to go on or back."""
    import shlex

    from kite.upcycle import pending_migration

    pending = None if dry_run else pending_migration(folder)
    if pending is None:
        return f"no state in {folder} was changed"
    return (f"{folder} may be half-migrated ({pending['done']} states moved to the new fingerprint so far, "
            f"journal {pending['journal']}): resume with `{shlex.join(resume)}` or roll back with "
            f"`{shlex.join(['kite', 'upcycle', 'migrate', '--rollback', '--upcycle-dir', str(folder)])}`")


def _rollback_kept(folder: Path) -> str:
    import shlex

    from kite.upcycle import pending_migration

    if pending_migration(folder) is None:
        return f"the rollback of {folder} had finished"
    return (f"{folder} may be half rolled back (its journal is kept): finish with "
            f"`{shlex.join(['kite', 'upcycle', 'migrate', '--rollback', '--upcycle-dir', str(folder)])}`")


def _register_eval_tagging() -> None:
    from kite.cli.upcycle_tagging import eval_tagging

    app.command("eval-tagging", help="Tagging accuracy against the ground truth of generated contracts.")(eval_tagging)


_register_eval_tagging()


def _register_train() -> None:
    from kite.cli.upcycle_train import train

    app.command("train", help="Fit the regenerator and train the reader adapter from training pairs.")(train)


_register_train()


def _register_weigh() -> None:
    from kite.cli.upcycle_weigh import weigh

    app.command("weigh", help="Measure a model's layer weights for the state-wide bit allocation.")(weigh)


_register_weigh()
