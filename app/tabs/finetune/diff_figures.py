"""Pure view functions for "What changed" (model_core.interp.model_diff results -> figures, tables,
HTML): a corpus diff's ranked contexts, KL by next token, residual difference per layer and the
layer x head map of attention change; a prompt diff's KL per token, where the streams part and the
tokens that gained and lost probability."""

from __future__ import annotations

import html

import pandas as pd
import plotly.graph_objects as go

from app.shared import figure_style as style

CONTEXT_CHARS = 90
KL = "KL(base ‖ tuned), nats"


def _shown(text: str) -> str:
    """The end of a context (what comes right before the ranked position), on one line."""
    one_line = " ".join(str(text).split())
    return one_line if len(one_line) <= CONTEXT_CHARS else "…" + one_line[-CONTEXT_CHARS:]


def contexts_table(report: dict | None) -> pd.DataFrame:
    rows = [[round(c["kl"], 4), c["next"], _shown(c["text"])] for c in (report or {}).get("contexts") or []]
    return pd.DataFrame(rows, columns=[KL, "next token", "context (its end)"])


def next_tokens_table(report: dict | None) -> pd.DataFrame:
    rows = [[r["token"], round(r["kl_sum"], 3), r["count"]] for r in (report or {}).get("kl_by_next_token") or []]
    return pd.DataFrame(rows, columns=["next token", "KL summed", "times"])


def summary_markdown(report: dict, job_id: str) -> str:
    note = "" if report.get("vocabulary") == "same" else f" {report['vocabulary']}"
    return (f"**{report['tuned']}** against **{report['base']}** over {report['tokens']:,} tokens of "
            f"{report.get('meta', {}).get('corpus', 'the corpus')} ({report['windows']} contexts of "
            f"{report['window']} tokens; job {job_id}): mean KL(base ‖ tuned) {report['mean_kl']:.4f} nats "
            f"per token.{note} Click a context to see it token by token.")


def layers_figure(resid_diff: list[float]) -> go.Figure:
    """Mean ||r_tuned - r_base|| / ||r_base|| after the embeddings and after each layer."""
    if not resid_diff:
        return style.empty_figure("No residual difference to show.")
    x = ["emb"] + [f"L{i}" for i in range(len(resid_diff) - 1)]
    fig = go.Figure(go.Scatter(x=x, y=resid_diff, mode="lines+markers", line=dict(color="#7c3aed"),
                               hovertemplate="after %{x}: %{y:.4f}<extra></extra>"))
    fig.update_yaxes(title="‖r tuned − r base‖ / ‖r base‖", rangemode="tozero")
    fig.update_xaxes(title="residual stream after")
    return style.layout(fig, "Where the residual streams part, per layer (mean over the corpus)", 320)


