"""One instrumented forward pass -> one Trace; every view is a function of a Trace.

Capture is cheap by design: the forward keeps transformers' fast attention kernel (SDPA),
and the hooks only keep references to tensors the model computes anyway (each block's input
and what its attention and MLP add to the residual stream). Attention patterns and MLP
activations are recomputed per layer on demand, from that layer's captured input with the
layer's own norm and projections; tests check them equal to transformers' eager attentions.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from model_core.core import hooks
from model_core.core.errors import PromptError
from model_core.core.hook_names import act_name, parse, trace_names
from model_core.core.hooks import Recorder, instrument, recording
from model_core.core.prompts import DEFAULT_MAX_TOKENS, encode_prompt, server_token_cap  # noqa: F401 (re-exported)
from model_core.core.tokenization import describe_tokens
from model_core.interp.trace_batching import batcher_for


@dataclass
class Trace:
    model_name: str
    token_ids: list[int]
    tokens: list[dict]  # [{id, text, display}]
    n_layers: int
    captured_layers: list[int]
    resid_pre: dict[int, torch.Tensor]  # [T, d] per captured layer
    attn_out: dict[int, torch.Tensor]
    mlp_out: dict[int, torch.Tensor]
    ln_final: torch.Tensor  # [T, d]
    next_logits: torch.Tensor  # [V], the model's own output at the last position
    token_logprobs: torch.Tensor  # [T], log p(token_t | tokens_<t); NaN at t = 0
    rope: dict[int, tuple]  # rotary (cos, sin) [1, T, dh] per layer, where the model passes them
    seconds: float
    lm: object = field(repr=False, default=None)  # the LoadedModel this trace ran (adapter, shape, tokenizer)
    # Each layer's call as the model made it (hooks.LayerCall; generic adapter): views re-run layers with it.
    calls: dict[int, object] = field(default_factory=dict)
    _cache: OrderedDict[tuple, torch.Tensor] = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    cache_size: int = 12

    # --- residual stream: the same additions the model performs ---------------------------
    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def device(self) -> torch.device:
        return self.ln_final.device

    def _need(self, layer: int) -> None:
        if layer not in self.resid_pre:
            raise KeyError(f"layer {layer} was not captured (captured: {self.captured_layers})")

    def resid_mid(self, layer: int) -> torch.Tensor:
        self._need(layer)
        return self.resid_pre[layer] + self.attn_out[layer]

    def resid_post(self, layer: int) -> torch.Tensor:
        return self.resid_mid(layer) + self.mlp_out[layer]

    @property
    def embed(self) -> torch.Tensor:
        self._need(0)
        return self.resid_pre[0]

    # --- recomputed on demand, cached per trace -------------------------------------------
    def _cached(self, key, fn):
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        with torch.inference_mode():
            value = fn()
        with self._lock:
            self._cache[key] = value
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return value

    def layer_call(self, layer: int):
        """What a view re-runs layer `layer` with: its captured call, else its rotary (cos, sin)."""
        return self.calls.get(layer) or self.rope.get(layer)

    def attention_pattern(self, layer: int) -> torch.Tensor:
        """[heads, T, T]: row i is where query token i attends."""
        self._need(layer)
        ad = self.lm.adapter
        return self._cached(("pattern", layer),
                            lambda: ad.attention_pattern(layer, self.resid_pre[layer], self.layer_call(layer)))

    def attention_steps(self, layer: int) -> dict[str, torch.Tensor]:
        self._need(layer)
        with torch.inference_mode():
            return self.lm.adapter.attention_scores(layer, self.resid_pre[layer], self.layer_call(layer))

    def mlp_post(self, layer: int) -> torch.Tensor:
        """[T, d_mlp]: the activation entering the MLP's down projection."""
        ad = self.lm.adapter

        def compute():
            x = ad.mlp_norm(ad.layers[layer])(self.resid_mid(layer))
            return ad.mlp_hidden(layer, x)
        return self._cached(("mlp_post", layer), compute)

    def logits(self, positions=None) -> torch.Tensor:
        """[T, V] (or the chosen positions) through the model's own unembedding."""
        x = self.ln_final if positions is None else self.ln_final[positions]
        with torch.inference_mode():
            return self.lm.adapter.logits_from_normed(x)

    def __getitem__(self, name: str) -> torch.Tensor:
        """TransformerLens-style names (model_core.core.hook_names), e.g. trace['blocks.3.attn.hook_pattern']."""
        kind, layer = parse(name)
        if layer is None:
            return {"embed": lambda: self.embed, "ln_final": lambda: self.ln_final, "logits": self.logits}[kind]()
        getter = {
            "resid_pre": lambda: self.resid_pre[layer], "resid_mid": lambda: self.resid_mid(layer),
            "resid_post": lambda: self.resid_post(layer), "attn_out": lambda: self.attn_out[layer],
            "mlp_out": lambda: self.mlp_out[layer], "pattern": lambda: self.attention_pattern(layer),
            "post": lambda: self.mlp_post(layer),
        }.get(kind)
        if getter is None:
            raise KeyError(f"'{name}' is an edit point of the forward pass; a Trace does not keep it")
        self._need(layer)
        return getter()

    def hook_names(self) -> list[str]:
        return trace_names(self.captured_layers)

    def captured_bytes(self) -> int:
        seen, total = set(), 0
        for d in (self.resid_pre, self.attn_out, self.mlp_out):
            for t in d.values():
                if id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
        return total + self.ln_final.numel() * self.ln_final.element_size()

    def perplexity(self) -> float | None:
        lp = self.token_logprobs[1:]
        if lp.numel() == 0:
            return None
        return float(torch.exp(-lp.float().mean()))


