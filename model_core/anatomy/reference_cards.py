"""Architecture cards computed from a configuration alone: six reference systems that nobody here
has weights for (Llama 3.2-1B, GPT-2, GPT-3 175B, Mistral 7B, DeepSeek-V2, Granite 3B), and any
loaded or local model.

Each reference is its published configuration (config.json values, or a paper's numbers) given to
transformers' own config class; the model is built on PyTorch's `meta` device (shapes, no memory)
and every card field is computed from that model: parameters by summing its tensors (each tensor
once, so tied weights once), key/value-cache bytes from the widths of the projections that produce
what is cached, norm placement by watching which tensors layer 0's norms read and write in a meta
forward. Nothing on a card is typed in; the sources' own claims (`Claim`) are kept beside the cards
and compared with what was computed, each difference with its reason.

The decoder guide's comparison table (the text lmscope is built from) is not on disk; its claims
are encoded as issue 21 quotes them (the table errors it names) and labelled "table (as quoted in
issue 21)". Published numbers come with their source (paper, model card, config.json). The
references themselves (configs, claims, caveats) are data: reference_cards.json beside this file.

Pure PyTorch + transformers; no gradio.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import nn

from model_core.anatomy.walkthrough import (
    activation_label,
    config_activation,
    count_by_part,
    is_norm,
    linear_out_features,
    norm_kind,
    rope_thetas,
)
from model_core.core.errors import ModelLoadError

FP16 = 2  # bytes per cached value in the cards' KV numbers


# ---------------------------------------------------------------------------------------------
# The references: published configuration + what the sources claim


@dataclass(frozen=True)
class Claim:
    """One thing a source states about a model, for comparison with the computed card.
    `value`: as stated ('124M', 'post-norm', 2048, ...); None when a source is reported wrong
    but its value was not quoted. `note`: why the computed value differs (shown when it does)."""
    field: str
    value: object
    source: str
    note: str = ""


@dataclass(frozen=True)
class Reference:
    name: str
    title: str
    config_class: str
    config: dict
    source: str
    claims: tuple = ()
    notes: tuple = ()  # caveats about the configuration itself (values not confirmed by a source)


def _load_references(path: Path) -> OrderedDict[str, Reference]:
    """The references as published: reference_cards.json (each one's config.json values or a paper's
    numbers, its sources' claims and caveats), one Reference per entry, in the file's order."""
    refs = OrderedDict()
    for r in json.loads(path.read_text(encoding="utf-8"))["references"]:
        refs[r["name"]] = Reference(name=r["name"], title=r["title"], config_class=r["config_class"],
                                    config=r["config"], source=r["source"],
                                    claims=tuple(Claim(**c) for c in r["claims"]), notes=tuple(r.get("notes", ())))
    return refs


REFERENCES: OrderedDict[str, Reference] = _load_references(Path(__file__).with_name("reference_cards.json"))

ALIASES = {"gpt2-small (config only)": "gpt2", "gpt-2": "gpt2", "gpt3": "gpt3-175b", "mistral": "mistral-7b",
           "llama-3.2-1B": "llama-3.2-1b", "deepseek-v2-236b": "deepseek-v2", "granite": "granite-3b"}


def reference_names() -> list[str]:
    return list(REFERENCES)


def reference(name: str) -> Reference:
    key = ALIASES.get(name, name)
    if key not in REFERENCES:
        raise ModelLoadError(f"Unknown reference card '{name}': use one of {', '.join(REFERENCES)}.")
    return REFERENCES[key]


def reference_config(name: str):
    """The reference's published values given to transformers' own config class."""
    import transformers

    ref = reference(name)
    return getattr(transformers, ref.config_class)(**ref.config)


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


# ---------------------------------------------------------------------------------------------
# Claims vs computed values


_UNITS = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


def _parse_amount(text: str, binary: bool = False) -> tuple[float, float] | None:
    """'124M' -> (124e6, 1e6): the value and the size of its last stated digit."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMBT])\s*", str(text))
    if not m:
        return None
    num, unit = m.group(1), m.group(2)
    scale = 1024 if (binary and unit == "K") else _UNITS[unit]
    decimals = len(num.split(".")[1]) if "." in num else 0
    return float(num) * scale, scale * 10 ** -decimals


def claim_matches(claim: Claim, computed) -> bool | None:
    """Does the source's statement agree with the computed value? Rounded amounts ('7B', '128K')
    agree when the computed value rounds or truncates to them at the precision stated; None when
    the source's value was not quoted."""
    v = claim.value
    if v is None:
        return False
    if isinstance(v, str) and isinstance(computed, (int, float)) and not isinstance(computed, bool):
        amt = _parse_amount(v, binary=claim.field == "max_context")
        if amt is not None:
            value, step = amt
            return abs(computed - value) <= step / 2 + 1e-9 or 0 <= computed - value < step
    if claim.field == "attention" and isinstance(computed, str):
        return str(v).lower() in computed.lower()
    if claim.field == "norm_position":
        return str(v).lower() == str(computed).lower()
    return v == computed


