"""Explore-view figures: pure functions from plain data (lists / numpy arrays) to Plotly figures.
No model, no trace, no gradio in here, so each one is easy to test and reuse."""

from __future__ import annotations

import html
import math

import numpy as np
import plotly.graph_objects as go

ATTN_SCALE = "Blues"
FONT = dict(family="Inter, system-ui, sans-serif", size=12)


def _layout(fig: go.Figure, title: str, height: int = 420, **kw) -> go.Figure:
    fig.update_layout(title=dict(text=title, x=0.01, font=dict(size=14)), height=height,
                      margin=dict(l=60, r=20, t=50, b=50), font=FONT, **kw)
    return fig


def _label(labels: list[str], idx: list[int] | range) -> list[str]:
    # Plotly merges identical category labels; prefix each with its position to keep them apart.
    return [f"{i}:{labels[i]}" for i in idx]


def empty_figure(message: str, height: int = 300) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
                       font=dict(size=14, color="#666"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, "", height=height)


def token_strip_html(tokens: list[dict], logprobs: list[float | None], perplexity: float | None) -> str:
    """Tokens as chips coloured by surprisal (-log2 p); hover shows id, bytes and probability.
    Tokens that only make a character together (model_core.tokenization glyph spans: a Burmese
    letter is three byte tokens) are grouped: the character on top, one chip per token below."""
    def chip(i: int, t: dict, lp, text: str, extra: str = "") -> str:
        byte_ids = f" · bytes {t['bytes']}" if t.get("bytes") else ""
        if lp is None or (isinstance(lp, float) and math.isnan(lp)):
            title, bg = f"id {t['id']}{byte_ids}{extra} · first token (nothing to predict it from)", "#eef"
        else:
            bits = -lp / math.log(2)
            p = math.exp(lp)
            a = min(1.0, bits / 16)
            bg = f"rgba(220, 60, 40, {0.08 + 0.8 * a:.2f})"
            title = f"id {t['id']}{byte_ids}{extra} · p = {p:.4f} · surprisal {bits:.2f} bits"
        cls = "tok tok-part" if extra else "tok"
        return (f'<span class="{cls}" data-pos="{i}" title="{html.escape(title)}" style="background:{bg}">'
                f'{html.escape(text)}</span>')

    chips, i = [], 0
    while i < len(tokens):
        t = tokens[i]
        n = max(1, int(t.get("parts") or 1))
        # a whole span only (a slice of the prompt may start or end inside one)
        if n == 1 or t.get("part") != 1 or i + n > len(tokens) or tokens[i + n - 1].get("part") != n:
            chips.append(chip(i, t, logprobs[i], t["display"]))
            i += 1
            continue
        glyph = t.get("glyph", "")
        parts = "".join(chip(i + k, tokens[i + k], logprobs[i + k], tokens[i + k].get("bytes", ""),
                             f" · token {k + 1} of {n} making “{glyph}”") for k in range(n))
        title = f"“{glyph}”: {n} tokens, bytes " + " | ".join(tokens[i + k].get("bytes", "") for k in range(n))
        chips.append(f'<span class="glyph" title="{html.escape(title)}"><span class="glyph-text">{html.escape(glyph)}'
                     f'</span><span class="glyph-toks">{parts}</span></span>')
        i += n
    ppl = f"perplexity <b>{perplexity:.2f}</b>" if perplexity else "perplexity n/a (one token)"
    grouped = any((t.get("parts") or 1) > 1 for t in tokens)
    return (f'<div class="tokens">{"".join(chips)}</div>'
            f'<div class="token-legend">{len(tokens)} tokens · {ppl} · colour = surprisal '
            f'(white: expected, red: surprising) · hover a token for its id and probability'
            + (" · a character spelled by several tokens is shown above them (their bytes below)" if grouped else "")
            + '</div>')


def head_grid(patterns: np.ndarray, labels: list[str], positions: list[int], layer: int,
              kv_group: list[int], selected_head: int) -> go.Figure:
    """All heads of one layer, small; patterns [H, P, P] over the shown positions.
    The grid's axes are laid out here in one dict (make_subplots built it 4x slower, and this
    figure is redrawn on every layer change)."""
    H = patterns.shape[0]
    cols = min(H, 5 if H > 4 else H)
    rows = math.ceil(H / cols)
    hgap, vgap = 0.02, 0.08 if rows > 1 else 0.0
    w = (1 - hgap * (cols - 1)) / cols
    h_ = (1 - vgap * (rows - 1)) / rows
    lab = _label(labels, positions)
    traces, layout, titles = [], {}, []
    for h in range(H):
        r, c = divmod(h, cols)
        n = "" if h == 0 else str(h + 1)
        x0, y1 = c * (w + hgap), 1 - r * (h_ + vgap)
        layout[f"xaxis{n}"] = dict(domain=[max(0.0, x0), min(1.0, x0 + w)], anchor=f"y{n}", showticklabels=False)
        layout[f"yaxis{n}"] = dict(domain=[max(0.0, y1 - h_), min(1.0, y1)], anchor=f"x{n}", showticklabels=False,
                                   autorange="reversed")
        traces.append(go.Heatmap(z=patterns[h], x=lab, y=lab, coloraxis="coloraxis", xaxis=f"x{n}", yaxis=f"y{n}",
                                 hovertemplate="query %{y}<br>key %{x}<br>weight %{z:.3f}<extra>head " + str(h) + "</extra>"))
        titles.append(dict(text=f"{'▶ ' if h == selected_head else ''}head {h} · kv {kv_group[h]}", x=x0 + w / 2,
                           y=y1, xref="paper", yref="paper", xanchor="center", yanchor="bottom", showarrow=False,
                           font=dict(size=11)))
    fig = go.Figure(data=traces, layout=dict(layout, annotations=titles))
    return _layout(fig, f"Layer {layer}: every head (rows = query token, columns = key token it attends to)",
                   height=190 * rows + 70, coloraxis=dict(colorscale=ATTN_SCALE, cmin=0, cmax=1))


