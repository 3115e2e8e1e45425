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

from model_core.core.row_edits import RowEdit, RowSlot, same_device
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
    return {hp.edit_name: ClampFeature(feats, feature, check_value(value), from_position)}


class ClampFeature(RowEdit):
    """x -> x + (value - a_f(x)) d_f at positions >= start (a decode step's single position always
    counts as later); the engine runs it per row (ClampSlot)."""

    def __init__(self, feats: Features, feature: int, value: float, start: int = 1):
        self.feats, self.feature, self.value, self.start = feats, int(feature), float(value), max(0, int(start))
        self.d_f = feats.sae.W_dec.detach()[self.feature].float()  # [d_model]

    def __call__(self, name, x):  # x [B, T, d_model]
        lo = 0 if x.shape[1] == 1 else self.start
        part = x[:, lo:]
        delta = (self.value - feature_activation(self.feats, part.float(), self.feature))[..., None] \
            * self.d_f.to(x.device)  # [B, T', d]
        out = x.clone()
        out[:, lo:] = (part.float() + delta).to(x.dtype)
        return out

    def slot_key(self, name):
        return (name, "clamp", id(self.feats.sae))  # one slot per autoencoder: its weights are the step's

    def new_slot(self, name, slots, dtype, device):
        return ClampSlot(name, slots, self.feats, device)

    def runs_on(self, device):
        return same_device(self.feats.sae.device, device)


class ClampSlot(RowSlot):
    """Per row: the clamped feature, its value, and whether the row clamps at all (rows that do not
    keep x exactly: torch.where, not an added zero)."""

    BUFFERS = ("feature", "value", "on")

    def __init__(self, name: str, slots: int, feats: Features, device):
        super().__init__(name, slots)
        self.feats = feats
        self.feature = torch.zeros(slots, dtype=torch.long, device=device)  # [S]
        self.value = torch.zeros(slots, dtype=torch.float32, device=device)  # [S]
        self.on = torch.zeros(slots, dtype=torch.bool, device=device)  # [S]
        # detached here, not in the step: a recording holds them as constants, and one made from a
        # parameter inside the recorded call would carry its grad
        sae = feats.sae
        self.W_enc, self.b_enc = sae.encoder.weight.detach(), sae.encoder.bias.detach()  # [M, d], [M]
        self.b_dec, self.W_dec = sae.b_dec.detach(), sae.W_dec.detach()  # [d], [M, d]

    def reset(self, row):
        self.on[row] = False

    def write(self, row, edit):
        self.feature[row], self.value[row], self.on[row] = edit.feature, edit.value, True

    def _encode(self, x: torch.Tensor):
        """x [B, d] float32 -> (top acts, top indices) [B, k] each: the autoencoder's own encode
        (sparsify's SparseCoder.encode) on the detached weights."""
        from sparsify.fused_encoder import fused_encoder

        cfg = self.feats.sae.cfg
        if not cfg.transcode:
            x = x - self.b_dec
        out = fused_encoder(x, self.W_enc, self.b_enc, cfg.k, cfg.activation)
        return out.top_acts.float(), out.top_indices

    def apply(self, x):  # x [B, 1, d] or [B, d]
        B = x.shape[0]
        flat = x.reshape(B, x.shape[-1])  # [B, d]: one position per row
        acts, idx = self._encode(flat.float())  # [B, k] each
        f = self.feature[:B]
        a = (acts * (idx == f[:, None])).sum(-1)  # [B]
        d = self.W_dec[f].float()  # [B, d]
        new = (flat.float() + (self.value[:B] - a)[:, None] * d).to(x.dtype)  # [B, d]
        return torch.where(self.on[:B, None], new, flat).view_as(x)


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
