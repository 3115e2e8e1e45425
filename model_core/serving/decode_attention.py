"""Attention for one new token per row over the engine's slot cache, as two grouped matmuls.

transformers' SDPA path packs grouped-query heads for a one-token query only when it runs eagerly;
under torch.compile it repeats every key and value head to the query heads first (3x the cache
read and a copy for SmolLM2's 9 query / 3 key-value heads) and hands a masked query of length 1
to the memory-efficient kernel. The engine's compiled decode step attends here instead: each
key-value head's query heads form a [G, D] block that multiplies the cache once.

Installed as a thin wrapper over transformers' "sdpa" attention that changes nothing unless the
caller passes `slot_decode=True` through the model's keyword arguments (transformers hands them
down to the attention function), so every other forward in the process is untouched.
"""

from __future__ import annotations

import torch

SLOT_DECODE = "slot_decode"  # the keyword the engine passes through model(...)
_installed = False


def grouped_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """query [B, H, 1, D]; key, value [B, Hkv, L, D]; mask [B, 1, 1, L] additive -> [B, 1, H, D]."""
    B, H, _, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    G = H // Hkv
    # batched matmuls over (row, key-value head); reshaping a length-prefix of the cache's
    # [slots, Hkv, max_len, D] stays a view for every L (no guard on L = max_len when compiled)
    q = query.reshape(B * Hkv, G, D)  # the query heads sharing a key-value head
    k = key.reshape(B * Hkv, L, D)
    v = value.reshape(B * Hkv, L, D)
    scores = torch.bmm(q, k.transpose(1, 2)).float() * scaling  # [B*Hkv, G, L]
    scores = scores.view(B, Hkv * G, L) + mask.float().view(B, 1, L)  # mask [B, 1, 1, L]
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(B * Hkv, G, L)
    out = torch.bmm(probs, v)  # [B*Hkv, G, D]
    return out.view(B, 1, H, D)

def install() -> None:
    """Wrap transformers' "sdpa" attention once per process (idempotent)."""
    global _installed
    if _installed:
        return
    from transformers.modeling_utils import AttentionInterface

    original = AttentionInterface._global_mapping["sdpa"]

    def sdpa_or_slot_decode(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if kwargs.pop(SLOT_DECODE, False) and query.shape[2] == 1 and attention_mask is not None \
                and kwargs.get("softcap") is None and kwargs.get("s_aux") is None:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return grouped_decode_attention(query, key, value, attention_mask, scale), None
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    AttentionInterface.register("sdpa", sdpa_or_slot_decode)
    _installed = True