def attention_heatmap(pattern: np.ndarray, labels: list[str], positions: list[int], layer: int, head: int,
                      query_pos: int) -> go.Figure:
    lab = _label(labels, positions)
    fig = go.Figure(go.Heatmap(z=pattern, x=lab, y=lab, colorscale=ATTN_SCALE, zmin=0, zmax=1,
                               hovertemplate="query %{y}<br>key %{x}<br>weight %{z:.3f}<extra></extra>",
                               colorbar=dict(title="weight")))
    if query_pos in positions:
        fig.add_hline(y=positions.index(query_pos), line=dict(color="#e4572e", width=1, dash="dot"))
    fig.update_yaxes(autorange="reversed", title="query token (attending)")
    fig.update_xaxes(title="key token (attended to)", tickangle=-60)
    return _layout(fig, f"Layer {layer}, head {head}", height=560)


def attention_bars(weights: np.ndarray, labels: list[str], positions: list[int], query_label: str,
                   layer: int, head: int) -> go.Figure:
    lab = _label(labels, positions)
    fig = go.Figure(go.Bar(x=lab, y=weights, marker_color="#3b75af",
                           hovertemplate="%{x}<br>weight %{y:.3f}<extra></extra>"))
    fig.update_xaxes(tickangle=-60)
    fig.update_yaxes(title="attention weight", range=[0, 1])
    return _layout(fig, f"Where “{query_label}” looks (layer {layer}, head {head})", height=330)


def head_overview(values: np.ndarray, metric: str, selected: tuple[int, int] | None = None) -> go.Figure:
    """values [L, H]."""
    L, H = values.shape
    fig = go.Figure(go.Heatmap(z=values, x=[f"h{h}" for h in range(H)], y=[f"L{l}" for l in range(L)],
                               colorscale="Viridis", colorbar=dict(title=metric.split(" ")[0]),
                               hovertemplate="layer %{y} head %{x}<br>" + metric + " %{z:.3f}<extra></extra>"))
    if selected:
        fig.add_shape(type="rect", x0=selected[1] - 0.5, x1=selected[1] + 0.5, y0=selected[0] - 0.5,
                      y1=selected[0] + 0.5, line=dict(color="#e4572e", width=2))
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, f"Every layer × head: {metric}", height=max(360, 16 * L + 120))


