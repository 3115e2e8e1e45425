"""Where fine-tuning changed the weights: ‖ΔW‖_F / ‖W‖_F per layer and module.

`weight_delta(parent, tuned)` compares two models of the same shape (a fine-tuned model and its
parent) parameter by parameter and sums per module (a module's weight and bias together):
delta = ‖W_tuned − W_parent‖_F, norm = ‖W_parent‖_F, rel = delta / norm. A LoRA run is saved
merged, so its delta is the merged low-rank update B·A·(alpha/r).

Tied weights (an lm_head that is the embedding matrix) are one parameter and counted once, under
the name the model lists first; the row names the other names in `also`. Gemma's RMSNorm scales by
(1 + w) and stores w (zero at initialisation), so its norm is ‖1 + w‖: the gain the model applies
(`offset` 1.0 in the row; anatomy.norm_kind says which norms do this).

Computed in float64 on each parameter's own device, one tensor at a time, so a small change is not
lost to rounding in the subtraction.
"""

from __future__ import annotations

import math
import re

import torch

from model_core.core.errors import SettingsError

_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.(.+)$")


def _module_of(param_name: str) -> tuple[int | None, str]:
    """(layer index or None, module path inside the layer / outside the layers) of a parameter name:
    'model.layers.3.self_attn.q_proj.weight' -> (3, 'self_attn.q_proj'); 'model.embed_tokens.weight'
    -> (None, 'embed_tokens'); 'lm_head.weight' -> (None, 'lm_head'); GPT-2 'transformer.h.0.attn.c_attn.bias'
    -> (0, 'attn.c_attn')."""
    path = param_name.rsplit(".", 1)[0] if "." in param_name else param_name
    m = _LAYER_RE.search(path + ".")
    if m:
        return int(m.group(1)), m.group(2).rstrip(".")
    for prefix in ("model.language_model.", "model.", "transformer."):
        if path.startswith(prefix):
            return None, path[len(prefix):]
    return None, path


def _module(x) -> torch.nn.Module:
    if isinstance(x, torch.nn.Module):
        return x
    m = getattr(x, "model", None)  # a LoadedModel
    if isinstance(m, torch.nn.Module):
        return m
    raise TypeError(f"Expected a torch module or a LoadedModel, got {type(x).__name__}.")


def _gain_offsets(model: torch.nn.Module) -> dict[str, float]:
    """{parameter name: 1.0} for the weights of norms that scale by (1 + w) (Gemma's RMSNorm)."""
    from model_core.anatomy.walkthrough import is_norm, norm_kind

    out = {}
    for mn, m in model.named_modules():
        if is_norm(m) and isinstance(getattr(m, "weight", None), torch.nn.Parameter) and norm_kind(m)["gain_offset"]:
            out[f"{mn}.weight" if mn else "weight"] = float(norm_kind(m)["gain_offset"])
    return out


def short_names(modules: list[str]) -> dict[str, str]:
    """Column labels: the last part of each module path ('self_attn.q_proj' -> 'q_proj'), or the
    whole path where two paths share a last part (GPT-2's attn.c_proj and mlp.c_proj)."""
    last = [m.rsplit(".", 1)[-1] for m in modules]
    return {m: (s if last.count(s) == 1 else m) for m, s in zip(modules, last)}


@torch.no_grad()
def weight_delta(parent_model, tuned_model) -> list[dict]:
    """Rows, in the models' parameter order: {layer (int | None), module (path inside the layer,
    e.g. 'self_attn.q_proj', or 'embed_tokens', 'norm', 'lm_head' outside), kind (short column label),
    params [names], also [tied aliases], numel, delta (‖ΔW‖_F), norm (‖W_parent‖_F; ‖1 + W‖ for Gemma's
    norms, with offset 1.0), rel (delta / norm; None when the parent's norm is 0 and delta is not)}.
    SettingsError when the two models' parameter names or shapes differ. Neither model is modified."""
    a_mod, b_mod = _module(parent_model), _module(tuned_model)
    a_all = dict(a_mod.named_parameters(remove_duplicate=False))
    b_all = dict(b_mod.named_parameters(remove_duplicate=False))
    if set(a_all) != set(b_all):
        only = sorted(set(a_all) ^ set(b_all))
        raise SettingsError(f"These models have different parameters ({', '.join(only[:3])}"
                            f"{' ...' if len(only) > 3 else ''}); compare a fine-tuned model with its parent.")
    # tied aliases of the tuned model: names that share one Parameter object
    first_name: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for n, p in b_mod.named_parameters(remove_duplicate=False):
        if id(p) in first_name:
            aliases.setdefault(first_name[id(p)], []).append(n)
        else:
            first_name[id(p)] = n
    offsets = _gain_offsets(a_mod)
    rows: dict[tuple, dict] = {}
    for n, pb in b_mod.named_parameters():  # each Parameter once
        pa = a_all[n]
        if pa.shape != pb.shape:
            raise SettingsError(f"Parameter {n} has shape {tuple(pa.shape)} in one model and {tuple(pb.shape)} in "
                                "the other; compare a fine-tuned model with its parent.")
        layer, module = _module_of(n)
        # out-of-place only: .double() of a float64 weight is that weight itself
        a64 = pa.detach().reshape(-1).double()
        b_ = pb.detach().to(pa.device)
        if pb is pa or torch.equal(b_, pa):  # common (LoRA leaves most tensors alone) and cheaper
            d2 = 0.0
        else:
            d = b_.reshape(-1).double() - a64
            d2 = float(torch.dot(d, d))
            del d
        off = offsets.get(n, 0.0)
        if off:
            a64 = a64 + off
        w2 = float(torch.dot(a64, a64))
        r = rows.setdefault((layer, module), {"layer": layer, "module": module, "params": [], "also": [],
                                              "numel": 0, "offset": 0.0, "_d2": 0.0, "_w2": 0.0})
        r["offset"] = max(r["offset"], off)
        r["params"].append(n)
        r["also"] += aliases.get(n, [])
        r["numel"] += pb.numel()
        r["_d2"] += d2
        r["_w2"] += w2
    out = list(rows.values())
    kinds = short_names(list(dict.fromkeys(r["module"] for r in out)))
    for r in out:
        d2, w2 = r.pop("_d2"), r.pop("_w2")
        r["delta"], r["norm"] = math.sqrt(d2), math.sqrt(w2)
        r["rel"] = r["delta"] / r["norm"] if r["norm"] > 0 else (0.0 if r["delta"] == 0 else None)
        r["kind"] = kinds[r["module"]]
    return out