def heads_figure(head_js: list[list[float] | None]) -> go.Figure:
    """Layer x head mean Jensen-Shannon distance of attention rows (0 same, 1 disjoint)."""
    rows = [r for r in head_js or [] if r is not None]
    if not rows:
        return style.empty_figure("This model has no softmax attention layers to compare.")
    n_heads = len(rows[0])
    z = [r if r is not None else [None] * n_heads for r in head_js]
    fig = go.Figure(go.Heatmap(z=z, x=[f"H{h}" for h in range(n_heads)], y=[f"L{l}" for l in range(len(z))],
                               colorscale="Oranges", zmin=0, colorbar=dict(title="JS"),
                               hovertemplate="%{y} %{x}<br>mean JS distance %{z:.4f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    return style.layout(fig, "Attention change per head: mean Jensen-Shannon distance (0 same, 1 disjoint)",
                        max(300, 18 * len(z) + 110))


def prompt_kl_figure(tokens: list[str], kl: list[float]) -> go.Figure:
    fig = go.Figure(go.Bar(x=list(range(len(kl))), y=kl, marker_color="#7c3aed",
                           hovertext=[f"{i}: {t}" for i, t in enumerate(tokens)],
                           hovertemplate="%{hovertext}<br>KL %{y:.4f} nats<extra></extra>"))
    fig.update_xaxes(title="position (predicting the next token)", tickvals=list(range(len(kl))),
                     ticktext=[t[:10] for t in tokens], tickangle=-60)
    fig.update_yaxes(title=KL, rangemode="tozero")
    return style.layout(fig, "This context token by token: how far the next-token distributions are", 340)


def prompt_resid_figure(tokens: list[str], resid_diff: list[list[float]]) -> go.Figure:
    """[L + 1][T] relative residual difference."""
    fig = go.Figure(go.Heatmap(z=resid_diff, x=[f"{i}:{t[:10]}" for i, t in enumerate(tokens)],
                               y=["emb"] + [f"L{l}" for l in range(len(resid_diff) - 1)], colorscale="Purples",
                               zmin=0, colorbar=dict(title="rel."),
                               hovertemplate="after %{y} · %{x}<br>‖Δr‖/‖r‖ %{z:.4f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    return style.layout(fig, "Residual streams apart, per layer and position (‖r tuned − r base‖ / ‖r base‖)",
                        max(320, 14 * len(resid_diff) + 120))


def changes_html(d: dict, position: int) -> str:
    """The tokens that gained and lost the most probability at one position, and where the streams part."""
    def rows(pairs):
        return "".join(f"<tr><td><code>{html.escape(repr(t))}</code></td><td>{v:+.4f}</td></tr>" for t, v in pairs)

    parted = d["parted_at"][position]
    where = ("the residual streams never part by 5% here" if parted is None else
             "the residual streams part " + ("at the embeddings" if parted == 0 else f"after layer {parted - 1}"))
    tok = html.escape(d["tokens"][position])
    return (f"<div id='diff-changes'><p>After <b>{tok}</b> (position {position}): KL {d['kl'][position]:.4f} nats; "
            f"{where}.</p><table><tr><th>gained</th><th>Δp</th></tr>{rows(d['gained'][position])}</table>"
            f"<table><tr><th>lost</th><th>Δp</th></tr>{rows(d['lost'][position])}</table></div>")


def run_figure(run: dict | None) -> go.Figure:
    """Mean KL(base ‖ model at the step) per followed prompt, at each checkpoint the run kept (step 0
    is the base: 0)."""
    if not run or len(run.get("steps") or []) < 2:
        return style.empty_figure("This run kept no checkpoints: train with 'keep checkpoints' to see when it changed.")
    fig = go.Figure()
    steps, models = run["steps"], run["models"]
    for p, text in enumerate(run["prompts"]):
        fig.add_trace(go.Scatter(
            x=steps, y=[row[p] for row in run["mean_kl"]], mode="lines+markers", name=_shown(text)[-40:],
            customdata=models, hovertemplate="step %{x} (%{customdata})<br>mean KL %{y:.4f} nats<extra></extra>"))
    fig.update_xaxes(title="training step (0: the base)")
    fig.update_yaxes(title="mean " + KL, rangemode="tozero")
    fig.update_layout(showlegend=len(run["prompts"]) <= 8)
    return style.layout(fig, "When did it change: KL from the base at each kept checkpoint, per context", 360)


def feature_shift_table(shift: dict | None) -> pd.DataFrame:
    """The features that appeared, vanished or shifted most (model_core.interp.model_diff_features)."""
    rows = []
    for kind, what in (("appeared", "appeared"), ("vanished", "vanished"), ("shifted", "shifted")):
        for r in (shift or {}).get(kind) or []:
            rows.append([what, r["feature"], round(r["freq_base"], 4), round(r["freq_tuned"], 4),
                         round(r["mean_base"], 4), round(r["mean_tuned"], 4), (r.get("label") or "")[:60]])
    return pd.DataFrame(rows, columns=["change", "feature", "fires (base)", "fires (tuned)", "mean act. (base)",
                                       "mean act. (tuned)", "label"])


def feature_shift_summary(shift: dict) -> str:
    return (f"**{shift.get('features', 'the set')}** (`{shift.get('hook', '')}`) on {shift.get('positions', 0):,} "
            f"positions of the built-in held-out text: {shift.get('firing_base', 0):,} features fire under the base, "
            f"{shift.get('firing_tuned', 0):,} under the tuned model; {len(shift.get('appeared') or [])} appeared, "
            f"{len(shift.get('vanished') or [])} vanished. Click a feature for its page.")


CLASS_COLOURS = {"base_only": "#2563eb", "shared": "#9ca3af", "tuned_only": "#ea580c"}
CLASS_NAMES = {"base_only": "base-only", "shared": "shared", "tuned_only": "tuned-only"}


def crosscoder_figure(report: dict | None) -> go.Figure:
    """The live latents' relative decoder norm r = ‖d_tuned‖ / (‖d_base‖ + ‖d_tuned‖), binned; bins
    coloured by class (base-only under 0.1, tuned-only over 0.9)."""
    h = (report or {}).get("histogram") or {}
    edges, counts = h.get("edges") or [], h.get("counts") or []
    if not counts or not sum(counts):
        return style.empty_figure("No crosscoder latent fired on the held-out text.")
    mids = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
    colours = [CLASS_COLOURS["base_only"] if m < 0.1 else CLASS_COLOURS["tuned_only"] if m > 0.9
               else CLASS_COLOURS["shared"] for m in mids]
    fig = go.Figure(go.Bar(x=mids, y=counts, width=[b - a for a, b in zip(edges, edges[1:])], marker_color=colours,
                           hovertemplate="r %{x:.2f}: %{y} latents<extra></extra>"))
    fig.update_xaxes(title="r = ‖d tuned‖ / (‖d base‖ + ‖d tuned‖)   (0: base only, 1: tuned only)", range=[0, 1])
    fig.update_yaxes(title="live latents")
    c = report["counts"]
    return style.layout(fig, f"Crosscoder latents: {c['base_only']} base-only, {c['shared']} shared, "
                             f"{c['tuned_only']} tuned-only", 320)


def crosscoder_table(report: dict | None) -> pd.DataFrame:
    rows = []
    for cls in ("tuned_only", "base_only", "shared"):
        for lat in ((report or {}).get("top") or {}).get(cls) or []:
            ctx = (lat.get("contexts") or [{}])[0]
            rows.append([CLASS_NAMES[cls], lat["latent"], round(lat["r"], 3), round(lat.get("frequency", 0.0), 4),
                         _shown(ctx.get("text", "")), ctx.get("token", "")])
    return pd.DataFrame(rows, columns=["class", "latent", "r", "fires", "top context (its end)", "token"])


def crosscoder_summary(report: dict, job_id: str) -> str:
    f = report.get("fve") or {}
    return (f"**Crosscoder** of {report['tuned']} and {report['base']} at `{report['hook_name']}` (job {job_id}): "
            f"{report['num_latents']:,} latents trained on {report['tokens']:,} tokens; {report['dead']:,} never fired "
            f"on the held-out text. Variance explained: {f.get('base', 0):.1%} (base), {f.get('tuned', 0):.1%} "
            f"(tuned). A latent whose tuned decoder carries over 90% of its norm is tuned-only: a direction the "
            f"fine-tuned model writes and its base does not.")
