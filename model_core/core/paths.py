"""Where lmscope keeps things on disk (both folders come from model_core.core.settings).

- cache dir (LMSCOPE_CACHE_DIR, default ~/.cache/lmscope): converted models, shared by every
  clone on the machine so a fresh clone does not pay the GGUF conversion again.
- data dir (LMSCOPE_DATA_DIR, default ./data): jobs, artifacts, fine-tuned models, Redis data.
"""

from __future__ import annotations

from pathlib import Path

from model_core.core import settings


def cache_dir() -> Path:
    p = Path(settings.current().cache_dir)
    p.mkdir(parents=True, exist_ok=True)
    return p


def data_dir() -> Path:
    p = Path(settings.current().data_dir).resolve()
    p.mkdir(parents=True, exist_ok=True)
    return p


def models_cache_dir() -> Path:
    p = cache_dir() / "models"
    p.mkdir(parents=True, exist_ok=True)
    return p


def finetuned_dir() -> Path:
    p = data_dir() / "models"
    p.mkdir(parents=True, exist_ok=True)
    return p
