"""DoLa's figure (a pure function of dola_greedy's JSON): for each generated token, each candidate
layer's divergence from the final layer, the layer DoLa contrasted with marked."""

from __future__ import annotations

import plotly.graph_objects as go


def divergence_figure(run: dict | None, labels: list[str] | None = None) -> go.Figure:
    """Heatmap: candidate layers x steps, the divergence DoLa ranks them by; a star on each step's
    premature layer (the argmax). `labels`: the generated tokens as text."""
    fig = go.Figure()
    dola = (run or {}).get("dola") or {}
    steps, layers = dola.get("steps") or [], dola.get("candidates") or []
    if not steps or not layers:
        fig.add_annotation(text="Press Decode: which earlier layer each token was contrasted with", showarrow=False,
                           x=0.5, y=0.5, xref="paper", yref="paper", font=dict(size=14))
        fig.update_layout(height=220, xaxis_visible=False, yaxis_visible=False, margin=dict(l=10, r=10, t=10, b=10))
        return fig
    labels = labels or [str(s["token_id"]) for s in steps]
    xs = [f"{i}:{labels[i] if i < len(labels) else '?'}" for i in range(len(steps))]
    ys = [f"L{layer}" for layer in layers]
    z = [[s["js"].get(str(layer)) for s in steps] for layer in layers]  # [candidates, steps]
    fig.add_heatmap(x=xs, y=ys, z=z, colorscale="Blues", colorbar=dict(title="divergence", thickness=10),
                    hovertemplate="token %{x}<br>layer %{y}<br>divergence %{z:.3g}<extra></extra>")
    fig.add_scatter(x=xs, y=[f"L{s['premature_layer']}" for s in steps], mode="markers", name="contrasted with",
                    marker=dict(symbol="star", size=11, color="#f97316", line=dict(width=1, color="black")),
                    hovertemplate="token %{x}: contrasted with %{y}<extra></extra>")
    fig.update_layout(title=f"Each token's divergence from the final layer, per candidate ('{dola.get('layers')}' layers);"
                            " ★ the layer DoLa contrasted with",
                      xaxis=dict(title="generated token", type="category", tickangle=-45),
                      yaxis=dict(title="earlier layer", type="category"),
                      height=max(280, 24 * len(layers) + 200), showlegend=False,
                      margin=dict(l=60, r=10, t=60, b=100))
    return fig
