"""An attribution graph in the JSON layout that Neuronpedia's graph viewer (and circuit-tracer's
local server) reads: `metadata`, `qParams`, `nodes`, `links`, with circuit-tracer's node ids
(feature `{layer}_{feature}_{pos}`, error `{layer}_-1_{pos}`, embedding `E_{token id}_{pos}`, logit
`{layers + 1}_{token id}_{pos}`). Pinned nodes and supernodes travel in qParams."""

from __future__ import annotations

from model_core.interp.attribution_graph import Graph, Node


def _cantor(x: int, y: int) -> int:
    """The feature number the viewer expects for (layer, feature): Cantor's pairing."""
    return (x + y) * (x + y + 1) // 2 + y


def _node(n: Node, g: Graph, n_layers: int) -> dict:
    pos = n.position
    if n.kind == "feature":
        nid, js = f"{n.layer}_{n.feature}_{pos}", f"{n.layer}_{n.feature}-0"
        return {"node_id": nid, "jsNodeId": js, "feature": _cantor(n.layer, n.feature), "layer": str(n.layer),
                "ctx_idx": pos, "feature_type": "cross layer transcoder", "influence": n.influence,
                "activation": n.value, "clerp": n.label, "token_prob": 0.0, "is_target_logit": False, "run_idx": 0,
                "reverse_ctx_idx": 0}
    if n.kind == "error":
        return {"node_id": f"{n.layer}_-1_{pos}", "jsNodeId": f"{n.layer}_-1-{pos}", "feature": -1,
                "layer": str(n.layer), "ctx_idx": pos, "feature_type": "mlp reconstruction error",
                "influence": n.influence, "activation": None, "clerp": "", "token_prob": 0.0,
                "is_target_logit": False, "run_idx": 0, "reverse_ctx_idx": 0}
    if n.kind == "embedding":
        vocab = g.prompt_ids[pos]
        return {"node_id": f"E_{vocab}_{pos}", "jsNodeId": f"E_{vocab}-{pos}", "feature": pos, "layer": "E",
                "ctx_idx": pos, "feature_type": "embedding", "influence": n.influence, "activation": None,
                "clerp": "", "token_prob": 0.0, "is_target_logit": False, "run_idx": 0, "reverse_ctx_idx": 0}
    layer = str(n_layers + 1)
    return {"node_id": f"{layer}_{g.target}_{pos}", "jsNodeId": f"L_{g.target}-{pos}", "feature": g.target,
            "layer": layer, "ctx_idx": pos, "feature_type": "logit", "influence": None, "activation": None,
            "clerp": f'Output "{g.target_token}" (p={g.target_prob:.3f})', "token_prob": g.target_prob,
            "is_target_logit": True, "run_idx": 0, "reverse_ctx_idx": 0}


def neuronpedia_json(g: Graph, n_layers: int, *, slug: str = "lmscope-graph", pinned: list[str] | None = None,
                     supernodes: list[list[str]] | None = None) -> dict:
    """The graph in Neuronpedia's layout. `pinned` and each supernode's members are lmscope node ids
    (Graph.nodes[i].id); they are written as the viewer's ids. A supernode is [name, member, ...]."""
    mapped = {n.id: _node(n, g, n_layers) for n in g.nodes}
    to_np = {k: v["node_id"] for k, v in mapped.items()}

    def ids(xs):
        return [to_np[x] for x in xs if x in to_np]

    return {
        "metadata": {"slug": slug, "scan": g.model, "transcoder_list": [g.settings.get("transcoders") or ""],
                     "prompt_tokens": g.prompt_tokens, "prompt": g.prompt_text or "".join(g.prompt_tokens),
                     "node_threshold": g.settings.get("node_threshold"), "schema_version": 1},
        "qParams": {"pinnedIds": ids(pinned or []), "supernodes": [[s[0], *ids(s[1:])] for s in supernodes or []],
                    "linkType": "both", "clickedId": "", "sg_pos": ""},
        "nodes": list(mapped.values()),
        "links": [{"source": to_np[s], "target": to_np[t], "weight": w} for s, t, w in g.edges],
    }
