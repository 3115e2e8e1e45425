"""Figures and HTML of the neuron / head page (app/tabs/explore/unit_page.py): pure functions of data."""

from __future__ import annotations

import html
import math

import plotly.graph_objects as go

from app.shared import figure_style as style

PROMOTE, SUPPRESS = "#e4572e", "#3b75af"


def weights_figure(top: dict, title: str) -> go.Figure:
    """Horizontal bars: the tokens a unit promotes (largest logit effect, red, on top) and suppresses
    (most negative, blue, below). top: model_core.interp.neurons.top_tokens."""
    pro, sup = top.get("promoted", []), top.get("suppressed", [])
    rows = sup  # most negative at the bottom
    y = [f"{t['token']} ({t['id']})" for t in pro] + [f"{t['token']} ({t['id']}) " for t in rows]
    x = [t["value"] for t in pro] + [t["value"] for t in rows]
    colours = [PROMOTE] * len(pro) + [SUPPRESS] * len(rows)
    fig = go.Figure(go.Bar(x=x, y=y, orientation="h", marker_color=colours,
                           hovertemplate="%{y}<br>logit per unit %{x:.3f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed", automargin=True, type="category")
    fig.update_xaxes(title="logit change per unit (through the final norm's gain)", zeroline=True)
    return style.layout(fig, title, 60 + 22 * len(y), margin=dict(l=10, r=20, t=60, b=50), showlegend=False)


def activation_figure(labels: list[str], values: list[float], title: str, ytitle: str,
                      hover: list[str] | None = None) -> go.Figure:
    colours = [PROMOTE if v >= 0 else SUPPRESS for v in values]
    fig = go.Figure(go.Bar(x=list(range(len(values))), y=values, marker_color=colours,
                           hovertext=hover or labels, hoverinfo="text+y"))
    n = len(labels)
    step = max(1, n // 40)
    fig.update_xaxes(tickvals=list(range(0, n, step)), ticktext=labels[::step], tickangle=-60, automargin=True)
    fig.update_yaxes(title=ytitle)
    return style.layout(fig, title, 340, margin=dict(l=60, r=20, t=60, b=60))


def empty(message: str, height: int = 240) -> go.Figure:
    return style.empty_figure(message, height, margin=dict(l=10, r=10, t=20, b=10))


def _tok(t: str, cls: str = "") -> str:
    return f'<span class="tok{(" " + cls) if cls else ""}">{html.escape(t)}</span>'


def contexts_html(contexts: list[dict], what: str) -> str:
    """One line per context: its value, then the tokens before it and the token itself (marked)."""
    if not contexts:
        return "<p class='unit-none'>No contexts.</p>"
    rows = []
    for i, c in enumerate(contexts):
        toks = "".join(_tok(t, "unit-at" if j == c["at"] else "") for j, t in enumerate(c["tokens"]))
        rows.append(f"<div class='unit-ctx' data-rank='{i + 1}'><span class='unit-val'>{c['value']:.3f}</span>"
                    f"<span class='tokens unit-toks'>{toks}</span>"
                    f"<span class='unit-where'>window {c['window']}, position {c['position']}</span></div>")
    return (f"<div class='unit-contexts'><p class='unit-head'>Top contexts: {html.escape(what)} (the marked token; "
            f"tokens before it give the context)</p>{''.join(rows)}</div>")


def ov_html(rows: list[dict]) -> str:
    """rows: {source, promoted: [{token, value}], self_rank}: what the head writes when it attends to each token."""
    if not rows:
        return ""
    def promoted(r):
        return " ".join(f"{_tok(t['token'])} <small>{t['value']:+.2f}</small>" for t in r["promoted"])
    body = "".join(f"<tr><td>{_tok(r['source'])}</td><td>{promoted(r)}</td><td>{r['self_rank']}</td></tr>"
                   for r in rows)
    return ("<div class='unit-ov'><p class='unit-head'>OV circuit: when the head attends to a token of this prompt, "
            "what it writes (top logits through W_V, W_O, the final gain and W_U)</p><table><thead><tr>"
            "<th>attends to</th><th>promotes</th><th>rank of the token itself</th></tr></thead>"
            f"<tbody>{body}</tbody></table></div>")


def clamp_figure(rows: list[dict], title: str, after_label: str = "with the feature clamped") -> go.Figure:
    """Next-token probabilities before and after an edit, grouped: rows [{token, before, after}],
    the union of both top lists, largest before-probability first."""
    fig = go.Figure([go.Bar(name="as the model runs", x=[r["token"] for r in rows], y=[r["before"] for r in rows],
                            marker_color="#9ca3af", hovertemplate="%{x}<br>p %{y:.4f}<extra>before</extra>"),
                     go.Bar(name=after_label, x=[r["token"] for r in rows], y=[r["after"] for r in rows],
                            marker_color="#e4572e", hovertemplate="%{x}<br>p %{y:.4f}<extra>after</extra>")])
    fig.update_layout(barmode="group", title=title, height=320, margin=dict(l=40, r=20, t=60, b=80),
                      legend=dict(orientation="h", y=1.02, x=1, xanchor="right", yanchor="bottom"),
                      xaxis=dict(tickangle=-45), yaxis=dict(title="probability"))
    return fig


def density_figure(d: dict, title: str) -> go.Figure:
    """A feature's activations over the corpus scan: counts per log-spaced bin (d from
    model_core.interp.features.density: counts [B], edges [B + 1]), bars spanning their bins."""
    edges, counts = d["edges"], d["counts"]
    lo, hi = edges[:-1], edges[1:]
    mid = [(a * b) ** 0.5 for a, b in zip(lo, hi)]  # geometric centre: the middle of a log bin
    fig = go.Figure(go.Bar(x=mid, y=counts, width=[b - a for a, b in zip(lo, hi)], marker_color="#e4572e",
                           customdata=list(zip(lo, hi)),
                           hovertemplate="activation %{customdata[0]:.3g}-%{customdata[1]:.3g}<br>"
                                         "%{y:,} tokens<extra></extra>"))
    used = [i for i, c in enumerate(counts) if c]
    rng = [edges[used[0]], edges[used[-1] + 1]] if used else [edges[0], edges[-1]]
    fig.update_layout(title=title, height=300, margin=dict(l=50, r=20, t=60, b=50), bargap=0.05,
                      xaxis=dict(type="log", title="activation (log scale)",
                                 range=[math.log10(rng[0]), math.log10(rng[1])]),
                      yaxis=dict(title="tokens"))
    return fig
