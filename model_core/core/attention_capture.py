"""lmscope's own attention function, registered with transformers as attn_implementation "lmscope".

Families without a hand adapter (model_core.core.generic_adapter) do not get their q/k/v
recomputed by hand: their attention modules call this function with the exact tensors the model
uses (after RoPE, QK-norm, ...), and the mask, scaling, softcap, sliding window and sinks they were
given. The output is transformers' own SDPA (eager maths only where SDPA cannot: softcap, sinks);
when the active Recorder asks for a layer's pattern, the softmax is computed beside it and kept.
transformers' global "sdpa" entry is never overridden: only models loaded with
attn_implementation="lmscope" go through here.
"""

from __future__ import annotations

import logging
import sys

import torch

from model_core.core.hooks import active_recorder

log = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "lmscope"
_REGISTERED = False


def _layer_of(module) -> int | None:
    """The decoder-layer index of an attention module (set by the generic adapter, else transformers')."""
    i = getattr(module, "_lmscope_layer", None)
    return i if i is not None else getattr(module, "layer_idx", None)


def _mask_scores(scores: torch.Tensor, attention_mask, sliding_window) -> torch.Tensor:
    """scores [B, H, Q, K] with the model's mask applied (-inf where a key may not be seen). No mask
    given (transformers skips it when it is plain causal): causal, aligned on the last query, and
    the sliding window the module passed (key j visible from query i when j > i - window)."""
    q_len, k_len = scores.shape[-2:]
    if attention_mask is None:
        i = torch.arange(k_len - q_len, k_len, device=scores.device)[:, None]
        j = torch.arange(k_len, device=scores.device)[None, :]
        allowed = j <= i
        if sliding_window:
            allowed = allowed & (j > i - sliding_window)
        return scores.masked_fill(~allowed, float("-inf"))
    mask = attention_mask[..., :k_len]
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask


def _repeat(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, H_kv, T, dh] -> [B, H, T, dh], each key/value head repeated for its query heads."""
    return x.repeat_interleave(n_heads // x.shape[1], dim=1) if x.shape[1] != n_heads else x


def lmscope_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      **kwargs):
    """The AttentionInterface function: query [B, H, Q, dh], key / value [B, H_kv, K, dh] ->
    (output [B, Q, H, dh], weights or None), as transformers' attention functions return."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rec = active_recorder()
    layer = _layer_of(module)
    wants = rec is not None and layer is not None and layer in rec.patterns
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if not (wants or softcap or sinks is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    k = _repeat(key, query.shape[1])  # [B, H, K, dh]
    v = _repeat(value, query.shape[1])
    raw = torch.matmul(query, k.transpose(-1, -2))  # [B, H, Q, K]
    scaled = raw * scale
    if softcap:
        scaled = torch.tanh(scaled / softcap) * softcap
    masked = _mask_scores(scaled, attention_mask, kwargs.get("sliding_window"))
    if sinks is not None:  # one extra logit per head that takes probability mass and no value
        sink = sinks.reshape(1, -1, 1, 1).expand(*masked.shape[:-1], 1).to(masked.dtype)
        probs = torch.softmax(torch.cat([masked, sink], dim=-1).float(), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(masked.float(), dim=-1)  # [B, H, Q, K]
    if wants and sinks is not None:
        probs = _family_weights(module, query, key, value, masked, scaling, kwargs, probs)
    if wants:
        rec.patterns_out[layer] = {"q": query[0], "k": k[0], "v": value[0], "raw_scores": raw[0],
                                   "scaled_scores": scaled[0], "mask": torch.isfinite(masked[0, 0]),
                                   "probs": probs[0]}
    if softcap or sinks is not None:
        out = torch.matmul(probs.to(v.dtype), v).transpose(1, 2).contiguous()  # [B, Q, H, dh]
        return out, probs.to(v.dtype)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


def _family_weights(module, query, key, value, masked, scaling, kwargs, probs):
    """The weights the family's own eager attention reports, given the mask applied above: families
    differ in what a pattern with sinks is (GPT-OSS drops the sink's column after the softmax;
    Granite SWA scales the output by the sink and reports the softmax without it). `probs` where
    the family's module has no eager function."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        return probs
    additive = torch.zeros(masked.shape[-2:], dtype=query.dtype, device=query.device)
    additive = additive.masked_fill(~torch.isfinite(masked[0, 0]), float("-inf"))[None, None]
    kw = {k: v for k, v in kwargs.items() if k not in ("dropout", "scaling")}
    try:
        _, weights = eager(module, query, key, value, additive, dropout=0.0, scaling=scaling, **kw)
    except TypeError:  # an eager function with another signature: the interface's reading
        return probs
    return probs if weights is None else weights.float()


def register() -> str:
    """Register "lmscope" with transformers' attention and mask interfaces (idempotent); the mask is
    SDPA's, so the model hands this function exactly the mask it would hand SDPA."""
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(ATTN_IMPLEMENTATION, lmscope_attention)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
        _REGISTERED = True
    return ATTN_IMPLEMENTATION