def comparison(card: dict, ref: Reference) -> list[dict]:
    """Each source claim next to the computed value: {field, computed, claim, source, agrees, note}."""
    out = []
    for cl in ref.claims:
        computed = card.get(cl.field)
        ok = claim_matches(cl, computed)
        out.append({"field": cl.field, "computed": computed, "claim": cl.value, "source": cl.source,
                    "agrees": ok, "note": "" if ok else (cl.note or "The computed value differs from the source.")})
    return out


# ---------------------------------------------------------------------------------------------
# Entry points


@cache
def _reference_card(name: str) -> dict:
    ref = reference(name)
    t0 = time.perf_counter()
    model = meta_model(reference_config(ref.name))
    card = card_from_model(model, name=ref.name, weights="none: the published configuration, built on the meta device",
                           source=ref.source)
    card["title"] = ref.title
    card["config_class"] = ref.config_class
    card["comparison"] = comparison(card, ref)
    card["notes"] = list(ref.notes)
    card["seconds"] = round(time.perf_counter() - t0, 3)  # build on meta + every computation
    return card


def reference_card(name: str) -> dict:
    """A reference system's card (cached: a copy per call)."""
    return _copy(_reference_card(reference(name).name))


def _copy(card: dict) -> dict:
    import copy

    return copy.deepcopy(card)


def loaded_card(lm) -> dict:
    """The card of a LoadedModel (its real tensors)."""
    weights = ("random (untrained, seed 0): numbers about shapes only" if lm.source == "random"
               else f"loaded ({lm.source}, {str(lm.dtype).replace('torch.', '')})")
    card = card_from_model(lm.model, name=lm.name, weights=weights, source=f"lmscope model '{lm.name}'")
    card["title"] = lm.name + (" (random weights)" if lm.source == "random" else "")
    return card


def config_card(config, name: str, weights: str, source: str) -> dict:
    card = card_from_model(meta_model(config), name=name, weights=weights, source=source)
    card["title"] = name
    return card


def card(name: str) -> dict:
    """`lmscope card NAME`: a reference, or any model lmscope knows, from its config when one is on
    disk (no weights read), else by loading it."""
    if ALIASES.get(name, name) in REFERENCES:
        return reference_card(name)
    from transformers import AutoConfig

    from model_core.core.registry import (
        RANDOM_CONFIGS,
        REGISTRY,
        converted_dir,
        finetuned_path,
        is_ready,
        load_model,
    )

    entry = REGISTRY.get(name)
    if entry is not None and entry.source == "random":
        cfg = dict(RANDOM_CONFIGS[name])
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        out = config_card(config, name, "random (untrained, seed 0): numbers about shapes only",
                          f"lmscope random-weight test config '{name}'")
        out["title"] = f"{name} (random weights)"
        return out
    folder = None
    if entry is not None and is_ready(name):
        folder = converted_dir(name)
    elif entry is None:
        folder = finetuned_path(name) or (Path(name).expanduser() if Path(name).expanduser().is_dir() else None)
    if folder is not None and (Path(folder) / "config.json").exists():
        try:
            config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"Could not read the config of '{name}': {str(e).splitlines()[0]}") from e
        return config_card(config, name, f"none read: {Path(folder).name}/config.json built on the meta device",
                           f"config.json in {folder}")
    return loaded_card(load_model(name))


def to_json(card: dict) -> dict:
    """The card without private fields, JSON-ready."""
    return {k: v for k, v in card.items() if not k.startswith("_")}


# ---------------------------------------------------------------------------------------------
# The comparison as rows people read


def _n(v) -> str:
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


# card field -> the row where a claim about it is shown
CLAIM_ROWS = {"params": "params", "active_params": "active params / token", "layers": "layers",
              "d_model": "d_model", "attention": "attention kind", "q_heads": "query heads", "kv_heads": "key/value heads",
              "kv_bytes_per_token": "KV cache / token (fp16)", "sliding_window": "sliding window",
              "position": "position encoding", "ffn": "feed-forward", "norm": "norm", "norm_position": "norm position",
              "vocab": "vocabulary", "max_context": "context length", "tied": "weight tying"}


