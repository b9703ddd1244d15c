"""`upcycle_config.yaml` in the seed's shape: adapter, regenerator, compression, semantic_tagging."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kite.errors import BadInput
from kite.upcycle.tail import EXPECTED, parse_recompute
from kite.yaml_model import load_yaml_model

PRECISIONS = ("fp32", "fp16", "bf16", "fp8", "int8", "int4", "int3", "int2")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CompressionConfig(_Strict):
    # The state's size as a fraction of the document's raw fp16 KV (0.25 = 4× compression), used
    # when neither a flag nor the KITE config's features.upcycle_compression_ratio sets it
    # (kite.upcycle.pipeline). The seed's name; KITE's codec spends this byte budget on PCA
    # components of pre-RoPE keys and values by bit allocation (docs/compression.md), not on a
    # plain SVD rank.
    svd_ratio: float = Field(0.25, gt=0, le=1)
    cluster_num: int = Field(8, ge=1, le=256)
    # A preset instead of a ratio: exact | fp16 | bf16 | fp8 | int8 | int4 ... (overrides svd_ratio)
    precision: str | None = None
    min_span_tokens: int = Field(32, ge=4)
    max_span_tokens: int = Field(128, ge=8)
    # Per clause label, its own compression ratio (> 1) for the clusters of that label: a map, or
    # a YAML file of one relative to this config (`kite upcycle retune` keeps label_ratios.yaml
    # beside the states). Labels not named take the state's ratio. Needs a PCA ratio, not a preset.
    label_ratios: dict[str, float] | str = Field(default_factory=dict)
    # A ratio's PCA bases: one over a layer's heads together (true: the most quality per byte) or one
    # per KV head (false). Presets ignore it.
    joint_heads: bool = True
    # The codes of every PCA-coded part entropy coded (the codec's last stage, docs/compression.md):
    # at a ratio the bits it saves are spent again on the components, the file the size asked.
    # Compressing codes the state up to three times; loads decode the parts on the host.
    entropy_coding: bool = False
    # The document's last tokens kept as token ids instead of coded: every load runs them through the
    # model after the rebuilt prefix (a forward of this many tokens), and the state's bytes go to the
    # tokens before them. auto: 256 (at most an eighth of the document) at 16x and above, else none;
    # a count: that many at any ratio; 0: none (docs/compression.md, "Recomputed tail").
    recompute_tokens: int | str = "auto"

    @field_validator("recompute_tokens", mode="before")
    @classmethod
    def _tail(cls, v):
        try:
            return parse_recompute(v)
        except BadInput:
            raise ValueError(EXPECTED) from None

    @field_validator("precision")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        if v is not None and v not in PRECISIONS + ("exact",):
            raise ValueError(f"must be one of exact, {', '.join(PRECISIONS)}")
        return v


class Example(_Strict):
    text: str = Field(min_length=1)
    label: str = Field(min_length=1)


class TaggingConfig(_Strict):
    prompt_template: str = (
        "Clause: {text}\nThe type of this clause is: {label}")
    labels: list[str] = Field(default_factory=list)
    examples: list[Example] = Field(default_factory=list)
    # A labeled JSONL file ({"text": ..., "label": ...} per line), relative to the config file.
    examples_file: str | None = None
    # Generated examples per label when none are given (from `kite data contracts`' generator).
    generated_examples_per_label: int = Field(4, ge=0, le=64)


class AdapterConfig(_Strict):
    """The reader adapter: where a trained one is, and what `kite upcycle train --mode custom` trains."""

    # A reader adapter folder (`kite upcycle train` writes DIR/adapter), relative to the config
    # file: on while the model reads a state made for it, off otherwise.
    path: str | None = None
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "o_proj"], min_length=1)
    r: int = Field(16, ge=1, le=256)
    lora_alpha: int = Field(32, ge=1)
    lora_dropout: float = Field(0.05, ge=0, lt=1)
    # The distillation's temperature (the teacher's and the student's logits are divided by it).
    temperature: float = Field(1.0, gt=0)
    # The LoRA's AdamW learning rate (both modes); a large rank on many modules may need a lower one.
    learning_rate: float = Field(5e-4, gt=0, le=1)


class UpcycleConfig(_Strict):
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    # A regenerator folder (`kite upcycle train` writes DIR/regenerator), relative to the config
    # file: states are then coded on its calibrated bases where that pays.
    regenerator: str | None = None
    # A layer weights file (`kite upcycle weigh` writes one), relative to the config file: the
    # state-wide bit allocation weighs each layer's keys and values by how much their errors cost.
    # Unset: the weights KITE ships for the model (the embedded one's), if any; "none": without.
    layer_weights: str | None = None
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    semantic_tagging: TaggingConfig = Field(default_factory=TaggingConfig)

    @model_validator(mode="before")
    @classmethod
    def _adapter_path(cls, data):
        """`adapter: DIR` (a string) is the reader adapter's path; `adapter: null` is none."""
        if isinstance(data, dict) and (data.get("adapter") is None or isinstance(data.get("adapter"), str)):
            data = {**data, "adapter": {"path": data.get("adapter")}}
        return data

    def resolve(self, value: str | None, base: Path | None) -> Path | None:
        """A path of this config (adapter.path, regenerator, layer_weights) made absolute against its file's folder."""
        if value is None:
            return None
        p = Path(value).expanduser()
        return p if p.is_absolute() or base is None else base.parent / p


def load_upcycle_config(path: str | Path | None) -> tuple[UpcycleConfig, Path | None]:
    """The config at `path`, else `configs/upcycle_config.yaml` when present, else defaults."""
    if path is None:
        from kite.paths import repo_root

        root = repo_root()
        default = root / "configs" / "upcycle_config.yaml" if root else None
        if default is None or not default.exists():
            return UpcycleConfig(), None
        path = default
    path = Path(path)
    return load_yaml_model(path, UpcycleConfig), path
