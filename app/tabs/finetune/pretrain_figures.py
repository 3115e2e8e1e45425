"""Pure view functions for training from scratch: a 'pretrain' / 'scaling' job record -> figures,
tables and text (app/tabs/finetune/pretrain_panel.py shows them). The published laws drawn beside our points are
those papers' fits on their data, in nats per token of their tokenizers, not fits to ours."""

from __future__ import annotations

import html
import math

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.shared import figure_style as style
from model_core.training.pretrain import CHINCHILLA_2022, KAPLAN_2020, chinchilla_loss, kaplan_loss

WIDTH_COLOURS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#a16207", "#db2777"]
LOSS_TICKS = [0.5, 0.75, 1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50, 70, 100]
POINT_COLUMNS = ["width", "layers", "N (non-embedding)", "N (all)", "tokens", "held-out loss", "bits/byte",
                 "perplexity", "train s", "model"]


def _layout(fig: go.Figure, title: str, height: int = 380, **kw) -> go.Figure:
    """The shared layout, with room below for the legend (a row under the x axis)."""
    return style.layout(fig, title, height, margin=dict(l=60, r=20, t=48, b=90),
                        legend=dict(orientation="h", y=-0.22, x=0, xanchor="left", font=dict(size=11)), **kw)


def empty_figure(message: str, height: int = 320) -> go.Figure:
    return _layout(style.with_message(go.Figure(), message), "", height)


def _ticks(values, mantissas) -> list[float]:
    """Round tick values (mantissa × 10^k) within the values' range, for a log axis."""
    vals = [v for v in values if v and v > 0]
    if not vals:
        return []
    lo, hi = min(vals) / 1.1, max(vals) * 1.1
    return [m * 10.0 ** k for k in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
            for m in mantissas if lo <= m * 10.0 ** k <= hi]


def curve_figure(history: list[dict] | None) -> go.Figure:
    """Training loss per step and held-out loss at its steps (top), held-out perplexity (bottom), against
    tokens seen; one colour per shape (a sweep's widths, or a depth sweep's (layers, width), share the
    token axis)."""
    hist = history or []
    if not any(h.get("loss") is not None or h.get("eval_loss") is not None for h in hist):
        return empty_figure("Loss and perplexity curves appear here while a job trains.", 460)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.62, 0.38])
    shapes = sorted({(h.get("layers") or 0, h["width"]) for h in hist if h.get("width") is not None},
                    key=lambda s: (s[1], s[0]))
    by_depth = len({layers for layers, _ in shapes}) > 1  # a depth sweep: name each curve by its layers too
    widths = shapes or [None]
    for i, sh in enumerate(widths):
        c = WIDTH_COLOURS[i % len(WIDTH_COLOURS)]
        w = sh[1] if sh is not None else None
        rows = ([h for h in hist if h.get("width") == w and (not by_depth or (h.get("layers") or 0) == sh[0])]
                if sh is not None else hist)
        tag = (f"L={sh[0]} d={w} " if by_depth else f"d={w} ") if sh is not None else ""
        tr = [(h["tokens_seen"], h["loss"]) for h in rows if h.get("loss") is not None]
        ev = [(h["tokens_seen"], h["eval_loss"]) for h in rows if h.get("eval_loss") is not None]
        if tr:
            fig.add_scatter(x=[a for a, _ in tr], y=[b for _, b in tr], mode="lines", name=f"{tag}train loss",
                            line=dict(color=c, width=1), opacity=0.45, row=1, col=1)
        if ev:
            fig.add_scatter(x=[a for a, _ in ev], y=[b for _, b in ev], mode="lines+markers",
                            name=f"{tag}held-out loss", line=dict(color=c, width=2), marker=dict(size=6), row=1, col=1)
            fig.add_scatter(x=[a for a, _ in ev], y=[math.exp(min(b, 50.0)) for _, b in ev], mode="lines+markers",
                            name=f"{tag}held-out perplexity", line=dict(color=c, width=2, dash="dot"),
                            marker=dict(size=5), row=2, col=1, showlegend=len(widths) == 1)
    fig.update_yaxes(title="nats per byte", row=1, col=1)
    ppl = [v for t in fig.data if t.yaxis == "y2" for v in (t.y or ()) if v and v > 0]
    ticks = _ticks(ppl, [1, 2, 5])
    fig.update_yaxes(title="perplexity", type="log", row=2, col=1, tickvals=ticks, ticktext=[f"{v:g}" for v in ticks])
    fig.update_xaxes(title="training tokens (bytes) seen", row=2, col=1)
    return _layout(fig, "Loss and perplexity (held-out: the corpus's held-out files)", 460)


