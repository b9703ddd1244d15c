"""The layered config: defaults < `$KITE_HOME/config.yaml` < `KITE_*` env < command-line overrides.

Every key is a field of one section model below; adding a key is one line there (plus its
comment in `configs/config.yaml`, which a test keeps in step). Validation is strict: unknown keys,
wrong types and out-of-range values are refused with one line that names where the value came
from (file and line, environment variable, or override), the key, and what is allowed.

Environment: `KITE_` + the dotted key upper-cased with `.` → `__`
(`KITE_FEATURES__UPCYCLE_YOCO_FUSION=1`); `KITE_ADMIN_TOKEN` is also accepted for
`server.admin_token`. Any other `KITE_<A>__<B>` variable is refused as an unknown key. Values are
read as YAML scalars, except that string and path keys take the text as it is (a token `0123`
stays `0123`) and boolean keys take 1/0, true/false, yes/no, on/off.

Importing this module does not import torch.

Why not pydantic-settings and ruamel.yaml (both were tried on 2026-11-30 against
tests/test_config.py): pydantic-settings merges the layers and reads `KITE_A__B` names, but an
unknown section's variable (`KITE_SERVR__PORT`) passes silently, its errors name the key rather
than the variable, and it records no origin per key, so the variable scan, the origins and the
per-layer messages below would all stay. ruamel.yaml's round trip (in place of `_edited`) re-indents
sections and moves trailing comments the user did not touch, writes untouched `null`s as empty
values unless told otherwise, reads YAML 1.2 (`yes`, `on` would stop being booleans), and wrote
`server: {port: 9000, host: ::1}`, which PyYAML, and so `kite`, refuses to read back.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from kite.atomic import write_text
from kite.errors import BadInput, KiteError
from kite.paths import config_path, kite_home
from kite.tenants import TENANT_RE
from kite.yaml_model import YamlLoader, parse_yaml_tree, read_utf8

# --------------------------------------------------------------------------- the schema

# features.yoco_min_hit_gain: a load predicted to gain less is skipped. Defined here, at the bottom of
# the layers, so YOCO, the server, the bench and the CLI all import this one value.
DEFAULT_MIN_HIT_GAIN = 0.005

_STRICT = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)
_SECRET = {"secret": True}  # marks a key that `kite config show` does not print


class FeaturesConfig(BaseModel):
    """Switches and knobs of the Upcycle → YOCO loop."""

    model_config = _STRICT
    upcycle_yoco_fusion: bool = False
    # The seed's knob: the fraction of the raw fp16 KV a state keeps (0.25 = `--ratio 4`), the
    # default of every `--ratio`; None leaves the upcycle config's compression settings.
    upcycle_compression_ratio: float | None = Field(None, gt=0, le=1)
    yoco_min_hit_gain: float = Field(DEFAULT_MIN_HIT_GAIN, ge=0)


class GpuMemWatermarkConfig(BaseModel):
    """How the hardware watermark samples GPU memory."""

    model_config = _STRICT
    sampling_interval_ms: int = Field(200, gt=0)
    spike_threshold_gb: float = Field(3.0, gt=0)


class HardwareWatermarkConfig(BaseModel):
    model_config = _STRICT
    gpu_mem: GpuMemWatermarkConfig = Field(default_factory=GpuMemWatermarkConfig)


class ServerConfig(BaseModel):
    """`kite serve`: address, admin token, request size, where uploaded states go."""

    model_config = _STRICT
    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(8088, ge=1, le=65535)
    admin_token: str | None = Field(None, min_length=1, json_schema_extra=_SECRET)
    # API keys of the /v1/ routes and the tenant of each (docs/serving.md, "Tenants"): a YAML file
    # `key: tenant` (null: no tenant); None: no keys, the routes are open and of no tenant
    api_keys_file: Path | None = Field(None, strict=False)
    max_body_mb: int = Field(32, ge=1)
    state_dir: Path | None = Field(None, strict=False)  # None: $KITE_HOME/states
    max_batch: int = Field(8, ge=1, le=1024)            # sequences decoding together (continuous batching)
    batch_kv_gb: float | None = Field(None, gt=0)       # the batch's KV buffers; None: unbounded
    batch_reserve_tokens: int | None = Field(None, ge=1)  # slots a row allocated at start; None: grow on demand
    prefix_cache_gb: float = Field(2.0, ge=0)           # loaded states kept for the next request (0: none)
    # the form loaded states are held in for the batch: a registered resident form (kite.upcycle.RESIDENT_FORMS:
    # raw, rebuilt KV; lanes); kite serve checks the name against the registry, which lives above this module
    resident: str = "raw"
    lane_bits: str = "4"    # resident lanes: bits an element, "B" or "K:V" (keys, values)
    # `kite serve --replicas` (docs/scale-out.md): replicas on Ray Serve; min/max both set = autoscaled
    replicas: int = Field(1, ge=1, le=256)
    min_replicas: int | None = Field(None, ge=1, le=256)
    max_replicas: int | None = Field(None, ge=1, le=256)
    route_max_imbalance: int = Field(4, ge=0)           # queued requests a state's holder may exceed the least loaded by
    ray_address: str | None = Field(None, min_length=1)  # None: a local Ray head

    @field_validator("state_dir", "api_keys_file")
    @classmethod
    def _expand(cls, v: Path | None) -> Path | None:
        return v.expanduser() if v is not None else None

    @field_validator("lane_bits", mode="before")
    @classmethod
    def _check_lane_bits(cls, v) -> str:
        try:
            parse_lane_bits(v)
        except BadInput as exc:   # its text, as the config's error
            raise ValueError(str(exc).removeprefix("server.lane_bits ")) from None
        return str(v)


LANE_BITS = (1, 2, 4, 8)     # bits an element a side of resident lanes may take (kite.kernels.lanes)


def parse_lane_bits(spec) -> tuple[int, int]:
    """``server.lane_bits``: "B" (keys and values) or "K:V" (keys K bits, values V), each in LANE_BITS."""
    text = str(spec).strip()
    parts = text.split(":") if ":" in text else [text, text]
    try:
        bits = tuple(int(p) for p in parts)
    except ValueError:
        bits = ()
    if len(bits) != 2 or any(b not in LANE_BITS for b in bits):
        raise BadInput(f"server.lane_bits {spec!r}: expected B or K:V with bits in {', '.join(map(str, LANE_BITS))}")
    return bits


_TIER_URL = re.compile(r"^[a-z][a-z0-9+.-]*://\S*$")


class StoreConfig(BaseModel):
    """The tiered state store (docs/store.md): `--store` takes the place of `url` for one command."""

    model_config = _STRICT
    # tier URLs, fastest first, comma-separated (mem://?max=2GB,file:///path,redis://...,s3://...); None: no store
    url: str | None = Field(None, min_length=1)
    write: str = "through"   # a tier URL's default write= (through or back)
    # the tenant whose states the CLI's store commands file, find and list (kite.tenants); None: no tenant
    tenant: str | None = Field(None, min_length=1)

    @field_validator("tenant")
    @classmethod
    def _check_tenant(cls, v: str | None) -> str | None:
        if v is not None and not TENANT_RE.fullmatch(v):
            raise ValueError("a tenant is 1-64 of A-Z a-z 0-9 . _ - starting with a letter or a digit")
        return v

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str | None) -> str | None:
        # the form only (kite.store checks schemes and parameters when it opens the store)
        if v is not None:
            bad = next((p for p in v.split(",") if not _TIER_URL.match(p.strip())), None)
            if bad is not None:
                raise ValueError(f"{bad.strip()!r} is not a tier URL (mem://, file://, redis://, s3://)")
        return v

    @field_validator("write")
    @classmethod
    def _check_write(cls, v: str) -> str:
        if v not in ("through", "back"):
            raise ValueError("expected through or back")
        return v


class SecurityConfig(BaseModel):
    """Keyed digests of `.upc` states (docs/upc-format.md, "Keyed digest"): with `state_key` set,
    every state KITE writes carries an HMAC-SHA256 of its header under that key, and a reader
    refuses a state whose keyed digest does not match; `require_signed` also refuses a state
    without one."""

    model_config = _STRICT
    state_key: str | None = Field(None, min_length=16, json_schema_extra=_SECRET)
    require_signed: bool = False


class VllmConfig(BaseModel):
    """KITE's KV connector inside vLLM (docs/vllm-connector.md): the defaults of its settings; a key
    in vLLM's ``kv_connector_extra_config`` takes the place of its twin here."""

    model_config = _STRICT
    states: str | None = Field(None, min_length=1)      # None: server.state_dir
    save: bool = False
    save_ratio: float = Field(4.0, gt=1.0)
    save_min_tokens: int = Field(256, ge=1)
    save_clusters: int = Field(8, ge=1)
    save_queue: int = Field(4, ge=1)


