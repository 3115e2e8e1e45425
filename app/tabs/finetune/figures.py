"""Pure view functions for the SFT tab: job record / compare result -> plotly figures and HTML."""

from __future__ import annotations

import html

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.shared import figure_style as style

TRAINED_BG = "#bbf7d0"
MASKED_BG = "#e5e7eb"


def _layout(fig: go.Figure, title: str, height: int = 340, **kw) -> go.Figure:
    return style.layout(fig, title, height, **kw)


def empty_figure(message: str, height: int = 300) -> go.Figure:
    return style.empty_figure(message, height)


def loss_figure(history: list[dict] | None) -> go.Figure:
    """Train loss per step (line) and eval loss at its steps (markers)."""
    hist = history or []
    tr = [(h["step"], h["loss"]) for h in hist if h.get("loss") is not None]
    ev = [(h["step"], h["eval_loss"]) for h in hist if h.get("eval_loss") is not None]
    if not tr and not ev:
        return empty_figure("Loss curves appear here while a job trains.")
    fig = go.Figure()
    if tr:
        fig.add_scatter(x=[s for s, _ in tr], y=[v for _, v in tr], mode="lines", name="train loss",
                        line=dict(color="#2563eb"))
    if ev:
        fig.add_scatter(x=[s for s, _ in ev], y=[v for _, v in ev], mode="lines+markers", name="eval loss",
                        line=dict(color="#dc2626", dash="dot"), marker=dict(size=8))
    _integer_steps(fig, [s for s, _ in tr + ev])
    fig.update_yaxes(title="cross-entropy on assistant tokens (nats)", rangemode="tozero")
    return _layout(fig, "Loss", legend=dict(orientation="h", y=1.12, x=1, xanchor="right"))


