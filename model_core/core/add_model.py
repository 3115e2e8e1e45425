"""Adding the host's own checkpoint by name (`lmscope models add NAME PATH|HUB_ID`), checked
before any weight is read: its config is a decoder-only family lmscope opens (the adapter is built
on the meta device, so a family it cannot read is refused in the same sentence a load would give),
its weights are safetensors, and its size in the chosen dtype fits the device's memory. The list
itself is model_core.core.host_models."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import torch

from model_core.core import host_models, paths
from model_core.core.errors import ModelLoadError
from model_core.core.registry import (
    REGISTRY,
    _check_architecture,
    attn_implementation_for,
    looks_like_hub_id,
    resolve_device,
)
from model_core.core.settings import current as current_settings

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# Room a loaded model needs beyond its weights (activations of a trace, the engine's KV slots).
HEADROOM = 1.2


def _local(source: str) -> Path | None:
    return host_models.local_folder(source)


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
    host_models.save(name, entry)
    log.info("model '%s' added: %s (%s, %d parameters)", name, entry["source"], entry["architecture"],
             entry["parameters"])
    return entry
