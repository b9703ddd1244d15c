"""`kite store`: the tiered, content-addressed state store (docs/store.md): ls, get, put, sync, gc, stats."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kite.cli._common import JsonOpt, MkdirOpt, console, emit_json, new_app, user_config
from kite.errors import BadInput, KiteError

app = new_app("The tiered state store: list, fetch, add, evict and count content-addressed states.")

StoreOpt = typer.Option("--store", help="Tier URLs, fastest first, comma-separated: "
                        "mem://?max=2GB,file:///path?max=50GB,redis://127.0.0.1:6379/0,s3://bucket/prefix"
                        "?endpoint_url=http://127.0.0.1:9000 (default: the config's store.url).")


TenantOpt = typer.Option("--tenant", help="The tenant whose states these are: salted into content addresses, "
                         "its own part of every tier; another tenant's states are neither listed nor found "
                         "(default: the config's store.tenant; none: no tenant, addresses as before tenants).")


def store_tenant(flag: str | None) -> str | None:
    """The tenant a command works for: --tenant, else the config's store.tenant (None: no tenant).
    BadInput (one line, exit 2) for an empty or malformed name."""
    from kite.tenants import check_tenant

    if flag is not None:
        return check_tenant(flag, "--tenant")
    return check_tenant(user_config().store.tenant, "store.tenant")


def store_url(flag: str | None, required: bool = True) -> str | None:
    """The store a command uses: --store, else the config's store.url; BadInput when neither is set
    and the command needs one."""
    url = flag if flag is not None else user_config().store.url
    if url is None and required:
        raise BadInput("no store: pass --store URL or set store.url (kite config set store.url URL)")
    return url


def open_cli_store(flag: str | None, required: bool = True, tenant: str | None = None, create: bool = True):
    """The TieredStore of --store / store.url (None when neither is set and not `required`), of the
    tenant `tenant` (a name already checked by :func:`store_tenant`; None: no tenant).
    ``create`` False (the read commands): a file:// folder that does not exist is one line, exit 2
    (kite.store.MissingStore), never created (nor a tenant's folder in it)."""
    url = store_url(flag, required)
    if url is None:
        return None
    from kite.store import open_store

    return open_store(url, default_write=user_config().store.write, tenant=tenant, create=create)


def resolve_id(store, ref: str) -> str:
    """A full address, or a unique prefix of one (8 hex digits or more) among the stored ids."""
    from kite.store import is_address

    ref = ref.strip().lower()
    if is_address(ref):
        return ref
    if len(ref) < 8 or any(c not in "0123456789abcdef" for c in ref):
        raise BadInput(f"{ref[:80]!r}: expected a state address (64 hex digits) or its first 8 or more")
    matches = [i for i in store.ids() if i.startswith(ref)]
    if len(matches) > 1:
        raise BadInput(f"{ref}: names {len(matches)} states ({', '.join(m[:16] for m in matches[:3])} ...); give more digits")
    if not matches:
        raise KiteError(f"{ref}: no state with that address in the store")
    return matches[0]


@app.command("ls")
def ls(store: Annotated[str | None, StoreOpt] = None, tenant: Annotated[str | None, TenantOpt] = None,
       json_out: bool = JsonOpt) -> None:
    """Every state any tier holds (of the tenant, with --tenant), with the tiers holding it.

    Example: kite store ls --store mem://,file:///var/kite/store
    """
    st = open_cli_store(store, tenant=store_tenant(tenant), create=False)
    rows = []
    for sid, tiers in st.ids().items():
        rows.append({"id": sid, "tiers": tiers})
    if json_out:
        emit_json({"states": rows, "errors": st.counters.snapshot()["errors"]})
        return
    out = console()
    for r in rows:
        out.print(f"{r['id']}  {','.join(r['tiers'])}", highlight=False)
    out.print(f"[dim]{len(rows)} state(s)[/]")
    for e in st.counters.snapshot()["errors"]:
        out.print(f"[yellow]warning:[/] tier {e['tier']} could not {e['op']} ({e['count']}×)", highlight=False)


@app.command("get")
def get(
    state_id: Annotated[str, typer.Argument(help="The state's address (or its first 8+ hex digits).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the .upc state.")],
    store: Annotated[str | None, StoreOpt] = None,
    tenant: Annotated[str | None, TenantOpt] = None,
    mkdir: bool = MkdirOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Fetch a state (verified: checksums and address) into a file; exit 1 when no tier has a good copy
    (another tenant's state is no copy: the same exit and message as a state nobody holds).

    Example: kite store get 36f597c14edb48d5 -o contract.upc
    """
    from kite.atomic import check_output

    check_output(output, mkdir, "--output")
    st = open_cli_store(store, tenant=store_tenant(tenant), create=False)
    sid = resolve_id(st, state_id)
    info = st.get_file(sid, output)
    st.close()
    if info is None:
        raise KiteError(f"state {sid}: no tier holds a good copy (see kite store stats for errors)")
    if json_out:
        emit_json({**info.to_dict(), "output": str(output)})
        return
    console().print(f"[bold green]wrote[/] {output}: state {sid} ({info.bytes:,} B, {info.n_tokens:,} tokens)",
                    highlight=False)


@app.command("put")
def put(
    files: Annotated[list[Path], typer.Argument(help="The .upc states to store.", show_default=False)],
    store: Annotated[str | None, StoreOpt] = None,
    tenant: Annotated[str | None, TenantOpt] = None,
    mkdir: bool = typer.Option(False, "--mkdir", help="Create a file:// tier's folder when it does not "
                               "exist (without it a missing folder is an error)."),
    json_out: bool = JsonOpt,
) -> None:
    """Verify each state (its checksums and content address) and store it in every tier under its
    address. Exit 1 when a tier failed to take one (each failure is named); exit 2 for a state made
    for another tenant than --tenant (or for none).

    Example: kite store put contract.upc --store file:///var/kite/store,redis://127.0.0.1:6379/0
    """
    from kite.store import MissingStore, read_state_file

    who = store_tenant(tenant)
    loaded = [read_state_file(f) for f in files]   # every file checked before anything is stored
    try:
        st = open_cli_store(store, tenant=who, create=mkdir)
    except MissingStore as exc:
        raise MissingStore(f"{exc} (pass --mkdir to create it)") from None
    for (_, info), f in zip(loaded, files):
        st.check_tenant_of(info, str(f))
    reports = [st.put(data) for data, _ in loaded]
    late = st.flush()   # write-back tiers finish before the command answers
    st.close()
    failed = [r for r in reports if r.failed] + late
    if json_out:
        emit_json({"stored": [{**r.to_dict(), "file": str(f)} for r, f in zip(reports, files)],
                   "write_back_failures": late})
    else:
        out = console()
        for r, f in zip(reports, files):
            tiers = "  ".join(f"{t} {s}" for t, s in r.tiers.items())
            out.print(f"{r.id}  {f}  {r.bytes:,} B  {tiers}", highlight=False)
        for f in late:
            out.print(f"[red]write-back to {f['tier']} failed[/] for {f['id'][:16]}: {f['why']}", highlight=False)
    if failed:
        raise KiteError(f"{len(failed)} put(s) failed in a tier (named above)")


@app.command("sync")
def sync(
    store: Annotated[str | None, StoreOpt] = None,
    tenant: Annotated[str | None, TenantOpt] = None,
    to: Annotated[str | None, typer.Option("--to", help="Only these tiers, by name (comma-separated: "
                                           "file,redis,s3; default every tier but mem).")] = None,
    json_out: bool = JsonOpt,
) -> None:
    """Copy into each tier the states it misses from the tiers that hold them (verified), e.g. after
    Redis or S3 was down during puts; retries the journal of missed writes. With --tenant: within the
    tenant's part of each tier only. Idempotent: a second run copies nothing. Exit 1 when a copy failed
    (each is named).

    Example: kite store sync --store file:///var/kite/store,redis://127.0.0.1:6379/0
    """
    from kite.cli._progress import progress_bar
    from kite.store import sync_store

    st = open_cli_store(store, tenant=store_tenant(tenant), create=False)
    targets = [t.strip() for t in to.split(",") if t.strip()] if to is not None else None
    with progress_bar() as progress:
        report = sync_store(st, targets, progress)
    st.close()
    if json_out:
        emit_json(report.to_dict())
    else:
        out = console()
        for name, row in report.tiers.items():
            out.print(f"{name:<6} {row['url']}  held {row['held_before']}, missed {row['missing']}: copied "
                      f"{row['copied']}, failed {row['failed']}, declined {row['declined']}, no good copy "
                      f"{row['no_copy']}", highlight=False)
        for name, why in report.unreachable.items():
            out.print(f"[yellow]warning:[/] tier {name} could not be listed, not synced: {why}", highlight=False)
        for f in report.failed[:10]:
            out.print(f"[red]{f['to']} failed[/] for {f['id'][:16]}: {f['why']}", highlight=False)
    if report.failed or report.unreachable:
        what = [f"{len(report.failed)} copy(ies) failed"] if report.failed else []
        if report.unreachable:
            what.append(f"tier(s) unreachable: {', '.join(report.unreachable)}")
        raise KiteError(f"{'; '.join(what)}; run kite store sync again once it is back")


@app.command("gc")
def gc(store: Annotated[str | None, StoreOpt] = None, tenant: Annotated[str | None, TenantOpt] = None,
       json_out: bool = JsonOpt) -> None:
    """Evict least recently used states from every bounded tier (max=SIZE) until it is within its bound
    (with --tenant: the tenant's part of each tier, which keeps the tier's bound on its own)."""
    st = open_cli_store(store, tenant=store_tenant(tenant), create=False)
    dropped = st.gc()
    if json_out:
        emit_json({"evicted": dropped})
        return
    out = console()
    for tier, ids in dropped.items():
        out.print(f"{tier}: evicted {len(ids)}" + (f" ({', '.join(i[:12] for i in ids[:5])})" if ids else ""),
                  highlight=False)


@app.command("stats")
def stats(store: Annotated[str | None, StoreOpt] = None, tenant: Annotated[str | None, TenantOpt] = None,
          json_out: bool = JsonOpt) -> None:
    """Per tier: objects and bytes held (of the tenant, with --tenant), its bound and write policy, and
    this process's counts.

    A server counts hits, misses and errors over its life: see its /metrics (kite_store_*).
    """
    st = open_cli_store(store, tenant=store_tenant(tenant), create=False)
    report = st.stats()
    if json_out:
        emit_json(report)
        return
    out = console()
    for t in report["tiers"]:
        held = (f"{t['objects']} states, {t['bytes']:,} B" if t["objects"] is not None
                else f"[red]unreachable[/]: {t['error']}")
        bound = f" of {t['max_bytes']:,} B" if t["max_bytes"] else ""
        missed = f"  [yellow]{t['missed']} missed write(s)[/]: kite store sync" if t["missed"] else ""
        out.print(f"{t['name']:<6} {t['url']}  write-{t['write']}  {held}{bound}{missed}", highlight=False)
