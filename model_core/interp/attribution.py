"""Direct logit attribution (DLA): how much each component writes toward a target token.

The residual stream at the last layer is a sum of what each component wrote:
    resid_final = embed + sum_l (attn_out[l] + mlp_out[l])                        (exact)
    attn_out[l] = sum_h o_proj(z[l] with only head h kept) + b_O[l]                (exact, linear)
The final norm is not linear, but with its scale FROZEN at the value the real forward computed
at that position (RMSNorm: s = 1/sqrt(mean(x^2) + eps); LayerNorm: s = 1/sqrt(var(x) + eps),
with every component also centred), it is a linear map N(c) = g * c * s (LayerNorm: g * (c -
mean(c)) * s), plus the norm's bias b_N (LayerNorm only). So, with u = W_U[target] (minus
W_U[other] for a logit difference):

    logit = u . N(embed) + sum_l u . N(attn_out[l]) + sum_l u . N(mlp_out[l]) + u . b_N + b_U

holds EXACTLY (to float rounding), because N applied to the whole residual with its own scale is
the real final norm. Per head: u . N(head output) summed over heads plus the layer's attention
bias term equals the layer's attention term. Gemma 3 normalises each attention output again
(post-attention norm) before adding it to the residual; the per-head split is taken through that
norm with ITS scale frozen the same way. Gemma-style final logit soft-capping (tanh) is applied
after this decomposition: the attributions add up to the logit BEFORE the cap.

What this is not: a total effect. A head can write toward " Paris" and a later component can
erase it; ablation and patching (interventions.py) measure total effects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from model_core.core.adapters import is_norm
from model_core.core.hook_names import act_name
from model_core.core.prompts import prompt_ids
from model_core.interp.interventions import Metric, trace_with_edits


def frozen_norm(norm: nn.Module, x: torch.Tensor):
    """Linearise a final/post norm at the input x [d] it really saw. Returns (apply, bias, scale):
    apply(c [..., d]) is linear in c, and apply(x) + bias equals norm(x)."""
    x = x.float()
    if isinstance(norm, nn.LayerNorm):
        eps = norm.eps
        s = 1.0 / torch.sqrt(x.var(unbiased=False) + eps)
        g = norm.weight.float() if norm.weight is not None else torch.ones_like(x)
        b = norm.bias.float() if norm.bias is not None else torch.zeros_like(x)
        return (lambda c: (c.float() - c.float().mean(-1, keepdim=True)) * s * g), b, float(s)
    # RMSNorm family (Llama's w * x, Gemma's (1 + w) * x, ...): read the gain off the module by
    # feeding it a vector of ones, whose mean square is exactly 1.
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        eps = getattr(norm, "eps", 1e-6)
    ones = torch.ones_like(x, dtype=next(norm.parameters()).dtype if any(True for _ in norm.parameters()) else x.dtype)
    with torch.inference_mode():
        g = norm(ones[None])[0].float() * math.sqrt(1.0 + eps)
    s = torch.rsqrt(x.pow(2).mean() + eps)
    return (lambda c: c.float() * s * g), torch.zeros_like(x), float(s)


@dataclass
class Attribution:
    target: int
    other: int | None
    position: int
    embed: float  # u . N(embedding (+ positions))
    attn: torch.Tensor  # [L] per layer's attention
    mlp: torch.Tensor  # [L]
    heads: torch.Tensor  # [L, H]; heads[l].sum() + attn_bias[l] == attn[l]
    attn_bias: torch.Tensor  # [L] output-projection bias term (0 for bias-free models)
    final_bias: float  # u . b_N + b_U (LayerNorm bias, unembedding bias)
    logit: float  # the model's own (pre-softcap) logit of target (minus other) at `position`
    final_scale: float  # the frozen final-norm scale s
    token_ids: list[int]

    @property
    def total(self) -> float:
        """embed + every attention and MLP + final bias: equals `logit`."""
        return self.embed + float(self.attn.sum()) + float(self.mlp.sum()) + self.final_bias

    def to_dict(self) -> dict:
        return {"target": self.target, "other": self.other, "position": self.position, "embed": self.embed,
                "attn": self.attn.tolist(), "mlp": self.mlp.tolist(), "heads": self.heads.tolist(),
                "attn_bias": self.attn_bias.tolist(), "final_bias": self.final_bias, "logit": self.logit,
                "total": self.total, "final_scale": self.final_scale}


def direct_logit_attribution(lm, prompt, target: int | Metric, other: int | None = None, *,
                             position: int = -1, chat: bool = False) -> Attribution:
    """DLA toward `target` (a token id or a Metric, whose target/other are used) at `position`
    (default: the last one, which predicts the next token). With `other`: toward target - other."""
    if isinstance(target, Metric):
        target, other = target.target, (target.other if target.kind == "logit_diff" else None)
    ids = prompt_ids(lm, prompt, chat)
    ad, s = lm.adapter, lm.shape
    zs: dict = {}
    tr = trace_with_edits(lm, ids, {}, capture_z=True, store=zs)
    T = len(ids)
    pos = position % T
    W = ad.unembed.weight
    u = W[target].float()
    if other is not None:
        u = u - W[other].float()
    b_u = getattr(ad.unembed, "bias", None)
    ub = 0.0
    if b_u is not None:
        ub = float(b_u[target] - (b_u[other] if other is not None else 0))

    L, H, dh = s.n_layers, s.n_heads, s.d_head
    with torch.inference_mode():
        x_final = tr.resid_post(L - 1)[pos]
        N, b_n, scale = frozen_norm(ad.final_norm, x_final)

        def dla(c):
            return N(c) @ u

        embed = float(dla(tr.embed[pos]))
        attn = torch.stack([dla(tr.attn_out[l][pos]) for l in range(L)]).cpu()
        mlp = torch.stack([dla(tr.mlp_out[l][pos]) for l in range(L)]).cpu()
        heads = torch.zeros(L, H)
        attn_bias = torch.zeros(L)
        can_split = hasattr(ad, "attn_z_module")
        for l in range(L) if can_split else ():
            layer = ad.layers[l]
            proj = ad.attn_z_module(layer)
            z = zs[act_name("z", l)][pos]  # [H*dh]
            blocks = torch.zeros(H, H * dh, dtype=z.dtype, device=z.device)
            for h in range(H):
                blocks[h, h * dh:(h + 1) * dh] = z[h * dh:(h + 1) * dh]
            zero = torch.zeros(1, H * dh, dtype=z.dtype, device=z.device)
            bias = proj(zero)[0].float()
            per_head = proj(blocks).float() - bias  # [H, d]
            post = ad.attn_out_module(layer)
            if is_norm(post):  # Gemma 3: attn_out = post_attention_norm(o_proj(z))
                P, b_p, _ = frozen_norm(post, proj(z[None])[0])
                per_head, bias = P(per_head), P(bias) + b_p
            heads[l] = (N(per_head) @ u).cpu()
            attn_bias[l] = float(N(bias) @ u)
        final_bias = float(b_n @ u) + ub
        logit = float(ad.unembed(tr.ln_final[pos][None])[0].float()[target]
                      - (ad.unembed(tr.ln_final[pos][None])[0].float()[other] if other is not None else 0))
    return Attribution(target=int(target), other=None if other is None else int(other), position=pos,
                       embed=embed, attn=attn, mlp=mlp, heads=heads, attn_bias=attn_bias, final_bias=final_bias,
                       logit=logit, final_scale=scale, token_ids=ids)
