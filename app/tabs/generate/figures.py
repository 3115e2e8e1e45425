"""Pure figure functions for the Generation lab: plain data (the JSON of model_core.serving.generate)
in, a plotly Figure out. No gradio, no model."""

from __future__ import annotations

import functools

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.shared import figure_style as style

STAGE_COLOURS = {"top_k": "#d62728", "top_p": "#ff7f0e", "min_p": "#9467bd", "greedy": "#7f7f7f", None: "#1f77b4"}
_MARGIN = style.MARGIN
CHOSEN_EXTRA_COLOUR = "#e377c2"  # the chosen token's extra bar when it is past the top 10


def step_label(step: dict) -> str:
    """The chosen token as views show it: "glyph·k/n" for one of several byte tokens making a
    character (set by the tab once the tokens after it are known), else its byte-safe text."""
    c = step["chosen"]
    return c.get("label") or c.get("display") or c["token"]


_label = step_label


def _hint(fig: go.Figure, message: str, height: int) -> go.Figure:
    """An empty chart says what to do instead of showing bare axes."""
    return style.empty_figure(message, height, fig=fig)


def prob_bucket(p: float) -> str:
    """Category for colouring a token by the model's probability of it."""
    if p >= 0.9:
        return "p ≥ 0.9"
    if p >= 0.5:
        return "0.5–0.9"
    if p >= 0.1:
        return "0.1–0.5"
    return "< 0.1"


BUCKET_COLOURS = {"p ≥ 0.9": "#b7e4c7", "0.5–0.9": "#d8f3dc", "0.1–0.5": "#ffe8a1", "< 0.1": "#ffb3b3"}


def timeline_figure(steps: list[dict], color_by: str = "prob", selected: int | None = None) -> go.Figure:
    """One bar per generated token: height = the model's probability of the chosen token (or the
    entropy of the distribution in nats), colour = the same value."""
    if not steps:
        return _hint(go.Figure(), "No steps yet: press Generate", 260)
    return go.Figure(timeline_spec(steps, color_by, selected), _validate=False)


@functools.cache
def _template() -> dict:
    """The default template as a validated figure carries it (made once: a Figure per call was most
    of the unvalidated build's time)."""
    return go.Figure().layout.template.to_plotly_json()


def _figure(data: list, layout: dict) -> go.Figure:
    """A figure built without plotly's validators, as timeline_figure is: the step figures are
    rebuilt on every finished generation and every step clicked, and validating their layouts cost
    ~3 ms of the two-panel figures' ~7-11 ms and ~10 of the attention heatmap's ~12. So each layout
    value is written as the validators would leave it (a title as dict(text=...), no None values or
    empty lists), and the default template, which only a validated Figure fills in, is set here; the
    traces are validated when built. tests/unit/test_generate_figures_unvalidated.py compares each
    figure with plotly validating its dict."""
    return go.Figure(data=data, layout={**layout, "template": _template()}, _validate=False)


@functools.cache
def _colorscale(name: str) -> list:
    """A named colorscale as the validator spells it out (plotly.js knows "Viridis" but not "RdYlGn")."""
    return [list(x) for x in go.bar.Marker(colorscale=name).colorscale]


