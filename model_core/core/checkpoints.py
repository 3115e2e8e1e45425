"""Trained models on their way into the registry: the rule for output names (and for the names of a
run's intermediate checkpoints), the staging folders runs write into before a finished model is
renamed into data/models/<name>, and the names the registry's built-in entries already take.
model_core.training.run (SFT, pretraining, the preference trainers) and the feature dictionaries
(model_core.interp.features) share it."""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

from model_core.core import paths

OUTPUT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")  # a model name a URL and a folder can carry


def valid_output_name(name) -> bool:
    return isinstance(name, str) and OUTPUT_NAME.match(name) is not None


def checkpoint_name(name: str, step: int) -> str:
    """The registered name of a run's intermediate checkpoint: '<final name>-step<S>'."""
    return f"{name}-step{int(step)}"


def staging_root(kind: str = "sft") -> Path:
    """data/<kind>-staging, made if missing."""
    p = paths.data_dir() / f"{kind}-staging"
    p.mkdir(parents=True, exist_ok=True)
    return p


def staging_dir(name: str, kind: str = "sft") -> Path:
    """A fresh folder name for `name` under the kind's staging root (this process's pid in it, so a
    later sweep knows whether its writer is still alive)."""
    return staging_root(kind) / f"{name}.{os.getpid()}.{uuid.uuid4().hex[:6]}"


def sweep_staging(kind: str = "sft") -> int:
    """Remove staging folders left by runs whose process died; returns how many went."""
    n = 0
    for d in staging_root(kind).iterdir():
        try:
            pid = int(d.name.rsplit(".", 2)[-2])
        except (ValueError, IndexError):
            continue
        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
        if not alive:
            shutil.rmtree(d, ignore_errors=True)
            n += 1
    return n


def name_taken(name: str, overwrite: bool = False) -> str | None:
    """Why a trained model may not be registered as `name` now, as one sentence, or None: the name is
    a built-in registry entry's, or (unless the run overwrites) a registered model's. Checked when a
    job is submitted and again when its run starts."""
    if name in builtin_names():
        return f"'{name}' is a built-in model name; choose another output name."
    if not overwrite and (paths.finetuned_dir() / name).exists():
        return f"A model named '{name}' already exists; choose another output name."
    return None


def builtin_names() -> set[str]:
    """Names the registry's own entries take (a trained model may not shadow one)."""
    from model_core.core.registry import REGISTRY

    return set(REGISTRY)