class YocoConfig(BaseModel):
    model_config = _STRICT
    rules_file: str = Field("rules/yoco_rules.yaml", min_length=1)


class ModelConfig(BaseModel):
    model_config = _STRICT
    default: str = Field("smollm2-135m", min_length=1)


class KiteConfig(BaseModel):
    """The effective config. Attribute access: `cfg.features.upcycle_yoco_fusion`."""

    model_config = _STRICT
    features: FeaturesConfig = Field(default_factory=FeaturesConfig)
    hardware_watermark: HardwareWatermarkConfig = Field(default_factory=HardwareWatermarkConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    yoco: YocoConfig = Field(default_factory=YocoConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    vllm: VllmConfig = Field(default_factory=VllmConfig)

    # dotted key → (layer, origin) for every key a layer above the defaults set
    _sources: dict[str, tuple[str, str]] = PrivateAttr(default_factory=dict)


# --------------------------------------------------------------------------- key table

def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _leaves(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        if _is_section(info.annotation):
            out.update(_leaves(info.annotation, key + "."))
        else:
            out[key] = info
    return out


_FIELDS = _leaves(KiteConfig)
CONFIG_KEYS: tuple[str, ...] = tuple(_FIELDS)
"""Every leaf key, dotted, in schema order."""

DEFAULTS: Mapping[str, Any] = MappingProxyType({k: f.get_default(call_default_factory=True)
                                                 for k, f in _FIELDS.items()})
"""Dotted key → default value (`server.state_dir` None means `$KITE_HOME/states`)."""

_ENV_ALIASES = {"KITE_ADMIN_TOKEN": "server.admin_token"}


def env_var_name(dotted_key: str) -> str:
    """`features.upcycle_yoco_fusion` → `KITE_FEATURES__UPCYCLE_YOCO_FUSION`."""
    return "KITE_" + dotted_key.upper().replace(".", "__")


_ENV_NAMES = {env_var_name(k): k for k in CONFIG_KEYS}


def env_vars_for(dotted_key: str) -> list[str]:
    """The environment variables that set a key, strongest first."""
    key = _check_key(dotted_key)
    return [env_var_name(key)] + [name for name, k in _ENV_ALIASES.items() if k == key]


def _base_type(key: str) -> tuple[type, bool]:
    """The value type of a leaf and whether it may be null."""
    ann = _FIELDS[key].annotation
    args = get_args(ann)
    if get_origin(ann) is Union or (args and type(None) in args):
        inner = [a for a in args if a is not type(None)]
        return inner[0], True
    return ann, False


def allowed(dotted_key: str) -> str:
    """What a key accepts, in words: 'a number > 0 and <= 1', 'true or false', ..."""
    typ, nullable = _base_type(dotted_key)
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
             Path: "a path"}.get(typ, typ.__name__)
    bounds = []
    for m in _FIELDS[dotted_key].metadata:
        for attr, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(m, attr, None) is not None:
                bounds.append(f"{op} {getattr(m, attr)}")
        if getattr(m, "min_length", None) and typ is str:
            words = "a non-empty string" if m.min_length == 1 else f"a string of {m.min_length} characters or more"
    text = words + (" " + " and ".join(bounds) if bounds else "")
    return text + (", or null" if nullable else "")


def _check_key(dotted_key: str) -> str:
    """Return the key if it is a leaf; else raise BadInput with a "did you mean"."""
    if dotted_key in _FIELDS:
        return dotted_key
    raise BadInput(f"unknown config key {dotted_key!r}{_suggest_key(dotted_key)}"
                   f" (see `kite config show`)")


def _suggest_key(dotted_key: str) -> str:
    """'; did you mean 'x.y'?' for a mistyped key: its own section first, then anywhere."""
    parent, _, leaf = dotted_key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in CONFIG_KEYS if k.rpartition(".")[0] == parent}
    match = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.6)
    if match:
        return f"; did you mean {siblings[match[0]]!r}?"
    sections = {k.rpartition(".")[0] for k in CONFIG_KEYS}
    return _did_you_mean(dotted_key, [*CONFIG_KEYS, *sections])


