"""Anatomy of a decoder: every part, computed step by step on the real model.

Everything here is read from the loaded model (its config, its modules and its weights) or
recomputed from a Trace with the model's own modules; nothing about an architecture is typed
in. tests/reference/test_anatomy.py checks each step against the model's own forward.

Pure PyTorch (+ pandas for tables); no gradio.

This module walks a Trace through one block (attention, norms, MLP, output) and checks each
panel's hand computation against the model's own forward; the parts beside it:
  architecture_card  the card from config, modules and weights; compare_models
  module_tree        the module tree with output shapes for the prompt
  positions          sinusoidal, RoPE (frequencies, angles, a pair by hand, score vs distance), learned
  embedding_space    a token from text, nearest tokens, analogies
Everything stays importable from here.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model_core.anatomy.architecture_card import (
    activation_label,
    architecture_card,
    card_frame,
    compare_models,
    config_activation,
    config_only_model,
    count_by_part,
    linear_out_features,
    norm_kind,
    param_counts,
    rope_thetas,
)
from model_core.anatomy.embedding_space import analogy, nearest_tokens, resolve_token, token_id
from model_core.anatomy.module_tree import module_tree, tree_frame
from model_core.anatomy.positions import (
    learned_positions,
    rope_angles,
    rope_full_turn_positions,
    rope_inv_freq,
    rope_pair_example,
    rope_rotate,
    rope_score_vs_distance,
    sinusoidal_encoding,
)
from model_core.core.adapters import is_norm, kv_cache_bytes
from model_core.core.errors import PromptError
from model_core.core.tokenization import describe_tokens

__all__ = [
    "activation_label", "analogy", "architecture_card", "attention_step", "attn_out_from_heads", "card_frame",
    "check_attention", "check_mlp", "check_norm", "check_output", "compare_models", "config_activation",
    "config_only_model", "count_by_part", "gain_stats", "head_outputs", "is_norm", "kv_cache_bytes",
    "learned_positions", "linear_out_features", "mlp_out_from_hidden", "mlp_step", "module_tree",
    "nearest_tokens", "norm_kind", "norm_module", "norm_step", "output_step", "param_counts",
    "resolve_token", "rope_angles", "rope_full_turn_positions", "rope_inv_freq", "rope_pair_example",
    "rope_rotate", "rope_score_vs_distance", "rope_thetas", "sinusoidal_encoding", "token_id", "tree_frame",
]


# ---------------------------------------------------------------------------------------------
# Attention, step by step


def attention_step(tr, layer: int, head: int) -> dict:
    """One head of one layer, every step (tensors on CPU, float32):
      x_normed [T, d], q [T, dh], k [T, dh], v [T, dh], raw [T, T] = q k^T, scale,
      scaled [T, T] (softcapped too if the model does that), mask [T, T] bool, masked [T, T]
      (-inf where masked), pattern [T, T] = softmax(masked), z [T, dh] = pattern @ v,
      no_scale [T, T] = softmax(masked raw scores), no_mask [T, T] = softmax(scaled, no mask),
      kv_head (which K/V head this query head shares), window (the sliding window W of this
      layer, or None: then the mask is causal only; with W, key j is seen by query i iff i-W < j <= i)."""
    ad = tr.lm.adapter
    steps = tr.attention_steps(layer)
    H = steps["q"].shape[0]
    if not 0 <= head < H:
        raise PromptError(f"Head must be between 0 and {H - 1}.")
    n_kv = tr.lm.shape.n_kv_heads
    scale = float(ad.attention_scale(layer))
    f = lambda t: t.detach().float().cpu()  # noqa: E731
    raw = f(steps["raw_scores"][head])
    scaled = f(steps["scaled_scores"][head])
    mask = steps["mask"].cpu()
    masked = scaled.masked_fill(~mask, float("-inf"))
    no_scale = torch.softmax(raw.masked_fill(~mask, float("-inf")), dim=-1)
    no_mask = torch.softmax(scaled, dim=-1)
    kv_head = head // (H // n_kv)
    rope = None
    if ad.uses_rope and tr.rope.get(layer) is not None:
        # Q and K above are after RoPE. The rotation step: the same projections with the rotation
        # switched off (cos = 1, sin = 0) give W_q·x and W_k·x, what a learner computes by hand.
        cos, sin = tr.rope[layer]
        with torch.inference_mode():
            q0, k0, _ = ad.qkv(layer, steps["x_normed"], (torch.ones_like(cos), torch.zeros_like(sin)))
        q_pre, k_pre = f(q0[head]), f(k0[kv_head])
        rope = {"q_pre": q_pre, "k_pre": k_pre, "cos": f(cos[0]), "sin": f(sin[0]),
                "inv_freq": rope_inv_freq(tr.lm, layer),
                "max_change_q": float((f(steps["q"][head]) - q_pre).abs().max()),
                "max_change_k": float((f(steps["k"][head]) - k_pre).abs().max())}
    return {"layer": layer, "head": head, "kv_head": kv_head, "scale": scale, "rope": rope,
            "window": ad.sliding_window(layer),
            "softcap": ad.attn_logit_softcap(), "x_normed": f(steps["x_normed"]),
            "q": f(steps["q"][head]), "k": f(steps["k"][head]), "v": f(steps["v"][head]),
            "raw": raw, "scaled": scaled, "mask": mask, "masked": masked,
            "pattern": f(steps["pattern"][head]), "z": f(steps["z"][head]),
            "no_scale": no_scale, "no_mask": no_mask}


def head_outputs(tr, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each head's contribution through the output matrix: [H, T, d] with z_h @ W_O[h], plus the
    output bias (GPT-2) or None. sum over heads + bias = the output projection's result; that is
    attn_out for Llama and GPT-2. Gemma 3 applies post_attention_layernorm to that sum before it
    joins the residual (see attn_out_from_heads)."""
    ad = tr.lm.adapter
    steps = tr.attention_steps(layer)
    z = steps["z"]  # [H, T, dh]
    H, T, dh = z.shape
    o = ad.attn_z_module(ad.layers[layer])
    w = (o.weight.T if isinstance(o, nn.Linear) else o.weight)  # [H*dh, d]
    with torch.inference_mode():
        per_head = torch.einsum("htk,hkd->htd", z, w.reshape(H, dh, -1))
    bias = getattr(o, "bias", None)
    return per_head, bias


