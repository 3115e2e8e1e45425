"""Every field of an architecture card, computed from a model alone (real weights, or built on
PyTorch's `meta` device from a configuration: shapes, no memory), with no per-family adapter
(DeepSeek-V2 and Granite have none): the decoder layers found among its modules, parameters by part
(each tensor once), what each layer's attention caches per token (from the projections' widths;
MLA: latent + RoPE key), sliding windows, norm placement watched in a meta forward of layer 0,
the FFN or mixture of experts, and the position encoding.

Pure PyTorch + transformers; no gradio.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch
from torch import nn

from model_core.anatomy.architecture_card import (
    activation_label,
    config_activation,
    count_by_part,
    linear_out_features,
    norm_kind,
    rope_thetas,
)
from model_core.core.adapters import is_norm
from model_core.core.errors import ModelLoadError

FP16 = 2  # bytes per cached value in the cards' KV numbers


def meta_model(config) -> nn.Module:
    """The model for `config` on the meta device: every module and tensor shape, no memory."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"Could not build '{getattr(config, 'model_type', '?')}' from its config: {first}") from e


# ---------------------------------------------------------------------------------------------
# Finding the parts of any decoder (no per-family adapter: DeepSeek-V2 and Granite have none)


def _n_layers(config) -> int:
    return int(getattr(config, "num_hidden_layers", None) or config.n_layer)


def find_layers(model: nn.Module) -> nn.ModuleList:
    n = _n_layers(model.config)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if not lists:
        raise ModelLoadError(f"Could not find the {n} decoder layers of '{type(model).__name__}'.")
    return lists[0]


def _child(module: nn.Module, names: tuple[str, ...]):
    for n in names:
        if isinstance(getattr(module, n, None), nn.Module):
            return n, getattr(module, n)
    return None, None


ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention")
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn")


def _experts(mlp: nn.Module):
    e = getattr(mlp, "experts", None)
    return e if isinstance(e, nn.Module) else None


def _n_experts(experts: nn.Module) -> int:
    n = getattr(experts, "num_experts", None)
    if n:
        return int(n)
    if isinstance(experts, nn.ModuleList):
        return len(experts)
    return int(next(p for p in experts.parameters() if p.dim() == 3).shape[0])


def _top_k(mlp: nn.Module, config) -> int:
    for m in mlp.modules():
        k = getattr(m, "top_k", None)
        if isinstance(k, int) and k > 0:
            return k
    return int(config.num_experts_per_tok)


def _router_ids(mlp: nn.Module) -> set[int]:
    """Parameters of the router (the gate that picks experts), counted with the experts."""
    out = set()
    for name, m in mlp.named_modules():
        if name and ("router" in type(m).__name__.lower() or name.split(".")[-1] in ("gate", "router")):
            out |= {id(p) for p in m.parameters()}
    return out


PARTS = ("embedding", "attention", "mlp", "experts", "norms", "unembedding", "other")


def param_parts(model: nn.Module) -> OrderedDict[str, int]:
    """Parameters by part, each tensor once (a tied unembedding is the embedding): embedding
    (token + learned positions), attention, mlp (dense MLPs and MoE shared experts), experts (MoE
    routed experts + router), norms (every norm, incl. those inside attention), unembedding (only
    when untied), other. Sums to the model's parameter count."""
    attn_ids, mlp_ids, expert_ids = set(), set(), set()
    for layer in find_layers(model):
        _, attn = _child(layer, ATTN_NAMES)
        _, mlp = _child(layer, MLP_NAMES)
        if attn is not None:
            attn_ids |= {id(p) for p in attn.parameters()}
        if mlp is not None:
            mlp_ids |= {id(p) for p in mlp.parameters()}
            ex = _experts(mlp)
            if ex is not None:
                expert_ids |= {id(p) for p in ex.parameters()} | _router_ids(mlp)
    return count_by_part(model, model.get_output_embeddings(),
                         {"experts": expert_ids, "attention": attn_ids, "mlp": mlp_ids}, PARTS)


