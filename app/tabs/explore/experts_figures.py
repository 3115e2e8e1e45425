"""Explore's experts view, pure: router probabilities per token and expert (the chosen ones
marked), and each expert's load over the prompt. Plotly only: lists in, figures out."""

from __future__ import annotations

import plotly.graph_objects as go

from app.shared import figure_style as style


def routing_figure(tokens: list[str], probs: list[list[float]], chosen: list[list[int]], layer: int,
                   weights: list[list[float]] | None = None) -> go.Figure:
    """Heatmap tokens (rows, in prompt order) x experts of the router's softmax; a ● on each
    (token, expert) the model chose, its mixing weight in the hover."""
    if not tokens or not probs:
        return style.empty_figure("Run a prompt on a mixture-of-experts model to see its routing.")
    n_exp = len(probs[0])
    rows = [f"{i}: {t}" for i, t in enumerate(tokens)]  # positions keep repeated tokens apart
    mark = [["●" if e in set(ch) else "" for e in range(n_exp)] for ch in chosen]
    w = {(i, e): weights[i][j] for i, ch in enumerate(chosen) for j, e in enumerate(ch)} if weights else {}
    hover = [[f"{rows[i]}<br>expert {e}: p = {probs[i][e]:.3f}"
              + (f"<br>chosen, weight {w[(i, e)]:.3f}" if (i, e) in w else "") for e in range(n_exp)]
             for i in range(len(rows))]
    fig = go.Figure(go.Heatmap(z=probs, x=[f"E{e}" for e in range(n_exp)], y=rows, colorscale="Blues",
                               zmin=0, zmax=1, text=mark, texttemplate="%{text}", hovertext=hover,
                               hoverinfo="text", colorbar=dict(title="p", thickness=10)))
    fig.update_yaxes(autorange="reversed", tickfont=dict(size=11))
    height = min(900, 120 + 18 * len(rows))
    return style.layout(fig, f"Layer {layer}: where the router sends each token (● = chosen)", height,
                        margin=dict(l=120, r=20, t=40, b=40))


def load_figure(load: list[float], layer: int) -> go.Figure:
    """Bars: each expert's share of the prompt's choices; the even share as a dashed line."""
    if not load:
        return style.empty_figure("No routed layer to show.", height=240)
    fig = go.Figure(go.Bar(x=[f"E{e}" for e in range(len(load))], y=load, marker_color="#4c78a8",
                           hovertemplate="%{x}: %{y:.1%} of the choices<extra></extra>"))
    fig.add_hline(y=1 / len(load), line_dash="dash", line_color="#999",
                  annotation_text="even share", annotation_position="top right")
    fig.update_yaxes(tickformat=".0%", title="share of choices")
    return style.layout(fig, f"Layer {layer}: expert load over the prompt", 260)
