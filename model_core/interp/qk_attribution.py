"""QK attribution: why a head attended from one position to another, in terms of the attribution
graph's nodes. A graph's edges treat attention patterns as fixed; this explains one pattern entry.

In the frozen replacement model (model_core.interp.attribution_graph) the residual stream entering
layer l at position p is an exact sum of terms: the token embedding, and for every earlier layer its
attention output, each active transcoder feature (activation x decoder row), the error node, the
skip connection's output and the decoder bias. The attention norm with its scale frozen is linear
(plus its bias), the query and key projections are linear (plus their biases) and rotary embedding
is linear at a fixed position, so the pre-softmax score of head h, query position q, key position k

    score = scale * (sum_i Q_i) . (sum_j K_j)        (Q_i: query term i through norm, W_Q, RoPE at q)

splits exactly into query-side contributions Q_i . K * scale, key-side contributions Q . K_j * scale,
and pairs Q_i . K_j * scale; both sides sum to the score, which is checked against the model's own
score (from the real forward) and shown with the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_core.interp.attribution_graph import FrozenModel, LinearNorm
from model_core.interp.features_sae import FeatureError

TOLERANCE = 1e-3  # the terms' sum against the model's score, relative to max(1, |score|)


@dataclass
class QKAttribution:
    layer: int
    head: int
    query_pos: int
    key_pos: int
    score: float  # the model's own scaled pre-softmax score
    pattern: float  # the attention weight (after the softmax)
    query_terms: list[tuple[str, float]]  # (term, contribution), largest |contribution| first
    key_terms: list[tuple[str, float]]
    pairs: list[tuple[str, str, float]]  # (query term, key term, contribution), the largest
    check: dict

    def to_dict(self) -> dict:
        return {"layer": self.layer, "head": self.head, "query_pos": self.query_pos, "key_pos": self.key_pos,
                "score": self.score, "pattern": self.pattern,
                "query_terms": [{"term": t, "contribution": c} for t, c in self.query_terms],
                "key_terms": [{"term": t, "contribution": c} for t, c in self.key_terms],
                "pairs": [{"query": a, "key": b, "contribution": c} for a, b, c in self.pairs], "check": self.check}


def residual_terms(fm: FrozenModel, parts: dict, layer: int, pos: int) -> tuple[list[str], torch.Tensor]:
    """The terms whose sum is the residual stream entering `layer` at `pos` in the frozen model:
    (labels, vectors [n, d]). Feature terms carry the graph's node ids (F{layer}.{pos}.{feature})."""
    labels, vecs = ["T%d" % pos], [fm.leaves.emb[pos]]
    for src in range(layer):
        coder = fm.tc.coders[src]
        labels.append(f"attention L{src}")
        vecs.append(parts[("attention", src)][pos])
        acts = fm.leaves.acts[src][pos]
        for f in (acts != 0).nonzero().flatten().tolist():  # signed: TopK and JumpReLU sets from elsewhere
            labels.append(f"F{src}.{pos}.{f}")
            vecs.append(acts[f] * coder.W_dec[f].float())
        labels.append(f"E{src}.{pos}")
        vecs.append(fm.leaves.errs[src][pos])
        if parts.get(("skip", src)) is not None:
            labels.append(f"skip L{src}")
            vecs.append(parts[("skip", src)][pos])
        labels.append(f"decoder bias L{src}")
        vecs.append(coder.b_dec.float())
    return labels, torch.stack(vecs)


def _linear_norm(norm: LinearNorm, x: torch.Tensor, pos: int) -> torch.Tensor:
    """The frozen norm's linear part at position `pos` (without its bias), applied to rows x [n, d]."""
    if norm.centred:
        x = x - x.mean(-1, keepdim=True)
    return norm.g * x * norm.s[pos]


