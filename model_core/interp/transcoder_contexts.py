"""What each transcoder feature reads and writes, for the graph's hover and node pages: its top
contexts over held-out windows (the largest activations and the tokens around them, as a feature
set's page shows them, model_core.interp.features_reading) and an automatic label (the n-grams it
fires on -> the tokens its decoder row promotes through the final norm and the unembedding).

Saved beside each layer's coder: `layers.<l>.mlp/contexts.safetensors` (the features_reading
layout) and `layers.<l>.mlp/labels.json`. One pass over the windows serves every layer; memory is
one batch's dense activations per layer plus [latents, k] kept values per layer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from model_core.interp.features_reading import (
    HIST_BINS,
    FeatureContexts,
    finish_contexts,
    label,
    merge_top,
)
from model_core.interp.features_sae import FeaturesCancelled

TOP_K = 8


def scan(lm, tc, windows: torch.Tensor, *, k: int = TOP_K, batch_size: int = 8,
         should_stop: Callable[[], bool] | None = None) -> dict[int, FeatureContexts]:
    """{layer: FeatureContexts} over `windows` [N, W]: every feature's k largest activations."""
    from model_core.interp.transcoder_acts import encode, mlp_pairs

    N, W = windows.shape
    k = max(1, min(int(k), N * (W - 1)))
    state = {}
    for layer, c in tc.coders.items():
        M = int(c.num_latents)
        state[layer] = [torch.full((M, k), float("-inf")), torch.full((M, k), -1, dtype=torch.int64),
                        torch.zeros(M * HIST_BINS, dtype=torch.int64)]
    for b0 in range(0, N, batch_size):
        if should_stop is not None and should_stop():
            raise FeaturesCancelled()
        ids = windows[b0:b0 + batch_size]
        pairs = mlp_pairs(lm, ids, list(tc.coders))
        for layer, (x, _) in pairs.items():
            acts, top_i = encode(tc.coders[layer], x.reshape(-1, x.shape[-1]))  # [B*W, kk]
            vals, idx, hist = state[layer]
            state[layer][:2] = merge_top(vals, idx, hist, acts, top_i, b0, W)
    return {layer: finish_contexts(windows, *s) for layer, s in state.items()}


def promoted_ids(lm, coder, k: int = 3, chunk: int = 1024) -> list[list[int]]:
    """Each feature's k most promoted token ids (its decoder row through the final norm's gain and
    the unembedding)."""
    from model_core.interp.neurons import unembed_direction

    out = []
    with torch.no_grad():
        for c0 in range(0, coder.num_latents, chunk):
            logits = unembed_direction(lm, coder.W_dec[c0:c0 + chunk].float().to(lm.device))
            out += torch.topk(logits, k, dim=1).indices.cpu().tolist()
    return out


def labels(lm, coder, index: FeatureContexts) -> list[str]:
    promoted = promoted_ids(lm, coder)
    return [label(lm, None, index, f, promoted=promoted[f])["label"] for f in range(coder.num_latents)]


def save(folder: Path, index: FeatureContexts, names: list[str]) -> None:
    index.save(Path(folder) / "contexts.safetensors")
    (Path(folder) / "labels.json").write_text(json.dumps(names, ensure_ascii=False), encoding="utf-8")


def load_labels(folder: Path) -> list[str] | None:
    try:
        return json.loads((Path(folder) / "labels.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def load_contexts(folder: Path) -> FeatureContexts | None:
    p = Path(folder) / "contexts.safetensors"
    return FeatureContexts.load(p) if p.is_file() else None