# ---------------------------------------------------------------------------------------------
# Attention and the KV cache, per layer, from the projections' widths


def _attn_numbers(attn: nn.Module, config) -> dict:
    """What this attention module caches per token (values, all heads), read from its weights."""
    heads = int(getattr(config, "num_attention_heads", None) or config.n_head)
    if hasattr(attn, "kv_a_proj_with_mqa"):  # MLA: a compressed latent + one decoupled RoPE key
        cached = linear_out_features(attn.kv_a_proj_with_mqa)
        latent = attn.kv_a_layernorm.weight.shape[0]
        rope = cached - latent
        kv_b = linear_out_features(attn.kv_b_proj)  # heads x (k without RoPE + v)
        v = int(attn.v_head_dim)
        k_nope = kv_b // heads - v
        return {"kind": "MLA", "q_heads": heads, "kv_heads": heads, "cached": cached, "latent": latent,
                "rope": rope, "head_dim": k_nope + rope, "v_head_dim": v,
                "uncompressed": heads * (k_nope + rope) + heads * v}
    head_dim = getattr(attn, "head_dim", None) or getattr(config, "head_dim", None) or config.hidden_size // heads
    head_dim = int(head_dim)
    if hasattr(attn, "k_proj") and hasattr(attn, "v_proj"):
        k, v = linear_out_features(attn.k_proj), linear_out_features(attn.v_proj)
        q = linear_out_features(attn.q_proj) if hasattr(attn, "q_proj") else heads * head_dim
    elif hasattr(attn, "c_attn"):  # GPT-2: one fused [d, 3d] projection; q, k and v each d wide
        q = k = v = linear_out_features(attn.c_attn) // 3
    else:
        k = v = int(getattr(config, "num_key_value_heads", heads)) * head_dim
        q = heads * head_dim
    q_heads, kv_heads = q // head_dim, k // head_dim
    kind = "MHA" if kv_heads == q_heads else ("MQA" if kv_heads == 1 else "GQA")
    return {"kind": kind, "q_heads": q_heads, "kv_heads": kv_heads, "cached": k + v, "head_dim": head_dim}


def _windows(model: nn.Module, layers) -> list[int | None]:
    """Each layer's sliding window (None: it sees every earlier token)."""
    c = model.config
    types = getattr(c, "layer_types", None)
    W = getattr(c, "sliding_window", None)
    out = []
    for i, layer in enumerate(layers):
        _, attn = _child(layer, ATTN_NAMES)
        w = getattr(attn, "sliding_window", None) if attn is not None else None
        if types:
            w = W if types[i] == "sliding_attention" else None
        elif w is None and W and getattr(c, "use_sliding_window", True) is not False:
            w = W  # Mistral: one window for every layer when the config sets one
        out.append(int(w) if w else None)
    return out


def kv_bytes_at(card: dict, tokens, bytes_per_value: int = FP16, uncompressed: bool = False) -> list[int]:
    """KV-cache bytes of one sequence after `tokens` tokens, for each value in `tokens`: the sum over
    layers of (values cached per token) x min(tokens, window) x bytes. Per attention kind:
      MHA / GQA / MQA: 2 x layers x kv_heads x head_dim x T x bytes
      sliding window W: T replaced by min(T, W) on the windowed layers
      MLA: layers x (latent + RoPE key) x T x bytes (uncompressed: layers x heads x (d_qk + d_v) x T x bytes)"""
    per = card["_kv_layers"]
    out = []
    for T in tokens:
        T = int(T)
        total = 0
        for cached, full, w in per:
            total += (full if uncompressed else cached) * (min(T, w) if w else T)
        out.append(total * bytes_per_value)
    return out


# ---------------------------------------------------------------------------------------------
# Norm placement, watched in a meta forward of layer 0


class _Stop(Exception):
    pass


