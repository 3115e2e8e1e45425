"""Explore-view figures: pure functions from plain data (lists / numpy arrays) to Plotly figures.
No model, no trace, no gradio in here, so each one is easy to test and reuse."""

from __future__ import annotations

import html
import math

import numpy as np
import plotly.colors
import plotly.graph_objects as go

from app.shared import figure_style as style

ATTN_SCALE = "Blues"
# The layout is not validated (_figure), so a colour scale in it is spelled out as the validator would
ATTN_COLOURS = plotly.colors.get_colorscale(ATTN_SCALE)
FONT = dict(family="Inter, system-ui, sans-serif", size=12)


def _compact_template() -> go.layout.Template:
    """Plotly's default look for the trace kinds used here, without the 7 KB every figure would
    otherwise carry for polar, geo, 3-D and a dozen other kinds (a page holds a dozen figures)."""
    import plotly.io as pio

    full = pio.templates["plotly"].to_plotly_json()
    keep = ("autotypenumbers", "colorway", "font", "hovermode", "hoverlabel", "paper_bgcolor", "plot_bgcolor",
            "coloraxis", "xaxis", "yaxis", "shapedefaults", "annotationdefaults", "title")
    data = {k: [{kk: vv for kk, vv in full["data"][k][0].items() if kk != "colorscale"}] for k in ("heatmap", "bar")}
    return go.layout.Template(layout={k: full["layout"][k] for k in keep if k in full["layout"]}, data=data)


TEMPLATE = _compact_template()
# what the figures carry: the validated template as plain JSON, set as is in an unvalidated layout
TEMPLATE_JSON = TEMPLATE.to_plotly_json()


def _fig(data=None, layout=None) -> go.Figure:
    # Unvalidated like _figure. empty_figure's message and hidden axes come from figure_style's updates,
    # which store the same JSON the validators would (tests/unit/test_explore_figures_unvalidated.py).
    return go.Figure(data=data, layout={**(layout or {}), "template": TEMPLATE_JSON}, _validate=False)


def _layout(fig: go.Figure, title: str, height: int = 420, **kw) -> go.Figure:
    margin = kw.pop("margin", dict(l=60, r=20, t=75 if "<br>" in title else 50, b=50))  # a caption line
    return style.layout(fig, title, height, margin=margin, font=FONT, **kw)


def _figure(data, title: str, height: int = 420, **layout) -> go.Figure:
    """A figure built in one go, every layout setting in the constructor, and not validated: a layer
    switch redraws six figures, and plotly's validators took ~30 of its ~70 ms. So every layout value
    here is written as the validators would leave it (a title as dict(text=...), a colour scale as
    its list of stops, font keys only when set, no empty list of shapes or annotations):
    tests/unit/test_explore_figures_unvalidated.py compares each figure with plotly validating the
    same dict. The traces are validated when built."""
    margin = layout.pop("margin", dict(l=60, r=20, t=75 if "<br>" in title else 50, b=50))  # a caption line
    layout = {k: v for k, v in layout.items() if not (isinstance(v, list) and not v)}  # as the validator drops them
    return go.Figure(data=data, layout=dict(title=style.title(title), height=height, margin=margin, font=FONT,
                                            template=TEMPLATE_JSON, **layout), _validate=False)


def _label(labels: list[str], idx: list[int] | range) -> list[str]:
    # Plotly merges identical category labels; prefix each with its position to keep them apart.
    return [f"{i}:{labels[i]}" for i in idx]


def empty_figure(message: str, height: int = 300) -> go.Figure:
    return _layout(style.with_message(_fig(), message), "", height=height)


