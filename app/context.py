"""What every tab shares: the global model picker and prompt, and safe model access.

A tab module exposes `build(shared: Shared) -> None`, called inside its `gr.Tab`; it reads the
current model name and prompt from `shared` components as event inputs, and raises `gr.Error`
(via `user_error`) for anything the user can fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import gradio as gr

from model_core.errors import LmscopeError
from model_core.registry import DEFAULT_MODEL, LoadedModel, load_model


@dataclass
class Shared:
    model: gr.Dropdown  # value: model name
    prompt: gr.Textbox
    chat: gr.Checkbox  # wrap the prompt in the model's chat template


def allowed_models() -> list[str] | None:
    """LMSCOPE_ALLOWED_MODELS (comma-separated) restricts what the server loads; None = registry,
    fine-tuned models and local paths given on the server's command line."""
    raw = os.environ.get("LMSCOPE_ALLOWED_MODELS", "").strip()
    return [m.strip() for m in raw.split(",") if m.strip()] or None


def default_model() -> str:
    return os.environ.get("LMSCOPE_DEFAULT_MODEL", DEFAULT_MODEL)


def get_model(name: str) -> LoadedModel:
    """Load a model for a UI request. Only registry names and fine-tuned models: the browser may
    not name arbitrary paths or hub ids (no path traversal, no surprise downloads)."""
    name = (name or "").strip() or default_model()
    allowed = allowed_models()
    if allowed is not None and name not in allowed:
        raise gr.Error(f"Model '{name}' is not enabled on this server.")
    try:
        return load_model(name, allow_paths=False, allow_hub=False)
    except LmscopeError as e:
        raise gr.Error(str(e)) from None


def user_error(e: Exception) -> gr.Error:
    """One sentence for the UI from any lmscope error."""
    return gr.Error(str(e))
