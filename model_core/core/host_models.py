"""The host's own checkpoints, by name: what `lmscope models add NAME PATH|HUB_ID` (or the
LMSCOPE_MODELS setting, for containers) puts in every model picker.

The browser may only name models (never a path or a hub id); the host, who chose the path, gives
it a name here. A checkpoint is checked when it is added, before any weight is read: its config
is a decoder-only family lmscope opens (the adapter is built on the meta device, so a family it
cannot read is refused in the same sentence a load would give), its weights are safetensors, and
its size in the chosen dtype fits the device's memory. Added models are kept in
<data dir>/host_models.json; LMSCOPE_MODELS entries are listed after them (not written there).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

import torch

from model_core.core import paths
from model_core.core.errors import ModelLoadError
from model_core.core.settings import current as current_settings

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
FILE_NAME = "host_models.json"
# Room a loaded model needs beyond its weights (activations of a trace, the engine's KV slots).
HEADROOM = 1.2


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


def _local(source: str) -> Path | None:
    p = Path(os.path.expanduser(source))
    return p.resolve() if p.is_dir() else None


def _model_type(source: str) -> str | None:
    p = _local(source)
    try:
        return json.loads((p / "config.json").read_text()).get("model_type") if p else None
    except (OSError, ValueError):
        return None


def _config(name: str, source: str):
    """The checkpoint's config, read without remote code (a local folder, or a hub id in the cache
    or online)."""
    from transformers import AutoConfig

    p = _local(source)
    if p is not None:
        if not (p / "config.json").exists():
            raise ModelLoadError(f"'{source}' is not a Hugging Face model folder (no config.json), so '{name}' "
                                 f"cannot be added.")
        if not any(p.glob("*.safetensors")):
            raise ModelLoadError(f"'{source}' has no .safetensors weights; lmscope loads safetensors only.")
        where = str(p)
    else:
        from model_core.core.registry import looks_like_hub_id

        if not looks_like_hub_id(source):
            raise ModelLoadError(f"'{source}' is neither a model folder on this machine nor a hub id like 'org/name'.")
        where = source
    try:
        return AutoConfig.from_pretrained(where, trust_remote_code=False)
    except Exception as e:  # config errors come in many classes; the host needs one sentence
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ModelLoadError(f"Could not read the config of '{source}': {first}") from None


def _device_bytes(dev: torch.device) -> int:
    """Memory a model may take on `dev`: the GPU's total (every GPU's when a model is split), or RAM."""
    if dev.type == "cuda":
        if current_settings().device == "auto":
            return sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
        return torch.cuda.get_device_properties(dev).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check(name: str, source: str, device: str | None = None, dtype: str | None = None) -> dict:
    """What `name` -> `source` would be in the pickers (architecture, parameters, dtype, device),
    checked as described above; raises ModelLoadError with one sentence."""
    from transformers import AutoModelForCausalLM

    from model_core.core.adapters import adapter_for
    from model_core.core.registry import (
        REGISTRY,
        _check_architecture,
        attn_implementation_for,
        resolve_device,
    )

    if not NAME_RE.match(name or ""):
        raise ModelLoadError(f"'{name}' cannot name a model: use up to 64 letters, digits, '.', '_' or '-', "
                             f"starting with a letter or digit.")
    if name in REGISTRY or (paths.finetuned_dir() / name).exists():
        raise ModelLoadError(f"'{name}' already names a {'registry' if name in REGISTRY else 'fine-tuned'} model; "
                             f"choose another name.")
    cfg = _config(name, source)
    _check_architecture(getattr(cfg, "model_type", None))
    cfg._attn_implementation = attn_implementation_for(cfg.model_type)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build: one sentence
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ModelLoadError(f"transformers cannot build '{source}' ({cfg.model_type}): {first}") from None
    adapter_for(model)  # the family's places found, or its one-sentence refusal
    n_params = sum(p.numel() for p in model.parameters())
    dev, dt = resolve_device(device, dtype)
    need = n_params * torch.finfo(dt).bits // 8
    have = _device_bytes(dev)
    if need * HEADROOM > have:
        raise ModelLoadError(f"'{name}' has {n_params / 1e9:.1f}B parameters, {need / 2**30:.1f} GiB in "
                             f"{str(dt).removeprefix('torch.')}: more than the {have / 2**30:.0f} GiB of {dev.type} "
                             f"memory here (try LMSCOPE_DTYPE=bfloat16 or LMSCOPE_DEVICE=auto).")
    return {"source": str(_local(source) or source), "architecture": cfg.model_type, "parameters": n_params,
            "dtype": str(dt).removeprefix("torch."), "device": dev.type, "added": time.strftime("%Y-%m-%d %H:%M:%S")}


def add(name: str, source: str, device: str | None = None, dtype: str | None = None) -> dict:
    """Check and keep `name` -> `source` (replacing an earlier entry of that name)."""
    entry = check(name, source, device, dtype)
    data = _read()
    data[name] = entry
    tmp = _file().with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(_file())
    log.info("model '%s' added: %s (%s, %d parameters)", name, entry["source"], entry["architecture"],
             entry["parameters"])
    return entry


def remove(name: str) -> bool:
    """Forget `name` (its checkpoint stays where it is); False if it was not added here."""
    data = _read()
    if name not in data:
        return False
    del data[name]
    _file().write_text(json.dumps(data, indent=2))
    return True