def norm_wiring(model: nn.Module) -> dict:
    """Where layer 0's norms sit, from the tensors they read and write in a forward on the meta
    device (no memory, no weights): 'pre-norm' (a norm reads the block's input and feeds
    attention; the residual stream is never normalised), 'post-norm' (the block's output is a
    norm's output), 'pre- and post-norm' (pre-norm, plus norms on the sub-layers' outputs before
    they join the residual, as in Gemma). Returns {position, feeds: [(norm, module)], final_norm}."""
    meta = model if next(model.parameters()).device.type == "meta" else meta_model(model.config)
    layer = find_layers(meta)[0]
    attn_name, _ = _child(layer, ATTN_NAMES)
    mlp_name, _ = _child(layer, MLP_NAMES)
    seen: dict[str, tuple] = {}
    handles = []

    def first(x):
        return x[0] if isinstance(x, (tuple, list)) else x

    def watch(name, mod):
        def pre(m, args, kwargs):
            seen.setdefault(name + ":in", (first(args) if args else kwargs.get("hidden_states"),))

        def post(m, args, kwargs, out):
            seen.setdefault(name + ":out", (first(out),))
            if name == "":
                raise _Stop
        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))

    for name, child in layer.named_children():
        watch(name, child)
    watch("", layer)
    T = 3
    try:
        with torch.no_grad():
            meta(input_ids=torch.zeros(1, T, dtype=torch.long, device="meta"),
                 attention_mask=torch.ones(1, 1, T, T, dtype=torch.bool, device="meta"),
                 position_ids=torch.arange(T, device="meta")[None], use_cache=False)
    except _Stop:
        pass
    except Exception as e:  # noqa: BLE001 - a model whose forward cannot run on meta: say so on the card
        return {"position": f"not determined ({type(e).__name__} in a meta forward)", "feeds": [], "final_norm": None}
    finally:
        for h in handles:
            h.remove()
    t = {k: v[0] for k, v in seen.items()}
    norms = [n for n, c in layer.named_children() if is_norm(c)]
    feeds = []
    for n in norms:
        for target in (attn_name, mlp_name):
            if target and t.get(f"{target}:in") is not None and t.get(f"{target}:in") is t.get(f"{n}:out"):
                feeds.append((n, target))
    pre = any(t.get(f"{n}:in") is t.get(":in") for n, tgt in feeds if tgt == attn_name)
    on_sub = any(t.get(f"{n}:in") is not None and t.get(f"{n}:in") is t.get(f"{s}:out")
                 for n in norms for s in (attn_name, mlp_name) if s)
    post = any(t.get(f"{n}:out") is t.get(":out") for n in norms)
    if pre and on_sub:
        position = "pre- and post-norm"
    elif pre:
        position = "pre-norm"
    elif post:
        position = "post-norm"
    else:
        position = "no norm in the block" if not norms else "not determined"
    base = getattr(meta, meta.base_model_prefix, meta)
    final = next((n for n, c in base.named_children() if is_norm(c)), None)
    return {"position": position, "feeds": feeds, "final_norm": final}


# ---------------------------------------------------------------------------------------------
# The card


def _positions(model: nn.Module, attn0: dict) -> str:
    c = model.config
    emb = model.get_input_embeddings()
    learned = [m for m in model.modules() if isinstance(m, nn.Embedding) and m is not emb]
    if learned:
        w = learned[0].weight
        return f"learned absolute ({w.shape[0]:,} × {w.shape[1]:,} table)"
    has_rotary = any("rotary" in type(m).__name__.lower() for m in model.modules())
    if not has_rotary:
        return "none found"
    thetas = rope_thetas(c)
    text = "RoPE, θ " + ", ".join((f"{v:,.0f}" if k == "all layers" else f"{v:,.0f} ({k})") for k, v in thetas.items())
    rp = getattr(c, "rope_parameters", None) or {}
    rtype = rp.get("rope_type") if isinstance(rp, dict) else None
    if rtype and rtype != "default" and rp.get("factor"):
        text += f", {rtype} scaling ×{rp['factor']:g}"
    if attn0["kind"] == "MLA":
        text += (f"; decoupled: {attn0['rope']} of each head's {attn0['head_dim']} q·k dims rotate, "
                 f"one RoPE key shared by all heads")
    return text


