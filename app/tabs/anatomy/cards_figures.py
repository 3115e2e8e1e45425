"""Architecture-card comparison views: pure functions, data (cards from
model_core.anatomy.reference_cards) -> HTML / plotly Figure."""

from __future__ import annotations

import html

import plotly.graph_objects as go

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf"]
PART_LABELS = {"embedding": "embedding", "attention": "attention", "mlp": "MLP (dense, shared experts)",
               "experts": "routed experts + router", "norms": "norms", "unembedding": "unembedding",
               "other": "other"}
KIND_NOTE = {"reference": "published config · no weights", "random": "random weights (untrained)",
             "loaded": "loaded weights"}


def _mark(m: dict) -> str:
    said = "value not quoted" if m["claim"] is None else (
        f"{m['claim']:,}" if isinstance(m["claim"], int) and not isinstance(m["claim"], bool) else str(m["claim"]))
    src = html.escape(m["source"])
    if m["agrees"]:
        return (f"<div class='lmscope-claim lmscope-claim-ok' data-agrees='1' title='{src}' "
                f"style='color:#166534;font-size:11px'>✓ {src.split(' (')[0]}: {html.escape(said)}</div>")
    return (f"<div class='lmscope-claim lmscope-claim-differs' data-agrees='0' "
            f"style='margin-top:3px;padding:3px 5px;border-left:3px solid #dc2626;background:#fef2f2;color:#7f1d1d;"
            f"font-size:11px'><b>≠ {src}: {html.escape(said)}</b><br>{html.escape(m['note'])}</div>")


def comparison_html(columns: list[dict]) -> str:
    """Cards side by side: one column per model, one row per property (the union of the cards'
    rows, in order). Each column: {title, kind: reference|loaded|random, rows: {label: text},
    marks: {label: [claim checks]}, notes: [text]}. A source's claim that agrees with the computed
    value is a small ✓ line; one that differs is a red box with the source's value and the reason."""
    labels: list[str] = []
    for col in columns:
        prev = None
        for k in col["rows"]:
            if k not in labels:
                labels.insert(labels.index(prev) + 1 if prev in labels else len(labels), k)
            prev = k
    n = max(1, len(columns))
    width = max(118, int(780 / n))
    th = ("style='position:sticky;top:0;background:var(--block-background-fill, #fff);text-align:left;"
          f"vertical-align:bottom;min-width:{width}px;padding:4px 6px;border-bottom:2px solid #999'")
    head = "".join(
        f"<th {th} data-kind='{c['kind']}'>{html.escape(c['title'])}<br>"
        f"<span style='font-weight:normal;font-size:11px;color:{'#b45309' if c['kind'] == 'random' else '#6b7280'}'>"
        f"{KIND_NOTE.get(c['kind'], '')}</span></th>" for c in columns)
    first = ("style='position:sticky;left:0;background:var(--block-background-fill, #fff);font-weight:600;"
             "padding:4px 6px;vertical-align:top;min-width:120px;max-width:160px'")
    body = []
    for label in labels:
        cells = []
        for c in columns:
            v = c["rows"].get(label)
            marks = c.get("marks", {}).get(label, [])
            differs = any(not m["agrees"] for m in marks)
            text = "—" if v is None else html.escape(v)
            cells.append(f"<td data-differs='{int(differs)}' style='padding:4px 6px;vertical-align:top;"
                         f"overflow-wrap:anywhere'>{text}{''.join(_mark(m) for m in marks)}</td>")
        body.append(f"<tr data-row='{html.escape(label)}'><th scope='row' {first}>{html.escape(label)}</th>{''.join(cells)}</tr>")
    notes = [f"<li><b>{html.escape(c['title'])}</b>: {html.escape(t)}</li>" for c in columns for t in c.get("notes", [])]
    n_diff = sum(not m["agrees"] for c in columns for ms in c.get("marks", {}).values() for m in ms)
    summary = (f"<p style='margin:4px 0'>{n_diff} statement{'s' if n_diff != 1 else ''} of the sources differ from "
               f"the computed values (red boxes, each with the reason); ✓ lines agree.</p>" if n_diff else "")
    return ("<div class='lmscope-cards' style='overflow-x:auto;max-width:100%'>" + summary +
            "<table class='lmscope-cards-table' style='border-collapse:collapse;font-size:13px;width:100%'>"
            f"<thead><tr><th {th}>property</th>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
            + (f"<ul style='font-size:12px;color:#6b7280'>{''.join(notes)}</ul>" if notes else "") + "</div>")


