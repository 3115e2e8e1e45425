"""Feature steering: clamp one sparse-autoencoder feature (model_core.interp.features) to a value in the
forward pass, keeping everything the autoencoder does not explain.

At the feature set's edit point (the hook where its activation is read), from `from_position` on:

    x  ->  x + (value - a_f(x)) * d_f

a_f(x) is the feature's activation in the autoencoder's top-k code of x (0 when it is not among the
k), d_f its decoder row. value = a_f(x) changes nothing; value = 0 ablates the feature; a larger
value pushes along what the feature writes. The reconstruction error x - x_hat is untouched, so the
edit moves the model only along d_f. Position 0 (the attention sink, never trained on) is left
alone by default. Shapes: x [B, T, d_model]; d_f [d_model].

`next_token_shift` is what the clamp does to the next token after a prompt (both distributions and
their KL); a clamped generation is generate(..., edits=feature_edits(...)).
"""

from __future__ import annotations

import math

import torch

from model_core.interp.features import FeatureError, Features, _encode, check_width

MAX_VALUE = 1000.0


def check_value(value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise FeatureError("The feature's clamp value must be a number (0 ablates it).") from None
    if not math.isfinite(v) or abs(v) > MAX_VALUE:
        raise FeatureError(f"The feature's clamp value must be a finite number between {-MAX_VALUE:g} and "
                           f"{MAX_VALUE:g}.")
    return v


def feature_activation(feats: Features, x: torch.Tensor, feature: int) -> torch.Tensor:
    """x [..., d] -> the feature's activation [...] (0 where it is not among the top-k)."""
    acts, idx = _encode(feats.sae, x)  # [rows, k] each
    a = (acts * (idx == feature)).sum(-1)  # [rows]
    return a.reshape(x.shape[:-1]).to(x.device)


def feature_edits(lm, feats: Features, feature, value, *, from_position: int = 1) -> dict:
    """{hook name: edit} clamping `feature` to `value` at positions >= from_position of every forward
    (a decode step's single position always counts as later)."""
    check_set_fits(lm, feats)
    hp = feats.point(lm)
    M = feats.num_latents
    if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < M:
        raise FeatureError(f"Feature {feature} is outside this set (0-{M - 1}).")
    value = check_value(value)
    start = max(0, int(from_position))
    d_f = feats.sae.W_dec.detach()[feature].float()  # [d_model]

    def clamp(name, x):  # x [B, T, d_model]
        lo = 0 if x.shape[1] == 1 else start
        part = x[:, lo:]
        delta = (value - feature_activation(feats, part.float(), feature))[..., None] * d_f.to(x.device)  # [B, T', d]
        out = x.clone()
        out[:, lo:] = (part.float() + delta).to(x.dtype)
        return out

    return {hp.edit_name: clamp}


def check_set_fits(lm, feats: Features) -> None:
    """One sentence when a feature set was trained on another model."""
    if feats.model != lm.name:
        raise FeatureError(f"The feature set '{feats.name}' was trained on {feats.model}, not {lm.name}: "
                           "pick a set of this model.")
    check_width(lm, feats.sae, feats.point(lm))


def next_token_shift(lm, ids: torch.Tensor, edits: dict) -> dict:
    """ids [1, T] -> the next-token log-probabilities as the model runs and with `edits` ([V] each,
    float32) and KL(edited || as it runs) in nats."""
    from model_core.interp.interventions import last_logits

    base = torch.log_softmax(last_logits(lm, ids)[0].float(), -1)  # [V]
    after = torch.log_softmax(last_logits(lm, ids, edits)[0].float(), -1)  # [V]
    kl = float((after.double().exp() * (after.double() - base.double())).sum())
    return {"base": base, "after": after, "kl": max(kl, 0.0)}