def display_rows(card: dict) -> OrderedDict[str, str]:
    """The card as labelled rows (labels shared with the Anatomy tab's comparison)."""
    r = OrderedDict()
    r["architecture"] = card["architecture"]
    r["weights"] = card["weights"]
    r["params"] = _n(card["params"])
    if card["active_params"] != card["params"]:
        r["active params / token"] = f"{card['active_params']:,} ({100 * card['active_params'] / card['params']:.1f}%)"
    else:
        r["active params / token"] = "all (dense)"
    r["layers"] = _n(card["layers"])
    r["d_model"] = _n(card["d_model"])
    r["attention kind"] = card["attention_detail"]
    r["query heads"] = _n(card["q_heads"])
    r["key/value heads"] = _n(card["kv_heads"])
    if card.get("v_head_dim"):
        r["head dim"] = (f"q·k {card['head_dim']} ({card['head_dim'] - card['kv_rope_key']} + {card['kv_rope_key']} RoPE), "
                         f"v {card['v_head_dim']}")
    else:
        r["head dim"] = _n(card["head_dim"])
    r["KV cache / token (fp16)"] = f"{card['kv_bytes_per_token']:,} B = {card['kv_formula']}"
    if card["kv_bytes_per_token_uncompressed"]:
        u = card["kv_bytes_per_token_uncompressed"]
        r["KV / token if uncompressed (fp16)"] = (f"{u:,} B ({u / card['kv_bytes_per_token']:.0f}× the latent): "
                                                 f"every head's full K and V")
    else:
        r["KV / token if uncompressed (fp16)"] = "same (K and V are cached as they are)"
    if card["sliding_window"]:
        r["sliding window"] = f"{card['sliding_layers']} of {card['layers']} layers see only the last {card['sliding_window']:,} tokens"
    else:
        r["sliding window"] = "no (every layer sees all tokens)"
    r["position encoding"] = card["position"]
    r["feed-forward"] = card["ffn"]
    r["norm"] = card["norm"]
    feeds = ", ".join(card["norm_feeds"])
    r["norm position"] = card["norm_position"] + (f": {feeds}" if feeds else "") + (
        f"; final {card['final_norm']}" if card["final_norm"] else "")
    r["vocabulary"] = _n(card["vocab"])
    r["context length"] = _n(card["max_context"])
    r["weight tying"] = "tied (unembedding = embedding)" if card["tied"] else "untied (separate unembedding)"
    for part, v in card["params_by_part"].items():
        if part in ("experts",) and not v:
            continue
        if part == "other" and not v:
            continue
        if part == "unembedding" and card["tied"]:
            continue
        r[f"params: {part}"] = _n(v)
    return r


def row_marks(card: dict) -> dict[str, list[dict]]:
    """The claims to show in each row: {row label: [{claim, source, agrees, note}]}."""
    marks: dict[str, list[dict]] = {}
    for c in card.get("comparison", []):
        marks.setdefault(CLAIM_ROWS.get(c["field"], c["field"]), []).append(c)
    return marks


def param_shares(card: dict) -> OrderedDict[str, float]:
    """Share (%) of the model's parameters in each part."""
    total = max(1, card["params"])
    return OrderedDict((k, 100 * v / total) for k, v in card["params_by_part"].items())


def kv_growth(cards: dict[str, dict], points: int = 60) -> dict:
    """KV-cache bytes (fp16) vs context for each card, from 1 token to its own context length, on a
    log grid shared by all: {name: {tokens, bytes, uncompressed (MLA) or None, formula, max_context}}."""
    top = max(c["max_context"] or 1 for c in cards.values())
    grid = sorted({int(round(x)) for x in [10 ** (i * math.log10(top) / (points - 1)) for i in range(points)]})
    out = {}
    for name, c in cards.items():
        toks = [t for t in grid if t <= (c["max_context"] or top)]
        if c["max_context"] and toks[-1] != c["max_context"]:
            toks.append(c["max_context"])
        windows = sorted({w for *_, w in c["_kv_layers"] if w})
        for w in windows:  # the bend of a sliding window is a grid point
            if w < toks[-1] and w not in toks:
                toks = sorted(toks + [w])
        out[name] = {"tokens": toks, "bytes": kv_bytes_at(c, toks),
                     "uncompressed": kv_bytes_at(c, toks, uncompressed=True) if c["kv_bytes_per_token_uncompressed"] else None,
                     "formula": c["kv_formula"], "kind": c["attention"], "max_context": c["max_context"]}
    return out


FORMULAS = OrderedDict([
    ("MHA / GQA / MQA", "bytes = 2 (K and V) × layers × kv_heads × head_dim × T × 2 B"),
    ("sliding window W", "bytes = 2 × layers × kv_heads × head_dim × min(T, W) × 2 B on the windowed layers"),
    ("MLA", "bytes = layers × (latent d_c + RoPE key d_R) × T × 2 B; uncompressed: layers × heads × (d_qk + d_v) × T × 2 B"),
])
