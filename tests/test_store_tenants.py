"""Tenants over one shared store: the tenant's tag salted into content addresses (no tenant: the
addresses of before tenants, pinned), each tenant's own part of every tier, and neither tenant
listing, finding or loading the other's states, whether through the library or `kite store`. The
memory and disk tiers here; Redis and S3-compatible against real servers (marked `services`)."""

from __future__ import annotations

import shutil

import pytest
from typer.testing import CliRunner

from kite.cli.main import app
from tests.conftest import parse_json
from tests.tiny_models import CORPUS

OTHER_DOC = CORPUS.replace(". ", ".\n\n", 3)
# The address of fixed fields, computed by KITE at commit f89cf9e (before tenants existed):
# a state made for no tenant keeps exactly this id.
PINNED_ADDRESS = "1073020b4c6999407d6ec7a71ae3b6a16ddf560642cb5d0e3ecc749e5702bda5"

runner = CliRunner()


def kite(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def pipe(tiny_models):
    from kite.model import load_model
    from kite.upcycle import open_pipeline

    return open_pipeline(lm=load_model(str(tiny_models["llama"]), device="cpu"), tagger=False, ratio=4, clusters=2)


@pytest.fixture(scope="module")
def made(pipe, tmp_path_factory):
    """The same document compressed for no tenant, for acme and for beta, and another document for
    beta: name -> (address, path, bytes)."""
    folder = tmp_path_factory.mktemp("tenant-states")
    out = {}
    for name, tenant, doc in (("none", None, CORPUS), ("acme", "acme", CORPUS), ("beta", "beta", CORPUS),
                              ("beta2", "beta", OTHER_DOC)):
        path = folder / f"{name}.upc"
        result = pipe.compress(doc, path, tenant=tenant)
        out[name] = (result.address, path, path.read_bytes())
    return out


# ---------------------------------------------------------------- addresses

def _fixed_address(tenant=None):
    from dataclasses import replace

    from kite.upcycle import address_for, codec_settings
    from kite.upcycle.compress import CompressSettings

    # ratio 4's codec as it was at that commit (per-layer budgets, 0.99 of the bits, keys 3/8 of them)
    before = replace(codec_settings(4.0), budget="layer", even_groups=False, k_weight=1.0,
                     k_bits=32.0 / 4.0 * 0.99 * 0.375, v_bits=32.0 / 4.0 * 0.99 * (1 - 0.375))
    settings = CompressSettings(codec=before, n_clusters=2, label_ratios={"a": 6.0, "b": 8.0})
    return address_for("kite-fp1:aa", list(range(50)), settings, {"labels": ["x", "y"]}, None, tenant)


def test_no_tenant_keeps_the_address_of_before_tenants():
    addr = _fixed_address()
    assert addr.id == PINNED_ADDRESS
    assert "tenant" not in addr.to_header()           # the header section as before: same bytes
    assert _fixed_address("acme").id != PINNED_ADDRESS
    assert _fixed_address("acme").id == _fixed_address("acme").id
    assert _fixed_address("acme").id != _fixed_address("beta").id
    assert _fixed_address("acme").to_header()["tenant"] == _fixed_address("acme").tenant


def test_the_same_document_for_two_tenants_has_two_addresses(pipe, made):
    from kite.store import verify_state
    from kite.tenants import tenant_tag
    from kite.upcycle import StateFile

    ids = {name: made[name][0] for name in ("none", "acme", "beta")}
    assert len(set(ids.values())) == 3
    for name, tenant in (("none", None), ("acme", "acme"), ("beta", "beta")):
        address, path, data = made[name]
        assert pipe.address_of(CORPUS, tenant=tenant).id == address     # known before compressing
        info = verify_state(data)
        assert info.id == address and info.tenant == tenant_tag(tenant)
        with StateFile(path) as sf:
            assert ("tenant" in sf.meta["address"]) is (tenant is not None)
            if tenant is not None:
                assert tenant not in str(sf.meta)   # the header carries the tag, never the name
    assert made["acme"][2] != made["beta"][2]


def test_a_tenant_tag_that_was_tampered_with_is_refused(made, tmp_path):
    from kite.store import CorruptState, verify_state
    from kite.tenants import tenant_tag
    from kite.upcycle import StateFile
    from kite.upcycle.format import rewrite_header

    _, path, _ = made["acme"]
    with StateFile(path) as sf:
        meta = dict(sf.meta)
    meta["address"] = {**meta["address"], "tenant": tenant_tag("beta")}   # claims beta, keeps acme's id
    rewrite_header(path, tmp_path / "forged.upc", meta)
    with pytest.raises(CorruptState, match="not the hash of its fields"):
        verify_state((tmp_path / "forged.upc").read_bytes())


# ---------------------------------------------------------------- two tenants, one store

def _two_tenants(url):
    from kite.store import open_store

    shared = open_store(url)
    return shared, shared.for_tenant("acme"), shared.for_tenant("beta")


def _isolated(shared, acme, beta, made):
    """acme and beta each put their state of the same document (and beta another); neither lists,
    finds nor gets the other's, nor does the store without a tenant, and a probe of the other's
    address is a plain miss in every tier (no object read, nothing refused)."""
    from kite.store import WrongTenant

    a_id, _, a_data = made["acme"]
    b_id, _, b_data = made["beta"]
    b2_id, _, b2_data = made["beta2"]
    assert set(acme.put(a_data).tiers.values()) == {"stored"}
    beta.put(b_data)
    beta.put(b2_data)
    assert list(acme.ids()) == [a_id]
    assert sorted(beta.ids()) == sorted([b_id, b2_id])
    assert shared.ids() == {}
    assert acme.get(a_id) == a_data and beta.get(b_id) == b_data
    before = shared.counters.snapshot()
    for probe, other in ((beta, a_id), (acme, b_id), (acme, b2_id), (shared, a_id)):
        assert probe.where(other) == [] and probe.get(other) is None
    after = shared.counters.snapshot()
    assert after["misses"] - before["misses"] == 4
    assert after["errors"] == before["errors"]          # nothing was read and refused: never found
    # a state of another tenant (or of none) is not filed under this one
    with pytest.raises(WrongTenant, match="made for another tenant"):
        beta.put(a_data)
    with pytest.raises(WrongTenant, match="made for no tenant"):
        acme.put(made["none"][2])
    with pytest.raises(WrongTenant, match="made for another tenant"):
        shared.put(a_data)
    # a tenant's stats count its own states
    assert [t["objects"] for t in acme.stats()["tiers"]] == [1] * len(acme.tiers)
    assert [t["objects"] for t in beta.stats()["tiers"]] == [2] * len(beta.tiers)


def test_two_tenants_share_a_memory_and_disk_store(made, tmp_path):
    shared, acme, beta = _two_tenants(f"mem://,file://{tmp_path}/disk")
    assert shared.for_tenant("acme") is acme and acme.for_tenant(None) is shared
    _isolated(shared, acme, beta, made)
    # on disk: a folder per tenant, under a hash of its name; the folder's own listing is not theirs
    from kite.tenants import tenant_tag

    assert sorted(p.name for p in (tmp_path / "disk" / "tenants").iterdir()) == sorted(
        [tenant_tag("acme"), tenant_tag("beta")])
    assert list((tmp_path / "disk").glob("*.upc")) == []
    # a copy of acme's state planted in beta's folder under its own id is refused there, not served
    a_id = made["acme"][0]
    shutil.copy(made["acme"][1], tmp_path / "disk" / "tenants" / tenant_tag("beta") / f"{a_id}.upc")
    _, _, beta_again = _two_tenants(f"file://{tmp_path}/disk")
    assert beta_again.get(a_id) is None
    assert beta_again.counters.errors[("file", "verify")] == 1


def test_the_memory_tier_keeps_one_bound_for_every_tenant_and_counts_its_evictions_once(made):
    a_id, _, a_data = made["acme"]
    b_id, _, b_data = made["beta"]
    shared, acme, beta = _two_tenants(f"mem://?max={max(len(a_data), len(b_data)) + 10}")
    acme.put(a_data)
    beta.put(b_data)                                  # the process's bound: acme's state goes
    assert acme.ids() == {} and list(beta.ids()) == [b_id]
    assert shared.tiers[0].evictions == acme.tiers[0].evictions == 1
    assert shared.stats()["tiers"][0]["evictions"] == 1


def test_a_closed_tenant_store_leaves_the_shared_one_working(made, tmp_path):
    shared, acme, _ = _two_tenants(f"file://{tmp_path}/disk")
    acme.put(made["acme"][2])
    acme.close()
    assert shared.for_tenant("acme").get(made["acme"][0]) == made["acme"][2]
    shared.close()


@pytest.mark.services
def test_two_tenants_share_redis_and_s3(made, redis_service, s3_service, aws_env):
    bucket = s3_service.bucket()
    url = f"{redis_service.url},s3://{bucket}/states?endpoint_url={s3_service.endpoint}"
    shared, acme, beta = _two_tenants(url)
    _isolated(shared, acme, beta, made)
    from kite.tenants import tenant_tag

    redis = shared.tiers[0].client
    a_id = made["acme"][0]
    assert redis.exists(f"kite:tenant:{tenant_tag('acme')}:state:{a_id}")
    assert not redis.exists(f"kite:state:{a_id}") and not redis.hkeys("kite:index")
    keys = sorted(o["Key"] for o in s3_service.client().list_objects_v2(Bucket=bucket)["Contents"])
    assert f"states/tenants/{tenant_tag('acme')}/{a_id}.upc" in keys
    assert all(k.startswith("states/tenants/") for k in keys)
    # a fresh process's view (another server, another CLI run) sees the same parts
    _, acme2, beta2 = _two_tenants(url)
    assert list(acme2.ids()) == [a_id] and beta2.get(a_id) is None
    # the Redis index of a tenant is rebuilt from its own states only
    part = acme2.tiers[0]
    redis.delete(part._index)
    assert part.rebuild_index() == 1 and part.ids() == [a_id]


# ---------------------------------------------------------------- the CLI

@pytest.mark.services
def test_compress_through_redis_and_s3_for_two_tenants(tiny_models, redis_service, s3_service, aws_env,
                                                       tmp_path):
    """`kite upcycle compress --store --tenant`: each tenant compresses the same document once, under its
    own address; a tenant asking again is answered from its part; the other tenant's state is no hit."""
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS)
    store = f"{redis_service.url},s3://{s3_service.bucket()}/states?endpoint_url={s3_service.endpoint}"

    def compress(tenant, out):
        done = kite("upcycle", "compress", "--model", tiny_models["llama"], "-i", doc, "-o", tmp_path / out,
                    "--ratio", "4", "--clusters", "2", "--store", store, "--tenant", tenant, "--json")
        assert done.exit_code == 0, done.output
        return parse_json(done.output)

    acme, beta, again = compress("acme", "a.upc"), compress("beta", "b.upc"), compress("acme", "a2.upc")
    from kite.tenants import tenant_tag

    from kite.store import verify_state

    expect = {"acme": acme["store"]["address"], "beta": beta["store"]["address"]}
    assert expect["acme"] != expect["beta"]
    for tenant, out in (("acme", "a.upc"), ("beta", "b.upc")):
        info = verify_state((tmp_path / out).read_bytes())
        assert info.id == expect[tenant] and info.tenant == tenant_tag(tenant)
    assert acme["store"]["recompressed"] is True and beta["store"]["recompressed"] is True   # no hit on acme's
    assert acme["store"]["put"]["tiers"] == {"redis": "stored", "s3": "stored"}
    assert again["store"] == {"address": expect["acme"], "recompressed": False, "found_in": "redis", "put": None}
    assert (tmp_path / "a2.upc").read_bytes() == (tmp_path / "a.upc").read_bytes()
    for tenant in ("acme", "beta"):
        listed = parse_json(kite("store", "ls", "--store", store, "--tenant", tenant, "--json").output)
        assert listed["states"] == [{"id": expect[tenant], "tiers": ["redis", "s3"]}]
        assert redis_service_has(redis_service, tenant_tag(tenant), expect[tenant])
    assert parse_json(kite("store", "ls", "--store", store, "--json").output)["states"] == []