def _did_you_mean(word: str, choices: Any) -> str:
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


# --------------------------------------------------------------------------- values

def render_value(value: Any) -> str:
    """A value as one line of YAML (what `get` prints and `set` writes)."""
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, allow_unicode=True)
    return text.removesuffix("\n...\n").removesuffix("\n")


_TRUE = {"1", "true", "yes", "on", "y"}
_FALSE = {"0", "false", "no", "off", "n"}


def parse_raw(dotted_key: str, raw: str) -> Any:
    """Text from an env var or the command line → a value for `dotted_key`, still unvalidated."""
    typ, nullable = _base_type(_check_key(dotted_key))
    text = raw.strip()
    if nullable and text in ("null", "~"):
        return None
    if typ is bool:
        low = text.lower()
        return True if low in _TRUE else False if low in _FALSE else raw
    if typ in (str, Path):
        return raw
    try:
        return int(text) if typ is int else float(text)
    except ValueError:
        pass
    try:
        value = yaml.load(text, Loader=YamlLoader)
    except yaml.YAMLError:
        return raw
    return value if not isinstance(value, (dict, list)) else raw


def get_value(cfg: KiteConfig, dotted_key: str) -> Any:
    """The value at `dotted_key` (a leaf, or a section as its model). Unknown key: BadInput."""
    node: Any = cfg
    for part in dotted_key.split("."):
        if not isinstance(node, BaseModel) or part not in type(node).model_fields:
            _check_key(dotted_key)  # not a leaf either: raises with a "did you mean"
        node = getattr(node, part)
    return node


