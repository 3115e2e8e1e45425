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


def guard(fn):
    """Decorator for callbacks: every lmscope error (one user-facing sentence) and malformed input
    becomes a gr.Error the page shows, never a traceback."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except gr.Error:
            raise
        except LmscopeError as e:
            raise gr.Error(str(e)) from None
        except (KeyError, IndexError, ValueError) as e:
            raise gr.Error(f"Bad input: {e}") from None
    return wrapper


def user_error(e: Exception) -> gr.Error:
    """One sentence for the UI from any lmscope error."""
    return gr.Error(str(e))


# ---------------------------------------------------------------------------------------------
# Per-user limits (hosted demos): how many model requests one user may have running at once,
# and the longest prompt. Users are the signed-in name, else the browser session.

import contextlib  # noqa: E402
import threading  # noqa: E402

_RUNNING: dict[str, int] = {}
_RUNNING_LOCK = threading.Lock()


def _env_int(name: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(name, "") or default))
    except ValueError:
        return default


def max_prompt_tokens() -> int:
    return _env_int("LMSCOPE_MAX_PROMPT_TOKENS", 1024)


def generate_concurrency() -> int:
    """Generations streaming at once (their decode steps are batched together, so many are cheap)."""
    return _env_int("LMSCOPE_GENERATE_CONCURRENCY", 16)


def user_key(request: gr.Request | None) -> str:
    if request is None:
        return "local"
    return getattr(request, "username", None) or getattr(request, "session_hash", None) or "anonymous"


@contextlib.contextmanager
def user_slot(request: gr.Request | None):
    """Hold one of the user's LMSCOPE_MAX_CONCURRENT_PER_USER request slots (released on return,
    on error, and when a streaming client goes away)."""
    key, limit = user_key(request), _env_int("LMSCOPE_MAX_CONCURRENT_PER_USER", 2)
    with _RUNNING_LOCK:
        if _RUNNING.get(key, 0) >= limit:
            raise gr.Error(f"You already have {limit} requests running; wait for one to finish.")
        _RUNNING[key] = _RUNNING.get(key, 0) + 1
    try:
        yield
    finally:
        with _RUNNING_LOCK:
            _RUNNING[key] -= 1
            if not _RUNNING[key]:
                del _RUNNING[key]