def token_strip_html(tokens: list[dict], logprobs: list[float | None], perplexity: float | None) -> str:
    """Tokens as chips coloured by surprisal (-log2 p); hover shows id, bytes and probability.
    Tokens that only make a character together (model_core.core.tokenization glyph spans: a Burmese
    letter is three byte tokens) are grouped: the character on top, one chip per token below."""
    def chip(i: int, t: dict, lp, text: str, extra: str = "") -> str:
        byte_ids = f" · bytes {t['bytes']}" if t.get("bytes") else ""
        if lp is None or (isinstance(lp, float) and math.isnan(lp)):
            title, bg = f"id {t['id']}{byte_ids}{extra} · first token (nothing to predict it from)", "#eef"
        else:
            bits = -lp / math.log(2)
            p = math.exp(lp)
            a = min(1.0, bits / 16)
            bg = f"rgba(220,60,40,{0.08 + 0.8 * a:.2f})"
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
                             f" · part {k + 1}/{n} of “{glyph}”") for k in range(n))
        # (the chips carry the hover texts: a long prompt's strip stays small)
        chips.append(f'<span class="glyph"><span class="glyph-text">{html.escape(glyph)}'
                     f'</span><span class="glyph-toks">{parts}</span></span>')
        i += n
    ppl = f"perplexity <b>{perplexity:.2f}</b>" if perplexity else "perplexity n/a (one token)"
    grouped = any((t.get("parts") or 1) > 1 for t in tokens)
    return (f'<div class="tokens">{"".join(chips)}</div>'
            f'<div class="token-legend">{len(tokens)} tokens · {ppl} · colour = surprisal '
            f'(white: expected, red: surprising) · hover a token for its id and probability'
            + (" · a character spelled by several tokens is shown above them (their bytes below)" if grouped else "")
            + '</div>')


def _coords(ax: dict) -> list:
    """An axis from app.tabs.explore.views.axis: token labels (category axis) when each cell is one position,
    else the bins' centre positions (numeric axis)."""
    return ax["labels"] if ax["labels"] is not None else ax["centers"]


def _meta(kind: str, x: dict | None = None, y: dict | None = None) -> dict:
    """What the page's click/zoom bridge needs to turn a point or a dragged box into positions."""
    def one(ax):
        return None if ax is None else {"lo": ax["lo"], "hi": ax["hi"], "cat": ax["labels"] is not None}
    return {"lmscope": {"kind": kind, "x": one(x), "y": one(y)}}


def _span(ax: dict) -> str:
    return f"{ax['lo']}-{ax['hi']}" if ax["hi"] > ax["lo"] else f"{ax['lo']}"


def pooling_note(rows: dict, cols: dict) -> str:
    """How a heatmap's cells relate to positions, for its caption."""
    if rows["bin"] == 1 and cols["bin"] == 1:
        return "every cell shown"
    return f"each cell = the largest weight of a {rows['bin']}×{cols['bin']} block (max pooling)"


def _attn_colour(scale: str, log_floor: float) -> dict:
    """zmin/zmax and colour bar of the attention heatmaps for a scale (app.tabs.explore.views.SCALES)."""
    if scale == "log":
        decades = list(range(int(log_floor), 1))
        return dict(zmin=log_floor, zmax=0, colorbar=dict(title=dict(text="weight"), tickvals=decades,
                                                          ticktext=[f"{10.0 ** d:g}" for d in decades]))
    return dict(zmin=0, zmax=1, colorbar=dict(title=dict(text="÷ row max" if scale == "row" else "weight")))


def _attn_hover(scale: str, pooled: bool, extra: str = "") -> str:
    value = {"log": "weight 10^%{z:.2f}", "row": "weight ÷ row max %{z:.3f}"}.get(scale, "weight %{z:.3f}")
    where = ("queries ≈ %{y:.0f}<br>keys ≈ %{x:.0f}<br>largest " if pooled else "query %{y}<br>key %{x}<br>")
    return where + value + f"<extra>{extra}</extra>"


SCALE_WORDS = {"linear": "linear scale", "log": "log scale", "row": "rows ÷ their largest weight"}


