"""Where lmscope keeps things on disk.

- cache dir (LMSCOPE_CACHE_DIR, default ~/.cache/lmscope): converted models, shared by every
  clone on the machine so a fresh clone does not pay the GGUF conversion again.
- data dir (LMSCOPE_DATA_DIR, default ./data): jobs, artifacts, fine-tuned models, Redis data.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    base = os.environ.get("LMSCOPE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lmscope"
    )
    p = Path(base)
    p.mkdir(parents=True, exist_ok=True)
    return p


def data_dir() -> Path:
    p = Path(os.environ.get("LMSCOPE_DATA_DIR") or "data").resolve()
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