def scaling_figure(points: list[dict] | None, fit: dict | None = None, tokens: int | None = None,
                   published: bool = True) -> go.Figure:
    """Final held-out loss against non-embedding N (log-log), our least-squares power law, and the
    published laws over the same N range: Kaplan et al. 2020 L(N) and Hoffmann et al. 2022
    L(N, D = our tokens), plus Kaplan's exponent drawn through our middle point (slope only)."""
    pts = [p for p in (points or []) if p.get("final_eval_loss") is not None]
    if not pts:
        return empty_figure("The L(N) plot appears here as a scaling sweep finishes each width.", 460)
    ns = [p["n_non_embedding"] for p in pts]
    ls = [p["final_eval_loss"] for p in pts]
    lo, hi = min(ns) / 1.5, max(ns) * 1.5
    grid = [lo * (hi / lo) ** (i / 60) for i in range(61)]
    fig = go.Figure()
    fig.add_scatter(x=ns, y=ls, mode="markers+text", name="ours: final held-out loss (nats/byte)",
                    text=[f"d={p['width']}" for p in pts], textposition="top right",
                    marker=dict(size=11, color="#111827"))
    title = "L(N): final held-out loss vs non-embedding parameters"
    if fit:
        fig.add_scatter(x=grid, y=[fit["a"] * n ** -fit["alpha"] for n in grid], mode="lines",
                        name=f"ours, least squares: L = {fit['a']:.3g}·N^-{fit['alpha']:.3f} (R² {fit['r2']:.3f})",
                        line=dict(color="#111827", width=2))
        se = f" ± {fit['alpha_stderr']:.3f}" if fit.get("alpha_stderr") is not None else ""
        title = (f"L(N): our α = {fit['alpha']:.3f}{se} (R² {fit['r2']:.3f}, {fit['n_points']} widths)"
                 if fit["n_points"] > 2 else f"L(N): our α = {fit['alpha']:.3f} (two widths: the line through both)")
    if published:
        fig.add_scatter(x=grid, y=[kaplan_loss(n) for n in grid], mode="lines",
                        name=f"{KAPLAN_2020['name']}'s fit on their data: (8.8e13/N)^0.076, nats/token (WebText2)",
                        line=dict(color="#2563eb", dash="dash"))
        if tokens:
            fig.add_scatter(x=grid, y=[chinchilla_loss(n, tokens) for n in grid], mode="lines",
                            name=(f"{CHINCHILLA_2022['name']}'s fit on their data: 1.69 + 406.4/N^0.34 + 410.7/D^0.28 "
                                  f"at D = {tokens:,}, nats/token (MassiveText; N all parameters)"),
                            line=dict(color="#dc2626", dash="dash"))
        mid = sorted(zip(ns, ls))[len(ns) // 2]
        fig.add_scatter(x=grid, y=[mid[1] * (n / mid[0]) ** -KAPLAN_2020["alpha_N"] for n in grid], mode="lines",
                        name="slope α_N = 0.076 (Kaplan) through our middle point: shape only",
                        line=dict(color="#2563eb", dash="dot", width=1))
    xt = _ticks(grid, [1, 2, 5])
    fig.update_xaxes(title="N, non-embedding parameters (each tensor once)", type="log", tickvals=xt,
                     ticktext=[f"{v / 1e6:g}M" if v >= 1e6 else f"{v / 1e3:g}k" if v >= 1e3 else f"{v:g}" for v in xt])
    ys = [v for t in fig.data for v in (t.y or ()) if v is not None and v > 0]
    ticks = [v for v in LOSS_TICKS if min(ys) / 1.1 <= v <= max(ys) * 1.1]
    fig.update_yaxes(title="loss (nats; ours per byte, theirs per token)", type="log", tickvals=ticks,
                     ticktext=[f"{v:g}" for v in ticks])
    return _layout(fig, title, 480)


def _n(v: float) -> str:
    return f"{v / 1e6:.3g}M" if v >= 1e6 else f"{v / 1e3:.3g}k" if v >= 1e3 else f"{v:g}"


def depth_figure(points: list[dict] | None, params: int | None = None) -> go.Figure:
    """A depth sweep: final held-out loss against the number of layers at (about) equal non-embedding
    N; each point labelled with its width and its exact counted N (hover: the totals too). No fit:
    N is (nearly) the same for every point."""
    pts = sorted((p for p in (points or []) if p.get("final_eval_loss") is not None), key=lambda p: p["layers"])
    if not pts:
        return empty_figure("The loss-against-depth plot appears here as a depth sweep finishes each shape.", 460)
    fig = go.Figure()
    fig.add_scatter(
        x=[p["layers"] for p in pts], y=[p["final_eval_loss"] for p in pts], mode="lines+markers+text",
        name="ours: final held-out loss (nats/byte)", line=dict(color="#111827", width=1, dash="dot"),
        marker=dict(size=11, color="#111827"), textposition="top center",
        text=[f"d={p['width']}, N={_n(p['n_non_embedding'])}" for p in pts],
        customdata=[[p["width"], p["n_non_embedding"], p["n_total"], p.get("model_name", "")] for p in pts],
        hovertemplate=("%{x} layers, width %{customdata[0]}<br>N %{customdata[1]:,} non-embedding "
                       "(%{customdata[2]:,} in all)<br>held-out loss %{y:.4f} nats/byte<br>%{customdata[3]}"
                       "<extra></extra>"))
    ns = [p["n_non_embedding"] for p in pts]
    target = f"target {params:,}, " if params else ""
    spread = (max(ns) - min(ns)) / (sum(ns) / len(ns))
    fig.update_xaxes(title="layers (width chosen for equal non-embedding parameters)", type="log",
                     tickvals=[p["layers"] for p in pts], ticktext=[str(p["layers"]) for p in pts])
    ls = [p["final_eval_loss"] for p in pts]
    pad = max(0.05, (max(ls) - min(ls)) * 0.25)
    fig.update_yaxes(title="final held-out loss (nats per byte)", range=[min(ls) - pad, max(ls) + pad])
    return _layout(fig, f"Loss against depth at equal N ({target}{min(ns):,} to {max(ns):,}, "
                        f"spread {spread:.1%}): no L(N) fit", 480)


def sweep_figure(rec: dict) -> go.Figure:
    """The sweep plot a scaling record calls for: loss against depth for a depth sweep, L(N) for widths."""
    pr = rec.get("pretrain") or {}
    params = rec.get("params") or {}
    if params.get("depths"):
        return depth_figure(pr.get("points"), params.get("params"))
    return scaling_figure(pr.get("points"), pr.get("fit"),
                          (pr.get("points") or [{}])[0].get("tokens") or params.get("tokens"))


def points_table(points: list[dict] | None) -> pd.DataFrame:
    rows = [[p["width"], p["layers"], p["n_non_embedding"], p["n_total"], p["tokens"], round(p["final_eval_loss"], 4),
             round(p["final_eval_loss"] / math.log(2), 4), round(math.exp(min(p["final_eval_loss"], 50.0)), 3),
             p["train_seconds"], p["model_name"]] for p in (points or [])]
    return pd.DataFrame(rows, columns=POINT_COLUMNS)


def _s(v) -> str:
    if v is None:
        return "–"
    v = float(v)
    return f"{v:.0f} s" if v < 120 else f"{v / 60:.1f} min"


def status_markdown(rec: dict | None) -> str:
    """What the selected run is doing or did: step, losses, perplexity, throughput; the model(s) it
    registered; a sweep's fitted exponent beside the published ones."""
    if not rec:
        return "Pick a from-scratch job, or start one."
    pr = rec.get("pretrain") or {}
    p = rec.get("params") or {}
    lines = []
    last = pr.get("latest") or {}
    hist = pr.get("history") or []
    ev = [h for h in hist if h.get("eval_loss") is not None]
    state = rec.get("state")
    if last:
        w = f" · width {last['width']}" if last.get("width") is not None else ""
        lines.append(f"**{state}**{w} · step {last.get('step')}/{last.get('max_steps')} · "
                     f"{int(last.get('tokens_seen') or 0):,} tokens · "
                     + (f"train loss {last['loss']:.3f} · " if last.get("loss") is not None else "")
                     + (f"{last['tokens_per_s']:,.0f} tokens/s" if last.get("tokens_per_s") else ""))
    elif state:
        lines.append(f"**{state}**")
    if ev:
        first = next((h for h in ev if h.get("width") == ev[-1].get("width")), ev[0])
        lines.append(f"held-out loss {first['eval_loss']:.3f} → {ev[-1]['eval_loss']:.3f} nats/byte "
                     f"({ev[-1]['eval_loss'] / math.log(2):.3f} bits/byte, perplexity "
                     f"{math.exp(min(ev[-1]['eval_loss'], 50.0)):.2f}); at initialisation ln 258 = 5.553")
    if rec.get("kind") == "scaling" and p.get("depths"):
        pts = pr.get("points") or []
        shapes = p.get("shapes") or []
        lines.append("depths " + ", ".join(f"{s['layers']} (width {s['width']})" for s in shapes)
                     + f" at ≈{int(p.get('params') or 0):,} non-embedding parameters, "
                     f"{int(p.get('tokens') or 0):,} tokens each; {len(pts)} finished")
        if pts:
            lines.append("held-out loss by depth: " + ", ".join(
                f"{x['layers']} layers {x['final_eval_loss']:.3f} (N {x['n_non_embedding']:,})" for x in pts))
        lines.append(pr.get("fit_note") or "A depth sweep at equal N has nothing to fit: loss is drawn against depth.")
        if pts:
            lines.append("registered: " + ", ".join(f"`{x['model_name']}`" for x in pts))
    elif rec.get("kind") == "scaling":
        pts = pr.get("points") or []
        lines.append(f"widths {', '.join(map(str, p.get('widths') or []))} × {p.get('layers')} layers, "
                     f"{int(p.get('tokens') or 0):,} tokens each; {len(pts)} finished")
        fit = pr.get("fit")
        if fit:
            se = f" ± {fit['alpha_stderr']:.4f}" if fit.get("alpha_stderr") is not None else ""
            lines.append(f"**fitted α = {fit['alpha']:.4f}{se}** (L = {fit['a']:.3g}·N^-α, R² {fit['r2']:.3f}, "
                         f"{fit['n_points']} widths" + (f", {_s(pr.get('wall_seconds'))}" if pr.get("wall_seconds") else "")
                         + "). Published fits, on their data: Kaplan et al. 2020 α_N = 0.076 (non-embedding N, WebText2); "
                         "Hoffmann et al. 2022 α = 0.34 in L = E + A/N^α + B/D^β (all parameters, MassiveText). Ours is "
                         "a few minutes of byte-level training on Python docstrings at a fixed token budget: an "
                         "exponent of this toy, not an estimate of theirs.")
            off = pr.get("fit_offset")
            if off:
                lines.append(f"with an irreducible term: L = {off['E']:.3f} + {off['A']:.3g}·N^-{off['alpha']:.3f}")
        if pts:
            lines.append("registered: " + ", ".join(f"`{x['model_name']}`" for x in pts))
    else:
        m = pr.get("metrics")
        if state == "succeeded" and pr.get("model_name"):
            ck = pr.get("checkpoints") or []
            lines.append(f"registered `{pr['model_name']}`"
                         + (f" and checkpoints {', '.join('`' + c['name'] + '`' for c in ck)}" if ck else "")
                         + " (open them in Explore's model menu)")
            if pr.get("non_embedding_parameters"):
                lines.append(f"{pr['non_embedding_parameters']:,} non-embedding + "
                             f"{pr['parameters'] - pr['non_embedding_parameters']:,} embedding parameters"
                             + (f" · trained {_s(m['train_seconds'])}" if m else ""))
    if rec.get("error"):
        lines.append(f"⚠️ {html.escape(str(rec['error']))}")
    return "  \n".join(lines)
