"""The trace behind an Explore page: its server-side key in the page's state, re-run when the cache
evicted it, and the layer / head / query a request names clamped to it. Explore and the neuron and
head pages (app/tabs/explore/unit_page.py) both read it."""

from __future__ import annotations

import gradio as gr

from app.shared import steering_settings
from app.shared.context import get_model, max_prompt_tokens
from app.shared.trace_store import STORE
from app.tabs.explore.lens_filler import FILLER
from model_core.interp.trace import trace


def trace_for_state(state: dict):
    """The stored trace of an Explore state ({"key", "model", "prompt", "chat", "truncate", "steer"?})."""
    tr = STORE.get((state or {}).get("key"))
    if tr is not None:
        return tr
    if not state or not state.get("prompt"):
        raise gr.Error("Run a prompt first.")
    # Evicted from the server's trace cache: re-run it transparently (with its steering vector, if any).
    lm = get_model(state["model"])
    edits = steering_settings.edits_for(lm, state["steer"])[0] if state.get("steer") else None
    tr = trace(lm, state["prompt"], chat=state.get("chat", False), truncate=state.get("truncate", False),
               max_tokens=max_prompt_tokens(), edits=edits)
    state["key"] = STORE.put(tr)
    FILLER.schedule(tr)
    return tr


def clamp(v, hi) -> int:
    """A browser's index as an int in [0, hi] (anything unreadable: hi)."""
    try:
        v = int(v)
    except (TypeError, ValueError, OverflowError):
        v = hi
    return max(0, min(hi, v))


def where(state, layer, head, query):
    """The stored trace and the layer, head and query clamped to it."""
    tr = trace_for_state(state)
    s = tr.lm.shape
    return tr, clamp(layer, s.n_layers - 1), clamp(head, s.n_heads - 1), clamp(query, tr.n_tokens - 1)
