"""Instrumentation hooks, installed once per model, active only inside `recording(...)`.

The hooks read the active Recorder from a ContextVar, so two requests tracing the same model
in two threads each see only their own captures and interventions: nothing leaks between
requests, and a model with no active recorder runs at full speed (one ContextVar lookup per hook).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial

import torch

from model_core.core.adapters import Adapter
from model_core.core.hook_names import act_name

# An edit receives (hook_name, tensor [B, T, ...]) and returns a tensor of the same shape.
Edit = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass
class Recorder:
    layers: frozenset[int] | None = None  # None: every layer
    capture: bool = True
    edits: dict[str, Edit] = field(default_factory=dict)
    store: dict[str, torch.Tensor] = field(default_factory=dict)
    rope: dict[int, tuple] = field(default_factory=dict)
    # Layers whose attention pattern the "lmscope" attention function keeps (generic adapter only),
    # and what it kept: {layer: {"q", "k", "v", "raw_scores", "scaled_scores", "mask", "probs"}}.
    patterns: frozenset[int] = frozenset()
    patterns_out: dict[int, dict] = field(default_factory=dict)

    def wants(self, layer: int) -> bool:
        return self.capture and (self.layers is None or layer in self.layers)


_ACTIVE: ContextVar[Recorder | None] = ContextVar("lmscope_recorder", default=None)


def active_recorder() -> Recorder | None:
    """The recorder active in the caller's context (None: a plain forward)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def recording(recorder: Recorder):
    token = _ACTIVE.set(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.reset(token)


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _replace_first(output, new):
    return (new, *output[1:]) if isinstance(output, tuple) else new


class Instrumentation:
    """Registers the hooks on a model's modules (once; see `instrument`)."""

    def __init__(self, adapter: Adapter):
        self.adapter = adapter
        self.handles = []
        for i, layer in enumerate(adapter.layers):
            self.handles.append(layer.register_forward_pre_hook(
                partial(self._resid_pre, i, act_name("resid_pre", i)), with_kwargs=True))
            self.handles.append(adapter.attn_out_module(layer).register_forward_hook(
                partial(self._out, i, act_name("attn_out", i))))
            self.handles.append(adapter.mlp_out_module(layer).register_forward_hook(
                partial(self._out, i, act_name("mlp_out", i))))
            # A generic family may have no single output / down projection (None: no edit point there).
            z = adapter.attn_z_module(layer) if hasattr(adapter, "attn_z_module") else None
            if z is not None:
                self.handles.append(z.register_forward_pre_hook(partial(self._input_edit, act_name("z", i))))
            post = adapter.mlp_post_module(layer) if hasattr(adapter, "mlp_post_module") else None
            if post is not None:
                self.handles.append(post.register_forward_pre_hook(partial(self._input_edit, act_name("post", i))))
        self.handles.append(adapter.final_norm.register_forward_hook(
            partial(self._final, act_name("ln_final"))))

    def _resid_pre(self, i, name, module, args, kwargs):
        rec = _ACTIVE.get()
        if rec is None:
            return None
        in_args = bool(args)
        x = args[0] if in_args else kwargs["hidden_states"]
        if name in rec.edits:
            x = rec.edits[name](name, x)
            if in_args:
                args = (x, *args[1:])
            else:
                kwargs = {**kwargs, "hidden_states": x}
        if rec.wants(i):
            rec.store[name] = x
            pe = kwargs.get("position_embeddings")
            if pe is not None:
                rec.rope[i] = pe
        return (args, kwargs) if name in rec.edits else None

    def _out(self, i, name, module, inputs, output):
        rec = _ACTIVE.get()
        if rec is None:
            return None
        out = _first(output)
        flat = out.dim() == 2  # OPT's fc2 works on [B*T, d]: edits and captures see [B, T, d]
        if flat:
            pre = rec.store.get(act_name("resid_pre", i))
            if pre is None:
                return None
            out = out.view(pre.shape)  # [B, T, d]
        if name in rec.edits:
            out = rec.edits[name](name, out)
        if rec.wants(i):
            rec.store[name] = out
        if name not in rec.edits:
            return None
        return _replace_first(output, out.reshape(-1, out.shape[-1]) if flat else out)

    def _input_edit(self, name, module, args):
        """Edit-only hook on a module's first input: the attention output projection's (hook_z,
        per-head results [B, T, H*dh]) or the MLP down projection's (mlp.hook_post)."""
        rec = _ACTIVE.get()
        if rec is None or name not in rec.edits:
            return None
        return (rec.edits[name](name, args[0]), *args[1:])

    def _final(self, name, module, inputs, output):
        rec = _ACTIVE.get()
        if rec is None:
            return None
        out = output
        if name in rec.edits:
            out = rec.edits[name](name, out)
        if rec.capture:
            rec.store[name] = out
        return out if name in rec.edits else None


def instrument(adapter: Adapter) -> Instrumentation:
    """Idempotent: the hooks live on the model object for its lifetime."""
    model = adapter.model
    inst = getattr(model, "_lmscope_instrumentation", None)
    if inst is None:
        inst = Instrumentation(adapter)
        model._lmscope_instrumentation = inst
    return inst