def timeline_spec(steps: list[dict], color_by: str = "prob", selected: int | None = None) -> dict:
    """The timeline as plotly's figure dict. timeline_figure builds it unvalidated: plotly's
    validators cost ~9 ms of the web process's interpreter for 256 bars, ~1 ms without, and the
    figure is redrawn on every few streamed updates of every generation (tests validate this dict
    once and compare: tests/unit/test_generate_figures.py)."""
    by_entropy = color_by == "entropy"
    ys = [s["entropy"] if by_entropy else s["chosen"]["prob"] for s in steps]
    hover = [
        f"step {s['index']}: {_label(s)!s}" + (f" (bytes {s['chosen']['bytes']})" if s["chosen"].get("bytes") else "")
        + f"<br>p = {s['chosen']['prob']:.3f} (rank {s['chosen']['rank']})"
        f"<br>p after filters = {s['chosen'].get('prob_filtered', float('nan')):.3f}"
        f"<br>entropy = {s['entropy']:.2f} nats" for s in steps
    ]
    bar = {"type": "bar", "x": [s["index"] for s in steps], "y": ys, "hovertext": hover, "hoverinfo": "text",
           "marker": {"color": ys, "colorscale": _colorscale("Viridis" if by_entropy else "RdYlGn"),
                      "cmin": 0, "cmax": max(ys + [1e-9]) if by_entropy else 1,
                      "colorbar": {"title": {"text": "nats" if by_entropy else "p"}, "thickness": 10},
                      "line": {"width": [3 if s["index"] == selected else 0 for s in steps], "color": "black"}},
           "text": [_label(s) for s in steps], "textposition": "outside", "cliponaxis": False}
    yaxis = {"title": {"text": "entropy (nats)" if by_entropy else "p (model, before filters)"}}
    if not by_entropy:
        yaxis["range"] = [0, 1.15]
    layout = {"title": {"text": "Entropy of each step's distribution" if by_entropy else "Probability of each chosen token"},
              "xaxis": {"title": {"text": "step"}}, "yaxis": yaxis,
              "margin": dict(_MARGIN), "height": 300, "showlegend": False, "bargap": 0.15,
              "template": _template()}
    return {"data": [bar], "layout": layout}


def _side_by_side(titles: tuple[str, str], spacing: float = 0.1) -> dict:
    """The layout plotly's make_subplots(rows=1, cols=2, subplot_titles=titles,
    horizontal_spacing=spacing) makes, as a plain dict (tested equal). A figure built from it in one
    constructor is validated once: make_subplots and the add/update calls after it cost ~25 ms a
    figure, this ~3 ms, on every finished generation and every step clicked."""
    w = (1.0 - spacing) / 2  # make_subplots' own arithmetic, to the last bit
    left, right = [0, w], [w + spacing, w + spacing + w]
    return {"xaxis": {"anchor": "y", "domain": left}, "yaxis": {"anchor": "x", "domain": [0.0, 1.0]},
            "xaxis2": {"anchor": "y2", "domain": [right[0], min(right[1], 1.0)]},
            "yaxis2": {"anchor": "x2", "domain": [0.0, 1.0]},
            "annotations": [dict(text=t, x=sum(d) / 2.0, y=1.0, xref="paper", yref="paper", xanchor="center",
                                 yanchor="bottom", showarrow=False, font=dict(size=16))
                            for t, d in zip(titles, (left, right))]}


def distribution_figure(step: dict | None) -> go.Figure:
    """Top candidates before the filters (model softmax; coloured by the filter that removed
    them) next to the distribution after the filters (what the token was drawn from)."""
    if not step:
        return _hint(go.Figure(), "Generate, then click a token (or move the step slider) to see its candidates", 360)
    return go.Figure(distribution_spec(step), _validate=False)