def _human_bytes(b: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= size:
            return f"{b / size:,.3g} {unit}"
    return f"{b:,.0f} B"


def kv_growth_figure(growth: dict) -> go.Figure:
    """KV-cache bytes of one sequence vs context length (log-log), one line per model up to its own
    context length; sliding windows flatten, MLA's latent line has its uncompressed size dashed."""
    fig = go.Figure()
    for i, (name, g) in enumerate(growth.items()):
        color = COLORS[i % len(COLORS)]
        fig.add_scatter(x=g["tokens"], y=g["bytes"], mode="lines", name=name, line=dict(color=color, width=2),
                        customdata=[[_human_bytes(b)] for b in g["bytes"]],
                        hovertemplate=(f"{html.escape(name)} ({g['kind']})<br>%{{x:,}} tokens: %{{customdata[0]}}"
                                       f"<br>per token: {html.escape(g['formula'])}<extra></extra>"))
        fig.add_scatter(x=[g["tokens"][-1]], y=[g["bytes"][-1]], mode="markers", showlegend=False,
                        marker=dict(color=color, size=7), name=f"{name}: at its context length",
                        hovertemplate=(f"{html.escape(name)} at its context length, %{{x:,}} tokens: "
                                       f"{_human_bytes(g['bytes'][-1])}<extra></extra>"))
        if g.get("uncompressed"):
            fig.add_scatter(x=g["tokens"], y=g["uncompressed"], mode="lines", name=f"{name} if uncompressed",
                            line=dict(color=color, dash="dot", width=1.5),
                            customdata=[[_human_bytes(b)] for b in g["uncompressed"]],
                            hovertemplate=(f"{html.escape(name)}, every head's full K and V<br>%{{x:,}} tokens: "
                                           "%{customdata[0]}<extra></extra>"))
    fig.update_layout(title="KV cache (fp16) vs context", height=520,
                      margin=dict(l=60, r=10, t=50, b=40),
                      legend=dict(font=dict(size=10), orientation="h", yanchor="top", y=-0.18, x=0),
                      xaxis=dict(type="log", title="context length T (tokens)"),
                      yaxis=dict(type="log", title="bytes", tickformat=".0s", ticksuffix="B"))
    return fig


def param_share_figure(cards: dict) -> go.Figure:
    """Stacked horizontal bars: each model's parameters by part (% of its total), the active
    parameters per token marked for mixture-of-experts models."""
    names = list(cards)
    parts = [p for p in PART_LABELS if any(c["params_by_part"].get(p, 0) for c in cards.values())]
    fig = go.Figure()
    for part in parts:
        counts = [cards[n]["params_by_part"].get(part, 0) for n in names]
        pct = [100 * k / max(1, cards[n]["params"]) for k, n in zip(counts, names)]
        fig.add_bar(name=PART_LABELS[part], y=names, x=pct, orientation="h", customdata=counts,
                    hovertemplate="%{y}<br>" + PART_LABELS[part] + ": %{customdata:,} (%{x:.1f}%)<extra></extra>")
    moe = [n for n in names if cards[n]["active_params"] != cards[n]["params"]]
    if moe:
        fig.add_scatter(y=moe, x=[100 * cards[n]["active_params"] / cards[n]["params"] for n in moe],
                        mode="markers", marker=dict(symbol="line-ns", size=22, line=dict(width=3, color="black")),
                        name="active per token (MoE)",
                        customdata=[cards[n]["active_params"] for n in moe],
                        hovertemplate="%{y}: %{customdata:,} parameters per token (%{x:.1f}%)<extra></extra>")
    fig.update_layout(barmode="stack", title="Parameters by part (% of each model)", xaxis_title="%",
                      height=160 + 34 * len(names), margin=dict(l=10, r=10, t=40, b=30),
                      yaxis=dict(autorange="reversed", automargin=True),
                      legend=dict(font=dict(size=10), orientation="h", yanchor="top", y=-0.22, x=0, traceorder="normal"))
    return fig