def _projected(fm: FrozenModel, layer: int, pos: int, rows: torch.Tensor, which: int) -> torch.Tensor:
    """rows [n, d] (already normalised) -> their queries (which=0) or keys (1) at position `pos`,
    [heads, n, dh], the projection's bias left out (it is a term of its own)."""
    ad, lm = fm.lm.adapter, fm.lm
    rope = fm.rope[layer]
    n = rows.shape[0]
    if rope is not None and isinstance(rope, tuple):
        cos, sin = rope
        rope = (cos[:, pos:pos + 1].expand(-1, n + 1, -1), sin[:, pos:pos + 1].expand(-1, n + 1, -1))
    with torch.no_grad():
        out = ad.qkv(layer, torch.cat([rows, rows.new_zeros(1, rows.shape[1])]).to(lm.dtype), rope)[which].float()
    return torch.cat([out[:, :n] - out[:, n:], out[:, n:]], dim=1)  # the last row: the bias alone


def qk_attribution(fm: FrozenModel, layer: int, head: int, query_pos: int, key_pos: int, top: int = 12
                   ) -> QKAttribution:
    """The score of `head` at `layer` from query_pos to key_pos, split over the residual terms at
    both positions (module docstring)."""
    ad = fm.lm.adapter
    H = fm.lm.shape.n_heads
    for name, v, hi in (("layer", layer, fm.L - 1), ("head", head, H - 1), ("query position", query_pos, fm.T - 1),
                        ("key position", key_pos, fm.T - 1)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
            raise FeatureError(f"The {name} must be a whole number from 0 to {hi}.")
    if key_pos > query_pos:
        raise FeatureError("The key position must not come after the query position (the attention is causal).")
    attn = ad.layers[layer].self_attn if hasattr(ad.layers[layer], "self_attn") else None
    if attn is not None and hasattr(attn, "q_norm"):
        raise FeatureError(f"QK attribution does not handle per-head query and key norms ({fm.lm.name}) yet.")
    parts: dict = {}
    with torch.no_grad():
        fm.forward(fm.leaves, parts)
    norm = fm.attn_norm[layer]
    sides = []
    for which, pos in ((0, query_pos), (1, key_pos)):
        labels, vecs = residual_terms(fm, parts, layer, pos)
        rows = torch.cat([_linear_norm(norm, vecs, pos), norm.b[None]])  # the norm's bias: a term of its own
        proj = _projected(fm, layer, pos, rows, which)  # [heads, n + 2, dh]
        h = head if which == 0 else head // (H // proj.shape[0])
        sides.append((labels + ["attention norm bias", "projection bias"], proj[h]))
    (q_labels, Q), (k_labels, K) = sides
    scale = ad.attention_scale(layer)
    pairs = (Q @ K.T) * scale  # [n_q, n_k]
    total = float(pairs.sum())
    with torch.no_grad():
        real = ad.attend(layer, ad.attn_norm(ad.layers[layer])(fm.resid_pre[layer].to(fm.lm.dtype)), fm.rope[layer])
    score, pattern = float(real.scaled_scores[head, query_pos, key_pos]), float(real.probs[head, query_pos, key_pos])
    q_contrib, k_contrib = pairs.sum(1), pairs.sum(0)
    order = torch.argsort(pairs.abs().flatten(), descending=True)[:top].tolist()
    diff = abs(total - score)
    tol = TOLERANCE * max(1.0, abs(score))

    def ranked(labels, c):
        return [(labels[i], float(c[i])) for i in torch.argsort(c.abs(), descending=True)[:top].tolist()]

    return QKAttribution(
        layer=layer, head=head, query_pos=query_pos, key_pos=key_pos, score=score, pattern=pattern,
        query_terms=ranked(q_labels, q_contrib), key_terms=ranked(k_labels, k_contrib),
        pairs=[(q_labels[i // len(k_labels)], k_labels[i % len(k_labels)], float(pairs.flatten()[i])) for i in order],
        check={"terms_sum": total, "model_score": score, "abs_diff": diff, "tolerance": tol, "ok": diff <= tol,
               "terms": [len(q_labels), len(k_labels)],
               "what": "the query-key pairs' contributions summed against the model's own pre-softmax score"})