def distribution_spec(step: dict) -> dict:
    """distribution_figure's figure dict, traces included, written as plotly's validators would leave
    it (tests/unit/test_generate_figures_unvalidated.py): the tab serializes it with orjson, as the
    timeline (validated trace objects and plotly's to_json were ~12 ms of the 15 a finished generation's
    two step figures cost the web process)."""
    before = list(reversed(step["top_before"]))
    after = list(reversed(step["top_after"]))
    ch = step["chosen"]
    chosen = ch["id"]
    # a sampled token past the recorded top 10 would be in neither chart: it gets an extra bar
    # (drawn at the bottom, below the top 10) that says its rank, in its own colour
    extra = {"id": chosen, "token": f"{step_label(step)} (rank {ch['rank']})", "extra": True}
    if all(c["id"] != chosen for c in before):
        before.insert(0, {**extra, "prob": ch["prob"], "removed_by": None})
    if all(c["id"] != chosen for c in after) and ch.get("prob_filtered") is not None:
        after.insert(0, {**extra, "prob": ch["prob_filtered"]})

    def name(c):
        star = " ★" if c["id"] == chosen else ""
        return f"{c['token']}{star} ·{c['id']}"

    def colour_before(c):
        return CHOSEN_EXTRA_COLOUR if c.get("extra") else STAGE_COLOURS.get(c.get("removed_by"), "#1f77b4")

    data = [
        {"type": "bar", "orientation": "h", "x": [c["prob"] for c in before], "y": [name(c) for c in before],
         "xaxis": "x", "yaxis": "y", "marker": {"color": [colour_before(c) for c in before]},
         "hovertext": [f"{c['token']}: p = {c['prob']:.4f}" + (f", removed by {c['removed_by']}"
                                                              if c.get("removed_by") else ", kept") for c in before],
         "hoverinfo": "text", "showlegend": False},
        {"type": "bar", "orientation": "h", "x": [c["prob"] for c in after], "y": [name(c) for c in after],
         "xaxis": "x2", "yaxis": "y2",
         "marker": {"color": [CHOSEN_EXTRA_COLOUR if c.get("extra") else "#2ca02c" if c["id"] == chosen else "#1f77b4"
                              for c in after]},
         "hovertext": [f"{c['token']}: p = {c['prob']:.4f}" for c in after], "hoverinfo": "text", "showlegend": False},
        *({"type": "scatter", "x": [None], "y": [None], "mode": "markers",
           "marker": {"color": colour, "size": 10, "symbol": "square"},
           "name": f"removed by {stage}", "xaxis": "x", "yaxis": "y"}  # legend for the removal colours
          for stage, colour in STAGE_COLOURS.items() if stage),
    ]
    # short subplot titles: the long ones ran into each other on a phone-wide page (the Markdown
    # above the chart says what each side is)
    layout = _side_by_side(("softmax, temperature 1, no filters", "drawn from: after temperature, filters"),
                           spacing=0.18)
    for axis in ("xaxis", "xaxis2"):
        layout[axis].update(title=dict(text="probability"), rangemode="tozero")
    layout.update(title=dict(text=f"Step {step['index']}: chose {step_label(step)!s} "
                                  f"(p = {step['chosen']['prob']:.3f}, rank {step['chosen']['rank']})"),
                  margin=dict(l=10, r=10, t=70, b=40), height=380, legend=dict(orientation="h", y=-0.22))
    return {"data": data, "layout": {**layout, "template": _template()}}


def removed_summary(step: dict | None) -> str:
    """Markdown: what each filter removed at this step."""
    if not step:
        return ""
    rows = ["| filter | tokens removed | mass kept, of the distribution entering the filter ¹ |", "|---|---|---|"]
    for stage, r in step.get("removed", {}).items():
        rows.append(f"| {stage} | {r['n_removed']:,} | {r['kept_mass']:.3f} |")
    if len(rows) == 2:
        rows.append("| (none active) | 0 | 1.000 |")
    kept = step.get("n_candidates")
    gone = [c for c in step["top_before"] if c.get("removed_by")]
    tail = (f"\n\n{kept:,} tokens could be drawn. Among the model's top {len(step['top_before'])}, removed: "
            + (", ".join(f"`{c['token']}` ({c['removed_by']})" for c in gone) if gone else "none") + ".")
    note = ("\n\n¹ Each filter's kept mass is measured on the distribution it receives: after the repetition "
            "penalty, the temperature and the filters above it. The left bars are the model's own temperature-1 "
            "distribution, so their sum over the kept tokens can differ.")
    return "\n".join(rows) + tail + note


