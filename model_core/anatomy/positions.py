"""Positions: the sinusoidal encoding, RoPE as this model applies it (its frequencies, angles, one
pair turned by hand, the score of two vectors against their distance), and learned positions.
"""

from __future__ import annotations

import math

import torch

from model_core.anatomy.architecture_card import rope_thetas
from model_core.core.adapters import apply_rope
from model_core.core.errors import PromptError


def sinusoidal_encoding(n_positions: int, d_model: int, base: float = 10000.0) -> torch.Tensor:
    """The original Transformer's encoding [n_positions, d_model]:
    PE[p, 2i] = sin(p / base^(2i/d)), PE[p, 2i+1] = cos(p / base^(2i/d))."""
    if n_positions < 1 or d_model < 2 or d_model % 2:
        raise PromptError("Sinusoidal encoding needs at least one position and an even d_model >= 2.")
    pos = torch.arange(n_positions, dtype=torch.float64)[:, None]
    i = torch.arange(0, d_model, 2, dtype=torch.float64)
    angle = pos / base ** (i / d_model)
    pe = torch.zeros(n_positions, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)
    return pe.float()


def rope_inv_freq(lm, layer: int = 0) -> torch.Tensor:
    """[head_dim/2] rotation frequencies the model uses at this layer (from its rotary module's
    buffers; Gemma 3 keeps one set per layer type). Falls back to theta^(-2i/d) from config."""
    ad = lm.adapter
    if not ad.uses_rope:
        raise PromptError(f"Model '{lm.name}' does not use RoPE.")
    rot = getattr(getattr(lm.model, "model", None), "rotary_emb", None)
    types = getattr(lm.model.config, "layer_types", None)
    if rot is not None:
        if types and hasattr(rot, f"{types[layer]}_inv_freq"):
            return getattr(rot, f"{types[layer]}_inv_freq").detach().float().cpu()
        if hasattr(rot, "inv_freq"):
            return rot.inv_freq.detach().float().cpu()
    thetas = rope_thetas(lm.model.config)
    theta = thetas.get(types[layer] if types else "all layers") or next(iter(thetas.values()))
    d = lm.shape.d_head
    return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)


def rope_angles(lm, layer: int = 0, n_positions: int = 64) -> torch.Tensor:
    """[n_positions, head_dim/2]: angle (radians) by which dimension pair i is rotated at
    position p: p * inv_freq[i]. (HF's rotate-half layout pairs dimension i with i + d/2.)"""
    return torch.arange(n_positions, dtype=torch.float32)[:, None] * rope_inv_freq(lm, layer)[None, :]


def rope_rotate(x: torch.Tensor, position: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate vector(s) x [..., d] as if at `position` (rotate-half convention)."""
    ang = position * inv_freq
    emb = torch.cat([ang, ang])
    return apply_rope(x, emb.cos(), emb.sin())


def rope_pair_example(q_pre: torch.Tensor, inv_freq: torch.Tensor, position: int, pair: int = 0) -> dict:
    """One dimension pair of one vector rotated by hand, in this model's layout (rotate_half):
    pair i is (dimension i, dimension i + d/2), turned by the angle position x theta_i:
      a' = a cos(p theta_i) - b sin(p theta_i),  b' = b cos(p theta_i) + a sin(p theta_i).
    The papers' adjacent-pair form pairs dimensions (2i, 2i+1) instead: the same rotation of a
    differently ordered vector (converted checkpoints permute the rows of W_q and W_k)."""
    d = q_pre.numel()
    half = d // 2
    angle = position * float(inv_freq[pair])
    a, b = float(q_pre[pair]), float(q_pre[pair + half])
    return {"pair": pair, "dims": (pair, pair + half), "theta": float(inv_freq[pair]), "angle": angle,
            "position": position, "before": (a, b),
            "after": (a * math.cos(angle) - b * math.sin(angle), b * math.cos(angle) + a * math.sin(angle))}


def rope_full_turn_positions(inv_freq: torch.Tensor) -> float:
    """Positions the slowest pair needs for one full turn: 2 pi / theta_min."""
    return 2 * math.pi / float(inv_freq[-1])


def rope_score_vs_distance(lm, layer: int = 0, max_distance: int = 256, q: torch.Tensor | None = None,
                           k: torch.Tensor | None = None, query_position: int | None = None) -> dict:
    """Score q_m . k_n of two fixed vectors after RoPE, as a function of distance m - n.
    Default vectors: all ones (every pair contributes 2 cos((m-n) theta_i)). The result depends
    only on the distance, not on where the pair sits: that is RoPE's relative-position property."""
    inv = rope_inv_freq(lm, layer)
    d = inv.numel() * 2
    q = torch.ones(d) if q is None else q.float().cpu()
    k = torch.ones(d) if k is None else k.float().cpu()
    m = max_distance if query_position is None else query_position
    dist = torch.arange(0, max_distance + 1)
    scores = torch.stack([rope_rotate(q, m, inv) @ rope_rotate(k, m - int(t), inv) for t in dist])
    return {"distance": dist, "score": scores, "unrotated": float(q @ k)}


def learned_positions(lm, n_positions: int | None = None) -> torch.Tensor | None:
    """GPT-2's learned position-embedding matrix [n_positions, d] (None for RoPE models)."""
    wpe = getattr(getattr(lm.model, "transformer", None), "wpe", None)
    if wpe is None:
        return None
    w = wpe.weight.detach().float().cpu()
    return w if n_positions is None else w[:n_positions]