def redis_service_has(service, tag, state_id) -> bool:
    import redis

    client = redis.Redis.from_url(service.url)
    try:
        return bool(client.exists(f"kite:tenant:{tag}:state:{state_id}"))
    finally:
        client.close()


def test_kite_store_with_two_tenants(made, tmp_path):
    store = f"file://{tmp_path}/disk"
    a_id, a_path, _ = made["acme"]
    b_id, b_path, _ = made["beta"]
    assert kite("store", "put", a_path, "--store", store, "--tenant", "acme").exit_code == 2   # no folder yet
    assert kite("store", "put", a_path, "--store", store, "--tenant", "acme", "--mkdir").exit_code == 0
    assert kite("store", "put", b_path, "--store", store, "--tenant", "beta").exit_code == 0
    listed = parse_json(kite("store", "ls", "--store", store, "--tenant", "acme", "--json").output)
    assert listed["states"] == [{"id": a_id, "tiers": ["file"]}]
    assert parse_json(kite("store", "ls", "--store", store, "--json").output)["states"] == []
    got = kite("store", "get", a_id, "-o", tmp_path / "a.upc", "--store", store, "--tenant", "acme")
    assert got.exit_code == 0 and (tmp_path / "a.upc").read_bytes() == a_path.read_bytes()
    # beta asking for acme's state, by its address or a prefix of it, fails as for a state nobody made
    never = "f" * 64
    for ref in (a_id, never):
        miss = kite("store", "get", ref, "-o", tmp_path / "b.upc", "--store", store, "--tenant", "beta")
        assert miss.exit_code == 1
        assert miss.output.replace(ref, "ID") == kite("store", "get", never, "-o", tmp_path / "b.upc", "--store",
                                                      store, "--tenant", "beta").output.replace(never, "ID")
    prefix = kite("store", "get", a_id[:12], "-o", tmp_path / "b.upc", "--store", store, "--tenant", "beta")
    assert prefix.exit_code == 1 and "no state with that address" in prefix.output
    assert not (tmp_path / "b.upc").exists()
    # a state of another tenant is not put under this one: one line, exit 2, nothing stored
    wrong = kite("store", "put", a_path, "--store", store, "--tenant", "beta")
    assert wrong.exit_code == 2 and "made for another tenant" in wrong.output
    assert len(wrong.output.strip().splitlines()) == 1
    stats = parse_json(kite("store", "stats", "--store", store, "--tenant", "beta", "--json").output)
    assert stats["tiers"][0]["objects"] == 1


