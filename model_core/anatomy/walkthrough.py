"""Anatomy of a decoder: every part, computed step by step on the real model.

Everything here is read from the loaded model (its config, its modules and its weights) or
recomputed from a Trace with the model's own modules; nothing about an architecture is typed
in. tests/reference/test_anatomy.py checks each step against the model's own forward.

Pure PyTorch (+ pandas for tables); no gradio.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from model_core.core.adapters import adapter_for, apply_rope, is_norm, kv_cache_bytes
from model_core.core.errors import PromptError
from model_core.core.tokenization import describe_tokens

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


# ---------------------------------------------------------------------------------------------
# Module tree with shapes for the current prompt


def module_tree(lm, token_ids, collapse_layers: bool = True) -> list[dict]:
    """One forward pass with a forward hook on every module; rows in execution order:
    {path, depth, module, shape (output, batch dim dropped), params}. With collapse_layers, only
    layer 0 is listed in full and the other layers are one summary row."""
    model, ad = lm.model, lm.adapter
    names = {id(m): n for n, m in model.named_modules()}
    layer_paths = [names[id(l)] for l in ad.layers]
    rows: list[dict] = []
    handles = []

    entered: dict[str, int] = {}

    def pre(module, inputs):
        entered.setdefault(names[id(module)], len(entered))

    def hook(module, inputs, output):
        out = output[0] if isinstance(output, (tuple, list)) else output
        for attr in ("logits", "last_hidden_state"):
            if hasattr(out, attr):
                out = getattr(out, attr)
                break
        shape = tuple(out.shape[1:]) if torch.is_tensor(out) and out.dim() >= 1 else None
        rows.append({"path": names[id(module)], "module": type(module).__name__,
                     "shape": list(shape) if shape is not None else None,
                     "params": sum(p.numel() for p in module.parameters(recurse=False)),
                     "_tensors": [(id(p), p.numel()) for p in module.parameters(recurse=False)]})

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([list(token_ids)], device=lm.device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    # forward hooks fire on exit: list modules in the order they were entered (parents first)
    rows.sort(key=lambda r: entered[r["path"]])
    dedup, seen = [], set()
    for r in rows:  # a module called twice (rotary embedding per layer type) keeps its first row
        if r["path"] in seen:
            continue
        seen.add(r["path"])
        r["depth"] = 0 if r["path"] == "" else r["path"].count(".") + 1
        r["path"] = r["path"] or type(model).__name__
        dedup.append(r)
    # tied weights: a tensor is counted at the first module (in running order) that owns it; a later
    # owner (a tied lm_head) shows its size with a note, so the "counted" column sums to the total
    owner: dict[int, str] = {}
    for r in dedup:
        r["counted"], tied = 0, []
        for pid, n in r.pop("_tensors"):
            if pid in owner:
                tied.append(owner[pid])
            else:
                owner[pid] = r["path"]
                r["counted"] += n
        r["tied_to"] = tied[0] if tied else None
    total = sum(r["counted"] for r in dedup)
    # the layer list (a ModuleList) is never called, so no hook names it: add its row before layer 0
    list_path = layer_paths[0].rsplit(".", 1)[0] if "." in layer_paths[0] else None
    if list_path is not None and list_path not in seen:
        at = next(i for i, r in enumerate(dedup) if r["path"] == layer_paths[0])
        dedup.insert(at, {"path": list_path, "module": f"ModuleList ({len(layer_paths)} × {type(ad.layers[0]).__name__})",
                          "shape": None, "params": 0, "counted": 0, "tied_to": None, "depth": list_path.count(".") + 1})
    total_row = {"path": "total (each tensor counted once)", "module": "", "shape": None, "params": total,
                 "counted": total, "tied_to": None, "depth": 0, "total": True}
    if not collapse_layers or len(layer_paths) < 3:
        return dedup + [total_row]
    out, skipped, skipped_params = [], 0, 0
    keep = (layer_paths[0], layer_paths[-1])
    for r in dedup:
        in_layer = next((lp for lp in layer_paths if r["path"] == lp or r["path"].startswith(lp + ".")), None)
        if in_layer is not None and in_layer not in keep:
            if r["path"] == in_layer:
                skipped += 1
            skipped_params += r["counted"]
            continue
        if in_layer == layer_paths[-1] and r["path"] == in_layer and skipped:
            out.append({"path": f"… {skipped} more layers, same shapes as layer 0", "module": "",
                        "shape": None, "params": skipped_params, "counted": skipped_params, "tied_to": None,
                        "depth": r["depth"]})
        out.append(r)
    return out + [total_row]


def tree_frame(rows: list[dict]) -> pd.DataFrame:
    """Rows indented by depth; a layer of the layer list is named with its list (layers.0, h.0)."""
    data = []
    for r in rows:
        indent = "\u2003" * max(0, r["depth"])
        parts = r["path"].split(".")
        leaf = r["path"] if not r["depth"] else parts[-1]
        if r["depth"] and len(parts) >= 2 and parts[-1].isdigit():
            leaf = ".".join(parts[-2:])
        if r["path"].startswith("…"):
            leaf = r["path"]
        if r.get("total"):
            leaf = r["path"]
        shape = "[" + ", ".join(str(s) for s in r["shape"]) + "]" if r["shape"] else ""
        params = f"{r['params']:,}" if r["params"] else ""
        if r.get("tied_to"):
            params += f" (tied to {r['tied_to']}: the same tensor, counted there)"
        data.append({"module": indent + leaf, "type": r["module"], "output shape": shape, "params": params})
    return pd.DataFrame(data)


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
# Positions: RoPE, sinusoidal, learned


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


# ---------------------------------------------------------------------------------------------
# Embedding space


def token_id(lm, text: str) -> int:
    """One token from user text: '#123' means id 123; otherwise the text must be exactly one
    token (leading spaces matter: ' Paris' and 'Paris' are different tokens)."""
    if not isinstance(text, str) or not text:
        raise PromptError("Type a token (or #id).")
    vocab = lm.shape.vocab_size
    if text.startswith("#") and text[1:].strip().isdigit():
        i = int(text[1:])
        if not 0 <= i < vocab:
            raise PromptError(f"Token id must be between 0 and {vocab - 1}.")
        return i
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = " | ".join(t["display"] for t in describe_tokens(lm.tokenizer, ids))
        raise PromptError(f"'{text}' is {len(ids)} tokens ({pieces}); pick one token, or type #id.")
    return int(ids[0])


def resolve_token(lm, text: str) -> tuple[int, str | None]:
    """Like token_id, but text that is several tokens (a word, for a byte-level tokenizer) falls
    back to its first token that is not only whitespace; returns (id, a note saying so, or None)."""
    try:
        return token_id(lm, text), None
    except PromptError:
        if not isinstance(text, str) or not text or (text.startswith("#") and text[1:].strip().isdigit()):
            raise
        ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise
        toks = describe_tokens(lm.tokenizer, ids)
        pick = next((i for i, t in enumerate(toks) if t["display"].strip("␣ ")), 0)
        return int(ids[pick]), (f"'{text}' is {len(ids)} tokens here ({' '.join(t['display'] for t in toks)}): "
                                f"using {toks[pick]['display']} (#{ids[pick]}).")


def _embedding_matrix(lm) -> torch.Tensor:
    return lm.adapter.embed_tokens.weight.detach().float()


def _neighbours(lm, vec: torch.Tensor, k: int, exclude=()) -> list[dict]:
    E = _embedding_matrix(lm)
    sims = F.cosine_similarity(E, vec[None, :].to(E), dim=-1)
    for i in exclude:
        sims[i] = float("-inf")
    top = sims.topk(min(k, sims.numel() - len(exclude)))
    ids = top.indices.tolist()
    toks = describe_tokens(lm.tokenizer, ids)
    return [{"id": i, "token": t["display"], "cosine": float(s)} for i, t, s in zip(ids, toks, top.values.tolist())]


def nearest_tokens(lm, token: str | int, k: int = 10) -> list[dict]:
    """Tokens whose input embeddings have the highest cosine similarity to `token`'s."""
    i = token if isinstance(token, int) else token_id(lm, token)
    return _neighbours(lm, _embedding_matrix(lm)[i], k, exclude=(i,))


def analogy(lm, a: str | int, b: str | int, c: str | int, k: int = 10) -> list[dict]:
    """Nearest tokens to E[a] - E[b] + E[c] (a, b, c themselves excluded)."""
    ia, ib, ic = (t if isinstance(t, int) else token_id(lm, t) for t in (a, b, c))
    E = _embedding_matrix(lm)
    return _neighbours(lm, E[ia] - E[ib] + E[ic], k, exclude={ia, ib, ic})


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
