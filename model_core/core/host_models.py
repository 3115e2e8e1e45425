"""The host's own checkpoints, by name: what `lmscope models add NAME PATH|HUB_ID` (or the
LMSCOPE_MODELS setting, for containers) puts in every model picker. This module keeps the list
(the registry reads it); model_core.core.add_model checks a checkpoint before it joins.

The browser may only name models (never a path or a hub id); the host, who chose the path, gives
it a name here. A checkpoint is checked when it is added, before any weight is read: its config
is a decoder-only family lmscope opens (the adapter is built on the meta device, so a family it
cannot read is refused in the same sentence a load would give), its weights are safetensors, and
its size in the chosen dtype fits the device's memory. Added models are kept in
<data dir>/host_models.json; LMSCOPE_MODELS entries are listed after them (not written there).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from model_core.core import paths
from model_core.core.settings import current as current_settings

FILE_NAME = "host_models.json"


def _file() -> Path:
    return paths.data_dir() / FILE_NAME


def _read() -> dict[str, dict]:
    try:
        data = json.loads(_file().read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict) and isinstance(v.get("source"), str)}


def host_models() -> dict[str, dict]:
    """name -> {"source", "architecture", "parameters", "dtype", ...}: added ones, then LMSCOPE_MODELS'."""
    out = _read()
    for name, source in current_settings().host_models:
        out.setdefault(name, {"source": source, "architecture": _model_type(source), "parameters": None,
                              "from": "LMSCOPE_MODELS"})
    return out


def source_of(name: str) -> str | None:
    """The path or hub id the host gave `name`, or None."""
    entry = host_models().get(name)
    return entry["source"] if entry else None


def local_folder(source: str) -> Path | None:
    p = Path(os.path.expanduser(source))
    return p.resolve() if p.is_dir() else None


def _model_type(source: str) -> str | None:
    p = local_folder(source)
    try:
        return json.loads((p / "config.json").read_text()).get("model_type") if p else None
    except (OSError, ValueError):
        return None


def save(name: str, entry: dict) -> None:
    """Keep `name` -> entry (replacing an earlier entry of that name)."""
    data = _read()
    data[name] = entry
    tmp = _file().with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(_file())


def remove(name: str) -> bool:
    """Forget `name` (its checkpoint stays where it is); False if it was not added here."""
    data = _read()
    if name not in data:
        return False
    del data[name]
    _file().write_text(json.dumps(data, indent=2))
    return True
