"""Saved feature sets: <data dir>/features/<name>/ (sae.safetensors + cfg.json in sparsify's own
format, features.json, contexts.safetensors, labels.json), listed and loaded by name.
"""

from __future__ import annotations

import json
from pathlib import Path

from model_core.core import checkpoints, paths
from model_core.interp.features_sae import FeatureError, Features, import_sparsify


def features_dir() -> Path:
    """The folder of saved feature sets (made when missing)."""
    p = paths.data_dir() / "features"
    p.mkdir(parents=True, exist_ok=True)
    return p


def load_features(name: str, device="cpu") -> Features:
    """A saved feature set by name (folder under <data dir>/features)."""
    if not checkpoints.valid_output_name(name):
        raise FeatureError(f"{name!r} is not a feature set name.")
    path = features_dir() / name
    if not (path / "features.json").is_file():
        raise FeatureError(f"There is no feature set named '{name}'.")
    record = json.loads((path / "features.json").read_text(encoding="utf-8"))
    sae = import_sparsify().SparseCoder.load_from_disk(path, device=device)
    sae.requires_grad_(False)
    return Features(sae=sae, model=record["model"], layer=record["layer"], hook=record["hook"], name=name,
                    record=record, path=path)


def list_features() -> list[str]:
    """The names of the saved feature sets, sorted."""
    return sorted(p.name for p in features_dir().iterdir() if (p / "features.json").is_file())
