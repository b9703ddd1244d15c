"""Training checkpoints without pickle (invariant 6): the LoRA weights, the optimizer's moments, the
random generator's state as safetensors, and the loop's position and history as JSON.

A checkpoint is a folder ``checkpoints/step-NNNNNN``, complete before ``checkpoints/latest.json``
(written atomically) names it; an interrupted save leaves the previous checkpoint named. Only the
newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from kite.atomic import write_bytes, write_text
from kite.errors import BadInput

LATEST = "latest.json"


@dataclass
class Checkpoint:
    step: int
    params: dict[str, torch.Tensor]          # trainable parameters by name
    optimizer: dict                          # torch.optim state_dict
    rng: torch.Tensor                        # torch.get_rng_state()
    progress: dict                           # the loop's position and history (JSON-able)


def save_checkpoint(folder: Path, ck: Checkpoint, keep: int = 2) -> Path:
    from safetensors.torch import save

    root = Path(folder) / "checkpoints"
    target = root / f"step-{ck.step:06d}"
    target.mkdir(parents=True, exist_ok=True)
    tensors, groups = _flatten_optimizer(ck.optimizer)
    write_bytes(target / "params.safetensors", save({k: v.detach().contiguous() for k, v in ck.params.items()}))
    write_bytes(target / "optimizer.safetensors", save({**tensors, "rng": ck.rng.contiguous()}))
    write_text(target / "progress.json", json.dumps({"step": ck.step, "param_groups": groups,
                                                     "progress": ck.progress}, indent=1))
    write_text(root / LATEST, json.dumps({"step": ck.step, "folder": target.name}))
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def load_checkpoint(folder: Path) -> Checkpoint | None:
    """The newest complete checkpoint under ``folder`` (None when there is none)."""
    from safetensors.torch import load_file

    root = Path(folder) / "checkpoints"
    try:
        latest = json.loads((root / LATEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise BadInput(f"{root / LATEST}: damaged ({exc}); delete the checkpoints folder to start over") from None
    target = root / latest["folder"]
    try:
        params = load_file(target / "params.safetensors")
        opt = load_file(target / "optimizer.safetensors")
        meta = json.loads((target / "progress.json").read_text())
    except (OSError, ValueError) as exc:
        raise BadInput(f"{target}: damaged checkpoint ({exc})") from None
    rng = opt.pop("rng")
    return Checkpoint(step=int(meta["step"]), params=params, optimizer=_unflatten_optimizer(opt, meta["param_groups"]),
                      rng=rng, progress=meta["progress"])


def _flatten_optimizer(sd: dict) -> tuple[dict[str, torch.Tensor], list]:
    tensors = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"state.{idx}.{name}"] = t.detach().contiguous()
    return tensors, sd["param_groups"]


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], groups: list) -> dict:
    state: dict[int, dict] = {}
    for key, t in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = t
    return {"state": state, "param_groups": groups}