def _rotary(pe):
    """The rotary (cos, sin) of a layer's capture (the tuple itself, or a LayerCall's position_embeddings)."""
    if isinstance(pe, hooks.LayerCall):
        pe = pe.kwargs.get("position_embeddings")
        return pe if isinstance(pe, tuple) and len(pe) == 2 and all(torch.is_tensor(t) for t in pe) else None
    return pe


def _on(pe, device):
    """A layer's rotary (cos, sin) [1, T, dh] or captured call (hooks.LayerCall) on `device`."""
    if isinstance(pe, hooks.LayerCall):
        return pe.map(lambda t: t.to(device))
    return tuple(t[:1].to(device) for t in pe)


def _forward_traced(lm, token_ids: list[int], layers: frozenset[int], edits: dict | None):
    """One instrumented forward of one sequence -> (captures [1, T, ...] by hook name, rotary
    cos/sin per layer, logits [T, V])."""
    # A CPU engine's recording of this forward, where it has one (serving.torchscript_replay); it
    # keeps tensors only, not the layer calls the generic adapter re-runs its layers with.
    if not edits and not getattr(lm.adapter, "captures_layer_calls", False):
        eng = lm.meta.get("engine")  # set by serving.engine.engine_for: interp never imports serving
        replayed = None if eng is None else eng.recorded_trace(token_ids, layers)
        if replayed is not None:
            return replayed
    rec = Recorder(layers=layers, edits=dict(edits or {}))
    ids = torch.tensor([token_ids], device=lm.device)
    with torch.inference_mode(), recording(rec):
        out = lm.model(input_ids=ids, use_cache=False)
    return rec.store, rec.rope, out.logits[0]


def trace(lm, prompt: str | None = None, token_ids=None, *, layers=None, chat: bool = False,
          max_tokens: int | None = DEFAULT_MAX_TOKENS, truncate: bool = False, edits: dict | None = None) -> Trace:
    """Run one instrumented forward pass of `lm` (a LoadedModel) over a prompt or token ids.

    layers: iterable of layer indices to capture (default all); fewer layers, less memory.
    edits: {hook name: fn(name, tensor) -> tensor} active during this pass only (interventions);
      the Trace then shows the intervened model.
    """
    if token_ids is None:
        token_ids = encode_prompt(lm, prompt if prompt is not None else "", chat=chat,
                                  max_tokens=max_tokens, truncate=truncate)
    else:
        token_ids = [int(t) for t in (token_ids.tolist() if torch.is_tensor(token_ids) else token_ids)]
        if not token_ids:
            raise PromptError("No tokens to trace.")
    n_layers = lm.shape.n_layers
    wanted = sorted(set(range(n_layers) if layers is None else (int(l) for l in layers)))
    if any(l < 0 or l >= n_layers for l in wanted):
        raise PromptError(f"Layers must be between 0 and {n_layers - 1}.")
    instrument(lm.adapter)
    t0 = time.perf_counter()
    # Made before the forward: a host-to-device copy queued after it would wait for the whole pass
    # and leave the token strings below to run serially after it (26 ms at 2,048 tokens on a GPU).
    ids = torch.tensor([token_ids], device=lm.device)  # [1, T]
    if not edits and hooks.active_recorder() is None:  # may share one forward with concurrent traces
        s, rope, logits = batcher_for(lm).trace(token_ids, frozenset(wanted),
                                                lambda ids, lay: _forward_traced(lm, ids, lay, None))
    else:
        s, rope, logits = _forward_traced(lm, token_ids, frozenset(wanted), edits)
    # Read on the host while the device still runs the forward (nothing above waits for it).
    tokens = describe_tokens(lm.tokenizer, token_ids)
    ids = ids.to(logits.device)
    logprobs = torch.full((len(token_ids),), float("nan"), device=logits.device)
    if len(token_ids) > 1:
        with torch.inference_mode():
            lsm = torch.log_softmax(logits[:-1].float(), dim=-1)
            logprobs[1:] = lsm.gather(-1, ids[0, 1:, None].to(lsm.device))[:, 0]
    # A model split over GPUs hands each block its input before accelerate moves it: keep every
    # layer's tensors on that layer's device (a no-op on one device).
    where = {l: s[act_name("attn_out", l)].device for l in wanted}
    tr = Trace(
        model_name=lm.name, token_ids=token_ids, tokens=tokens,
        n_layers=n_layers, captured_layers=wanted,
        resid_pre={l: s[act_name("resid_pre", l)][0].to(where[l]) for l in wanted},
        attn_out={l: s[act_name("attn_out", l)][0] for l in wanted},
        mlp_out={l: s[act_name("mlp_out", l)][0] for l in wanted},
        ln_final=s[act_name("ln_final")][0], next_logits=logits[-1].clone(), token_logprobs=logprobs,
        rope={l: _on(pe, where[l]) for l, pe in ((l, _rotary(pe)) for l, pe in rope.items()) if pe is not None},
        seconds=time.perf_counter() - t0, lm=lm,
        calls={l: _on(pe, where[l]) for l, pe in rope.items() if isinstance(pe, hooks.LayerCall)},
    )
    return tr
