"""A decoder's architecture card, read from its config, modules and weights (nothing about an
architecture typed in): parameters by part (each tensor once), attention kind, FFN, norms,
positions, KV-cache bytes per token; one model's card as a table, several side by side.

Pure PyTorch (+ pandas for tables); no gradio.
"""

from __future__ import annotations

from collections import OrderedDict

import pandas as pd
import torch
from torch import nn

from model_core.core.adapters import adapter_for, is_norm, kv_cache_bytes

# ---------------------------------------------------------------------------------------------
# Small helpers


def _unwrap(lm_or_model):
    """(model, adapter) from a LoadedModel or a bare transformers model."""
    if hasattr(lm_or_model, "adapter") and hasattr(lm_or_model, "model"):
        return lm_or_model.model, lm_or_model.adapter
    return lm_or_model, adapter_for(lm_or_model)


def _cfg(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def norm_kind(module: nn.Module) -> dict:
    """What a norm module computes: {'type': 'RMSNorm'|'LayerNorm', 'gain_offset': 0 or 1, 'eps'}.
    Gemma's RMSNorm multiplies by (1 + w) instead of w (its weights are stored as offsets from 1)."""
    name = type(module).__name__
    eps = getattr(module, "eps", None) or getattr(module, "variance_epsilon", None) or 1e-5
    if isinstance(module, nn.LayerNorm) or ("LayerNorm" in name and "RMS" not in name):
        return {"type": "LayerNorm", "gain_offset": 0.0, "eps": float(eps), "class": name}
    offset = 1.0 if name.startswith("Gemma") else 0.0
    return {"type": "RMSNorm", "gain_offset": offset, "eps": float(eps), "class": name}


def linear_out_features(module: nn.Module) -> int:
    """Output width of nn.Linear (weight [out, in]) or GPT-2's Conv1D (weight [in, out])."""
    if isinstance(module, nn.Linear):
        return module.weight.shape[0]
    return module.weight.shape[1]


def _project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x @ W (+ b) for nn.Linear or Conv1D, as a plain matmul: [in] -> [out] weight matrix."""
    w = module.weight
    w_in_out = w.T if isinstance(module, nn.Linear) else w
    return x @ w_in_out


def config_activation(config) -> str:
    return str(_cfg(config, "hidden_act", "hidden_activation", "activation_function", default="?"))


def activation_label(act: str) -> str:
    a = act.lower()
    if a in ("silu", "swish"):
        return "SiLU"
    if a.startswith("gelu"):
        return "GELU" + (" (tanh approx.)" if ("tanh" in a or a in ("gelu_new", "gelu_fast")) else "")
    if a == "relu":
        return "ReLU"
    return act


# ---------------------------------------------------------------------------------------------
# Architecture card


def count_by_part(model: nn.Module, unembed: nn.Module, groups: dict[str, set[int]],
                  parts: tuple[str, ...]) -> OrderedDict[str, int]:
    """Parameters by part, each tensor once (tied weights counted once, like model.parameters()):
    embeddings, norms (every norm, wherever it sits), the unembedding (only when untied), then the
    first of `groups` (part -> ids of its parameters, in order) that holds the tensor, else other.
    `parts` lists every part in the order the result keeps; "total" is added."""
    out = OrderedDict((k, 0) for k in parts)
    seen: set[int] = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(module, nn.Embedding):
                part = "embedding"
            elif is_norm(module):
                part = "norms"
            elif module is unembed:
                part = "unembedding"
            else:
                part = next((name for name, ids in groups.items() if id(p) in ids), "other")
            out[part] += p.numel()
    out["total"] = sum(out.values())
    return out


def param_counts(lm_or_model) -> OrderedDict[str, int]:
    """Parameters by part, from the real tensors (count_by_part): embedding (token + learned
    positions), attention (Q, K, V, O and their biases), mlp, norms (every norm incl. QK-norm and the
    final norm), unembedding (only when untied), other (should be 0). Sums to the model's count."""
    model, ad = _unwrap(lm_or_model)
    attn_ids, mlp_ids = set(), set()
    for layer in ad.layers:
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attn", None)
        attn_ids |= {id(p) for p in attn.parameters()}
        mlp_ids |= {id(p) for p in layer.mlp.parameters()}
    return count_by_part(model, ad.unembed, {"attention": attn_ids, "mlp": mlp_ids},
                         ("embedding", "attention", "mlp", "norms", "unembedding", "other"))


def rope_thetas(config) -> dict[str, float]:
    """RoPE base(s) from config.rope_parameters (flat, or per layer type as in Gemma 3) or the
    older rope_theta / rope_local_base_freq fields."""
    rp = getattr(config, "rope_parameters", None)
    out: dict[str, float] = {}
    if isinstance(rp, dict) and rp:
        if "rope_theta" in rp:
            out["all layers"] = float(rp["rope_theta"])
        else:
            for kind, sub in rp.items():
                if isinstance(sub, dict) and "rope_theta" in sub:
                    out[kind] = float(sub["rope_theta"])
    if not out:
        theta = getattr(config, "rope_theta", None)
        if theta is not None:
            out["all layers"] = float(theta)
        local = getattr(config, "rope_local_base_freq", None)
        if local is not None:
            out["sliding_attention"] = float(local)
    return out


def architecture_card(lm_or_model) -> OrderedDict[str, object]:
    """Everything about the architecture, read from config, modules and weights."""
    model, ad = _unwrap(lm_or_model)
    c = model.config
    layers = ad.layers
    layer0 = layers[0]
    attn = getattr(layer0, "self_attn", None) or getattr(layer0, "attn", None)
    n_layers = len(layers)
    d_model = ad.embed_tokens.weight.shape[1]
    vocab = ad.embed_tokens.weight.shape[0]
    n_heads = int(_cfg(c, "num_attention_heads", "n_head"))
    n_kv = int(_cfg(c, "num_key_value_heads", default=n_heads))
    head_dim = int(getattr(attn, "head_dim", None) or _cfg(c, "head_dim", default=d_model // n_heads))
    # cross-check against the weights: the K projection is kv_heads x head_dim wide
    if hasattr(attn, "k_proj"):
        n_kv = linear_out_features(attn.k_proj) // head_dim
        n_heads = linear_out_features(attn.q_proj) // head_dim
    if n_kv == n_heads:
        attn_kind = "MHA (multi-head)"
    elif n_kv == 1:
        attn_kind = f"MQA (multi-query: {n_heads} query heads share 1 K/V head)"
    else:
        attn_kind = f"GQA (grouped-query: {n_heads // n_kv} query heads per K/V head)"
    mlp = layer0.mlp
    gated = hasattr(mlp, "gate_proj")
    act = activation_label(config_activation(c))
    if gated:
        d_mlp = linear_out_features(mlp.up_proj)
        ffn = {"SiLU": "SwiGLU", "GELU": "GeGLU", "GELU (tanh approx.)": "GeGLU"}.get(act, f"gated {act}")
        ffn_desc = f"down(act(gate x) · up x), act = {act}"
    else:
        fc = getattr(mlp, "c_fc", None) or getattr(mlp, "fc1", None)
        d_mlp = linear_out_features(fc)
        ffn = f"{act.split(' ')[0]} MLP"
        ffn_desc = f"down(act(up x)), act = {act}"
    nk = norm_kind(ad.attn_norm(layer0))
    post_norm = is_norm(ad.attn_out_module(layer0))
    placement = "pre-norm"
    if post_norm:
        placement = "pre- and post-norm"  # the post-norm's output is what joins the residual
    qk_norm = hasattr(attn, "q_norm")
    if ad.uses_rope:
        thetas = rope_thetas(c)
        pos = "RoPE, θ " + ", ".join(
            (f"{v:,.0f}" if k == "all layers" else f"{v:,.0f} ({k})") for k, v in thetas.items())
    else:
        wpe = getattr(getattr(model, "transformer", None), "wpe", None)
        pos = "learned absolute" + (f" [{wpe.weight.shape[0]}, {wpe.weight.shape[1]}]" if wpe is not None else "")
    unembed = ad.unembed
    tied = unembed.weight is ad.embed_tokens.weight
    counts = param_counts(model)
    dtype = next(model.parameters()).dtype
    bpv = torch.empty((), dtype=dtype).element_size()
    kv_bytes = kv_cache_bytes(n_layers, n_kv, head_dim, 1, bpv)
    windows = "no (every layer sees all tokens)"
    types = getattr(c, "layer_types", None)
    if types and "sliding_attention" in types:
        n_slide = sum(t == "sliding_attention" for t in types)
        windows = f"{n_slide} of {n_layers} layers see only the last {getattr(c, 'sliding_window', '?')} tokens"
    # the rows people compare first come first (the comparison table keeps this order)
    card = OrderedDict()
    card["architecture"] = f"{type(model).__name__} ({c.model_type})"
    card["params: total"] = counts["total"]
    card["dtype"] = str(dtype).replace("torch.", "")
    card["KV cache / token"] = kv_bytes
    card["KV cache / token (16-bit)"] = kv_cache_bytes(n_layers, n_kv, head_dim, 1, 2)
    card["layers"] = n_layers
    card["d_model"] = d_model
    card["query heads"] = n_heads
    card["key/value heads"] = n_kv
    card["attention"] = attn_kind
    card["head dim"] = head_dim
    card["QK-norm"] = "yes (RMSNorm on each head's q and k)" if qk_norm else "no"
    card["sliding window"] = windows
    card["attention scale"] = round(float(ad.attention_scale(0)), 6)
    card["FFN type"] = ffn
    card["FFN"] = ffn_desc
    card["FFN width"] = d_mlp
    card["norm"] = f"{nk['type']}" + (" with gain (1 + w)" if nk["gain_offset"] else "") + f", eps {nk['eps']:g}"
    card["norm placement"] = placement
    card["positions"] = pos
    card["vocabulary"] = vocab
    card["context length"] = int(_cfg(c, "max_position_embeddings", "n_positions", default=0))
    card["weight tying"] = "tied (unembedding = embedding)" if tied else "untied (separate unembedding)"
    for part in ("embedding", "attention", "mlp", "norms", "unembedding"):
        if part == "unembedding" and tied:
            continue
        card[f"params: {part}"] = counts[part]
    if counts["other"]:
        card["params: other"] = counts["other"]
    card["_numbers"] = dict(n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv,
                            head_dim=head_dim, d_mlp=d_mlp, vocab=vocab, gated=gated, tied=tied,
                            norm=nk, post_norm=post_norm, qk_norm=qk_norm, uses_rope=ad.uses_rope,
                            bytes_per_value=bpv, kv_bytes_per_token=kv_bytes)
    return card


def card_frame(card) -> pd.DataFrame:
    """One model's card as a two-column table (numbers formatted with thousands separators)."""
    rows = [(k, _fmt(v)) for k, v in card.items() if not k.startswith("_")]
    return pd.DataFrame(rows, columns=["property", "value"])


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def compare_models(cards: dict[str, object]) -> pd.DataFrame:
    """Side by side: one column per model, one row per property. `cards` maps a column name to
    a LoadedModel, a transformers model, or an already-built card."""
    built = OrderedDict()
    for name, obj in cards.items():
        built[name] = obj if isinstance(obj, dict) else architecture_card(obj)
    keys: list[str] = []
    for card in built.values():  # union of the rows; a row only some cards have goes after its predecessor
        prev = None
        for k in card:
            if k.startswith("_"):
                continue
            if k not in keys:
                keys.insert(keys.index(prev) + 1 if prev in keys else len(keys), k)
            prev = k
    data = {name: [_fmt(card[k]) if k in card else "—" for k in keys] for name, card in built.items()}
    return pd.DataFrame(data, index=pd.Index(keys, name="property")).reset_index()


def config_only_model(config) -> nn.Module:
    """A model built from a config on the meta device: its modules and weight shapes, no memory.
    Lets the comparison table show architectures that are not loaded (e.g. GPT-2 small)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