def test_reading_a_tenant_that_has_no_folder_yet_creates_none(made, tmp_path):
    from kite.tenants import tenant_tag

    store = f"file://{tmp_path}/disk"
    assert kite("store", "put", made["acme"][1], "--store", store, "--tenant", "acme", "--mkdir").exit_code == 0
    for args in (("ls",), ("stats",), ("gc",), ("sync",)):
        done = kite("store", *args, "--store", store, "--tenant", "gamma", "--json")
        assert done.exit_code == 0, done.output
    assert parse_json(kite("store", "ls", "--store", store, "--tenant", "gamma", "--json").output)["states"] == []
    assert not (tmp_path / "disk" / "tenants" / tenant_tag("gamma")).exists()
    missing = kite("store", "ls", "--store", f"file://{tmp_path}/nowhere", "--tenant", "gamma")
    assert missing.exit_code == 2 and "does not exist" in missing.output
    assert not (tmp_path / "nowhere").exists()
    # a read that writes (sync) makes the tenant's folder in an existing store folder, when it copies
    (tmp_path / "other").mkdir()
    both = f"{store},file://{tmp_path}/other"
    synced = kite("store", "sync", "--store", both, "--tenant", "acme", "--json")
    assert synced.exit_code == 0 and len(parse_json(synced.output)["copied"]) == 1
    assert (tmp_path / "other" / "tenants" / tenant_tag("acme") / f"{made['acme'][0]}.upc").is_file()