def config_source(cfg: KiteConfig, dotted_key: str) -> str:
    """Which layer set this key: 'default', 'file', 'env' or 'override'."""
    return cfg._sources.get(_check_key(dotted_key), ("default", ""))[0]


def config_origin(cfg: KiteConfig, dotted_key: str) -> str:
    """Where exactly: 'FILE:LINE', the env variable's name, 'override', or '' for a default."""
    return cfg._sources.get(_check_key(dotted_key), ("default", ""))[1]


def is_secret(dotted_key: str) -> bool:
    """Keys `kite config show` masks (the admin token)."""
    extra = _FIELDS[_check_key(dotted_key)].json_schema_extra
    return bool(isinstance(extra, dict) and extra.get("secret"))


def require_enabled(cfg: KiteConfig, dotted_key: str, what: str) -> None:
    """Raise KiteError saying how to switch a boolean feature on, when it is off."""
    if not get_value(cfg, dotted_key):
        raise KiteError(f"{what} needs {dotted_key}: switch it on with `kite config set "
                        f"{dotted_key} true` or {env_var_name(dotted_key)}=1")


# --------------------------------------------------------------------------- YAML with lines

class _Doc:
    """A parsed config file: its data, its node tree, and the line and column of every dotted
    key."""

    def __init__(self, path: Path, text: str) -> None:
        self.path, self.text = path, text
        self.root, self.data, self.lines = parse_yaml_tree(path, text)
        if self.data is None:
            self.data = {}
        if not isinstance(self.data, dict):
            raise BadInput(f"{path}:1:1: the top level must be a mapping of sections "
                           f"({', '.join(KiteConfig.model_fields)})")
        _drop_empty_sections(self.data)
        self.columns: dict[str, int] = {}
        stack = [(self.root, "")]
        while stack:
            node, prefix = stack.pop()
            if isinstance(node, yaml.MappingNode):
                for k, v in node.value:
                    if isinstance(k, yaml.ScalarNode):
                        self.columns.setdefault(prefix + str(k.value), k.start_mark.column + 1)
                        stack.append((v, f"{prefix}{k.value}."))

    def _nearest(self, key: str) -> str | None:
        """`key`, or its nearest section the file has."""
        parts = key.split(".")
        for n in range(len(parts), 0, -1):
            if self.lines.get(".".join(parts[:n])):
                return ".".join(parts[:n])
        return None

    def line_of(self, key: str) -> int:
        """The line of `key`, or of its nearest section the file has; 0 if none."""
        near = self._nearest(key)
        return self.lines[near] if near else 0

    def where(self, key: str) -> str:
        """`file:line` of `key` (what `kite config show` reports as its origin)."""
        line = self.line_of(key)
        return f"{self.path}:{line}" if line else str(self.path)

    def at(self, key: str) -> str:
        """`file:line:col` of `key` (or its nearest section), for error lines."""
        near = self._nearest(key)
        if near is None:
            return str(self.path)
        return f"{self.path}:{self.lines[near]}:{self.columns.get(near, 1)}"