def attn_out_from_heads(tr, layer: int) -> torch.Tensor:
    """Sum of head_outputs (+ bias), passed through the post-attention norm where the model has
    one (Gemma 3): equals what attention adds to the residual stream, trace.attn_out[layer]."""
    ad = tr.lm.adapter
    per_head, bias = head_outputs(tr, layer)
    with torch.inference_mode():
        out = per_head.sum(0)
        if bias is not None:
            out = out + bias
        post = ad.attn_out_module(ad.layers[layer])
        if is_norm(post):
            out = post(out)
    return out


# ---------------------------------------------------------------------------------------------
# Checks: every panel's hand computation against a tensor captured from the model's own forward
#
# Each function returns (mine, captured): `mine` is computed from what the panel shows (its
# vectors, pushed through the rest of the block with the model's own modules where needed), and
# `captured` is what the instrumented forward recorded (hook_attn_out, hook_mlp_out,
# ln_final.hook_normalized, the output logits). Neither side is recomputed from the other, so a
# wrong panel value (e.g. from a corrupted trace) shows as a difference.


def _to_model(lm, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.to(device=like.device, dtype=like.dtype)


def check_attention(tr, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_h z_h W_O^(h) (+ bias, + Gemma's post-attention norm) from the panel's heads vs the
    captured hook_attn_out of this layer."""
    return attn_out_from_heads(tr, layer), tr.attn_out[layer]


def mlp_out_from_hidden(lm, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """The MLP's output from its hidden activation h [..., d_mlp]: W_down h (+ bias), then Gemma's
    post-feedforward norm; for Llama and GPT-2 this is what the MLP adds to the residual."""
    ad = lm.adapter
    lay = ad.layers[layer]
    down = ad.mlp_post_module(lay)
    with torch.inference_mode():
        out = down(_to_model(lm, hidden, down.weight))
        post = ad.mlp_out_module(lay)
        if post is not lay.mlp and is_norm(post):
            out = post(out)
    return out


def check_mlp(tr, layer: int, position: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W_down · h of the panel's hidden activation h vs the captured hook_mlp_out at that token."""
    return mlp_out_from_hidden(tr.lm, layer, hidden), tr.mlp_out[layer][position]


def _hand_norm(x: torch.Tensor, kind: dict, g: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The norm formula by hand over the last dimension (float32)."""
    x = x.float()
    if kind["type"] == "LayerNorm":
        mu = x.mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + kind["eps"])
    else:
        y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + kind["eps"])
    return y * g + (b if b is not None else 0)


def check_norm(tr, layer: int, position: int, which: str, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The panel's hand-normalised vector `out` against the model's own forward:
    final  -> out vs the captured final-norm output (ln_final.hook_normalized);
    mlp    -> the layer's MLP (and Gemma's post-MLP norm) applied to out vs the captured hook_mlp_out;
    attn   -> the layer's attention fed with the hand formula on every token up to this one (this
              token's row is `out`) vs the captured hook_attn_out at this token."""
    lm = tr.lm
    ad = lm.adapter
    T = tr.n_tokens
    pos = position % T
    if which == "final":
        return out, tr.ln_final[pos]
    lay = ad.layers[layer]
    mod = norm_module(lm, layer, which)
    w = mod.weight
    with torch.inference_mode():
        if which == "mlp":
            y = lay.mlp(_to_model(lm, out, w))
            post = ad.mlp_out_module(lay)
            if post is not lay.mlp and is_norm(post):
                y = post(y)
            return y, tr.mlp_out[layer][pos]
        kind = norm_kind(mod)
        g = w.detach().float().cpu() + kind["gain_offset"]
        b = getattr(mod, "bias", None)
        b = b.detach().float().cpu() if b is not None else None
        normed = _hand_norm(tr.resid_pre[layer][: pos + 1].detach().float().cpu(), kind, g, b)
        normed[pos] = out.float().cpu()
        rope = tr.rope.get(layer)
        if rope is not None:
            rope = tuple(t[:, : pos + 1] for t in rope)
        steps = ad.attention_from_normed(layer, _to_model(lm, normed, w), rope)
        z = steps["z"]  # [H, pos + 1, dh]
        o = ad.attn_z_module(lay)
        y = o(z.transpose(0, 1).reshape(pos + 1, -1))
        post = ad.attn_out_module(lay)
        if is_norm(post):
            y = post(y)
        return y[pos], tr.attn_out[layer][pos]


def check_output(tr, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The panel's logits (W_U · the captured final-norm output) vs the logits the model returned."""
    return logits, tr.next_logits


# ---------------------------------------------------------------------------------------------
# Normalisation


def norm_module(lm, layer: int | None, which: str) -> nn.Module:
    ad = lm.adapter
    if which == "final":
        return ad.final_norm
    lay = ad.layers[layer]
    if which == "attn":
        return ad.attn_norm(lay)
    if which == "mlp":
        return ad.mlp_norm(lay)
    raise PromptError("Norm must be 'attn', 'mlp' or 'final'.")


def norm_step(tr, layer: int, position: int, which: str = "attn") -> dict:
    """A token's residual vector before and after a norm, computed by hand:
    RMSNorm:   y = x / sqrt(mean(x^2) + eps) * g          (Gemma: * (1 + g))
    LayerNorm: y = (x - mean) / sqrt(var + eps) * g + b
    which: 'attn' (before attention, input = resid_pre), 'mlp' (input = resid_mid) or 'final'
    (input = the last layer's resid_post)."""
    lm = tr.lm
    T = tr.n_tokens
    if not -T <= position < T:
        raise PromptError(f"Position must be between 0 and {T - 1}.")
    if which == "final":
        x = tr.resid_post(tr.n_layers - 1)
    elif which == "attn":
        x = tr.resid_pre[layer]
    else:
        x = tr.resid_mid(layer)
    x = x[position].detach().float().cpu()
    mod = norm_module(lm, layer, which)
    kind = norm_kind(mod)
    g = mod.weight.detach().float().cpu() + kind["gain_offset"]
    b = getattr(mod, "bias", None)
    b = b.detach().float().cpu() if b is not None else None
    eps = kind["eps"]
    mean = float(x.mean())
    if kind["type"] == "LayerNorm":
        var = float(x.var(unbiased=False))
        scale = math.sqrt(var + eps)
        normalized = (x - mean) / scale
    else:
        var = None
        scale = math.sqrt(float(x.pow(2).mean()) + eps)
        normalized = x / scale
    out = _hand_norm(x, kind, g, b)
    return {"type": kind["type"], "class": kind["class"], "eps": eps, "gain_offset": kind["gain_offset"],
            "x": x, "mean": mean, "std": math.sqrt(var) if var is not None else None,
            "rms": math.sqrt(float(x.pow(2).mean())), "scale": scale, "normalized": normalized,
            "gain": g, "bias": b, "out": out, "which": which, "position": position,
            "gain_stats": gain_stats(g)}


def gain_stats(g: torch.Tensor) -> dict:
    """The distribution of a norm's gain vector (the effective gain: 1 + w for Gemma): a mean alone
    hides gains that straddle zero (SmolLM2's first input norm: mean 0.001, 47 % negative)."""
    g = g.detach().float().cpu()
    return {"mean": float(g.mean()), "median": float(g.median()), "min": float(g.min()), "max": float(g.max()),
            "mean_abs": float(g.abs().mean()), "negative": float((g < 0).float().mean()), "n": g.numel()}


# ---------------------------------------------------------------------------------------------
# MLP


def mlp_step(tr, layer: int, position: int, top_k: int = 20) -> dict:
    """The MLP's hidden activation for one token, step by step.
    Gated (SwiGLU/GeGLU): gate_pre = W_gate x, gate = act(gate_pre), up = W_up x, product = gate * up.
    GELU MLP: pre = W_in x + b, post = act(pre).
    `product` / `post` is what enters the down projection (= trace.mlp_post)."""
    lm = tr.lm
    ad = lm.adapter
    T = tr.n_tokens
    if not -T <= position < T:
        raise PromptError(f"Position must be between 0 and {T - 1}.")
    lay = ad.layers[layer]
    mlp = lay.mlp
    with torch.inference_mode():
        x = ad.mlp_norm(lay)(tr.resid_mid(layer)[position])
        f = lambda t: t.detach().float().cpu()  # noqa: E731
        if hasattr(mlp, "gate_proj"):
            gate_pre = mlp.gate_proj(x)
            act_fn = mlp.act_fn
            gate = act_fn(gate_pre)
            up = mlp.up_proj(x)
            product = gate * up
            out = {"gated": True, "x": f(x), "gate_pre": f(gate_pre), "gate": f(gate), "up": f(up),
                   "product": f(product)}
            hidden = out["product"]
        else:
            fc = getattr(mlp, "c_fc", None)
            pre = fc(x)
            act_fn = mlp.act
            post = act_fn(pre)
            out = {"gated": False, "x": f(x), "pre": f(pre), "post": f(post)}
            hidden = out["post"]
    top = hidden.abs().topk(min(top_k, hidden.numel()))
    out["top_neurons"] = top.indices
    out["activation"] = activation_label(config_activation(lm.model.config))
    # the activation function itself over -4..4 (a reference curve: one token's neurons may span
    # only a small part of it, where any smooth activation looks like a straight line)
    with torch.inference_mode():
        cx = torch.linspace(-4, 4, 161)
        out["curve_x"] = cx
        out["curve_y"] = act_fn(cx.to(x)).detach().float().cpu()
    return out


# ---------------------------------------------------------------------------------------------
# Output


def output_step(tr, top_k: int = 10, position: int = -1) -> dict:
    """Final hidden state (after the final norm) -> logits = W_U h (softcapped where the model
    does so) -> softmax, at one position (default: the last)."""
    lm = tr.lm
    h = tr.ln_final[position]
    logits = tr.logits(positions=[position])[0].detach().float().cpu()
    probs = torch.softmax(logits, dim=-1)
    top = probs.topk(min(top_k, probs.numel()))
    ids = top.indices.tolist()
    toks = describe_tokens(lm.tokenizer, ids)
    return {"hidden": h.detach().float().cpu(), "logits": logits, "probs": probs,
            "top": [{"id": i, "token": t["display"], "logit": float(logits[i]), "prob": float(p)}
                    for i, t, p in zip(ids, toks, top.values.tolist())],
            "entropy": float(-(probs * torch.log(probs.clamp_min(1e-30))).sum())}
