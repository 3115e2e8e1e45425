"""Figures of the attribution-graph panel: pure functions of a graph's dict
(model_core.interp.attribution_graph.Graph.to_dict)."""

from __future__ import annotations

import html
import math

import plotly.graph_objects as go

from app.shared import figure_style as style

KIND_COLOURS = {"feature": "#e4572e", "error": "#9ca3af", "embedding": "#4c78a8", "logit": "#2ca02c",
                "supernode": "#7c3aed"}
POSITIVE, NEGATIVE = "#2563eb", "#dc2626"
MAX_DRAWN_EDGES = 1500  # the strongest are drawn; more lines hide the structure and slow the browser


def _layout_positions(nodes: list[dict], n_layers: int) -> dict[str, tuple[float, float]]:
    """(x, y) per node id: x the position (nodes sharing a cell spread across it), y the layer
    (embeddings below layer 0, the logit above the last)."""
    cells: dict[tuple, list[dict]] = {}
    for n in nodes:
        y = -1 if n["kind"] == "embedding" else (n_layers if n["kind"] == "logit" else n["layer"])
        cells.setdefault((n["position"], y), []).append(n)
    xy = {}
    for (pos, y), group in cells.items():
        group.sort(key=lambda n: (n["kind"] != "feature", -n["influence"]))
        for i, n in enumerate(group):
            offset = 0.0 if len(group) == 1 else (i / (len(group) - 1) - 0.5) * 0.7
            xy[n["id"]] = (pos + offset, y)
    return xy


def grouped(g: dict, view: dict | None) -> tuple[list[dict], list[dict]]:
    """The graph as the view draws it: each supernode (a named group of nodes) one node of kind
    "supernode" at its members' mean place, holding their summed influence, with the members' edges
    summed (edges inside a group dropped); with `pinned_only`, only the pinned nodes, the groups and
    the logit, and the edges among them."""
    view = view or {}
    groups = view.get("groups") or {}
    by_id = {n["id"]: n for n in g["nodes"]}
    owner = {m: name for name, members in groups.items() for m in members if m in by_id}
    nodes = [n for n in g["nodes"] if n["id"] not in owner]
    for name, members in groups.items():
        ms = [by_id[m] for m in members if m in by_id]
        if not ms:
            continue
        nodes.append({"id": f"group:{name}", "kind": "supernode", "name": name, "members": [m["id"] for m in ms],
                      "layer": None, "position": ms[-1]["position"], "feature": None, "token": ms[-1]["token"],
                      "value": float(sum(m["value"] for m in ms)), "influence": float(sum(m["influence"] for m in ms))})
    if view.get("pinned_only"):
        keep = set(view.get("pins") or []) | {n["id"] for n in nodes if n["kind"] in ("supernode", "logit")}
        nodes = [n for n in nodes if n["id"] in keep]
    kept = {n["id"] for n in nodes}
    summed: dict[tuple[str, str], float] = {}
    for e in g["edges"]:
        s, t = owner.get(e["source"]), owner.get(e["target"])
        s = f"group:{s}" if s else e["source"]
        t = f"group:{t}" if t else e["target"]
        if s != t and s in kept and t in kept:
            summed[(s, t)] = summed.get((s, t), 0.0) + e["weight"]
    return nodes, [{"source": s, "target": t, "weight": w} for (s, t), w in summed.items()]


