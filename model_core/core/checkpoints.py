"""Trained models on their way into the registry: the rule for output names, the staging folders
runs write into before a finished model is renamed into data/models/<name>, and the names the
registry's built-in entries already take. SFT, pretraining and the preference trainers share it."""

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


def builtin_names() -> set[str]:
    """Names the registry's own entries take (a trained model may not shadow one)."""
    from model_core.core.registry import REGISTRY

    return set(REGISTRY)
