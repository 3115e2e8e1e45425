"""Instrumentation hooks, installed once per model, active only inside `recording(...)`.

The hooks read the active Recorder from a ContextVar, so two requests tracing the same model
in two threads each see only their own captures and interventions: nothing leaks between
requests, and a model with no active recorder runs at full speed (one ContextVar lookup per hook).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial, wraps

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
    rope: dict[int, tuple] = field(default_factory=dict)  # rotary (cos, sin), or a LayerCall (generic adapter)
    # Layers whose attention pattern the "lmscope" attention function keeps (generic adapter only),
    # and what it kept: {layer: {"q", "k", "v", "raw_scores", "scaled_scores", "mask", "probs"}}.
    patterns: frozenset[int] = frozenset()
    patterns_out: dict[int, dict] = field(default_factory=dict)
    scratch: dict = field(default_factory=dict)  # this forward's layer inputs / additions (hooks._mlp_rest)

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


# Arguments of a decoder layer's call that are no input to its computation: the cache objects (a
# re-run for a view runs without one) and the switches a re-run sets itself.
_NOT_INPUTS = frozenset({"hidden_states", "past_key_values", "past_key_value", "layer_past", "cache_params",
                         "use_cache", "output_attentions", "output_hidden_states", "return_dict"})


def _keepable(v) -> bool:
    """Tensors, plain values and tuples / lists of them (no cache or config objects)."""
    if isinstance(v, (tuple, list)):
        return all(_keepable(x) for x in v)
    if isinstance(v, Mapping):  # Gemma 4's shared key / value states, by layer type (filled as it runs)
        return all(_keepable(x) for x in v.values())
    return v is None or torch.is_tensor(v) or isinstance(v, (bool, int, float, str))


def _map(v, fn):
    if isinstance(v, (tuple, list)):
        return type(v)(_map(x, fn) for x in v)
    if isinstance(v, Mapping):
        return type(v)({k: _map(x, fn) for k, x in v.items()})
    return fn(v) if torch.is_tensor(v) else v


class NoRows(ValueError):
    """A layer argument with no batch rows to cut (ALiBi's [B * heads, 1, T])."""


@dataclass
class LayerCall:
    """A decoder layer's call as the model made it, less its hidden states and cache: the other
    positional arguments and the keyword arguments (mask, positions, rotary or ALiBi tables, ...).
    The generic adapter re-runs a layer for a view with exactly these, whatever its family passes."""

    args: tuple
    kwargs: dict

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> LayerCall:
        return cls(tuple(a for a in args[1:] if _keepable(a)),
                   {k: v for k, v in kwargs.items() if k not in _NOT_INPUTS and _keepable(v)})

    def map(self, fn) -> LayerCall:
        """The same call with fn applied to every tensor in it."""
        return LayerCall(_map(self.args, fn), {k: _map(v, fn) for k, v in self.kwargs.items()})

    def row(self, i: int, n: int, batch: int, length: int | None = None) -> LayerCall:
        """Row i of a right-padded batch of `batch` rows, cut to its n tokens: [B, T, ...] tensors
        (positions, rotary) keep row i and n positions, [B, 1, Q, K] masks an n x n corner,
        [B, H, T, dh] keys / values n positions, 1-D positions n entries. Raises NoRows for a
        tensor whose layout says no row (ALiBi's [B * heads, 1, T]): that family's traces then
        run one forward each."""
        def cut(t):
            if t.dim() == 0:
                return t
            if t.dim() == 1:
                return t[:n]
            if t.shape[0] not in (1, batch):
                raise NoRows(f"cannot take a row of a {tuple(t.shape)} layer argument")
            if batch > 1 and t.shape[0] == batch == length:  # rows or positions? this batch runs row by row
                raise ValueError(f"a {tuple(t.shape)} layer argument is ambiguous with {batch} rows of {length}")
            t = t[i: i + 1] if t.shape[0] == batch else t
            if t.dim() == 4 and t.shape[1] == 1:  # a mask [B, 1, Q, K]
                return t[:, :, :n, :n]
            if t.dim() == 4:  # keys / values [B, H, T, dh]
                return t[:, :, :n]
            return t[:, :n]
        return self.map(cut)


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _replace_first(output, new):
    return (new, *output[1:]) if isinstance(output, tuple) else new


def _hook(body):
    """A hook that a compiled forward never traces. What a hook reads (the recorder in a ContextVar,
    its edits) would be a graph break at every hook, or a guard and a recompile per request, so a
    compiled forward either leaves the hooks out (`Instrumentation.compiled_hooks` False: the
    engine's plain step, one whole graph) or runs each as plain Python between graphs (True: the
    engine's edited step; the graphs between the hooks are the same for every request's edits)."""
    eager = torch.compiler.disable(body)

    @wraps(body)
    def hook(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # tracing: the attribute read is the compiled code's guard
            return eager(self, *args, **kwargs) if self.compiled_hooks else None
        return body(self, *args, **kwargs)
    return hook


class Instrumentation:
    """Registers the hooks on a model's modules (once; see `instrument`)."""

    def __init__(self, adapter: Adapter):
        self.adapter = adapter
        self.compiled_hooks = False  # whether a compiled forward runs the hooks (see _hook)
        # The generic adapter re-runs layers with their captured call (LayerCall) instead of
        # rebuilding one: families pass ALiBi, rotary as complex frequencies, positional tables...
        self.layer_calls = bool(getattr(adapter, "captures_layer_calls", False))
        # Granite-style blocks add `sublayer(x) * residual_multiplier` to the residual.
        self.residual_scale = float(getattr(adapter, "residual_scale", 1.0))
        # A parallel block may add the attention's output into the MLP's output tensor in place
        # (Falcon: mlp_output += attention_output): keep a copy of what the sublayer returned.
        self.copy_outputs = getattr(adapter, "family", "") == "generic" and bool(getattr(adapter, "parallel", False))
        self.handles = []
        self.absent: dict[int, list[str]] = {}
        self.remainder_layers: set[int] = set()  # layers whose mlp_out is _mlp_rest's (they keep scratch)
        self.beside: dict[str, tuple[int, float]] = {}  # attn_out name -> (layer, attention's multiplier)
        for i, layer in enumerate(adapter.layers):
            self.handles.append(layer.register_forward_pre_hook(
                partial(self._resid_pre, i, act_name("resid_pre", i)), with_kwargs=True))
            # A hybrid's layer may have no mixer or no MLP (Nemotron-H's blocks are one of either):
            # that addition is zero, recorded with the layer's input.
            self.absent[i] = []
            beside = getattr(adapter, "beside_attention", lambda _: None)(layer)
            if beside:  # Falcon-H1: attn_out is Mamba(x) * m + attention(x) * a (see _out)
                self.beside[act_name("attn_out", i)] = (i, beside[2])
                self.handles.append(beside[0].register_forward_hook(partial(self._beside, i, beside[1])))
            remainder = bool(getattr(adapter, "mlp_remainder", lambda _: False)(layer))
            if remainder:
                self.remainder_layers.add(i)
            if remainder:  # several MLPs summed (Granite-MoE-hybrid's experts + shared MLP): see _mlp_rest
                self.handles.append(layer.register_forward_hook(partial(self._mlp_rest, i, act_name("mlp_out", i))))
            for kind, mod in (("attn_out", adapter.attn_out_module(layer)), ("mlp_out", adapter.mlp_out_module(layer))):
                if kind == "mlp_out" and remainder:
                    continue
                if mod is None:
                    self.absent[i].append(act_name(kind, i))
                elif "residual" in inspect.signature(mod.forward).parameters:
                    # BLOOM's attention and MLP add the residual themselves: what they add is out - residual.
                    self.handles.append(mod.register_forward_hook(
                        partial(self._out_with_residual, i, act_name(kind, i)), with_kwargs=True))
                else:
                    self.handles.append(mod.register_forward_hook(partial(self._out, i, act_name(kind, i))))
            # A generic family may have no single output / down projection (None: no edit point there).
            z = adapter.attn_z_module(layer) if hasattr(adapter, "attn_z_module") else None
            if z is not None:
                self.handles.append(z.register_forward_pre_hook(partial(self._input_edit, act_name("z", i))))
            post = adapter.mlp_post_module(layer) if hasattr(adapter, "mlp_post_module") else None
            if post is not None:
                self.handles.append(post.register_forward_pre_hook(partial(self._input_edit, act_name("post", i))))
        self.handles.append(adapter.final_norm.register_forward_hook(
            partial(self._final, act_name("ln_final"))))

    @_hook
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
        if i in self.remainder_layers:
            rec.scratch[i] = x
        if rec.wants(i):
            rec.store[name] = x
            for zero in self.absent[i]:
                rec.store[zero] = torch.zeros_like(x)
            if self.layer_calls:
                rec.rope[i] = LayerCall.of(args if in_args else (x,), kwargs)
            else:
                pe = kwargs.get("position_embeddings")
                if pe is not None:
                    rec.rope[i] = pe
        return (args, kwargs) if name in rec.edits else None

    @_hook
    def _out_with_residual(self, i, name, module, args, kwargs, output):
        residual = args[1] if len(args) > 1 else kwargs.get("residual")
        return self._out(i, name, module, args, output, residual)

    @_hook
    def _out(self, i, name, module, inputs, output, residual=None):
        rec = _ACTIVE.get()
        if rec is None:
            return None
        out = _first(output)
        if residual is not None:
            out = out - residual
        flat = out.dim() == 2  # OPT's fc2 works on [B*T, d]: edits and captures see [B, T, d]
        if flat:
            pre = rec.store.get(act_name("resid_pre", i))
            if pre is None:
                return None
            out = out.view(pre.shape)  # [B, T, d]
        s = self.residual_scale
        extra = None
        if name in self.beside:  # the block beside the attention ran first: its share joins too
            s = self.beside[name][1]
            extra = rec.scratch.pop(("beside", i), None)
        if s != 1.0:  # what joins the residual is the output times the multiplier; edits see that
            out = out * s
        if extra is not None:
            out = out + extra
        if name in rec.edits:
            out = rec.edits[name](name, out)
        if i in self.remainder_layers:
            rec.scratch[name] = out
        if rec.wants(i):
            rec.store[name] = out.clone() if self.copy_outputs and out is _first(output) else out
        if name not in rec.edits:
            return None
        if extra is not None:
            out = out - extra
        if s != 1.0:
            out = out / s
        if residual is not None:
            out = out + residual
        return _replace_first(output, out.reshape(-1, out.shape[-1]) if flat else out)

    @_hook
    def _beside(self, i, scale, module, inputs, output):
        rec = _ACTIVE.get()
        if rec is not None:
            rec.scratch[("beside", i)] = _first(output) * scale

    @_hook
    def _mlp_rest(self, i, name, module, inputs, output):
        """mlp_out of a layer whose MLP part is several modules summed: what the layer added past its
        input and its attention's addition (edits replace exactly that part of the layer's output)."""
        rec = _ACTIVE.get()
        if rec is None or i not in rec.scratch:
            return None
        out = _first(output)
        attn = rec.scratch.get(act_name("attn_out", i))
        mlp = out - rec.scratch.pop(i) - (attn if attn is not None else 0)
        if rec.wants(i):
            rec.store[name] = mlp
        if name not in rec.edits:
            return None
        return _replace_first(output, out - mlp + rec.edits[name](name, mlp))

    @_hook
    def _input_edit(self, name, module, args):
        """Edit-only hook on a module's first input: the attention output projection's (hook_z,
        per-head results [B, T, H*dh]) or the MLP down projection's (mlp.hook_post)."""
        rec = _ACTIVE.get()
        if rec is None or name not in rec.edits:
            return None
        return (rec.edits[name](name, args[0]), *args[1:])

    @_hook
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
