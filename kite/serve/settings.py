"""What one server runs with: address, limits, token, where states and rules live, the loop's knobs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kite.config import DEFAULT_MIN_HIT_GAIN, parse_lane_bits
from kite.errors import BadInput
from kite.store.ids import check_state_id  # noqa: F401 - re-exported: kite.serve's name for it
from kite.yoco.rules import resolve_rules_path

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(slots=True)
class ServeSettings:
    """Settings of one `kite serve` process (built from the config by `from_config`)."""

    state_dir: Path
    rules_path: Path
    host: str = "127.0.0.1"
    port: int = 8088
    admin_token: str | None = None  # None: admin endpoints refuse (403), never run open
    max_body_mb: float = 32.0
    fusion: bool = False  # features.upcycle_yoco_fusion: off → nothing is loaded
    min_hit_gain: float = DEFAULT_MIN_HIT_GAIN
    default_max_tokens: int = 64
    max_tokens_limit: int = 2048
    sampler_interval_ms: float = 200.0
    spike_threshold_gb: float = 3.0
    # memory-budgeted long context for completions without a state (docs/kv-budget.md): None = off
    kv_budget_tokens: int | None = None
    kv_budget_codec: str = "ratio=8"
    kv_budget_block: int = 256
    # continuous batching (kite.serve.batcher): sequences decoding together, and their KV buffers'
    # budget in GB (None: unbounded)
    max_batch: int = 8
    batch_kv_gb: float | None = None
    # slots of every row allocated at start (None: the buffers grow on demand). On a GPU the decode
    # steps of every batch size are captured then too, so no request pays a capture or a regrowth.
    batch_reserve_tokens: int | None = None
    # loaded states kept for the next request that loads the same (kite.serve.prefixes)
    prefix_cache_gb: float = 2.0
    # the form loaded states are held in for the batch, a registered resident form (kite.upcycle.RESIDENT_FORMS):
    # "raw" (rebuilt KV) or "lanes" (coded again into nibble lanes, ``lane_bits`` an element; docs/serving.md)
    resident: str = "raw"
    lane_bits: str = "4"
    # the shared, tiered state store (kite.store; docs/store.md): tier URLs, None = the folder only
    store_url: str | None = None
    store_write: str = "through"
    # API key -> tenant name (None: no tenant), from server.api_keys_file (kite.serve.tenants); None: no
    # keys, every request is of no tenant (the server is open, as before tenants)
    api_keys: dict[str, str | None] | None = None

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise BadInput(f"--max-batch {self.max_batch}: at least 1")
        if self.batch_kv_gb is not None and self.batch_kv_gb <= 0:
            raise BadInput(f"--batch-kv-gb {self.batch_kv_gb:g}: must be > 0")
        if self.batch_reserve_tokens is not None and self.batch_reserve_tokens < 1:
            raise BadInput(f"--batch-reserve-tokens {self.batch_reserve_tokens}: at least 1")
        if self.prefix_cache_gb < 0:
            raise BadInput(f"server.prefix_cache_gb {self.prefix_cache_gb:g}: must be ≥ 0 (0: keep none)")
        from kite.upcycle import check_resident

        check_resident(self.resident)
        parse_lane_bits(self.lane_bits)
        if self.max_body_mb <= 0:
            raise BadInput(f"server.max_body_mb {self.max_body_mb}: must be > 0")
        if not 1 <= self.port <= 65535 and self.port != 0:
            raise BadInput(f"server.port {self.port}: must be 1-65535")
        self.state_dir = Path(self.state_dir).expanduser()
        self.rules_path = Path(self.rules_path).expanduser()
        self.budget_settings()  # a bad budget fails at startup (the model's context is checked on load)

    def budget_settings(self, context_length: int | None = None):
        """The KV budget as `kite.upcycle.BudgetSettings` (None when off). Raises BadInput."""
        if self.kv_budget_tokens is None:
            return None
        from kite.upcycle import BudgetSettings, check_budget

        return check_budget(BudgetSettings(budget_tokens=self.kv_budget_tokens, codec=self.kv_budget_codec,
                                           block_tokens=self.kv_budget_block), context_length)

    @property
    def prefix_cache_bytes(self) -> int:
        return int(self.prefix_cache_gb * 1024 ** 3)

    @property
    def batch_kv_bytes(self) -> int | None:
        return None if self.batch_kv_gb is None else int(self.batch_kv_gb * 1024 ** 3)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    @classmethod
    def from_config(cls, cfg, *, rules: str | Path | None = None, **kw) -> "ServeSettings":
        """From a `KiteConfig` (server.*, features.*, hardware_watermark.*, yoco.rules_file)."""
        from kite.paths import kite_home
        from kite.serve.auth import read_api_keys

        s = cfg.server
        return cls(state_dir=s.state_dir or kite_home() / "states",
                   rules_path=resolve_rules_path(rules or cfg.yoco.rules_file),
                   host=s.host, port=s.port, admin_token=s.admin_token, max_body_mb=s.max_body_mb,
                   fusion=cfg.features.upcycle_yoco_fusion, min_hit_gain=cfg.features.yoco_min_hit_gain,
                   sampler_interval_ms=cfg.hardware_watermark.gpu_mem.sampling_interval_ms,
                   spike_threshold_gb=cfg.hardware_watermark.gpu_mem.spike_threshold_gb,
                   max_batch=s.max_batch, batch_kv_gb=s.batch_kv_gb,
                   batch_reserve_tokens=s.batch_reserve_tokens, prefix_cache_gb=s.prefix_cache_gb,
                   resident=s.resident, lane_bits=s.lane_bits,
                   store_url=cfg.store.url, store_write=cfg.store.write,
                   api_keys=None if s.api_keys_file is None else read_api_keys(s.api_keys_file), **kw)



def scale_settings(cfg):
    """`kite serve --replicas`' settings from the config (kite.serve.replicas.ScaleSettings; needs
    no Ray to build). Raises BadInput for bounds that do not hold."""
    from kite.serve.scale import ScaleSettings

    return ScaleSettings.from_config(cfg)