def attention_figure(attention: list[list[float]] | None, context_labels: list[str], step_index: int | None = None,
                     token_label: str | None = None, hint: str | None = None) -> go.Figure:
    """[layers, context] attention of the query that produced the step's token (head mean).
    Rows are layers, first at the top, and columns the context's tokens ("position:token"), as in
    Explore's views; with nothing to show, a hint says what to do."""
    if not attention:
        return _hint(go.Figure(), hint or "Generate, then click a token to see where that step looked", 300)
    n_layers = len(attention)
    x = [f"{i}:{lab}" for i, lab in enumerate(context_labels)]  # unique categories (Plotly merges equal ones)
    heatmap = go.Heatmap(z=attention, x=x, y=[f"L{l}" for l in range(n_layers)], colorscale="Blues", zmin=0,
                         colorbar=dict(title="weight"),
                         hovertemplate="%{y} · key %{x}<br>weight %{z:.3f}<extra></extra>")
    what = f" “{token_label}”" if token_label else ""
    return _figure([heatmap], dict(
        title=dict(text=f"Step {step_index}{what}: attention over the context when producing it (mean over heads)"),
        xaxis=dict(title=dict(text="context token (position:token)"), tickangle=-60, type="category"),
        yaxis=dict(title=dict(text="layer"), autorange="reversed", type="category"),
        margin=dict(l=60, r=20, t=50, b=90), height=max(300, 14 * n_layers + 170)))


def kv_cache_figure(report: dict | None, growth: dict | None = None) -> go.Figure:
    """Left: bytes per layer, formula next to measured. Right: total bytes as the sequence grows."""
    if not report:
        return _hint(go.Figure(), "KV cache: generate something first", 320)
    return go.Figure(kv_cache_spec(report, growth), _validate=False)


def kv_cache_spec(report: dict, growth: dict | None = None) -> dict:
    """kv_cache_figure's figure dict, as distribution_spec is distribution_figure's."""
    layers = list(range(len(report["formula_per_layer"])))
    data = [{"type": "bar", "x": layers, "y": list(report["formula_per_layer"]), "name": "formula",
             "marker": {"color": "#9ecae1"}, "xaxis": "x", "yaxis": "y"},
            {"type": "bar", "x": layers, "y": list(report["measured_per_layer"]), "name": "measured tensors",
             "marker": {"color": "#3182bd"}, "xaxis": "x", "yaxis": "y"}]
    if growth:
        data.append({"type": "scatter", "x": list(growth["tokens"]), "y": list(growth["total"]), "mode": "lines",
                     "name": "formula total", "line": {"color": "#9ecae1"}, "xaxis": "x2", "yaxis": "y2"})
    if report.get("measured_series"):
        xs, ys = zip(*report["measured_series"])
        data.append({"type": "scatter", "x": list(xs), "y": list(ys), "mode": "markers", "name": "measured total",
                     "marker": {"color": "#3182bd", "size": 6}, "xaxis": "x2", "yaxis": "y2"})
    layout = _side_by_side(("per layer at the end", "total as the sequence grows"))
    layout["xaxis"]["title"] = dict(text="layer")
    layout["xaxis2"]["title"] = dict(text="tokens in the cache")
    layout["yaxis"]["title"] = dict(text="bytes")
    layout.update(barmode="group", margin=_MARGIN, height=340,
                  title=dict(text=f"KV cache: {report['measured_total']:,} B measured, {report['formula_total']:,} B by "
                                  f"the formula ({report['tokens']} tokens)"),
                  template=_template())
    return {"data": data, "layout": layout}


def samples_figure(samples: list[dict]) -> go.Figure:
    """One line per sample: the probability of each chosen token, to compare diversity."""
    fig = go.Figure()
    if not samples:
        return _hint(fig, "Draw samples to compare them here", 300)
    for s in samples:
        fig.add_scatter(x=[st["index"] for st in s["steps"]], y=[st["chosen"]["prob"] for st in s["steps"]],
                        mode="lines+markers", name=f"seed {s['seed']}",
                        hovertext=[step_label(st) for st in s["steps"]])
    fig.update_layout(title="Chosen-token probability per step, one line per seed", xaxis_title="step",
                      yaxis=dict(title="p", range=[0, 1.05]), margin=_MARGIN, height=300)
    return fig


# --- search decoding (model_core.serving.search_decoding): beams as a tree, contrastive candidates ------------

BEAM_RIGHT_MARGIN = 130  # the colour bar sits here, clear of the score notes at the ends of the beams
BEAM_TOKEN_CHARS = 8  # longer token labels are cut with "…" (the whole token is on hover)


def _short(tok: str, n: int = BEAM_TOKEN_CHARS) -> str:
    return tok if len(tok) <= n else tok[: n - 1] + "…"