def _ffn(model: nn.Module, layers) -> tuple[str, dict | None]:
    c = model.config
    act = activation_label(config_activation(c))
    glu = {"SiLU": "SwiGLU", "GELU": "GeGLU", "GELU (tanh approx.)": "GeGLU"}.get(act, f"gated {act}")

    def dense(mlp):
        if hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj"):
            return f"{glu} {linear_out_features(mlp.up_proj):,}"
        fc = getattr(mlp, "c_fc", None) or getattr(mlp, "fc1", None) or getattr(mlp, "up_proj", None)
        return f"{act.split(' ')[0]} MLP {linear_out_features(fc):,}" if fc is not None else type(mlp).__name__

    mlps = [_child(layer, MLP_NAMES)[1] for layer in layers]
    moe_layers = [m for m in mlps if m is not None and _experts(m) is not None]
    if not moe_layers:
        return dense(mlps[0]), None
    m = moe_layers[0]
    ex = _experts(m)
    E, k = _n_experts(ex), _top_k(m, c)
    gate_up = getattr(ex, "gate_up_proj", None)  # fused experts: [E, 2 x hidden, d_model]
    if isinstance(gate_up, torch.Tensor):
        hidden = gate_up.shape[1] // 2
    elif isinstance(ex, nn.ModuleList) and hasattr(ex[0], "up_proj"):
        hidden = linear_out_features(ex[0].up_proj)
    else:
        hidden = None
    shared = getattr(m, "shared_experts", None) or getattr(m, "shared_expert", None)
    text = f"MoE {glu}: {E} routed experts of {hidden:,} ({k} per token)" if hidden else f"MoE: {E} experts ({k} per token)"
    info = {"routed_experts": E, "experts_per_token": k, "expert_hidden": hidden, "moe_layers": len(moe_layers)}
    if shared is not None:
        sw = linear_out_features(shared.up_proj)
        n_sh = getattr(c, "n_shared_experts", None)
        text += f" + shared {sw:,}" + (f" (= {n_sh} experts)" if n_sh else "")
        info["shared_hidden"] = sw
    n_dense = len(layers) - len(moe_layers)
    if n_dense:
        dense_m = next(mm for mm in mlps if mm is not None and _experts(mm) is None)
        text += f"; {n_dense} dense layer{'s' if n_dense > 1 else ''} ({dense(dense_m)})"
        info["dense_layers"] = n_dense
    return text, info


def _active(model: nn.Module, layers, total: int) -> int:
    """Parameters one token uses: all, minus the routed experts the router did not pick."""
    inactive = 0.0
    for layer in layers:
        _, mlp = _child(layer, MLP_NAMES)
        ex = _experts(mlp) if mlp is not None else None
        if ex is None:
            continue
        E, k = _n_experts(ex), _top_k(mlp, model.config)
        inactive += sum(p.numel() for p in ex.parameters()) * (E - k) / E
    return int(round(total - inactive))


