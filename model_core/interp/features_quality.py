"""A feature set's quality on held-out windows: FVU over every activation, and the CE loss clean,
with the reconstruction spliced in at the hook, and with the hook zero-ablated (CE recovered).
Position 0 of every window (the attention sink) stays clean and is not scored.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from model_core.core.hooks import Recorder, instrument, recording
from model_core.interp.features_sae import DEFAULT_BATCH, Features, FeaturesCancelled, sae_decode, sae_encode


def ce_loss(lm, ids: torch.Tensor, edits: dict | None = None) -> float:
    """transformers' labels= loss (mean over every next-token prediction of the batch), edits active."""
    instrument(lm.adapter)
    ids = ids.to(lm.device)
    with torch.inference_mode(), recording(Recorder(capture=False, edits=dict(edits or {}))):
        return float(lm.model(input_ids=ids, labels=ids, use_cache=False).loss)


def splice_edit(fn: Callable[[torch.Tensor], torch.Tensor]):
    """An edit replacing positions >= 1 of the activation with fn(x[:, 1:]) (position 0 stays clean)."""
    def edit(name, x):
        out = x.clone()
        out[:, 1:] = fn(x[:, 1:]).to(x.dtype)
        return out
    return edit


def evaluate(lm, feats: Features, windows: torch.Tensor, *, batch_size: int = DEFAULT_BATCH,
             should_stop: Callable[[], bool] | None = None) -> dict:
    """FVU and CE recovered on `windows` [N, T] (positions >= 1): three forwards per batch (clean,
    reconstruction spliced in, zero-ablated)."""
    hp = feats.point(lm)
    sae = feats.sae
    n = 0
    sx = torch.zeros(lm.shape.d_model, dtype=torch.float64)
    sxx = see = 0.0
    ce = {"clean": 0.0, "sae": 0.0, "zero": 0.0}
    preds = 0
    fired = torch.zeros(sae.num_latents, dtype=torch.bool)
    l0 = 0.0

    def spliced(v):  # v [B, T-1, d]: reconstruct, and keep the sums FVU needs
        nonlocal n, sxx, see, l0
        xs = v.reshape(-1, v.shape[-1]).float()
        acts, idx = sae_encode(sae, xs)
        xh = sae_decode(sae, acts, idx).to(xs.device)
        sx.add_(xs.double().sum(0).cpu())
        sxx += float(xs.double().pow(2).sum())
        see += float((xs - xh).double().pow(2).sum())
        n += xs.shape[0]
        fired[idx[acts > 0].cpu()] = True
        l0 += float((acts > 0).sum())
        return xh.reshape(v.shape)

    for b0 in range(0, windows.shape[0], batch_size):
        if should_stop is not None and should_stop():
            raise FeaturesCancelled()
        ids = windows[b0:b0 + batch_size]
        p = ids.shape[0] * (ids.shape[1] - 1)
        ce["clean"] += ce_loss(lm, ids) * p
        ce["sae"] += ce_loss(lm, ids, {hp.edit_name: splice_edit(spliced)}) * p
        ce["zero"] += ce_loss(lm, ids, {hp.edit_name: splice_edit(torch.zeros_like)}) * p
        preds += p
    total_var = sxx - float(sx.pow(2).sum()) / n
    fvu = see / total_var
    c = {k: v / preds for k, v in ce.items()}
    denom = c["zero"] - c["clean"]
    return {"fvu": fvu, "explained": 1 - fvu, "ce_clean": c["clean"], "ce_sae": c["sae"], "ce_zero": c["zero"],
            "ce_recovered": (c["zero"] - c["sae"]) / denom if denom != 0 else float("nan"),
            "ce_increase": c["sae"] - c["clean"], "l0": l0 / n, "alive_share": float(fired.float().mean()),
            "windows": int(windows.shape[0]), "context": int(windows.shape[1]), "activations": n,
            "predictions": preds}
