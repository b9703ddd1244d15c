"""The store as one string: tier URLs, fastest first, separated by commas.

    mem://?max=2GB,file:///var/kite/states?max=50GB,redis://127.0.0.1:6379/0,s3://bucket/prefix?endpoint_url=http://127.0.0.1:9000

Every tier takes ``max=SIZE`` (its bound; sizes 2GB, 512MB, 1GiB or bytes) and
``write=through|back`` (default: the config's ``store.write``, else through); Redis also
``max_value``, ``prefix``, ``timeout``; S3 ``endpoint_url``, ``region``, ``timeout``. Anything
else, an unknown scheme or a repeated memory tier is one line of BadInput.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit

from kite.errors import BadInput
from kite.store import disk, memory, redis_tier, s3  # noqa: F401  (each registers its tier)
from kite.store.tier import WRITE_POLICIES, MissingStore, Tier, TierURL, parse_size, tier_class, tier_schemes
from kite.store.journal import journal_for
from kite.store.tiered import TieredStore
from kite.tenants import check_tenant

COMMON = ("max", "write")


def split_url(text: str) -> list[TierURL]:
    """The tier URLs of a store URL, taken apart (BadInput for one that is malformed)."""
    if not isinstance(text, str) or not text.strip():
        raise BadInput("--store: empty; expected tier URLs such as mem://?max=2GB,file:///path")
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise BadInput(f"--store {text!r}: an empty tier between commas")
        if "://" not in part:
            raise BadInput(f"--store: {part!r} is not a URL (expected one of "
                           f"{', '.join(s + '://' for s in tier_schemes())})")
        try:
            u = urlsplit(part)
            params = parse_qsl(u.query, keep_blank_values=True, strict_parsing=bool(u.query))
        except ValueError as exc:
            raise BadInput(f"--store: {part!r}: {exc}") from None
        seen: dict[str, str] = {}
        for k, v in params:
            if k in seen:
                raise BadInput(f"--store: {part!r}: parameter {k} given twice")
            seen[k] = v
        out.append(TierURL(part, u.scheme, u.netloc, u.path, seen))
    return out


def open_tier(url: TierURL, name: str, default_write: str = "through", create: bool = True) -> Tier:
    """The tier of one URL. ``create`` False: MissingStore (one line) when its place does not exist
    (a file:// folder), instead of making it."""
    cls = tier_class(url.scheme)
    unknown = set(url.params) - set(COMMON) - set(cls.params)
    if unknown:
        raise BadInput(f"--store: {url.text!r}: unknown parameter {sorted(unknown)[0]} (a {url.scheme}:// tier "
                       f"takes {', '.join(COMMON + cls.params)})")
    write = url.params.get("write", default_write)
    if write not in WRITE_POLICIES:
        raise BadInput(f"--store: {url.text!r}: write={write!r}, expected through or back")
    max_bytes = parse_size(url.params["max"], f"--store {url.text!r}: max") if "max" in url.params else None
    if not create:
        why = cls.absent(url)
        if why is not None:
            raise MissingStore(f"store tier {name}: {why}")
    tier = cls.from_url(name, url, write, max_bytes)
    tier.create = create   # what its tenant parts do with a place they miss (kite.store.Tier.create)
    return tier


def open_store(text: str, default_write: str = "through", create: bool = True,
               tenant: str | None = None) -> TieredStore:
    """The TieredStore a store URL describes. Tier names are the schemes (``mem``, ``file``,
    ``redis``, ``s3``), numbered from the second of a kind (``file2``). ``create`` False (what reads
    ask for): MissingStore when a tier's place (a file:// folder) does not exist, nothing created (a
    tenant's folder in it is made only when a state is written there). ``tenant``: the store of that
    tenant (:meth:`TieredStore.for_tenant`; checked before any tier opens); None: no tenant."""
    check_tenant(tenant)
    urls = split_url(text)
    if sum(u.scheme == "mem" for u in urls) > 1:
        raise BadInput(f"--store {text!r}: one mem:// tier at most")
    tiers, counts = [], {}
    for u in urls:
        kind = tier_class(u.scheme).scheme   # rediss -> redis
        counts[kind] = counts.get(kind, 0) + 1
        tiers.append(open_tier(u, kind if counts[kind] == 1 else f"{kind}{counts[kind]}", default_write, create))
    return TieredStore(tiers, journal=journal_for(tiers)).for_tenant(tenant)