def card_from_model(model: nn.Module, name: str | None = None, weights: str = "", source: str = "") -> dict:
    """Every card field, computed from `model` (real weights or the meta device)."""
    t0 = time.perf_counter()
    c = model.config
    layers = find_layers(model)
    per_layer = []
    for layer in layers:
        _, attn = _child(layer, ATTN_NAMES)
        per_layer.append(_attn_numbers(attn, c))
    a0 = per_layer[0]
    windows = _windows(model, layers)
    emb = model.get_input_embeddings()
    unemb = model.get_output_embeddings()
    tied = unemb is not None and unemb.weight is emb.weight
    parts = param_parts(model)
    ffn, moe = _ffn(model, layers)
    wiring = norm_wiring(model)
    first_norm = next((m for _, m in layers[0].named_children() if is_norm(m)), None)
    nk = norm_kind(first_norm) if first_norm is not None else None
    kinds = {p["kind"] for p in per_layer}
    kind = "/".join(sorted(kinds))
    n_slide = sum(w is not None for w in windows)
    W = next((w for w in windows if w), None)
    L = len(layers)
    kv_layers = [(p["cached"], p.get("uncompressed", p["cached"]), w) for p, w in zip(per_layer, windows)]
    kv = sum(x[0] for x in kv_layers) * FP16
    if a0["kind"] == "MLA":
        formula = (f"{L} layers × ({a0['latent']} latent + {a0['rope']} RoPE key) × {FP16} B")
        detail = (f"MLA: {a0['q_heads']} heads read keys and values decompressed from one "
                  f"{a0['latent']}-dim latent per token (+ a {a0['rope']}-dim shared RoPE key)")
        uncompressed = sum(x[1] for x in kv_layers) * FP16
    else:
        formula = f"2 × {L} layers × {a0['kv_heads']} kv heads × {a0['head_dim']} × {FP16} B"
        g = a0["q_heads"] // max(1, a0["kv_heads"])
        detail = {"MHA": f"MHA: {a0['q_heads']} heads, each with its own K and V",
                  "MQA": f"MQA: {a0['q_heads']} query heads share 1 K/V head",
                  "GQA": f"GQA: {a0['q_heads']} query heads share {a0['kv_heads']} K/V heads ({g} per group)"}[a0["kind"]]
        uncompressed = None
    if len(kinds) > 1:
        detail += f" (layers differ: {kind})"
    if n_slide:
        detail += f"; sliding window {W:,} on {'all ' if n_slide == L else ''}{n_slide}{'' if n_slide == L else f' of {L}'} layers"
        formula += f" (at most {W:,} tokens on windowed layers)"
    card = OrderedDict()
    card["name"] = name or getattr(c, "_name_or_path", "") or type(model).__name__
    card["architecture"] = f"{type(model).__name__} ({c.model_type})"
    card["weights"] = weights
    card["source"] = source
    card["params"] = parts["total"]
    card["active_params"] = _active(model, layers, parts["total"]) if moe else parts["total"]
    card["params_by_part"] = {k: v for k, v in parts.items() if k != "total"}
    card["layers"] = L
    card["d_model"] = int(emb.weight.shape[1])
    card["attention"] = a0["kind"] + (" + sliding window" if n_slide else "")
    card["attention_detail"] = detail
    card["q_heads"] = a0["q_heads"]
    card["kv_heads"] = a0["kv_heads"]
    card["head_dim"] = a0["head_dim"]  # of q and k (MLA: the part without RoPE + the RoPE part)
    if a0["kind"] == "MLA":
        card["v_head_dim"] = a0["v_head_dim"]
    card["sliding_window"] = W
    card["sliding_layers"] = n_slide
    card["kv_bytes_per_token"] = kv
    card["kv_bytes_per_token_uncompressed"] = uncompressed
    card["kv_formula"] = formula
    if a0["kind"] == "MLA":
        card["kv_latent"] = a0["latent"]
        card["kv_rope_key"] = a0["rope"]
    card["position"] = _positions(model, a0)
    card["ffn"] = ffn
    card["moe"] = moe
    card["norm"] = (nk["type"] + (" with gain (1 + w)" if nk["gain_offset"] else "") + f", eps {nk['eps']:g}") if nk else "none"
    card["norm_position"] = wiring["position"]
    card["norm_feeds"] = [f"{n} → {t}" for n, t in wiring["feeds"]]
    card["final_norm"] = wiring["final_norm"]
    card["vocab"] = int(emb.weight.shape[0])
    card["max_context"] = int(getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", 0) or 0)
    card["tied"] = bool(tied)
    card["seconds"] = round(time.perf_counter() - t0, 3)
    card["_kv_layers"] = kv_layers
    return card