def graph_figure(g: dict, n_layers: int, selected: list[str] | None = None, view: dict | None = None) -> go.Figure:
    """Layers upward, positions across; nodes sized by influence and coloured by kind, edges by
    sign (blue excites, red inhibits) and width by |weight|. Each node's id is its customdata (a
    click selects it); supernodes and pinned nodes (the view) carry their names on the figure."""
    nodes, all_edges = grouped(g, view)
    edges = sorted(all_edges, key=lambda e: -abs(e["weight"]))[:MAX_DRAWN_EDGES]
    xy = _layout_positions(g["nodes"], n_layers)  # the full graph's places: a view change moves nothing
    for n in nodes:
        if n["kind"] == "supernode":  # at its members' mean place
            pts = [xy[m] for m in n["members"]]
            xy[n["id"]] = (sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts))
    pins = set((view or {}).get("pins") or [])
    chosen = set(selected or [])
    traces = []
    top = max((abs(e["weight"]) for e in edges), default=1.0) or 1.0
    for sign, colour in ((1, POSITIVE), (-1, NEGATIVE)):
        for lo, hi, width in ((0.0, 0.1, 0.6), (0.1, 0.4, 1.6), (0.4, 1.01, 3.2)):
            xs, ys = [], []
            for e in edges:
                share = abs(e["weight"]) / top
                if (e["weight"] >= 0) == (sign > 0) and lo <= share < hi:
                    (x0, y0), (x1, y1) = xy[e["source"]], xy[e["target"]]
                    xs += [x0, x1, None]
                    ys += [y0, y1, None]
            if xs:
                traces.append(go.Scatter(x=xs, y=ys, mode="lines", hoverinfo="skip", showlegend=False,
                                         line=dict(color=colour, width=width), opacity=0.55))
    for kind, colour in KIND_COLOURS.items():
        group = [n for n in nodes if n["kind"] == kind]
        if not group:
            continue
        labelled = kind == "supernode" or any(n["id"] in pins for n in group)
        traces.append(go.Scatter(
            x=[xy[n["id"]][0] for n in group], y=[xy[n["id"]][1] for n in group],
            mode="markers+text" if labelled else "markers", name=kind,
            customdata=[n["id"] for n in group], hovertext=[_hover(n) for n in group],
            text=[_label(n, pins) for n in group], textposition="top center", textfont=dict(size=11),
            hovertemplate="%{hovertext}<extra></extra>",
            marker=dict(color=colour, size=[8 + 22 * math.sqrt(max(n["influence"], 0.0)) for n in group],
                        symbol=["star" if n["id"] in pins else ("hexagon" if kind == "supernode" else "circle")
                                for n in group],
                        line=dict(color=["#111" if _is_chosen(n, chosen) else "#fff" for n in group],
                                  width=[3 if _is_chosen(n, chosen) else 1 for n in group]))))
    fig = go.Figure(traces)
    tokens = shown_tokens(g)
    fig.update_xaxes(tickvals=list(range(len(tokens))), ticktext=[f"{i}: {t!r}"[:18] for i, t in enumerate(tokens)],
                     tickangle=-40, range=[-0.6, len(tokens) - 0.4], title="position")
    fig.update_yaxes(tickvals=[-1, *range(0, n_layers, max(1, n_layers // 10)), n_layers],
                     ticktext=["embed", *[f"L{i}" for i in range(0, n_layers, max(1, n_layers // 10))], "logit"],
                     range=[-1.8, n_layers + 0.8], title="layer")
    drawn = (f"{len(all_edges):,} edges" if len(all_edges) <= MAX_DRAWN_EDGES
             else f"the {MAX_DRAWN_EDGES:,} strongest of {len(all_edges):,} edges")
    n_groups = sum(n["kind"] == "supernode" for n in nodes)
    title = (f"Attribution graph toward {shown_target(g)!r} (p={g['target_prob']:.3f}): "
             f"{sum(n['kind'] == 'feature' for n in nodes)} features"
             + (f", {n_groups} supernode{'s' * (n_groups != 1)}" if n_groups else "")
             + (" (pinned only)" if (view or {}).get("pinned_only") else "") + f", {drawn}; click a node")
    return style.layout(fig, title, 560, legend=dict(orientation="h", y=1.02, x=1, xanchor="right", yanchor="bottom"))


def _is_chosen(n: dict, chosen: set) -> bool:
    return n["id"] in chosen or (n["kind"] == "supernode" and bool(chosen) and set(n["members"]) <= chosen)


def _label(n: dict, pins: set) -> str:
    if n["kind"] == "supernode":
        return html.escape(n["name"])
    return html.escape(f"{n['id']} {n['token']!r}") if n["id"] in pins else ""


def _hover(n: dict) -> str:
    if n["kind"] == "supernode":
        listed = ", ".join(n["members"][:12]) + (f" and {len(n['members']) - 12} more" if len(n["members"]) > 12 else "")
        return (f"<b>{html.escape(n['name'])}</b>: supernode of {len(n['members'])} nodes<br>{html.escape(listed)}"
                f"<br>influence {n['influence']:.4f} (summed)")
    what = {"feature": f"feature {n['feature']} at layer {n['layer']}", "error": f"error node at layer {n['layer']}",
            "embedding": "token embedding", "logit": "target logit"}[n["kind"]]
    value = "activation" if n["kind"] == "feature" else ("logit" if n["kind"] == "logit" else "norm")
    label = f"<br>{html.escape(n['label'])}" if n.get("label") else ""
    return (f"<b>{html.escape(n['id'])}</b>: {what}{label}<br>position {n['position']} "
            f"{html.escape(repr(n['token']))}<br>{value} {n['value']:.3f} · influence {n['influence']:.4f}")


def shown_tokens(g: dict) -> list[str]:
    """The prompt's tokens as the views show them (a graph dict without display labels: each decode)."""
    return g.get("prompt_display") or g["prompt_tokens"]


def shown_target(g: dict) -> str:
    return g.get("target_display") or g["target_token"]


def checks_html(checks: dict) -> str:
    """Each check of the graph with its numbers and tolerance, ok or FAIL."""
    rows = []
    for name, c in checks.items():
        if not c:
            continue
        badge = ("<b style='color:#15803d'>ok</b>" if c["ok"] else "<b style='color:#b91c1c'>FAIL</b>")
        nums = ", ".join(f"{k.replace('_', ' ')} {v:.4g}" if isinstance(v, float) else f"{k.replace('_', ' ')} {v}"
                         for k, v in c.items() if k not in ("ok", "what"))
        rows.append(f"<tr><td>{badge}</td><td><b>{html.escape(name)}</b></td><td>{html.escape(c.get('what', ''))}"
                    f"<br><span style='font-size:12px;color:#555'>{html.escape(nums)}</span></td></tr>")
    # a long word ("real_model_change") may break: in a narrow window the table stays inside its panel
    return "<table class='circuits-checks' style='width:100%;overflow-wrap:anywhere'>" + "".join(rows) + "</table>"


def node_markdown(g: dict, node_id: str, top: int = 8, view: dict | None = None) -> str:
    """A node's page: what it is, its value and influence, its strongest inputs and outputs in the
    graph as the view draws it (a supernode's edges are its members' summed)."""
    nodes, edges = grouped(g, {**(view or {}), "pinned_only": False})
    by_id = {n["id"]: n for n in nodes}
    if node_id not in by_id:  # a group's member: its own edges
        nodes, edges = g["nodes"], g["edges"]
        by_id = {n["id"]: n for n in nodes}
    n = by_id[node_id]
    ins = sorted((e for e in edges if e["target"] == node_id), key=lambda e: -abs(e["weight"]))[:top]
    outs = sorted((e for e in edges if e["source"] == node_id), key=lambda e: -abs(e["weight"]))[:top]

    def line(other, w):
        o = by_id[other]
        what = f"supernode '{o['name']}'" if o["kind"] == "supernode" else f"{o['kind']}, {o['token']!r}"
        return f"- `{other}` ({what}): **{w:+.4f}**"

    head = _hover(n).replace("<br>", " · ").replace("<b>", "**").replace("</b>", "**")
    parts = [f"### {head}"]
    parts.append("**Inputs** (direct effects on it):\n" + ("\n".join(line(e["source"], e["weight"]) for e in ins)
                                                         or "none kept"))
    parts.append("**Outputs** (its direct effects):\n" + ("\n".join(line(e["target"], e["weight"]) for e in outs)
                                                         or "none kept"))
    return "\n\n".join(parts)
