"""Interventions chosen on an attribution graph, run on the real model: ablate (or scale) a set of
transcoder feature nodes, each at its own position, and see the next-token distribution and a
greedy continuation change. The edit takes each feature's decoded output (activation x decoder row)
out of its layer's MLP output at its position; the rest of the forward runs freely (attention,
other features), unlike the frozen model the graph was drawn from."""

from __future__ import annotations

import re
from collections import defaultdict

import torch

from model_core.core.hook_names import act_name
from model_core.interp.features_sae import FeatureError
from model_core.interp.transcoders import Transcoders

NODE_ID = re.compile(r"^F(\d+)\.(\d+)\.(\d+)$")
MAX_NODES = 64


def parse_feature_nodes(node_ids, graph_nodes: dict[str, dict]) -> list[tuple[int, int, int, float]]:
    """Feature node ids (F{layer}.{pos}.{feature}) that the graph has -> (layer, pos, feature, activation)."""
    if not isinstance(node_ids, (list, tuple)) or not node_ids:
        raise FeatureError("Choose one or more feature nodes of the graph.")
    if len(node_ids) > MAX_NODES:
        raise FeatureError(f"Choose at most {MAX_NODES} nodes at once.")
    out = []
    for nid in node_ids:
        m = NODE_ID.match(nid) if isinstance(nid, str) else None
        if m is None or nid not in graph_nodes:
            raise FeatureError(f"{str(nid)[:40]!r} is not a feature node of this graph (error and token nodes "
                               f"cannot be ablated here).")
        out.append((int(m[1]), int(m[2]), int(m[3]), float(graph_nodes[nid]["value"])))
    return out


def ablation_edits(tc: Transcoders, nodes: list[tuple[int, int, int, float]], scale: float = 0.0) -> dict:
    """Hook edits that set each node's output to `scale` times its value (0: ablated) at its position.
    A forward whose stream does not reach a node's position (a decode step) is left alone."""
    per_layer: dict[int, list] = defaultdict(list)
    for layer, pos, f, act in nodes:
        coder = tc.coders[layer]
        per_layer[layer].append((pos, (scale - 1.0) * act * coder.W_dec[f].float()))

    def edit_for(changes):
        def edit(name, y):
            if y.shape[1] <= max(p for p, _ in changes):
                return y
            out = y.clone()
            for pos, delta in changes:
                out[:, pos] += delta.to(y.device, y.dtype)
            return out
        return edit

    return {act_name("mlp_out", layer): edit_for(ch) for layer, ch in per_layer.items()}


def intervene(lm, tc: Transcoders, ids: list[int], nodes, *, scale: float = 0.0, target: int | None = None,
              new_tokens: int = 12) -> dict:
    """The next-token distribution before and after (log-probabilities [V]), KL, the target's logit
    change, and a greedy continuation of `new_tokens` tokens before and after."""
    from model_core.interp.feature_steering import next_token_shift
    from model_core.interp.interventions import last_logits

    edits = ablation_edits(tc, nodes, scale)
    t = torch.tensor([ids], device=lm.device)
    shift = next_token_shift(lm, t, edits)
    out = {"base": shift["base"], "after": shift["after"], "kl": shift["kl"]}
    if target is not None:
        out["target_logit_change"] = float(last_logits(lm, t, edits)[0].float()[target]
                                           - last_logits(lm, t)[0].float()[target])
    out["continuation"] = {"before": _greedy(lm, ids, {}, new_tokens), "after": _greedy(lm, ids, edits, new_tokens)}
    return out


def _greedy(lm, ids: list[int], edits: dict, n: int) -> str:
    """n greedy tokens after ids, each from a whole forward with the edits (they act at the prompt's
    positions every time)."""
    from model_core.interp.interventions import last_logits

    seq = list(ids)
    for _ in range(n):
        seq.append(int(last_logits(lm, torch.tensor([seq], device=lm.device), edits or None)[0].argmax()))
    return lm.tokenizer.decode(seq[len(ids):], skip_special_tokens=True)