def test_kite_store_sync_tenant_copies_within_the_tenant_part(made, tmp_path, monkeypatch):
    """A write acme's part of the second folder missed is journaled under that part: a sync of no tenant
    or of beta neither copies nor clears it; `kite store sync --tenant acme` copies it into acme's part."""
    import kite.store.disk as disk
    from kite.store import open_store
    from kite.tenants import tenant_tag

    a_id, a_path, a_data = made["acme"]
    b_id, b_path, _ = made["beta"]
    first, second = tmp_path / "first", tmp_path / "second"
    store = f"file://{first},file://{second}"
    real = disk.write_bytes

    def second_down(path, data):
        if str(path).startswith(str(second)):
            raise OSError(5, "Input/output error")
        return real(path, data)

    monkeypatch.setattr(disk, "write_bytes", second_down)
    put = kite("store", "put", a_path, "--store", store, "--tenant", "acme", "--mkdir")
    assert put.exit_code == 1 and "file2 failed" in put.output
    monkeypatch.setattr(disk, "write_bytes", real)             # the second folder is back
    assert kite("store", "put", b_path, "--store", store, "--tenant", "beta").exit_code == 0
    stats = parse_json(kite("store", "stats", "--store", store, "--tenant", "acme", "--json").output)
    assert [t["missed"] for t in stats["tiers"]] == [0, 1]
    [missed] = open_store(store).journal.pending()
    assert missed.id == a_id and missed.tier.endswith(f" tenant={tenant_tag('acme')}")
    for other in ((), ("--tenant", "beta")):                  # another part's sync leaves acme's alone
        done = parse_json(kite("store", "sync", "--store", store, *other, "--json").output)
        assert done["copied"] == []
    assert len(open_store(store).journal.pending()) == 1
    synced = kite("store", "sync", "--store", store, "--tenant", "acme", "--json")
    assert synced.exit_code == 0, synced.output
    assert parse_json(synced.output)["copied"] == [{"id": a_id, "from": "file", "to": "file2"}]
    assert (second / "tenants" / tenant_tag("acme") / f"{a_id}.upc").read_bytes() == a_data
    assert not (second / f"{a_id}.upc").exists()              # not into the untenanted part
    assert open_store(store).journal.pending() == []
    again = parse_json(kite("store", "sync", "--store", store, "--tenant", "acme", "--json").output)
    assert again["copied"] == [] and again["tiers"]["file2"]["missing"] == 0
    listed = parse_json(kite("store", "ls", "--store", store, "--tenant", "acme", "--json").output)["states"]
    assert listed == [{"id": a_id, "tiers": ["file", "file2"]}]