def _drop_empty_sections(data: dict[Any, Any], prefix: tuple[str, ...] = ()) -> None:
    """`section:` with nothing under it (every key commented out) is an empty section."""
    for key in list(data):
        loc = (*prefix, str(key))
        if data[key] is None and _model_at(loc) is not None:
            del data[key]
        elif isinstance(data[key], dict):
            _drop_empty_sections(data[key], loc)


def _read(path: Path) -> str:
    return read_utf8(path, what="config file")


# --------------------------------------------------------------------------- validation

_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal",
                 "finite_number", "string_too_short", "string_too_long"}


def _model_at(parts: tuple[str, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = KiteConfig
    for part in parts:
        info = model.model_fields.get(part)
        if info is None or not _is_section(info.annotation):
            return None
        model = info.annotation
    return model


def _problem(err: dict[str, Any]) -> tuple[str, str]:
    """A pydantic error → (dotted key, what is wrong and what is allowed)."""
    loc = tuple(str(p) for p in err["loc"])
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        siblings = list((_model_at(loc[:-1]) or KiteConfig).model_fields)
        hint = _did_you_mean(loc[-1], siblings)
        if not hint:  # a key put in the wrong section: match it against every key's last part
            tails = {k.rsplit(".", 1)[-1]: k for k in CONFIG_KEYS}
            match = difflib.get_close_matches(loc[-1], list(tails), n=1, cutoff=0.8)
            hint = f"; did you mean {tails[match[0]]!r}?" if match else ""
        where = f"in {'.'.join(loc[:-1])}" if loc[:-1] else "at the top level"
        return key, f"unknown key {key!r}{hint} (allowed {where}: {', '.join(siblings)})"
    section = _model_at(loc)
    if section is not None:
        return key, f"{key} must be a mapping (allowed keys: {', '.join(section.model_fields)})"
    shown = render_value(err["input"]) if not isinstance(err["input"], (dict, list)) else (
        "a mapping" if isinstance(err["input"], dict) else "a list")
    if key not in _FIELDS:
        return key, f"{key}: {err['msg']}"
    if is_secret(key):   # an error never shows a secret
        shown = "***"
    if err["type"] in _RANGE_ERRORS:
        return key, f"{key} = {shown} is out of range; allowed: {allowed(key)}"
    if err["type"] == "value_error":   # a field's own validator: its message says what is allowed
        return key, f"{key} = {shown}: {str(err['msg']).removeprefix('Value error, ')}"
    quote = ""
    if _base_type(key)[0] in (str, Path) and isinstance(err["input"], (int, float, bool)):
        quote = f" (quote it: '{shown}')"
    return key, f"{key} = {shown} has the wrong type; allowed: {allowed(key)}{quote}"


def _validate(data: Mapping[str, Any], where: Callable[[str], str],
              order: Callable[[str], int] = lambda key: 0) -> KiteConfig:
    """Validate nested data; on failure raise BadInput for the first problem (by `order`)."""
    try:
        return KiteConfig.model_validate(data)
    except ValidationError as exc:
        problems = sorted((_problem(e) for e in exc.errors()), key=lambda p: order(p[0]))
        key, text = problems[0]
        raise BadInput(f"{where(key)}: {text}") from None


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, Mapping) and f"{prefix}{k}" not in _FIELDS:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _assign(data: dict[str, Any], dotted_key: str, value: Any) -> None:
    *parents, leaf = dotted_key.split(".")
    for part in parents:
        child = data.get(part)
        if not isinstance(child, dict):
            child = data[part] = {}
        data = child
    data[leaf] = value


def _merge(base: dict[str, Any], flat: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in flat.items():
        _assign(out, key, value)
    return out


def _finish(data: dict[str, Any], sources: dict[str, tuple[str, str]]) -> KiteConfig:
    data = copy.deepcopy(data)
    if _flatten(data).get("server.state_dir") is None:
        _assign(data, "server.state_dir", kite_home() / "states")
    cfg = KiteConfig.model_validate(data)
    cfg._sources = sources
    return cfg


def _file_layer(path: Path) -> _Doc:
    doc = _Doc(path, _read(path))
    _validate(doc.data, doc.at, order=doc.line_of)
    return doc


def validate_file(path: str | os.PathLike[str]) -> KiteConfig:
    """Check one config file (over the defaults, no env): the config it gives, or BadInput."""
    path = Path(path)
    doc = _file_layer(path)
    flat = _flatten(doc.data)
    return _finish(doc.data, {k: ("file", doc.where(k)) for k in flat})


def _env_layer(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """`KITE_*__*` variables (and the aliases) → dotted key → (value, variable name)."""
    out: dict[str, tuple[Any, str]] = {}
    for name, key in _ENV_ALIASES.items():
        if env.get(name):
            out[key] = (parse_raw(key, env[name]), name)
    for name, raw in sorted(env.items()):
        if not name.startswith("KITE_") or "__" not in name or raw == "":
            continue
        key = _ENV_NAMES.get(name)
        if key is None:
            raise BadInput(f"environment variable {name}: no such config key"
                           f"{_did_you_mean(name, _ENV_NAMES)}")
        out[key] = (parse_raw(key, raw), name)
    return out


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> KiteConfig:
    """The effective config: defaults < file < env < overrides, each layer validated.

    `path` defaults to `$KITE_HOME/config.yaml` (a missing file is an empty layer); `env` to
    `os.environ`. `overrides` maps dotted keys (or nested sections) to values; None values are
    skipped (a flag that was not given) and strings are parsed like env values. A bad value
    raises BadInput naming the file and line, the env variable, or the override.
    """
    path = Path(path) if path is not None else config_path()
    env = os.environ if env is None else env
    sources: dict[str, tuple[str, str]] = {}
    data: dict[str, Any] = {}
    if path.exists():
        doc = _file_layer(path)
        data = doc.data
        sources.update({k: ("file", doc.where(k)) for k in _flatten(data)})

    env_values = _env_layer(env)
    data = _merge(data, {k: v for k, (v, _) in env_values.items()})
    _validate(data, lambda key: f"environment variable {env_values[key][1]}"
              if key in env_values else str(path))
    sources.update({k: ("env", name) for k, (_, name) in env_values.items()})

    flat = {k: v for k, v in _flatten(dict(overrides or {})).items() if v is not None}
    for key, value in flat.items():
        _check_key(key)
        if isinstance(value, str):
            flat[key] = parse_raw(key, value)
    data = _merge(data, flat)
    _validate(data, lambda key: "command-line override" if key in flat else str(path))
    sources.update({k: ("override", "override") for k in flat})
    return _finish(data, sources)


# --------------------------------------------------------------------------- set

def set_value(path: str | os.PathLike[str], dotted_key: str, raw_value: Any) -> None:
    """Set one key in a config file, creating the file if missing.

    The new value and the whole resulting file are validated before anything is written; the file
    is replaced atomically. Comments and other lines are kept: an existing key's value is edited
    in place, a new key is appended under its section (sections created as needed). Only where
    the file's layout makes that impractical (flow-style mappings) is the file rewritten whole.
    A string `raw_value` is parsed like an env value.
    """
    path = Path(path)
    key = _check_key(dotted_key)
    value = parse_raw(key, raw_value) if isinstance(raw_value, str) else raw_value
    if isinstance(value, Path):
        value = str(value)
    _validate(_merge({}, {key: value}), lambda _k: f"{path} not changed")

    doc = _Doc(path, _read(path)) if path.exists() else _Doc(path, "")
    data = _merge(doc.data, {key: value})
    _validate(data, doc.at, order=doc.line_of)
    text = _edited(doc, key.split("."), render_value(value))
    if text is None or _Doc(path, text).data != data:
        text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)
    write_text(path, text)


def _edited(doc: _Doc, parts: list[str], rendered: str) -> str | None:
    """The file's text with the key set, keeping every other line; None if impractical."""
    text, node, depth, key_col = doc.text, doc.root, 0, -2
    if node is None:
        return _insert(text, len(text), 0, parts, rendered)
    while depth < len(parts):
        if isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null") \
                and node.start_mark.index == node.end_mark.index:  # `section:` left empty
            line_end = text.find("\n", node.start_mark.index)
            pos = len(text) if line_end < 0 else line_end + 1
            return _insert(text, pos, key_col + 2, parts[depth:], rendered)
        if not isinstance(node, yaml.MappingNode) or node.flow_style or not node.value:
            return None
        match = [(k, v) for k, v in node.value
                 if isinstance(k, yaml.ScalarNode) and k.value == parts[depth]]
        if not match:
            col = node.value[0][0].start_mark.column
            return _insert(text, _line_after(text, _last_leaf_end(node)), col, parts[depth:],
                           rendered)
        key_col = match[-1][0].start_mark.column
        node, depth = match[-1][1], depth + 1
    if not isinstance(node, yaml.ScalarNode) or node.style in ("|", ">"):
        return None
    return text[: node.start_mark.index] + rendered + text[node.end_mark.index:]


def _last_leaf_end(node: Any) -> int:
    while isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) and node.value:
        last = node.value[-1]
        node = last[1] if isinstance(node, yaml.MappingNode) else last
    return node.end_mark.index


def _line_after(text: str, index: int) -> int:
    if index > 0 and text[index - 1] == "\n":
        return index
    end = text.find("\n", index)
    return len(text) if end < 0 else end + 1


def _insert(text: str, pos: int, col: int, parts: list[str], rendered: str) -> str:
    lines = [" " * (col + 2 * i) + f"{p}:" for i, p in enumerate(parts)]
    lines[-1] += f" {rendered}"
    block = "\n".join(lines) + "\n"
    if pos > 0 and text[pos - 1] != "\n":
        block = "\n" + block
    return text[:pos] + block + text[pos:]


__all__ = [
    "CONFIG_KEYS", "DEFAULTS", "KiteConfig", "allowed", "config_origin", "config_source",
    "env_var_name", "env_vars_for", "get_value", "is_secret", "load_config", "parse_raw",
    "render_value", "require_enabled", "set_value", "validate_file",
]
