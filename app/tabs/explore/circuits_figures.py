"""Figures of the attribution-graph panel: pure functions of a graph's dict
(model_core.interp.attribution_graph.Graph.to_dict)."""

from __future__ import annotations

import html
import math

import plotly.graph_objects as go

from app.shared import figure_style as style

KIND_COLOURS = {"feature": "#e4572e", "error": "#9ca3af", "embedding": "#4c78a8", "logit": "#2ca02c"}
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


def graph_figure(g: dict, n_layers: int, selected: list[str] | None = None) -> go.Figure:
    """Layers upward, positions across; nodes sized by influence and coloured by kind, edges by
    sign (blue excites, red inhibits) and width by |weight|. Each node's id is its customdata (a
    click selects it)."""
    nodes = g["nodes"]
    edges = sorted(g["edges"], key=lambda e: -abs(e["weight"]))[:MAX_DRAWN_EDGES]
    xy = _layout_positions(nodes, n_layers)
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
        traces.append(go.Scatter(
            x=[xy[n["id"]][0] for n in group], y=[xy[n["id"]][1] for n in group], mode="markers", name=kind,
            customdata=[n["id"] for n in group],
            text=[_hover(n) for n in group], hovertemplate="%{text}<extra></extra>",
            marker=dict(color=colour, size=[8 + 22 * math.sqrt(max(n["influence"], 0.0)) for n in group],
                        line=dict(color=["#111" if n["id"] in chosen else "#fff" for n in group],
                                  width=[3 if n["id"] in chosen else 1 for n in group]))))
    fig = go.Figure(traces)
    tokens = g["prompt_tokens"]
    fig.update_xaxes(tickvals=list(range(len(tokens))), ticktext=[f"{i}: {t!r}"[:18] for i, t in enumerate(tokens)],
                     tickangle=-40, range=[-0.6, len(tokens) - 0.4], title="position")
    fig.update_yaxes(tickvals=[-1, *range(0, n_layers, max(1, n_layers // 10)), n_layers],
                     ticktext=["embed", *[f"L{i}" for i in range(0, n_layers, max(1, n_layers // 10))], "logit"],
                     range=[-1.8, n_layers + 0.8], title="layer")
    drawn = (f"{len(g['edges']):,} edges" if len(g["edges"]) <= MAX_DRAWN_EDGES
             else f"the {MAX_DRAWN_EDGES:,} strongest of {len(g['edges']):,} edges")
    title = (f"Attribution graph toward {g['target_token']!r} (p={g['target_prob']:.3f}): "
             f"{sum(n['kind'] == 'feature' for n in nodes)} features, {drawn}; click a node")
    return style.layout(fig, title, 560, legend=dict(orientation="h", y=1.02, x=1, xanchor="right", yanchor="bottom"))


def _hover(n: dict) -> str:
    what = {"feature": f"feature {n['feature']} at layer {n['layer']}", "error": f"error node at layer {n['layer']}",
            "embedding": "token embedding", "logit": "target logit"}[n["kind"]]
    value = "activation" if n["kind"] == "feature" else ("logit" if n["kind"] == "logit" else "norm")
    return (f"<b>{html.escape(n['id'])}</b>: {what}<br>position {n['position']} {html.escape(repr(n['token']))}"
            f"<br>{value} {n['value']:.3f} · influence {n['influence']:.4f}")


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
    return "<table class='circuits-checks'>" + "".join(rows) + "</table>"


def node_markdown(g: dict, node_id: str, top: int = 8) -> str:
    """A node's page: what it is, its value and influence, its strongest inputs and outputs in the graph."""
    by_id = {n["id"]: n for n in g["nodes"]}
    n = by_id[node_id]
    ins = sorted((e for e in g["edges"] if e["target"] == node_id), key=lambda e: -abs(e["weight"]))[:top]
    outs = sorted((e for e in g["edges"] if e["source"] == node_id), key=lambda e: -abs(e["weight"]))[:top]

    def line(other, w):
        o = by_id[other]
        return f"- `{other}` ({o['kind']}, {o['token']!r}): **{w:+.4f}**"

    head = _hover(n).replace("<br>", " · ").replace("<b>", "**").replace("</b>", "**")
    parts = [f"### {head}"]
    parts.append("**Inputs** (direct effects on it):\n" + ("\n".join(line(e["source"], e["weight"]) for e in ins)
                                                         or "none kept"))
    parts.append("**Outputs** (its direct effects):\n" + ("\n".join(line(e["target"], e["weight"]) for e in outs)
                                                         or "none kept"))
    return "\n\n".join(parts)