def beam_tree_figure(beams: list[dict], prompt_tail: str = "prompt") -> go.Figure:
    """Every returned beam as a path from the prompt, one lane per beam (best on top); a prefix that
    several beams share is drawn once, so the tree shows where they split. Node colour: the model's
    log-probability of that token; the end of each path says its rank, score and log p."""
    if not beams:
        return _hint(go.Figure(), "Run a search to see its beams.", 260)
    nodes: dict[tuple, tuple[int, int]] = {}  # prefix -> (step, lane)
    xs, ys, texts, colours, hovers = [0], [0], [prompt_tail], [0.0], [prompt_tail]
    edge_x: list = []
    edge_y: list = []
    end_notes = []
    for lane, b in enumerate(beams):
        prev = (0, 0)
        run = 0.0
        for t, (tok, lp) in enumerate(zip(b["tokens"], b["step_logprobs"])):
            key = tuple(b["token_ids"][: t + 1])
            run += lp
            if key not in nodes:
                nodes[key] = (t + 1, -lane)
                xs.append(t + 1)
                ys.append(-lane)
                texts.append(_short(tok))
                colours.append(lp)
                hovers.append(f"beam #{b['rank']}, token {t + 1}: {tok!r}<br>log p(token) = {lp:.3f} "
                              f"(p = {2.718281828 ** lp:.3f})<br>log p so far = {run:.3f}")
            node = nodes[key]
            edge_x += [prev[0], node[0], None]
            edge_y += [prev[1], node[1], None]
            prev = node
        # short on the plot (rank and score), the rest on hover: long notes ran into each other
        full = (f"#{b['rank']} score {b['score']:.3f} · log p {b['logprob']:.2f}" + (" · EOS" if b.get("eos") else "")
                + (f" · group {b['group']}" if "group" in b else ""))
        end_notes.append((prev[0], prev[1], f"#{b['rank']} {b['score']:.2f}" + (" g" + str(b["group"]) if "group" in b
                                                                                else ""), full))
    fig = go.Figure()
    fig.add_scatter(x=edge_x, y=edge_y, mode="lines", line=dict(color="#b0b7c3", width=1.5), hoverinfo="skip",
                    showlegend=False)
    # neighbouring tokens' labels alternate above and below their nodes, so they do not run together
    fig.add_scatter(x=xs, y=ys, mode="markers+text", text=texts,
                    textposition=["top center" if x % 2 == 0 else "bottom center" for x in xs],
                    textfont=dict(size=11), hovertext=hovers, hoverinfo="text", showlegend=False,
                    marker=dict(size=10, color=colours, colorscale="Viridis", cmin=-6, cmax=0,
                                # outside the plot, past the right margin the score notes sit in
                                colorbar=dict(title="log p", thickness=10, len=0.8, x=1.0, xpad=70,
                                              xanchor="left")))
    for x, y, note, full in end_notes:
        fig.add_annotation(x=x, y=y, text=note, hovertext=full, showarrow=False, xanchor="left", xshift=10,
                           font=dict(size=11))
    n = max(len(b["tokens"]) for b in beams)
    fig.update_xaxes(title="generated token", range=[-0.5, n + 4.5], dtick=max(1, n // 16))
    fig.update_yaxes(visible=False, range=[-len(beams) + 0.5, 0.7])
    fig.update_layout(margin=dict(l=20, r=BEAM_RIGHT_MARGIN, t=40, b=40), height=max(280, 120 + 56 * len(beams)),
                      title=dict(text=(f"{len(beams)} beams from the prompt (shared prefixes drawn once)" if len(beams) > 1
                                      else "The text from the prompt, token by token"), x=0.01))
    return fig


def contrastive_figure(candidates: list[list[dict]], alpha: float) -> go.Figure:
    """Contrastive search step by step: each column is one step's top-k candidates (most likely on
    top), coloured by their score (1 - alpha) p - alpha max cos; the chosen one is outlined."""
    if not candidates:
        return _hint(go.Figure(), "Contrastive search shows each step's candidates here.", 260)
    k = max(len(s) for s in candidates)
    z = [[s[r]["score"] if r < len(s) else None for s in candidates] for r in range(k)]
    text = [[s[r]["token"] if r < len(s) else "" for s in candidates] for r in range(k)]
    hover = [[(f"step {t}: {s[r]['token']!r}<br>p = {s[r]['prob']:.3f}<br>max cos with earlier positions = "
               f"{s[r]['max_cos']:.3f} (position {s[r]['most_similar_position']})<br>score = (1-{alpha:g})·p − "
               f"{alpha:g}·cos = {s[r]['score']:.3f}" + ("<br><b>chosen</b>" if s[r]["chosen"] else ""))
              if r < len(s) else "" for t, s in enumerate(candidates)] for r in range(k)]
    fig = go.Figure(go.Heatmap(z=z, text=text, texttemplate="%{text}", hovertext=hover, hoverinfo="text",
                               colorscale="RdBu", zmid=0, colorbar=dict(title="score", thickness=10)))
    cx = [t for t, s in enumerate(candidates) for r, c in enumerate(s) if c["chosen"]]
    cy = [r for s in candidates for r, c in enumerate(s) if c["chosen"]]
    fig.add_scatter(x=cx, y=cy, mode="markers", marker=dict(symbol="square-open", size=26, color="#111",
                                                              line=dict(width=2)),
                    hoverinfo="skip", name="chosen")
    fig.update_yaxes(title="candidate (by p)", autorange="reversed", tickvals=list(range(k)),
                     ticktext=[f"#{r + 1}" for r in range(k)])
    fig.update_xaxes(title="step")
    fig.update_layout(margin=_MARGIN, height=140 + 42 * k, showlegend=False,
                      title=dict(text=f"Contrastive search: top-{k} candidates per step, score = (1−α)·p − α·max cos "
                                      f"(α = {alpha:g}); outlined = chosen", x=0.01))
    return fig


def steering_sweep_figure(rows: list[dict], layer: int | None = None) -> go.Figure:
    """The alpha sweep of a steering vector: three panels against alpha, one point per alpha.
    rows: [{alpha, kl_from_unsteered, base_perplexity, target_logprob}] (steering.alpha_sweep's
    rows as dicts; target_logprob / base_perplexity None when not measured)."""
    if not rows:
        return _hint(go.Figure(), "Run a sweep to see how the vector's strength changes the model.", 260)
    rows = sorted(rows, key=lambda r: r["alpha"])
    a = [r["alpha"] for r in rows]
    panels = [("KL from unsteered (nats)", "kl_from_unsteered", "#1f77b4"),
              ("perplexity of the output<br>under the unsteered model", "base_perplexity", "#ff7f0e"),
              ("on-target score<br>(mean log p of the targets)", "target_logprob", "#2ca02c")]
    fig = make_subplots(rows=1, cols=3, subplot_titles=[t for t, _, _ in panels], horizontal_spacing=0.09)
    for j, (title, key, colour) in enumerate(panels, start=1):
        ys = [r.get(key) for r in rows]
        if all(y is None for y in ys):
            note = "name target words" if key == "target_logprob" else "not measured"
            fig.add_annotation(text=note, x=0.5, y=0.5, xref=f"x{j} domain", yref=f"y{j} domain",
                               showarrow=False, font=dict(color="#666"))
            continue
        fig.add_trace(go.Scatter(x=a, y=ys, mode="lines+markers", marker=dict(color=colour), line=dict(color=colour),
                                 name=title.split("<br>")[0], showlegend=False,
                                 hovertemplate="α %{x:g}<br>%{y:.3f}<extra></extra>"), row=1, col=j)
        fig.update_xaxes(title_text="α", row=1, col=j)
    where = f" at layer {layer}" if layer is not None else ""
    fig.update_layout(title=dict(text=f"Steering vector{where}: what α does (α = 0 is the unsteered model)", x=0.01),
                      margin=dict(l=50, r=20, t=80, b=40), height=320)
    fig.update_annotations(font_size=12)
    return fig
