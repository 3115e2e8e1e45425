"""Figures for the Interventions tab: pure functions, data in -> plotly Figure out."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import plotly.graph_objects as go

from app.shared import figure_style as style

CLEAN, OTHER = "#1f77b4", "#d62728"


def _layout(fig: go.Figure, title: str, height: int = 360) -> go.Figure:
    """The shared layout, the legend in a row above the plot on the right."""
    return style.layout(fig, title, height, margin=dict(l=50, r=20, t=50, b=40),
                        legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0))


def _clean(values) -> list[list[float | None]]:
    rows = values.tolist() if hasattr(values, "tolist") else values
    return [[None if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in r] for r in rows]


def next_token_compare(tokens: Sequence[str], probs_a: Sequence[float], probs_b: Sequence[float],
                       label_a: str = "clean", label_b: str = "ablated", title: str = "Next-token probability") -> go.Figure:
    """Grouped bars: the same tokens under two runs."""
    fig = go.Figure([go.Bar(x=list(tokens), y=list(probs_a), name=label_a, marker_color=CLEAN),
                     go.Bar(x=list(tokens), y=list(probs_b), name=label_b, marker_color=OTHER)])
    fig.update_layout(barmode="group", yaxis=dict(title="probability", rangemode="tozero"))
    fig.update_xaxes(type="category")
    return _layout(fig, title)


def distribution(tokens: Sequence[str], probs: Sequence[float], title: str, color: str = CLEAN) -> go.Figure:
    fig = go.Figure(go.Bar(x=list(probs), y=list(tokens), orientation="h", marker_color=color,
                           text=[f"{p:.3f}" for p in probs], textposition="auto"))
    fig.update_yaxes(type="category", autorange="reversed")
    fig.update_xaxes(title="probability", rangemode="tozero")
    return _layout(fig, title, height=320)


def lens_change(layers: Sequence[int], clean: Sequence[float], ablated: Sequence[float], token: str,
                clean_top: Sequence[str] | None = None, ablated_top: Sequence[str] | None = None) -> go.Figure:
    """Logit lens at the last position: probability of `token` after each layer, both runs."""
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=list(layers), y=list(clean), mode="lines+markers", name="clean", line_color=CLEAN,
                             customdata=list(clean_top) if clean_top else None,
                             hovertemplate="layer %{x}<br>p=%{y:.3f}" + ("<br>top-1: %{customdata}" if clean_top else "")
                             + "<extra>clean</extra>"))
    fig.add_trace(go.Scatter(x=list(layers), y=list(ablated), mode="lines+markers", name="ablated",
                             line_color=OTHER, customdata=list(ablated_top) if ablated_top else None,
                             hovertemplate="layer %{x}<br>p=%{y:.3f}" + ("<br>top-1: %{customdata}" if ablated_top else "")
                             + "<extra>ablated</extra>"))
    fig.update_xaxes(title="layer (residual stream after it)", dtick=max(1, len(layers) // 15))
    fig.update_yaxes(title=f"p({token!r}) at the last position", range=[0, 1])
    return _layout(fig, f"Logit lens at the last position: p({token!r})")


def _numbers(labels: Sequence[str]) -> list[int] | None:
    """The numbers in labels like "L3" / "H7", or None when one has none."""
    out = []
    for t in labels:
        m = re.search(r"\d+", str(t))
        if m is None:
            return None
        out.append(int(m.group()))
    return out


def heads_meta(row_labels: Sequence[str], col_labels: Sequence[str]) -> dict:
    """layout.meta of a layer × head heatmap: which layer and head each row and column is, for the
    page's click (static/js/interventions_bridge.js puts the clicked head in the ablation's list)."""
    return {"lmscope": {"kind": "heads", "layers": _numbers(row_labels), "heads": _numbers(col_labels)}}


def heatmap(values, row_labels: Sequence[str], col_labels: Sequence[str], title: str, *,
            colorbar: str = "", zmid: float | None = 0.0, x_title: str = "", y_title: str = "",
            hover: str = "value", heads: bool = False) -> go.Figure:
    """Diverging heatmap (blue < 0 < red), first row at the top; NaN cells blank. heads: rows are
    layers and columns heads; a click on a cell puts that head in the ablation (said in the hover)."""
    z = _clean(values)
    click = "<br>click: put this head in “Heads to switch off”" if heads else ""
    fig = go.Figure(go.Heatmap(
        z=z, x=list(range(len(col_labels))), y=list(range(len(row_labels))), colorscale="RdBu", reversescale=True,
        zmid=zmid, colorbar=dict(title=colorbar), customdata=[[f"{r} · {c}" for c in col_labels] for r in row_labels],
        hovertemplate="%{customdata}<br>" + hover + " = %{z:.3f}" + click + "<extra></extra>"))
    if heads:
        fig.update_layout(meta=heads_meta(row_labels, col_labels))
    fig.update_xaxes(tickmode="array", tickvals=list(range(len(col_labels))), ticktext=list(col_labels),
                     title=x_title, tickangle=-45 if len(col_labels) > 8 else 0)
    fig.update_yaxes(tickmode="array", tickvals=list(range(len(row_labels))), ticktext=list(row_labels),
                     title=y_title, autorange="reversed")
    return _layout(fig, title, height=max(320, 60 + 18 * len(row_labels)))


def patching_heatmap(values, layers: Sequence[int], col_labels: Sequence[str], title: str,
                     kind: str = "resid", normalized: bool = True) -> go.Figure:
    return heatmap(values, [f"L{l}" for l in layers], col_labels, title,
                   colorbar="share of the<br>clean answer<br>restored" if normalized else "Δ metric",
                   x_title="corrupted prompt position" if kind == "resid" else "head",
                   y_title="layer (patched at its input)" if kind == "resid" else "layer",
                   hover="effect (0 = corrupted, 1 = clean)" if normalized else "Δ metric", heads=kind == "heads")


def head_attribution(values, title: str = "Direct logit attribution per head") -> go.Figure:
    n_heads = len(values[0]) if len(values) else 0
    return heatmap(values, [f"L{l}" for l in range(len(values))], [f"H{h}" for h in range(n_heads)], title,
                   colorbar="logit", x_title="head", y_title="layer", hover="direct effect", heads=True)


def layer_bars(attn: Sequence[float], mlp: Sequence[float], embed: float | None = None,
               title: str = "Direct logit attribution per layer") -> go.Figure:
    L = len(attn)
    fig = go.Figure([go.Bar(x=[f"L{l}" for l in range(L)], y=list(attn), name="attention", marker_color=CLEAN),
                     go.Bar(x=[f"L{l}" for l in range(L)], y=list(mlp), name="MLP", marker_color="#ff7f0e")])
    if embed is not None:
        fig.add_trace(go.Bar(x=["embed"], y=[embed], name="embedding", marker_color="#7f7f7f"))
    fig.update_layout(barmode="group")
    fig.update_xaxes(type="category", categoryorder="array",
                     categoryarray=(["embed"] if embed is not None else []) + [f"L{l}" for l in range(L)])
    fig.update_yaxes(title="contribution to the logit")
    return _layout(fig, title)


def resid_difference(norms: Sequence[float], rel: Sequence[float]) -> go.Figure:
    layers = list(range(len(norms)))
    fig = go.Figure([go.Scatter(x=layers, y=list(norms), mode="lines+markers", name="‖a − b‖", line_color=CLEAN),
                     go.Scatter(x=layers, y=list(rel), mode="lines+markers", name="relative", yaxis="y2",
                                line_color=OTHER)])
    fig.update_layout(yaxis=dict(title="‖a − b‖ (last position)", rangemode="tozero"),
                      yaxis2=dict(title="relative to mean norm", overlaying="y", side="right", rangemode="tozero"))
    fig.update_xaxes(title="layer (residual stream after it)")
    return _layout(fig, "Residual-stream difference per layer at the last position")
