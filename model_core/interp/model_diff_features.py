"""Which sparse-autoencoder features fine-tuning changed: a feature set trained on the base model read
under the base and under the tuned model, over the same corpus windows.

Both models run each batch of windows up to the set's hook point only (features_sae.capture: the
blocks above it never run) and the activations are encoded by the set's autoencoder. Per feature and
model: the frequency (the share of counted positions where the feature is among the active top-k with
an activation > 0) and the mean activation (its activation summed over the counted positions, 0 where
it is not active, over their number). Position 0 of every window, the attention sink, is left out as
everywhere in the features code. Counts and sums are float64 and accumulated batch by batch, so at
most `batch_size` x window activation vectors exist at once.

Ranked lists: `appeared` (fires under the tuned model and never under the base on this corpus, by
its tuned frequency), `vanished` (the reverse, by its base frequency) and `shifted` (fires under
both, by |mean_tuned - mean_base|; a feature whose mean did not move is not listed). A model against
itself gives identical statistics and three empty lists.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from model_core.core.errors import SettingsError
from model_core.interp.features_sae import DEFAULT_BATCH, FeatureError, Features, capture, sae_encode
from model_core.interp.model_diff import _check_pair

log = logging.getLogger(__name__)

TOP_FEATURES = 20


@dataclass
class FeatureShift:
    base: str
    tuned: str
    features: str  # the set's name
    hook: str  # the activation it reads, e.g. blocks.1.hook_resid_post
    layer: int
    num_latents: int
    windows: int
    window: int
    positions: int  # counted: windows x (window - 1)
    firing_base: int  # features active at least once under the base
    firing_tuned: int
    appeared: list[dict]  # {feature, freq_base, freq_tuned, mean_base, mean_tuned, label}, by freq_tuned
    vanished: list[dict]  # the same rows, by freq_base
    shifted: list[dict]  # the same rows, by |mean_tuned - mean_base|
    freq_base: list[float]  # [M] share of counted positions where each feature is active
    freq_tuned: list[float]  # [M]
    mean_base: list[float]  # [M] mean activation over the counted positions
    mean_tuned: list[float]  # [M]
    seconds: float = 0.0
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _labels(feats: Features) -> dict[int, str]:
    """feature -> its automatic label, from the set's labels.json ({} when it has none)."""
    if feats.path is None or not (feats.path / "labels.json").is_file():
        return {}
    try:
        rows = json.loads((feats.path / "labels.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        log.warning("unreadable labels.json in %s", feats.path)
        return {}
    return {int(r["feature"]): str(r.get("label", "")) for r in rows if isinstance(r, dict) and "feature" in r}


def _accumulate(lm, feats: Features, hp, ids: torch.Tensor, count: torch.Tensor, total: torch.Tensor) -> None:
    """Add one batch's activity (positions >= 1) into count and total ([M] float64 each)."""
    B, W = ids.shape
    acts, idx = sae_encode(feats.sae, capture(lm, hp, ids))  # [B*W, k] each
    acts, idx = acts.view(B, W, -1)[:, 1:].cpu(), idx.view(B, W, -1)[:, 1:].cpu()  # [B, W-1, k]
    fired = acts > 0  # the top-k of a position names each feature at most once
    f = idx[fired]  # [n] feature numbers of the active entries
    count.index_add_(0, f, torch.ones_like(f, dtype=torch.float64))
    total.index_add_(0, f, acts[fired].double())


def _check(base, tuned, feats: Features, windows: torch.Tensor):
    """The hook point of both models, or one sentence saying why the shift cannot be read."""
    _check_pair(base, tuned)
    if feats.model != base.name:
        raise FeatureError(f"The feature set {feats.name or '(unnamed)'} was trained on {feats.model}, not on "
                           f"{base.name}; choose a set trained on the base model.")
    hp = feats.point(base)  # refuses a layer the model lacks and a width that differs
    feats.point(tuned)
    if windows.ndim != 2 or windows.shape[0] == 0 or windows.shape[1] < 2:
        raise SettingsError("The corpus gave no windows of text to compare; give more text.")
    return hp


def features_shift(base, tuned, feats: Features, windows: torch.Tensor,
                   progress: Callable[[float], None] | None = None, top: int = TOP_FEATURES,
                   batch_size: int = DEFAULT_BATCH) -> FeatureShift:
    """windows: [N, W] token ids (model_core.interp.neurons.corpus_windows), read by `feats` (a set
    trained on `base`) under both models."""
    hp = _check(base, tuned, feats, windows)
    N, W = windows.shape
    M = feats.num_latents
    batch_size = max(1, int(batch_size))
    t0 = time.perf_counter()
    count = {k: torch.zeros(M, dtype=torch.float64) for k in ("base", "tuned")}
    total = {k: torch.zeros(M, dtype=torch.float64) for k in ("base", "tuned")}
    for b0 in range(0, N, batch_size):
        ids = windows[b0:b0 + batch_size].long()
        for key, lm in (("base", base), ("tuned", tuned)):
            _accumulate(lm, feats, hp, ids, count[key], total[key])
        if progress is not None:
            progress(min(b0 + batch_size, N) / N)
    positions = N * (W - 1)
    freq = {k: v / positions for k, v in count.items()}  # [M] each
    mean = {k: v / positions for k, v in total.items()}
    on_b, on_t = count["base"] > 0, count["tuned"] > 0
    names = _labels(feats)

    def rows(mask: torch.Tensor, key: torch.Tensor) -> list[dict]:
        picked = mask.nonzero()[:, 0].tolist()
        picked.sort(key=lambda i: (-float(key[i]), i))
        return [{"feature": i, "freq_base": float(freq["base"][i]), "freq_tuned": float(freq["tuned"][i]),
                 "mean_base": float(mean["base"][i]), "mean_tuned": float(mean["tuned"][i]),
                 "label": names.get(i, "")} for i in picked[:max(0, int(top))]]

    moved = (mean["tuned"] - mean["base"]).abs()  # [M]
    out = FeatureShift(
        base=base.name, tuned=tuned.name, features=feats.name, hook=hp.name, layer=hp.layer, num_latents=M,
        windows=int(N), window=int(W), positions=int(positions),
        firing_base=int(on_b.sum()), firing_tuned=int(on_t.sum()),
        appeared=rows(on_t & ~on_b, freq["tuned"]), vanished=rows(on_b & ~on_t, freq["base"]),
        shifted=rows(on_b & on_t & (moved > 0), moved),
        freq_base=freq["base"].tolist(), freq_tuned=freq["tuned"].tolist(),
        mean_base=mean["base"].tolist(), mean_tuned=mean["tuned"].tolist(),
        seconds=round(time.perf_counter() - t0, 2))
    log.info("feature shift %s -> %s on %s: %d positions, %d / %d features firing", base.name, tuned.name,
             hp.name, positions, out.firing_base, out.firing_tuned)
    return out