def head_grid(patterns: np.ndarray, rows: dict, cols: dict, layer: int, kv_group: list[int], selected_head: int,
              scale: str = "linear", log_floor: float = -4.0) -> go.Figure:
    """All heads of one layer, small; patterns [H, rows, cols] over a region (app.tabs.explore.views.attention_view).
    The grid's axes are laid out here in one dict (make_subplots built it 4x slower, and this
    figure is redrawn on every layer change)."""
    H = patterns.shape[0]
    cols_n = min(H, 5 if H > 4 else H)
    n_rows = math.ceil(H / cols_n)
    hgap, vgap = 0.02, 0.08 if n_rows > 1 else 0.0
    w = (1 - hgap * (cols_n - 1)) / cols_n
    h_ = (1 - vgap * (n_rows - 1)) / n_rows
    x, y = _coords(cols), _coords(rows)
    pooled = rows["bin"] > 1 or cols["bin"] > 1
    traces, layout, titles = [], {}, []
    for h in range(H):
        r, c = divmod(h, cols_n)
        n = "" if h == 0 else str(h + 1)
        x0, y1 = c * (w + hgap), 1 - r * (h_ + vgap)
        layout[f"xaxis{n}"] = dict(domain=[max(0.0, x0), min(1.0, x0 + w)], anchor=f"y{n}", showticklabels=False)
        layout[f"yaxis{n}"] = dict(domain=[max(0.0, y1 - h_), min(1.0, y1)], anchor=f"x{n}", showticklabels=False,
                                   autorange="reversed")
        traces.append(go.Heatmap(z=patterns[h], x=x, y=y, coloraxis="coloraxis", xaxis=f"x{n}", yaxis=f"y{n}",
                                 hovertemplate=_attn_hover(scale, pooled, f"head {h}")))
        titles.append(dict(text=f"{'▶ ' if h == selected_head else ''}head {h} · kv {kv_group[h]}", x=x0 + w / 2,
                           y=y1, xref="paper", yref="paper", xanchor="center", yanchor="bottom", showarrow=False,
                           font=dict(size=11, **({"color": "#e4572e"} if h == selected_head else {}))))
    colour = _attn_colour(scale, log_floor)
    coloraxis = dict(colorscale=ATTN_COLOURS, cmin=colour["zmin"], cmax=colour["zmax"], colorbar=colour["colorbar"])
    where = (f"queries {_span(rows)} × keys {_span(cols)}" + (f" · {pooling_note(rows, cols)}" if pooled else "")
             + f" · {SCALE_WORDS.get(scale, scale)} · click a head to open it")
    return _figure(traces, f"Layer {layer}: every head (rows = query token, columns = key token it attends to)"
                           f"<br><sub>{where}</sub>", height=190 * n_rows + 90, coloraxis=coloraxis,
                   annotations=titles, meta=_meta("grid", cols, rows), **layout)


def attention_heatmap(pattern: np.ndarray, rows: dict, cols: dict, layer: int, head: int, query_pos: int,
                      scale: str = "linear", log_floor: float = -4.0) -> go.Figure:
    """One head over a region: cells with token labels when each is one position, else max-pooled
    blocks on position axes. Dragging a box zooms (the page asks the server for that region)."""
    pooled = rows["bin"] > 1 or cols["bin"] > 1
    trace = go.Heatmap(z=pattern, x=_coords(cols), y=_coords(rows), colorscale=ATTN_SCALE,
                       hovertemplate=_attn_hover(scale, pooled), **_attn_colour(scale, log_floor))
    shapes = []
    if rows["lo"] <= query_pos <= rows["hi"]:  # the query's row
        yq = query_pos - rows["lo"] if rows["labels"] is not None else query_pos
        shapes.append(dict(type="line", xref="x domain", x0=0, x1=1, yref="y", y0=yq, y1=yq,
                           line=dict(color="#e4572e", width=1, dash="dot")))
    caption = (f"queries {_span(rows)} × keys {_span(cols)} · {pooling_note(rows, cols)} · "
               f"{SCALE_WORDS.get(scale, scale)} · drag to zoom, double-click: whole")
    return _figure([trace], f"Layer {layer}, head {head}<br><sub>{caption}</sub>", height=580, shapes=shapes,
                   yaxis=dict(autorange="reversed", title=dict(text="query token (attending)")),
                   xaxis=dict(title=dict(text="key token (attended to)"), tickangle=-60), meta=_meta("head", cols, rows))