def residual_norms(norms: np.ndarray, labels: list[str], positions: list[int]) -> go.Figure:
    """norms [L+1, P]: row 0 = embeddings, row l+1 = after layer l."""
    lab = _label(labels, positions)
    rows = ["embed"] + [f"after L{l}" for l in range(norms.shape[0] - 1)]
    # Log colour: the first token's norm (an "attention sink") is often 100x the rest and would
    # otherwise paint every other cell black.
    logn = np.log10(np.maximum(norms, 1e-6))
    ticks = [v for v in (0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000, 3000, 10000, 30000, 100000)
             if logn.min() - 0.1 <= math.log10(v) <= logn.max() + 0.1]
    fig = go.Figure(go.Heatmap(z=logn, x=lab, y=rows, colorscale="Magma", customdata=norms,
                               colorbar=dict(title="‖x‖ (log)", tickvals=[math.log10(v) for v in ticks],
                                             ticktext=[f"{v:g}" for v in ticks]),
                               hovertemplate="%{y}<br>%{x}<br>norm %{customdata:.1f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(tickangle=-60)
    return _layout(fig, "Residual stream norm, layer by layer and token by token", height=max(380, 14 * norms.shape[0] + 140))


def block_contributions(attn: np.ndarray, mlp: np.ndarray, position_label: str) -> go.Figure:
    layers = [f"L{l}" for l in range(len(attn))]
    fig = go.Figure([go.Bar(name="attention adds", x=layers, y=attn, marker_color="#3b75af"),
                     go.Bar(name="MLP adds", x=layers, y=mlp, marker_color="#e4572e")])
    fig.update_yaxes(title="norm of what the block adds")
    return _layout(fig, f"How much each layer writes into the residual stream at “{position_label}”",
                   height=340, barmode="group", legend=dict(orientation="h", y=1.12, x=0.6))


def logit_lens_grid(top_tokens: list[list[str]], probs: np.ndarray, colour: np.ndarray, colour_name: str,
                    labels: list[str], positions: list[int], layers: list[int]) -> go.Figure:
    """probs/colour [L, P]; top_tokens [L][P] strings."""
    lab = _label(labels, positions)
    text = [[t[:10] for t in row] for row in top_tokens]
    custom = np.stack([probs, colour], axis=-1)
    scale = "YlGnBu" if colour_name == "probability" else "YlOrRd"
    fig = go.Figure(go.Heatmap(
        z=colour, x=lab, y=[f"L{l}" for l in layers], text=text, texttemplate="%{text}", textfont=dict(size=9),
        customdata=custom, colorscale=scale, colorbar=dict(title=colour_name.split(" ")[0]),
        hovertemplate="%{y} at %{x}<br>top token %{text}<br>p = %{customdata[0]:.3f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(tickangle=-60, title="position (the lens predicts the NEXT token)")
    return _layout(fig, f"Logit lens: each layer's best guess for the next token (colour = {colour_name})",
                   height=max(420, 17 * len(layers) + 160))


def target_across_layers(probs: np.ndarray, ranks: np.ndarray, target: str, position_label: str) -> go.Figure:
    layers = [f"L{l}" for l in range(len(probs))]
    fig = go.Figure(
        [go.Scatter(x=layers, y=probs, name="probability", mode="lines+markers", line=dict(color="#3b75af")),
         go.Scatter(x=layers, y=ranks + 1, name="rank (1 = top)", mode="lines+markers", yaxis="y2",
                    line=dict(color="#e4572e", dash="dot"))],
        layout=dict(yaxis=dict(title="probability", range=[0, 1]),
                    yaxis2=dict(title="rank", type="log", autorange="reversed", overlaying="y", side="right",
                                    dtick=1, showgrid=False)))  # one tick per decade; the grid is y's
    return _layout(fig, f"“{target}” after “{position_label}”: probability and rank by layer", height=340,
                   legend=dict(orientation="h", y=1.15, x=0.55))


def neuron_heatmap(acts: np.ndarray, neuron_ids: list[int], labels: list[str], positions: list[int],
                   layer: int) -> go.Figure:
    lab = _label(labels, positions)
    lim = float(np.abs(acts).max()) or 1.0
    fig = go.Figure(go.Heatmap(z=acts.T, x=lab, y=[f"n{n}" for n in neuron_ids], colorscale="RdBu_r",
                               zmid=0, zmin=-lim, zmax=lim, colorbar=dict(title="activation"),
                               hovertemplate="neuron %{y}<br>%{x}<br>%{z:.3f}<extra></extra>"))
    fig.update_xaxes(tickangle=-60)
    return _layout(fig, f"Layer {layer} MLP: the most active neurons (rows) across the prompt", height=520)


def top_neurons_bars(values: np.ndarray, neuron_ids: list[int], token_label: str, layer: int) -> go.Figure:
    colours = ["#e4572e" if v > 0 else "#3b75af" for v in values]
    fig = go.Figure(go.Bar(x=[f"n{n}" for n in neuron_ids], y=values, marker_color=colours,
                           hovertemplate="neuron %{x}<br>activation %{y:.3f}<extra></extra>"))
    fig.update_yaxes(title="activation")
    return _layout(fig, f"Layer {layer}: strongest neurons at “{token_label}”", height=330)


def next_token_bars(tokens: list[str], base: np.ndarray, final: np.ndarray, removed_by: list[str],
                    summary: str) -> go.Figure:
    """Top candidates: the model's raw probability and the probability after sampling settings."""
    x = [f"{i + 1}. {t}" for i, t in enumerate(tokens)]
    hover = [f"{t}<br>model p = {b:.4f}<br>after settings p = {f:.4f}<br>{('removed by ' + r) if r else 'kept'}"
             for t, b, f, r in zip(tokens, base, final, removed_by)]
    fig = go.Figure([
        go.Bar(name="model (temperature 1, no filters)", x=x, y=base, marker_color="#c9d3df", hovertext=hover,
               hoverinfo="text"),
        go.Bar(name="after your sampling settings", x=x, y=final,
               marker_color=["#bbbbbb" if r else "#3b75af" for r in removed_by], hovertext=hover,
               hoverinfo="text",
               text=["✕" if r else "" for r in removed_by], textposition="outside"),
    ])
    fig.update_xaxes(tickangle=-50)
    fig.update_yaxes(title="probability")
    return _layout(fig, f"Next token · {summary}", height=420, barmode="group",
                   legend=dict(orientation="h", y=1.12, x=0.3))
