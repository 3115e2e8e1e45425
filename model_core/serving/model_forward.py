"""The model plumbing of a generation (public transformers APIs only; works on transformers 5.17 and
newer): one forward with the KV cache, and the ids that end a generation.
"""

from __future__ import annotations

import torch

from model_core.core.cache_api import cache_kwarg


def forward_last(lm, ids: torch.Tensor, cache) -> torch.Tensor:
    """ids [1, t] -> logits of the last position [V] (float32); the cache grows by t."""
    out = lm.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(lm.model): cache})
    return out.logits[0, -1].float()


def eos_ids(lm) -> list[int]:
    """The ids that end a generation: the generation config's EOS id(s), then the tokenizer's, each once."""
    ids: list[int] = []
    gc = getattr(lm.model, "generation_config", None)
    for src in (getattr(gc, "eos_token_id", None), getattr(lm.tokenizer, "eos_token_id", None)):
        if src is None:
            continue
        for i in (src if isinstance(src, (list, tuple)) else [src]):
            if int(i) not in ids:
                ids.append(int(i))
    return ids