def _integer_steps(fig: go.Figure, steps: list[int]) -> None:
    """Steps are whole numbers: never a 2.5 tick on a 4-step run."""
    top = max(steps or [1])
    fig.update_xaxes(title="step", tickformat="d", dtick=max(1, -(-top // 10)), rangemode="tozero")


def throughput_figure(history: list[dict] | None) -> go.Figure:
    """Tokens per second (cumulative average over training time) and the learning rate, per step."""
    hist = [h for h in (history or []) if h.get("loss") is not None]
    if not hist:
        return empty_figure("Tokens per second and learning rate appear here.")
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    steps = [h["step"] for h in hist]
    fig.add_scatter(x=steps, y=[h.get("tokens_per_s") for h in hist], name="tokens/s", line=dict(color="#16a34a"),
                    secondary_y=False)
    fig.add_scatter(x=steps, y=[h.get("lr") for h in hist], name="learning rate", line=dict(color="#a16207"),
                    secondary_y=True)
    _integer_steps(fig, steps)
    fig.update_yaxes(title="tokens/s", secondary_y=False, rangemode="tozero")
    fig.update_yaxes(title="lr", secondary_y=True, rangemode="tozero", exponentformat="e")
    return _layout(fig, "Throughput and learning rate", legend=dict(orientation="h", y=1.12, x=1, xanchor="right"))


def _fmt_s(s) -> str:
    if s is None:
        return "–"
    s = float(s)
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def status_markdown(rec: dict | None) -> str:
    """Latest step, loss, tokens/s, lr, ETA; data counts; accuracy before/after; the model's name."""
    if not rec:
        return "_Submit a job or pick one to follow it here._"
    s = rec.get("sft") or {}
    lines = [f"**Job {rec['id']}** · {rec['state']} · stage: {(rec.get('progress') or {}).get('stage', '')}"]
    hist = s.get("history") or []
    train = next((h for h in reversed(hist) if h.get("loss") is not None), None) or {}
    evals = next((h for h in reversed(hist) if h.get("eval_loss") is not None), None) or {}
    last = s.get("latest") or train
    if last or train:
        # the newest train row and the newest eval row, each with its own step: an eval-only row
        # must not blank the loss, and a job that ended has no ETA
        def num(v, f):
            return "–" if v is None else format(v, f)
        eta = f" · ETA {_fmt_s(last.get('eta_s'))}" if rec["state"] == "running" and last.get("eta_s") else ""
        lines.append(f"step {last.get('step', train.get('step'))}/{last.get('max_steps', train.get('max_steps'))} · "
                     f"loss {num(train.get('loss'), '.4f')} · eval loss {num(evals.get('eval_loss'), '.4f')}"
                     + (f" (step {evals['step']})" if evals else "")
                     + f" · {num(train.get('tokens_per_s'), '.0f')} tokens/s · lr {num(train.get('lr'), '.2e')}{eta}")
    d = (s.get("data") or {}).get("train")
    if d:
        lines.append(f"data: {d['examples']} training examples ({d['truncated']} truncated, {d['dropped']} dropped "
                     f"at max length); {d['trained_tokens']:,} of {d['tokens']:,} tokens count in the loss")
    b, a = s.get("accuracy_before"), s.get("accuracy_after")
    if b or a:
        def acc(x):
            return f"{x['correct']}/{x['n']} ({x['accuracy']:.0%})" if x else "–"
        lines.append(f"held-out accuracy (greedy, exact match): before **{acc(b)}** → after **{acc(a)}**")
    m = s.get("metrics")
    if m and m.get("tokens_per_s"):
        lines.append(f"trained {m['steps']} steps in {_fmt_s(m['train_seconds'])} at {m['tokens_per_s']:.0f} tokens/s")
    if rec["state"] == "succeeded" and s.get("model_name"):
        lines.append(f"registered as **{s['model_name']}**: it is in every model menu now; open it in Explore, or "
                     "compare it with its base below")
    if rec.get("error"):
        lines.append(f"⚠️ {rec['error']}")
    return "\n\n".join(lines)


ACCURACY_LIMIT = "the expected answer's length + 4 tokens"  # model_core.training.sft_eval.evaluate_accuracy


def samples_limit(max_new_tokens: int | None) -> str:
    """How far the samples generate: the run's recorded limit, else the least the run uses."""
    from model_core.training.sft_eval import SAMPLE_MAX_NEW_TOKENS

    return f"{int(max_new_tokens)} tokens" if max_new_tokens else f"{SAMPLE_MAX_NEW_TOKENS} tokens or more"


def accuracy_examples_html(rec: dict | None) -> str:
    """The held-out accuracy's first answers before and after, said with how they were generated: up
    to the expected answer's length + 4 tokens (enough to judge an exact match), where the samples
    table below runs to its own, longer limit. An answer that the samples show going on is marked
    cut (…), so the two tables read as the same answer at two lengths, not two answers."""
    s = (rec or {}).get("sft") or {}
    b, a = s.get("accuracy_before"), s.get("accuracy_after")
    if not b or not a:
        return ""
    samples = [r for r in s.get("samples") or [] if isinstance(r, dict) and r.get("step") is not None]
    last = max((int(r["step"]) for r in samples), default=None)
    longer: dict[tuple[str, str], str] = {}  # (before | after, prompt) -> that sample's completion
    for r in samples:
        for when, step in (("before", 0), ("after", last)):
            if int(r["step"]) == step:
                longer[(when, r.get("prompt"))] = r.get("completion") or ""
    rows = []
    for eb, ea in zip(b["examples"], a["examples"]):
        def cell(e, when):
            c = "#16a34a" if e["correct"] else "#dc2626"
            got, more = e["got"], longer.get((when, e["prompt"]))
            cut = more is not None and len(more.rstrip()) > len(got.rstrip()) and more.startswith(got)
            title = (f" title='cut at {html.escape(ACCURACY_LIMIT)}; the samples below show it going on'"
                     if cut else "")
            return (f"<td style='color:{c}' data-cut='{int(cut)}'{title}><code>{html.escape(got)}</code>"
                    f"{'…' if cut else ''}</td>")
        rows.append(f"<tr><td>{html.escape(eb['prompt'])}</td><td><code>{html.escape(eb['expected'])}</code></td>"
                    f"{cell(eb, 'before')}{cell(ea, 'after')}</tr>")
    further = (f"; the samples below run to {samples_limit((s.get('sampling') or {}).get('max_new_tokens'))}, so "
               "the same answer can read longer there (… marks where this one was cut)." if samples else ".")
    note = (f"Held-out accuracy (greedy, exact match): each answer is generated up to {ACCURACY_LIMIT}, enough "
            f"to judge it{further}")
    return (f"<div class='lmscope-sft-examples-note'>{html.escape(note)}</div>"
            "<table class='lmscope-sft-examples'><tr><th>held-out prompt</th><th>expected</th><th>before</th>"
            "<th>after</th></tr>" + "".join(rows) + "</table>")


def mask_html(rows: list[dict]) -> str:
    """Each token as a chip: green = counts in the loss (assistant), grey = masked (label -100)."""
    if not rows:
        return "<em>No example.</em>"
    chips = []
    for i, r in enumerate(rows):
        bg = TRAINED_BG if r["trained"] else MASKED_BG
        title = f"#{i} id {r['id']} · {'in the loss' if r['trained'] else 'masked (-100)'}"
        chips.append(f"<span class='lmscope-mask-tok' data-trained='{int(r['trained'])}' title='{html.escape(title)}' "
                     f"style='background:{bg};border-radius:3px;padding:1px 2px;margin:1px;display:inline-block;"
                     f"font-family:monospace'>{html.escape(r['display'])}</span>")
        if r["display"].endswith("↵"):
            chips.append("<br>")
    n = sum(r["trained"] for r in rows)
    legend = (f"<div style='margin-bottom:6px'><span style='background:{TRAINED_BG};padding:1px 4px'>in the loss</span> "
              f"<span style='background:{MASKED_BG};padding:1px 4px'>masked (label −100)</span> · "
              f"{n} of {len(rows)} tokens count</div>")
    return f"<div class='lmscope-mask'>{legend}{''.join(chips)}</div>"


def next_token_figure(nxt: dict, base_name: str, tuned_name: str) -> go.Figure:
    """Top next-token candidates of both models, side by side."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=(base_name, tuned_name), horizontal_spacing=0.18)
    for col, key, colour in ((1, "base", "#6b7280"), (2, "tuned", "#2563eb")):
        items = nxt.get(key) or []
        fig.add_bar(x=[p for _, p in items][::-1], y=[repr(t)[1:-1] or "∅" for t, _ in items][::-1],
                    orientation="h", marker_color=colour, row=1, col=col, showlegend=False,
                    text=[f"{p:.2f}" for _, p in items][::-1], textposition="outside")
        fig.update_xaxes(range=[0, 1.15], title="probability", row=1, col=col)
    return _layout(fig, "Next-token distribution", 380)


def compare_headline(r: dict, base_name: str, tuned_name: str) -> str:
    """The numbers that tell a real change from noise, before the charts: how far the next-token
    distributions are apart on this prompt, where the logit lens first disagrees, which head moved most."""
    kl, tokens = r.get("kl") or [], r.get("tokens") or []
    if not kl:
        return ""
    i = max(range(len(kl)), key=kl.__getitem__)
    base_top, tuned_top = (r.get("lens_top") or {}).get("base") or [], (r.get("lens_top") or {}).get("tuned") or []
    differ = [layer for layer, (a, b) in enumerate(zip(base_top, tuned_top)) if a != b]
    attn = r.get("attn_diff") or []
    cells = [(v, layer, h) for layer, row in enumerate(attn) for h, v in enumerate(row)]
    tv, tl, th = max(cells) if cells else (0.0, 0, 0)
    where = (f"from layer **{differ[0]}** on ({len(differ)} of {len(base_top)} layers)" if differ
             else "at **no** layer")
    return (f"**{tuned_name}** vs **{base_name}** on this prompt: KL(tuned ‖ base) of the next token is "
            f"**{sum(kl) / len(kl):.4f}** nats on average, **{kl[i]:.4f}** at most (position {i}, "
            f"`{html.escape(tokens[i]['display']) if i < len(tokens) else i}`); at the last position, the logit "
            f"lens's top token differs {where}; the attention head that moved most is **L{tl}H{th}** "
            f"(total variation {tv:.3f}).")


def generations_html(rows: list[tuple[str, str]], prompt: str) -> str:
    """The same prompt, seed and settings through several models, side by side."""
    cells = "".join(f"<td><b>{html.escape(name)}</b><pre style='white-space:pre-wrap'>{html.escape(text)}</pre></td>"
                    for name, text in rows)
    return (f"<div class='lmscope-side-by-side'><div>Prompt: <code>{html.escape(prompt[:200])}</code></div>"
            f"<table style='width:100%;table-layout:fixed'><tr>{cells}</tr></table></div>")


def kl_figure(tokens: list[dict], kl: list[float]) -> go.Figure:
    labels = [f"{i}:{t['display']}" for i, t in enumerate(tokens)]
    fig = go.Figure(go.Bar(x=list(range(len(kl))), y=kl, marker_color="#7c3aed",
                           hovertext=labels, hovertemplate="%{hovertext}<br>KL %{y:.4f} nats<extra></extra>"))
    fig.update_xaxes(title="position (predicting the next token)", tickvals=list(range(len(kl))),
                     ticktext=[t["display"][:10] for t in tokens], tickangle=-60)
    fig.update_yaxes(title="KL(tuned ‖ base), nats", rangemode="tozero")
    return _layout(fig, "Where the fine-tuned model disagrees, per position", 360)


def lens_kl_figure(tokens: list[dict], lens_kl: list[list[float]]) -> go.Figure:
    fig = go.Figure(go.Heatmap(z=lens_kl, x=[f"{i}:{t['display'][:10]}" for i, t in enumerate(tokens)],
                               y=[f"L{l}" for l in range(len(lens_kl))], colorscale="Purples",
                               colorbar=dict(title="KL"),
                               hovertemplate="%{y} · %{x}<br>KL %{z:.4f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    top = max((max(row) for row in lens_kl if row), default=0.0)
    fig.update_traces(zmin=0, zmax=max(top, 1e-9))
    return _layout(fig, f"Logit-lens difference per layer and position: KL(tuned ‖ base), colour 0 – {top:.3g} nats",
                   max(300, 22 * len(lens_kl) + 100))


def attn_diff_figure(attn_diff: list[list[float]]) -> go.Figure:
    fig = go.Figure(go.Heatmap(z=attn_diff, x=[f"H{h}" for h in range(len(attn_diff[0]) if attn_diff else 0)],
                               y=[f"L{l}" for l in range(len(attn_diff))], colorscale="Oranges", zmin=0, zmax=1,
                               colorbar=dict(title="TV"),
                               hovertemplate="%{y} %{x}<br>mean TV distance %{z:.4f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, "Attention difference per head: mean TV distance (0 same – 1 disjoint)",
                   max(300, 22 * len(attn_diff) + 100))


def lens_table_html(lens_top: dict, base_name: str, tuned_name: str) -> str:
    b, t = lens_top.get("base", []), lens_top.get("tuned", [])
    rows = []
    for l, (x, y) in enumerate(zip(b, t)):
        diff = " style='background:#fef3c7'" if x != y else ""
        rows.append(f"<tr{diff}><td>L{l}</td><td><code>{html.escape(repr(x)[1:-1])}</code> "
                    f"{lens_top['base_p'][l]:.2f}</td><td><code>{html.escape(repr(y)[1:-1])}</code> "
                    f"{lens_top['tuned_p'][l]:.2f}</td></tr>")
    return (f"<table class='lmscope-sft-lens'><tr><th>layer</th><th>{html.escape(base_name)}</th>"
            f"<th>{html.escape(tuned_name)}</th></tr>" + "".join(rows) + "</table>")


def weight_delta_figure(rows: list[dict] | None) -> go.Figure:
    """Heatmap of model_core.anatomy.weight_delta rows: layers × module kinds, colour = ‖ΔW‖_F / ‖W‖_F of the
    fine-tuned weights against the parent; below it one row for what lies outside the layers
    (embeddings, final norm, lm_head). The title names the largest change and where it is."""
    rows = rows or []
    if not rows:
        return empty_figure("Pick a fine-tuned model to see how far each layer's weights moved from its parent.")
    layered = [r for r in rows if r.get("layer") is not None]
    outside = [r for r in rows if r.get("layer") is None]
    layers = sorted({r["layer"] for r in layered})
    kinds = list(dict.fromkeys(r["kind"] for r in layered))

    def where(r):
        tied = f" (tied: {', '.join(r['also'])})" if r.get("also") else ""
        return (f"L{r['layer']} {r['kind']}" if r.get("layer") is not None else r["kind"]) + tied

    def hover(r):
        if r is None:
            return ""
        rel = "parent norm is 0" if r.get("rel") is None else f"{r['rel']:.3e}"
        gain = " (‖1 + w‖: this norm scales by 1 + w)" if r.get("offset") else ""
        return (f"{where(r)}<br>‖ΔW‖/‖W‖ = {rel}<br>‖ΔW‖ = {r['delta']:.4g} · ‖W‖ = {r['norm']:.4g}{gain}"
                f"<br>{r['numel']:,} weights")

    finite = [r for r in rows if r.get("rel") is not None]
    top = max(finite, key=lambda r: r["rel"]) if finite else None
    zmax = max((top["rel"] if top else 0.0), 1e-12)
    if top is None or top["rel"] == 0:
        title = "Relative weight change ‖ΔW‖/‖W‖: no weight changed"
    else:
        title = f"Relative weight change ‖ΔW‖/‖W‖ per layer and module: max {top['rel']:.3g} at {where(top)}"

    grid = {(r["layer"], r["kind"]): r for r in layered}
    z = [[None if (c := grid.get((l, k))) is None or c.get("rel") is None else c["rel"] for k in kinds]
         for l in layers]
    text = [[hover(grid.get((l, k))) for k in kinds] for l in layers]
    top_margin, bottom_margin = 150, 60  # module names stand slanted above the grid
    height = max(340, 26 * len(layers) + (60 if outside else 0) + top_margin + bottom_margin)
    plot_h = height - top_margin - bottom_margin
    specs = dict(rows=2, cols=1, row_heights=[1 - 36 / plot_h, 36 / plot_h], vertical_spacing=24 / plot_h) \
        if outside else dict(rows=1, cols=1)
    fig = make_subplots(**specs)
    fig.add_trace(go.Heatmap(z=z, x=kinds, y=[f"L{l}" for l in layers], coloraxis="coloraxis", text=text,
                             hovertemplate="%{text}<extra></extra>", xgap=1, ygap=1), row=1, col=1)
    fig.update_yaxes(autorange="reversed", row=1, col=1)
    if outside:
        fig.add_trace(go.Heatmap(z=[[r["rel"] for r in outside]], x=[where(r) for r in outside], y=["outside layers"],
                                 coloraxis="coloraxis", text=[[hover(r) for r in outside]],
                                 hovertemplate="%{text}<extra></extra>", xgap=1), row=2, col=1)
    fig.update_layout(coloraxis=dict(colorscale="Reds", cmin=0, cmax=zmax,
                                     colorbar=dict(title="‖ΔW‖/‖W‖", exponentformat="e")))
    fig.update_xaxes(side="top", tickangle=-30, row=1, col=1)
    fig = _layout(fig, title, height)
    fig.update_layout(margin=dict(l=50, r=20, t=top_margin, b=bottom_margin))
    return fig


RUN_COLOURS = ["#2563eb", "#dc2626", "#16a34a", "#a16207", "#7c3aed", "#0891b2", "#db2777", "#4b5563"]


def run_label(rec: dict) -> str:
    """A run's short name: its registered model (or job id) and how it was trained."""
    p = rec.get("params") or {}
    method = f"LoRA r{p.get('lora_rank') or 8}" if p.get("method") == "lora" else "full"
    name = (rec.get("sft") or {}).get("model_name") or rec.get("id", "?")
    return f"{name} ({method})"


def runs_figure(records: list[dict]) -> go.Figure:
    """Several runs' loss curves on one chart: train loss as lines, eval loss as dotted markers, one
    colour per run."""
    runs = [r for r in records if ((r.get("sft") or {}).get("history"))]
    if not runs:
        return empty_figure("Pick two or more fine-tuning runs to overlay their loss curves.")
    fig = go.Figure()
    steps = []
    for i, rec in enumerate(runs):
        hist = rec["sft"]["history"]
        colour, label = RUN_COLOURS[i % len(RUN_COLOURS)], run_label(rec)
        tr = [(h["step"], h["loss"]) for h in hist if h.get("loss") is not None]
        ev = [(h["step"], h["eval_loss"]) for h in hist if h.get("eval_loss") is not None]
        steps += [s for s, _ in tr + ev]
        if tr:
            fig.add_scatter(x=[s for s, _ in tr], y=[v for _, v in tr], mode="lines", name=f"{label} train",
                            line=dict(color=colour), legendgroup=label)
        if ev:
            fig.add_scatter(x=[s for s, _ in ev], y=[v for _, v in ev], mode="lines+markers", name=f"{label} eval",
                            line=dict(color=colour, dash="dot"), marker=dict(size=7), legendgroup=label)
    _integer_steps(fig, steps)
    fig.update_yaxes(title="loss on assistant tokens (nats)", rangemode="tozero")
    return _layout(fig, f"{len(runs)} runs: train (lines) and eval (dotted) loss", height=380,
                   legend=dict(orientation="h", y=-0.2))


RUN_COLUMNS = ["run", "state", "method", "rank", "lr", "steps", "batch", "data", "held-out before", "held-out after",
               "final loss", "final eval loss", "tokens/s"]


def runs_table(records: list[dict]):
    """Settings and results of several runs, one row each (the W&B runs table)."""
    import pandas as pd

    rows = []
    for rec in records:
        p, s = rec.get("params") or {}, rec.get("sft") or {}
        m, lines = s.get("metrics") or {}, s.get("dataset_lines") or {}

        def acc(x):
            return f"{x['correct']}/{x['n']}" if x else ""
        data = p.get("dataset_file") or p.get("dataset") or ""
        if lines:
            data += f" ({lines.get('kept')} lines)"
        rows.append([run_label(rec), rec.get("state", ""), p.get("method", ""),
                     p.get("lora_rank") if p.get("method") == "lora" else "",
                     p.get("learning_rate") or ("1e-3 (default)" if p.get("method") == "lora" else "1e-4 (default)"),
                     m.get("steps") or p.get("max_steps"), p.get("batch_size"), data,
                     acc(s.get("accuracy_before")), acc(s.get("accuracy_after")),
                     _round(m.get("final_loss")), _round(m.get("final_eval_loss")), _round(m.get("tokens_per_s"), 0)])
    return pd.DataFrame(rows, columns=RUN_COLUMNS)


def _round(v, nd: int = 4):
    return "" if v is None else round(float(v), nd)


def samples_table_html(samples: list[dict], max_new_tokens: int | None = None) -> str:
    """Held-out generations during training (record['sft']['samples']): one row per prompt, one
    column per step (step 0 = before training, then during, the last = after), the expected answer
    beside the prompt when known; a cell is green when its completion matches, red when not.
    `max_new_tokens` (record['sft']['sampling']) is said above the table: the held-out accuracy's
    answers stop earlier (accuracy_examples_html)."""
    rows = [r for r in (samples or []) if isinstance(r, dict) and r.get("step") is not None]
    if not rows:
        return ("<div class='lmscope-samples lmscope-samples-empty'><em>No sample generations yet: the run "
                "generates a few held-out prompts at step 0 and every few steps (setting sample_every), "
                "and they appear here as it trains.</em></div>")
    steps = sorted({int(r["step"]) for r in rows})
    groups: dict = {}
    for r in rows:
        g = groups.setdefault((r.get("index"), r.get("prompt", "")),
                              {"prompt": r.get("prompt", ""), "expected": None, "cells": {}})
        if r.get("expected") is not None:
            g["expected"] = r["expected"]
        g["cells"][int(r["step"])] = r
    with_expected = any(g["expected"] is not None for g in groups.values())
    order = sorted(groups, key=lambda k: (k[0] is None, k[0] if k[0] is not None else 0, str(k[1])))

    def cell(r):
        if r is None:
            return "<td style='color:#9ca3af'>–</td>"
        text = r.get("completion") or ""
        ok = r.get("correct")
        style = ("background:#dcfce7;color:#166534" if ok is True else
                 "background:#fee2e2;color:#991b1b" if ok is False else "")
        verdict = {True: "matches the expected answer", False: "does not match the expected answer"}.get(ok, "")
        shown = html.escape(text) if text.strip() else "<span style='color:#9ca3af'>(blank)</span>"
        step = int(r["step"])
        title = html.escape(f"step {step}" + (f" · {verdict}" if verdict else ""))
        flag = "" if ok is None else int(bool(ok))
        return (f"<td data-step='{step}' data-correct='{flag}' title='{title}' style='{style}'>"
                f"<code style='white-space:pre-wrap'>{shown}</code></td>")

    head = "".join(f"<th>step {s}{' (before)' if s == 0 else ''}</th>" for s in steps)
    limit = f"<div class='lmscope-samples-note'>Greedy; each sample runs to {samples_limit(max_new_tokens)}.</div>"
    out = [f"<div class='lmscope-samples' style='overflow-x:auto'>{limit}<table class='lmscope-samples-table'>",
           f"<tr><th>held-out prompt</th>{'<th>expected</th>' if with_expected else ''}{head}</tr>"]
    for k in order:
        g = groups[k]
        exp = (f"<td><code>{html.escape(g['expected'])}</code></td>" if g["expected"] is not None else "<td></td>") \
            if with_expected else ""
        out.append(f"<tr><td>{html.escape(g['prompt'])}</td>{exp}"
                   + "".join(cell(g["cells"].get(s)) for s in steps) + "</tr>")
    if with_expected:
        tally = []
        for s in steps:
            known = [g["cells"][s]["correct"] for g in groups.values()
                     if s in g["cells"] and g["cells"][s].get("correct") is not None]
            tally.append(f"<td><b>{sum(map(bool, known))}/{len(known)}</b></td>" if known else "<td></td>")
        out.append(f"<tr><td><b>correct</b></td><td></td>{''.join(tally)}</tr>")
    out.append("</table></div>")
    return "".join(out)