def attention_bars(weights: np.ndarray, bars: dict, query_label: str, layer: int, head: int,
                   outside_mass: float = 0.0) -> go.Figure:
    """The query's attention over the region's keys; beyond app.tabs.explore.views.BAR_BINS keys each bar sums a block."""
    pooled = bars["bin"] > 1
    hover = ("keys ≈ %{x:.0f}<br>mass %{y:.3f}" if pooled else "%{x}<br>weight %{y:.3f}") + "<extra></extra>"
    trace = go.Bar(x=_coords(bars), y=weights, marker_color="#3b75af", hovertemplate=hover)
    note = [f"keys {_span(bars)}"]
    if pooled:
        note.append(f"each bar sums {bars['bin']} keys")
    if outside_mass > 0.005:
        note.append(f"+{outside_mass:.0%} on keys not shown")
    # The axis fits the data: over hundreds of keys the weights are small, and a fixed 0-1 axis
    # left the bars invisible. The keys end at the query (app.tabs.explore.views.attention_view).
    w = np.asarray(weights, dtype=np.float64)
    top = float(np.nanmax(w)) if w.size and np.isfinite(w).any() else 0.0
    y_range = [0, min(1.0, top * 1.12) if top > 0 else 1.0]
    n = len(weights)
    x_range = ([-0.5, n - 0.5] if bars["labels"] is not None
               else [bars["starts"][0] - 0.5, bars["ends"][-1] + 0.5])  # the first key's bin to the query's
    return _figure([trace], f"Where “{query_label}” looks (layer {layer}, head {head})<br><sub>{' · '.join(note)}</sub>",
                   height=350, xaxis=dict(tickangle=-60, range=x_range),
                   yaxis=dict(title=dict(text="attention mass" if pooled else "attention weight"), range=y_range),
                   meta={"lmscope": {"kind": "bars", "lo": bars["lo"], "hi": bars["hi"]}})


def head_overview(values: np.ndarray, metric: str, selected: tuple[int, int] | None = None) -> go.Figure:
    """values [L, H]; the selected head is outlined; a click on a cell opens that head."""
    L, H = values.shape
    trace = go.Heatmap(z=np.asarray(values, dtype=np.float32), x=[f"h{h}" for h in range(H)],
                       y=[f"L{l}" for l in range(L)], colorscale="Viridis", colorbar=dict(title=metric.split(" ")[0]),
                       hovertemplate="layer %{y} head %{x}<br>" + metric + " %{z:.3f}<br>click to open<extra></extra>")
    shapes = [dict(type="rect", x0=selected[1] - 0.5, x1=selected[1] + 0.5, y0=selected[0] - 0.5,
                   y1=selected[0] + 0.5, line=dict(color="#e4572e", width=3))] if selected else []
    sel = f" · outlined: layer {selected[0]}, head {selected[1]}" if selected else ""
    return _figure([trace], f"Every layer × head: {metric}<br><sub>click a cell to open that head{sel}</sub>",
                   height=max(380, 16 * L + 140), shapes=shapes, yaxis=dict(autorange="reversed"),
                   meta={"lmscope": {"kind": "overview"}})


