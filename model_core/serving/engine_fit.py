"""Whether a model's generation fits the engine's slot cache, decided from the model itself.

The engine (`model_core.serving.engine`) keeps per layer one key tensor and one value tensor of
[slots, kv_heads, max_len, head_dim] (`SlotCache`) and feeds the model explicit positions and
masks. Families whose cache is something else (multi-head latent attention's keys and values of
different head sizes, linear-attention or convolution state in hybrids, key/value layers shared
across layers, recurrent models that run their layers several times per token, a forward that
asks the cache for more than `update`) generate on transformers' own `DynamicCache` instead
(`model_core.serving.request_forwards`), with the same per-step records.

`engine_fit(lm)` decides once per model and logs the fallback's reason once:

  1. the layer kinds the config names (`config.layer_types`) are all softmax attention;
  2. a reference prefill and step on transformers' cache: every cache layer holds plain 4-D keys
     and values of one head size, one cache layer per decoder layer;
  3. a trial: the same prefill copied into a one-slot `SlotCache` and the same step run as the
     engine's decode step runs it (explicit positions, the slot mask); its logits must equal the
     reference step's.

It also says whether the engine may prefill from the decoder's last hidden state through the
adapter's unembedding (captured CUDA prefills, the CPU's recorded prefills): a family whose head
does more than the adapter's unembedding (ModernBERT-decoder's prediction head) prefills with the
model's own forward instead.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

import torch

from model_core.core.cache_api import cache_kwarg, new_cache, sliding_window_of

log = logging.getLogger(__name__)

ATTENTION_KINDS = ("full_attention", "sliding_attention")
TRIAL_TOKENS = 6  # prompt tokens of the trial prefill (one more for the trial step)


@dataclass(frozen=True)
class EngineFit:
    fits: bool  # the engine may run this model's generations
    reason: str | None = None  # why not, one sentence (None when it fits)
    hidden_prefill: bool = True  # prefills may go through the decoder's hidden state + the adapter's head


_FITS: dict[int, EngineFit] = {}
_LOCK = threading.Lock()


def engine_fit(lm) -> EngineFit:
    """The model's EngineFit, computed on first use (a few short forwards) and kept while it is loaded.
    A model that does not fit is logged once, with the reason."""
    key = id(lm)
    with _LOCK:
        fit = _FITS.get(key)
        if fit is None:
            fit = _decide(lm)
            _FITS[key] = fit
            weakref.finalize(lm, _FITS.pop, key, None)
            if not fit.fits:
                log.info("generation for %s runs on transformers' own cache, one request at a time: %s",
                         lm.name, fit.reason)
            elif not fit.hidden_prefill:
                log.info("the engine prefills %s with the model's own forward: its head is more than the "
                         "adapter's unembedding", lm.name)
    return fit


def _decide(lm) -> EngineFit:
    kinds = sorted({t for t in (getattr(lm.model.config, "layer_types", None) or []) if t not in ATTENTION_KINDS})
    if kinds:
        return EngineFit(False, f"its layers include {', '.join(map(str, kinds))}, which are not softmax attention.")
    try:
        with torch.inference_mode():
            return _trial(lm)
    except Exception as e:  # noqa: BLE001 - any failure of the trial means the slot cache does not fit
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        return EngineFit(False, f"its forward cannot run on the slot cache ({first}).")


def _trial_ids(lm) -> torch.Tensor:
    vocab = int(lm.shape.vocab_size)
    return (torch.arange(TRIAL_TOKENS + 1, device=lm.device) * 7 + 3) % vocab  # [n + 1]


def _trial(lm) -> EngineFit:
    from model_core.serving.cuda_prefill_graphs import decoder_prefill, eager_prefill
    from model_core.serving.slot_cache import SlotCache

    n, ids = TRIAL_TOKENS, _trial_ids(lm)
    kw = cache_kwarg(lm.model)
    ref_cache = new_cache(lm)
    lm.model(input_ids=ids[None, :n], use_cache=True, logits_to_keep=1, **{kw: ref_cache})
    problem = _cache_problem(lm, ref_cache)
    if problem is not None:
        return EngineFit(False, problem)
    want = lm.model(input_ids=ids[None, n:], use_cache=True, logits_to_keep=1, **{kw: ref_cache}).logits[0, -1].float()

    pre, first = eager_prefill(lm, ids[None, :n], [n])
    problem = _cache_problem(lm, pre)
    if problem is not None:
        return EngineFit(False, problem)
    shapes = [(int(layer.keys.shape[1]), int(layer.keys.shape[3])) for layer in pre.layers]
    cache = SlotCache(shapes, 1, n + 1, lm.dtype, lm.device, sliding_window_of(lm),
                      getattr(lm.model.config, "layer_types", None) is not None)
    cache.load_rows(torch.tensor([0], device=lm.device), pre, n)
    pos = torch.tensor([n], device=lm.device)
    mask = cache.window(1, n + 1, pos)
    got = lm.model(input_ids=ids[None, n:], position_ids=pos[:, None], attention_mask=mask, use_cache=True,
                   logits_to_keep=1, **{kw: cache}).logits[0, -1].float()
    off = _relative_gap(got, want)
    if off > _tolerance(lm):
        return EngineFit(False, f"a decode step on the slot cache differs from one on transformers' cache "
                                f"(logits off by {off:.2g} of their spread).")

    _, hidden = decoder_prefill(lm, ids[None, :n])
    from_hidden = lm.adapter.logits_from_normed(hidden[:, -1]).float()[0]
    hidden_prefill = _relative_gap(from_hidden, first[0]) <= _tolerance(lm)
    return EngineFit(True, None, hidden_prefill)


def _cache_problem(lm, cache) -> str | None:
    """Why transformers' cache after a prefill is not one plain key/value pair per layer (None: it is)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return "its cache has no per-layer keys and values."
    n_layers = int(lm.shape.n_layers)
    if len(layers) != n_layers:
        return (f"its cache has {len(layers)} layers for {n_layers} decoder layers "
                "(key/value layers shared or run more than once).")
    for l, layer in enumerate(layers):
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if type(layer).__name__ == "DummyLayer":  # transformers' placeholder of a layer reading another's
            return f"its layer {l} reuses another layer's keys and values (shared key/value layers)."
        if not (torch.is_tensor(k) and torch.is_tensor(v) and k.dim() == 4 and v.dim() == 4 and k.numel()):
            return f"its cache layer {l} ({type(layer).__name__}) holds no plain keys and values (a state instead)."
        if k.shape != v.shape:
            return (f"its cache layer {l} holds keys {tuple(k.shape)} and values {tuple(v.shape)} of different "
                    "sizes (latent attention).")
    return None


def _relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over the spread of b's values (logits of any scale)."""
    return float((a - b).abs().max() / (b.std() + 1e-6))


def _tolerance(lm) -> float:
    """float32 agrees to rounding; half precision runs other kernels for a padded mask than for none."""
    return 1e-3 if lm.dtype == torch.float32 else 5e-2
