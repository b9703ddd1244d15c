"""KiteConnector's settings: KITE's config (section ``vllm``), each key overridden by its twin in
vLLM's ``kv_connector_extra_config`` (docs/vllm-connector.md).

Every key is checked when the connector starts; a wrong one is one BadInput line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kite.errors import BadInput

_WHERE = "KiteConnector: kv_connector_extra_config"


@dataclass(frozen=True)
class ConnectorSettings:
    """``states``: the folder of ``.upc`` states (read; saved into). ``model_fingerprint``: the
    served model's combined fingerprint (None: computed from its folder). ``save``: compress each
    finished prompt of at least ``save_min_tokens`` tokens into a state, in the background, at
    ``save_ratio`` (a compression ratio, or a codec preset name) with ``save_clusters`` clusters; at
    most ``save_queue`` prompts wait (more are dropped, logged)."""

    states: Path
    model_fingerprint: str | None = None
    save: bool = False
    save_ratio: float | str = 4.0
    save_min_tokens: int = 256
    save_clusters: int = 8
    save_queue: int = 4

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, config=None) -> ConnectorSettings:
        """``config``: a KiteConfig (default: the user's: $KITE_HOME/config.yaml and KITE_* variables, kite.config.load_config) whose ``vllm``
        section gives every key ``extra`` leaves out."""
        extra = dict(extra or {})
        known = ("states", "model_fingerprint", "save", "save_ratio", "save_min_tokens", "save_clusters", "save_queue")
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise BadInput(f"{_WHERE}: unknown key {unknown[0]!r} (known: {', '.join(known)})")
        if config is None:
            from kite.config import load_config

            config = load_config()
        section = config.vllm.model_dump()
        section["states"] = section["states"] or str(config.server.state_dir)
        extra = {**section, **extra}
        states = extra["states"]
        if not isinstance(states, str) or not states:
            raise BadInput(f"{_WHERE}: \"states\" {states!r}: a folder path")
        fp = extra.get("model_fingerprint")
        if fp is not None and (not isinstance(fp, str) or not fp):
            raise BadInput(f"{_WHERE}: \"model_fingerprint\" {fp!r}: a fingerprint (kite model info)")
        save = extra.get("save", False)
        if not isinstance(save, bool):
            raise BadInput(f"{_WHERE}: \"save\" {save!r}: true or false")
        ratio = extra.get("save_ratio", cls.save_ratio)
        _check_ratio(ratio)
        ints = {}
        for key in ("save_min_tokens", "save_clusters", "save_queue"):
            value = extra.get(key, getattr(cls, key))
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadInput(f"{_WHERE}: \"{key}\" {value!r}: a whole number ≥ 1")
            ints[key] = value
        folder = Path(states).expanduser()
        if save:
            folder.mkdir(parents=True, exist_ok=True)
        if not folder.is_dir():
            raise BadInput(f"{_WHERE}: states folder {folder}: not a folder")
        return cls(folder, fp, save, ratio, **ints)


def _check_ratio(ratio) -> None:
    from kite.upcycle import codec_settings

    if isinstance(ratio, bool) or not isinstance(ratio, (int, float, str)):
        raise BadInput(f"{_WHERE}: \"save_ratio\" {ratio!r}: a compression ratio (e.g. 4) or a codec preset name")
    try:
        codec_settings(ratio)
    except (BadInput, ValueError, KeyError) as e:
        raise BadInput(f"{_WHERE}: \"save_ratio\" {ratio!r}: {e}") from None