def test_the_config_and_its_environment_name_the_tenant(made, tmp_path, monkeypatch):
    store = f"file://{tmp_path}/disk"
    monkeypatch.setenv("KITE_STORE__TENANT", "acme")
    assert kite("store", "put", made["acme"][1], "--store", store, "--mkdir").exit_code == 0
    assert made["acme"][0] in kite("store", "ls", "--store", store).output
    # the flag takes the config's place
    assert made["acme"][0] not in kite("store", "ls", "--store", store, "--tenant", "beta").output


@pytest.mark.parametrize("args", [
    ("store", "ls", "--store", "mem://", "--tenant", ""),
    ("store", "ls", "--store", "mem://", "--tenant", "acme/../beta"),
    ("store", "ls", "--store", "mem://", "--tenant", "-dash-first"),
    ("store", "get", "f" * 64, "-o", "x.upc", "--store", "mem://", "--tenant", "a b"),
    ("store", "put", "x.upc", "--store", "mem://", "--tenant", "x" * 65),
    ("upcycle", "compress", "-i", "doc.txt", "-o", "x.upc", "--tenant", "é"),
    ("generate", "--prompt", "x", "--tenant", ""),
])
def test_an_empty_or_malformed_tenant_is_one_line_exit_2(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.txt").write_text("text")
    result = kite(*args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--tenant" in lines[0] and "Traceback" not in result.output


def test_a_malformed_tenant_in_the_config_is_one_line_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("KITE_STORE__TENANT", "no spaces")
    result = kite("store", "ls", "--store", "mem://")
    assert result.exit_code == 2, result.output
    assert "KITE_STORE__TENANT" in result.output and len(result.output.strip().splitlines()) == 1