def head_search_map(mean, std, metric: str, n_prompts: int, model: str, snippets=None) -> go.Figure:
    """A head search over a corpus (model_core.interp.head_search): mean [L][H] of one metric over the
    prompts (None where undefined), its spread std [L][H] (None for a single-number test) and, per
    head, the start of the prompt where it scored highest (snippets [L][H] or None)."""
    if mean is None:
        return style.empty_figure("No head search for this model yet: score every head over the corpus above.", 220,
                                  margin=dict(l=40, r=20, t=30, b=30))
    z = np.array(mean, dtype=np.float32)  # None -> NaN
    L, H = z.shape
    sd = np.array(std, dtype=np.float32) if std is not None else np.full_like(z, np.nan)
    snip = snippets or [[""] * H for _ in range(L)]
    custom = np.dstack([sd, np.array([[html.escape(t) for t in row] for row in snip], dtype=object)])
    spread = "± %{customdata[0]:.3f} (spread over prompts)<br>top prompt: %{customdata[1]}" if std is not None else ""
    trace = go.Heatmap(z=z, x=[f"h{h}" for h in range(H)], y=[f"L{l}" for l in range(L)], customdata=custom,
                       colorscale="Viridis", colorbar=dict(title=metric.split(" ")[0][:12]),
                       hovertemplate="layer %{y} head %{x}<br>" + metric + " %{z:.3f} " + spread + "<extra></extra>")
    over = f"mean over {n_prompts} corpus prompts" if std is not None else "repeated random tokens, r r"
    return _figure([trace], f"Head search, {model}: {metric}<br><sub>{over} · hover for the spread and the "
                            f"prompt where the head scored highest</sub>",
                   height=max(380, 16 * L + 140), yaxis=dict(autorange="reversed"),
                   meta={"lmscope": {"kind": "head-search"}})


def residual_norms(norms: np.ndarray, ax: dict) -> go.Figure:
    """norms [L+1, bins]: row 0 = embeddings, row l+1 = after layer l; bins from app.tabs.explore.views.axis."""
    rows = ["embed"] + [f"after L{l}" for l in range(norms.shape[0] - 1)]
    # Log colour: the first token's norm (an "attention sink") is often 100x the rest and would
    # otherwise paint every other cell black.
    logn = np.log10(np.maximum(norms, 1e-6)).astype(np.float32)
    ticks = [v for v in (0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000, 3000, 10000, 30000, 100000)
             if logn.min() - 0.1 <= math.log10(v) <= logn.max() + 0.1]
    pooled = ax["bin"] > 1
    trace = go.Heatmap(z=logn, x=_coords(ax), y=rows, colorscale="Magma",
                       colorbar=dict(title="‖x‖ (log)", tickvals=[math.log10(v) for v in ticks],
                                     ticktext=[f"{v:g}" for v in ticks]),
                       hovertemplate=("%{y}<br>positions ≈ %{x:.0f}<br>largest norm 10^%{z:.2f}" if pooled
                                      else "%{y}<br>%{x}<br>norm 10^%{z:.2f}") + "<extra></extra>")
    note = f"positions {_span(ax)}" + (f" · each column = the largest norm of {ax['bin']} positions" if pooled else "")
    return _figure([trace], f"Residual stream norm, layer by layer and token by token<br><sub>{note}</sub>",
                   height=max(400, 14 * norms.shape[0] + 160), yaxis=dict(autorange="reversed"),
                   xaxis=dict(tickangle=-60), meta=_meta("resid", ax))


def block_contributions(attn: np.ndarray, mlp: np.ndarray, position_label: str) -> go.Figure:
    layers = [f"L{l}" for l in range(len(attn))]
    return _figure([go.Bar(name="attention adds", x=layers, y=attn, marker_color="#3b75af"),
                    go.Bar(name="MLP adds", x=layers, y=mlp, marker_color="#e4572e")],
                   f"How much each layer writes into the residual stream at “{position_label}”", height=340,
                   yaxis=dict(title=dict(text="norm of what the block adds")), barmode="group",
                   legend=dict(orientation="h", y=1.12, x=0.6))


LENS_FONT = 9  # px of a lens cell's word
LENS_CHAR_PX = 5.4  # px a character of it takes on average (Inter at 9 px; a wide glyph takes ~9)
LENS_MIN_CHARS = 3  # a cell narrower than this many characters shows colour only (its word on hover)
LENS_GUESS_PX = 1000  # the plot area's width assumed before the page measures it (static/js/explore_bridge.js)


def lens_cell_chars(plot_px: float, n_cols: int) -> int:
    """How many characters of a word fit in one lens cell of a plot area plot_px wide; 0 when fewer than
    LENS_MIN_CHARS fit (then the cells show colour only). The page does the same with the width measured."""
    fit = int((plot_px / max(1, n_cols) - 2) // LENS_CHAR_PX)
    return fit if fit >= LENS_MIN_CHARS else 0


def fit_word(word: str, chars: int) -> str:
    """The word cut to `chars` characters (the last one an ellipsis when cut); "" for 0. A word that
    must be cut loses its leading ␣ first (the hover and the strip keep it): "␣and" in 3 is "and"."""
    if chars <= 0:
        return ""
    if len(word) > chars and word.startswith("␣"):
        word = word[1:]
    return word if len(word) <= chars else word[: chars - 1] + "…"


def logit_lens_grid(top_tokens: list[list[str]], probs: np.ndarray, colour: np.ndarray, colour_name: str,
                    labels: list[str], positions: list[int], layers: list[int], step: int = 1,
                    query_pos: int | None = None, missing: int = 0) -> go.Figure:
    """probs/colour [L, P]; top_tokens [L][P] strings. step 1: every position of the region; step
    s > 1: one sampled position per column (the last of each s), on a position axis. A cell shows
    its top token while it can hold LENS_MIN_CHARS characters (cut to what fits): the figure is cut
    for an assumed LENS_GUESS_PX wide plot, and the page cuts it again for the width it measures,
    from the whole words in layout.meta (static/js/explore_bridge.js); hover always has the word.
    A click selects that layer and position. missing: columns not computed yet (NaN, drawn blank);
    the title says they are being computed."""
    sampled = step > 1
    x = positions if sampled else _label(labels, positions)
    words = [[t[:24] for t in row] for row in top_tokens]
    chars = lens_cell_chars(LENS_GUESS_PX, len(positions))
    text = [[fit_word(t, chars) for t in row] for row in words]
    same = colour_name == "probability"  # then the colour is the probability: no second array to send
    scale = "YlGnBu" if colour_name == "probability" else "YlOrRd"
    where = "position %{x}" if sampled else "%{x}"
    p = np.asarray(probs, dtype=np.float32)
    custom = np.empty(p.shape + (2,), dtype=object)  # [word, probability] per cell, for the hover
    custom[..., 0] = np.array(words, dtype=object).reshape(p.shape) if p.size else ""
    custom[..., 1] = np.where(np.isnan(p), None, np.round(p.astype(np.float64), 4))
    trace = go.Heatmap(
        z=np.asarray(colour, dtype=np.float32), x=x, y=[f"L{l}" for l in layers], text=text,
        texttemplate="%{text}", textfont=dict(size=LENS_FONT), customdata=custom, colorscale=scale,
        colorbar=dict(title=colour_name.split(" ")[0], thickness=14),  # thin: the width goes to the cells
        hovertemplate="%{y} at " + where + "<br>top token %{customdata[0]}<br>p = "
                      + ("%{z:.3f}" if same else "%{customdata[1]:.3f}<br>" + colour_name + " %{z:.3f}")
                      + "<br>click for the top 10<extra></extra>")
    shapes = []
    if query_pos is not None and positions and positions[0] <= query_pos <= positions[-1]:  # the query's column
        xq = query_pos if sampled else (positions.index(query_pos) if query_pos in positions else None)
        if xq is not None:
            shapes.append(dict(type="line", xref="x", x0=xq, x1=xq, yref="y domain", y0=0, y1=1,
                               line=dict(color="#e4572e", width=1, dash="dot")))
    first = max(0, positions[0] - step + 1)  # a sampled column stands for the `step` positions up to it
    ax = {"lo": first, "hi": positions[-1], "labels": None if sampled else x}
    span = f"positions {first}-{positions[-1]}" if positions[-1] > first else f"position {first}"
    note = (f"{span}, one column per {step} positions (the last of each; zoom in to see every one)"
            if sampled else f"{span}, every position") + " · click a cell for its top 10"
    if missing:
        note = f"computing {missing} of {len(positions)} columns… (blank until ready) · " + note
    meta = _meta("lens", ax)
    meta["lmscope"].update(words=words, font=LENS_FONT, char_px=LENS_CHAR_PX, min_chars=LENS_MIN_CHARS)
    return _figure([trace], f"Logit lens: each layer's best guess for the next token (colour = {colour_name})"
                            f"<br><sub>{note}</sub>", height=max(440, 17 * len(layers) + 180), shapes=shapes,
                   yaxis=dict(autorange="reversed"),
                   xaxis=dict(tickangle=-60, title=dict(text="position (the lens predicts the NEXT token)")),
                   meta=meta)


def _prob_bg(p) -> str:
    """A chip's background for a probability (the lens's YlGnBu, light to dark blue); grey if unknown."""
    if p is None or p != p:
        return "#eee"
    return f"rgba(34,94,168,{0.08 + 0.7 * max(0.0, min(1.0, float(p))):.2f})"


def lens_strip_html(words: list[str], probs, labels: list[str], positions: list[int], layer: int,
                    step: int = 1, query_pos: int | None = None) -> str:
    """The lens's top token at one layer as a row of words that wraps (readable at any length): per
    column of the lens, the prompt's token (small) over what the layer guesses comes next, shaded
    by its probability; a chip opens that cell's top 10 like a click on the lens."""
    chips = []
    for w, p, pos in zip(words, probs, positions):
        known = w != "" and p == p
        tip = (f"position {pos} “{labels[pos]}” → layer {layer} guesses “{w}”, p = {float(p):.3f}" if known
               else f"position {pos}: not computed yet")
        cls = "lens-chip lens-query" if pos == query_pos else "lens-chip"
        chips.append(f'<span class="{cls}" data-pos="{pos}" data-layer="{layer}" title="{html.escape(tip)}" '
                     f'style="background:{_prob_bg(p if known else None)}">'
                     f'<span class="lens-in">{html.escape(labels[pos][:16])}</span>'
                     f'<span class="lens-out">{html.escape(w) if known else "…"}</span></span>')
    sampled = f" (one position in {step}: zoom in for every one)" if step > 1 else ""
    return (f'<div class="lens-strip-legend">Layer {layer}\'s top guess after each position{sampled} · '
            f'small: the prompt\'s token, below it: the guess, shaded by its probability · '
            f'the Layer slider picks the row · click a word for its top 10</div>'
            f'<div class="lens-strip">{"".join(chips)}</div>')


def lens_topk_html(tokens: list[str], probs, layer: int, pos: int, label: str, entropy: float | None = None) -> str:
    """One lens cell's k best guesses, as a table with bars (a click on the lens or the strip)."""
    rows = "".join(
        f'<tr><td class="k">{i + 1}</td><td class="w">{html.escape(t)}</td>'
        f'<td class="p">{float(p):.3f}</td><td class="bar"><span style="width:{100 * float(p):.0f}%"></span></td></tr>'
        for i, (t, p) in enumerate(zip(tokens, probs)))
    ent = f" · entropy {entropy:.2f} nats" if entropy is not None else ""
    return (f'<div class="lens-topk-head">Layer {layer}, after position {pos} “{html.escape(label)}”{ent}</div>'
            f'<table class="lens-topk"><thead><tr><th>#</th><th>token</th><th>p</th><th></th></tr></thead>'
            f'<tbody>{rows}</tbody></table>')


def target_across_layers(probs: np.ndarray, ranks: np.ndarray, target: str, position_label: str) -> go.Figure:
    layers = [f"L{l}" for l in range(len(probs))]
    return _figure(
        [go.Scatter(x=layers, y=probs, name="probability", mode="lines+markers", line=dict(color="#3b75af")),
         go.Scatter(x=layers, y=ranks + 1, name="rank (1 = top)", mode="lines+markers", yaxis="y2",
                    line=dict(color="#e4572e", dash="dot"))],
        f"“{target}” after “{position_label}”: probability and rank by layer", height=340,
        yaxis=dict(title=dict(text="probability"), range=[0, 1]),
        yaxis2=dict(title=dict(text="rank"), type="log", autorange="reversed", overlaying="y", side="right",
                    dtick=1, showgrid=False),  # one tick per decade; the grid is y's
        legend=dict(orientation="h", y=1.15, x=0.55))


def neuron_heatmap(acts: np.ndarray, neuron_ids: list[int], ax: dict, layer: int) -> go.Figure:
    """acts [bins, neurons] over positions (app.tabs.explore.views.neuron_view; beyond its bins each column is the
    activation of largest magnitude among its positions)."""
    lim = float(np.abs(acts).max()) if acts.size else 1.0
    lim = lim or 1.0
    pooled = ax["bin"] > 1
    trace = go.Heatmap(z=np.asarray(acts, dtype=np.float32).T, x=_coords(ax), y=[f"n{n}" for n in neuron_ids],
                       colorscale="RdBu_r", zmid=0, zmin=-lim, zmax=lim, colorbar=dict(title="activation"),
                       hovertemplate="neuron %{y}<br>" + ("positions ≈ %{x:.0f}" if pooled else "%{x}")
                                     + "<br>%{z:.3f}<extra></extra>")
    note = f"positions {_span(ax)}" + (f" · each column = the strongest of {ax['bin']} positions" if pooled else "")
    return _figure([trace], f"Layer {layer} MLP: the most active neurons (rows) across the prompt<br><sub>{note}</sub>",
                   height=540, xaxis=dict(tickangle=-60), meta=_meta("neurons", ax))


def top_neurons_bars(values: np.ndarray, neuron_ids: list[int], token_label: str, layer: int) -> go.Figure:
    colours = ["#e4572e" if v > 0 else "#3b75af" for v in values]
    trace = go.Bar(x=[f"n{n}" for n in neuron_ids], y=values, marker_color=colours,
                   hovertemplate="neuron %{x}<br>activation %{y:.3f}<extra></extra>")
    return _figure([trace], f"Layer {layer}: strongest neurons at “{token_label}”", height=330,
                   yaxis=dict(title=dict(text="activation")))


def next_token_bars(tokens: list[str], base: np.ndarray, final: np.ndarray, removed_by: list[str],
                    summary: str) -> go.Figure:
    """Top candidates: the model's raw probability and the probability after sampling settings."""
    x = [f"{i + 1}. {t}" for i, t in enumerate(tokens)]
    hover = [f"{t}<br>model p = {b:.4f}<br>after settings p = {f:.4f}<br>{('removed by ' + r) if r else 'kept'}"
             for t, b, f, r in zip(tokens, base, final, removed_by)]
    return _figure([
        go.Bar(name="model (temperature 1, no filters)", x=x, y=base, marker_color="#c9d3df", hovertext=hover,
               hoverinfo="text"),
        go.Bar(name="after your sampling settings", x=x, y=final,
               marker_color=["#bbbbbb" if r else "#3b75af" for r in removed_by], hovertext=hover,
               hoverinfo="text",
               text=["✕" if r else "" for r in removed_by], textposition="outside"),
    ], f"Next token · {summary}", height=420, barmode="group", xaxis=dict(tickangle=-50),
        yaxis=dict(title=dict(text="probability")), legend=dict(orientation="h", y=1.12, x=0.3))
