"""Pure views of the reward / DPO / GRPO jobs (tasks/preference_job.py): a job record (or the
per-token log-ratios of model_core.training.preference.token_logratios) in, a plotly Figure, a table or a
few lines of text out. No gradio, no model: app/tabs/finetune/preference_panel.py shows them.

Record schema read here: rec['preference'] = {kind, history: [{step, total, loss, tokens_per_s,
eta_s, ... per kind}], latest, groups: {step, groups: [{prompt, completions, rewards, advantages,
mean, std}]}, before, after, model_name, metrics}; rec['params'] holds the run's settings."""

from __future__ import annotations

import html
import math

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.shared import figure_style as style
from app.shared.figure_style import empty_figure

KIND_LABELS = {"reward": "reward model", "dpo": "DPO", "grpo": "GRPO"}
BLUE, RED, GREEN, GREY, ORANGE = "#2563eb", "#dc2626", "#16a34a", "#6b7280", "#ea580c"
GROUP_COLUMNS = ["group", "prompt", "completion", "reward", "advantage"]
EVAL_COLUMNS = ["held-out", "before", "after", "change"]


def _layout(fig: go.Figure, title: str, height: int = 360, **kw) -> go.Figure:
    """The shared layout, with room below for the legend (a row under the x axis)."""
    return style.layout(fig, title, height, margin=dict(l=56, r=20, t=56, b=70),
                        legend=dict(orientation="h", y=-0.16, x=0, xanchor="left", font=dict(size=11)), **kw)


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in history or []:
        v = _num(r.get(key))
        if v is not None and r.get("step") is not None:
            xs.append(int(r["step"]))
            ys.append(v)
    return xs, ys


def _line(fig, history, key, name, colour, row, col, dash=None, **kw):
    x, y = _series(history, key)
    if x:
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=name, line=dict(color=colour, dash=dash),
                                 marker=dict(size=5), **kw), row=row, col=col)
    return x, y


# ---- live curves ---------------------------------------------------------------------------------

PANEL_TITLES = {
    "dpo": ("loss", "log-prob margin log π(chosen) − log π(rejected), batch mean", "implicit-reward accuracy",
            "drift from the reference: log π/π_ref per pair (= reward / β)"),
    "reward": ("loss (−log σ(r_chosen − r_rejected))", "score margin r_chosen − r_rejected", "accuracy (r_c > r_r)",
               "mean score (band: min to max)"),
    "grpo": ("loss", "reward: mean (band: ± std over the batch), mean within-group std",
             "completion length (tokens): the length bias Dr. GRPO removes", "KL to the reference"),
}


def curves_figure(kind: str | None, history: list[dict] | None, beta: float | None = None) -> go.Figure:
    """Four small panels of the run's per-step rows, chosen by kind (see PANEL_TITLES)."""
    if kind not in PANEL_TITLES:
        return empty_figure("Submit a run or pick one to follow its curves.", 460)
    if not history:
        return empty_figure("No training step yet (loading the model and evaluating before training).", 460)
    fig = make_subplots(rows=2, cols=2, subplot_titles=PANEL_TITLES[kind], vertical_spacing=0.2,
                        horizontal_spacing=0.1)
    _line(fig, history, "loss", "loss", BLUE, 1, 1)
    if kind == "dpo":
        rows = [{"step": r.get("step"),
                 "logp_margin": (_num(r.get("logp_chosen")) - _num(r.get("logp_rejected")))
                 if _num(r.get("logp_chosen")) is not None and _num(r.get("logp_rejected")) is not None else None}
                for r in history]
        _line(fig, rows, "logp_margin", "log π(chosen) − log π(rejected)", GREEN, 1, 2)
        _line(fig, history, "accuracy", "accuracy", ORANGE, 2, 1)
        b = _num(beta) or 0.1
        drift = [{"step": r.get("step"),
                  "c": _num(r.get("reward_chosen")) / b if _num(r.get("reward_chosen")) is not None else None,
                  "r": _num(r.get("reward_rejected")) / b if _num(r.get("reward_rejected")) is not None else None}
                 for r in history]
        _line(fig, drift, "c", "log π/π_ref (chosen)", GREEN, 2, 2)
        _line(fig, drift, "r", "log π/π_ref (rejected)", RED, 2, 2)
        fig.update_yaxes(range=[-0.05, 1.05], row=2, col=1)
    elif kind == "reward":
        _line(fig, history, "margin", "margin", GREEN, 1, 2)
        _line(fig, history, "accuracy", "accuracy", ORANGE, 2, 1)
        _band(fig, history, "reward_min", "reward_max", 2, 2, "score min–max")
        _line(fig, history, "reward_mean", "mean score", BLUE, 2, 2)
        fig.update_yaxes(range=[-0.05, 1.05], row=2, col=1)
    else:
        mean_std = [{"step": r.get("step"),
                     "lo": _num(r.get("reward_mean")) - _num(r.get("reward_std"))
                     if _num(r.get("reward_mean")) is not None and _num(r.get("reward_std")) is not None else None,
                     "hi": _num(r.get("reward_mean")) + _num(r.get("reward_std"))
                     if _num(r.get("reward_mean")) is not None and _num(r.get("reward_std")) is not None else None}
                    for r in history]
        _band(fig, mean_std, "lo", "hi", 1, 2, "± std")
        _line(fig, history, "reward_mean", "mean reward", GREEN, 1, 2)
        _line(fig, history, "reward_group_std", "mean std within a group", GREY, 1, 2, dash="dot")
        _line(fig, history, "completion_length", "mean completion length", ORANGE, 2, 1)
        x, _ = _line(fig, history, "kl", "KL", RED, 2, 2)
        if not x:
            fig.add_annotation(text="β = 0: no KL term", showarrow=False, x=0.78, y=0.2, xref="paper",
                               yref="paper", font=dict(color=GREY))
    fig.update_xaxes(title_text="step", row=2)
    _integer_steps(fig, history)
    for ann in fig.layout.annotations:
        ann.font = dict(size=12)
    return _layout(fig, f"{KIND_LABELS[kind]}: training curves", 560)


def _band(fig, history, lo_key, hi_key, row, col, name):
    xl, lo = _series(history, lo_key)
    xh, hi = _series(history, hi_key)
    if xl and xl == xh:
        fig.add_trace(go.Scatter(x=xl + xl[::-1], y=hi + lo[::-1], mode="lines", fill="toself",
                                 fillcolor="rgba(22,163,74,0.15)", line=dict(width=0), name=name, hoverinfo="skip"),
                      row=row, col=col)


def _integer_steps(fig: go.Figure, history: list[dict]) -> None:
    """Whole steps on the x axes (a 2-step run is not drawn at step 1.5)."""
    last = max((int(r["step"]) for r in history or [] if r.get("step") is not None), default=1)
    fig.update_xaxes(tickmode="linear", tick0=0, dtick=max(1, math.ceil(last / 8)))


def throughput_figure(history: list[dict] | None) -> go.Figure:
    x, y = _series(history or [], "tokens_per_s")
    if not x:
        return empty_figure("Tokens per second appear with the first step.", 260)
    fig = go.Figure(go.Scatter(x=x, y=y, mode="lines+markers", line=dict(color=BLUE), name="tokens/s"))
    fig.update_xaxes(title_text="step")
    _integer_steps(fig, history)
    fig.update_yaxes(title_text="tokens / s", rangemode="tozero")
    return _layout(fig, "throughput (tokens seen / training time)", 260, showlegend=False)


# ---- GRPO's latest group of completions --------------------------------------------------------

def groups_table(groups: dict | list | None) -> pd.DataFrame:
    """record['preference']['groups'] ({step, groups}) -> one row per completion with its reward and
    advantage (the group's prompt, mean and std in the group column)."""
    gs = groups.get("groups") if isinstance(groups, dict) else groups
    rows = []
    for i, g in enumerate(gs or []):
        label = f"{i + 1} (mean {g.get('mean', 0):.2f}, std {g.get('std', 0):.2f})"
        for c, r, a in zip(g.get("completions") or [], g.get("rewards") or [], g.get("advantages") or []):
            rows.append([label, g.get("prompt", ""), c, round(float(r), 3), round(float(a), 3)])
    return pd.DataFrame(rows, columns=GROUP_COLUMNS)


def groups_caption(groups: dict | None, loss_type: str | None = None) -> str:
    if not isinstance(groups, dict) or not groups.get("groups"):
        return "_GRPO runs show their latest groups of completions here (reward and advantage of each)._"
    adv = ("A = r − mean(r) (Dr. GRPO: no division by the std)" if loss_type == "dr_grpo"
           else "A = (r − mean(r)) / std(r) within the group")
    return (f"Completions sampled at step **{groups.get('step')}**, grouped by prompt; advantage {adv}. A group "
            "whose rewards are all equal has advantage 0 everywhere and teaches nothing.")


# ---- held-out before / after -------------------------------------------------------------------

EVAL_KEYS = {
    "dpo": [("logp_accuracy", "log-prob accuracy: log π(chosen) > log π(rejected)"),
            ("logp_margin", "log-prob margin (mean)"), ("accuracy", "implicit-reward accuracy"),
            ("margin", "implicit-reward margin β·Δ")],
    "reward": [("accuracy", "accuracy: score(chosen) > score(rejected)"), ("margin", "score margin (mean)"),
               ("score_chosen", "mean score of chosen"), ("score_rejected", "mean score of rejected")],
    "grpo": [("mean_reward", "mean verifiable reward (greedy)"), ("mean_length", "mean completion length")],
}


def eval_table(kind: str | None, before: dict | None, after: dict | None) -> pd.DataFrame:
    rows = []
    for key, label in EVAL_KEYS.get(kind or "", []):
        b, a = _num((before or {}).get(key)), _num((after or {}).get(key))
        if b is None and a is None:
            continue
        rows.append([label, "–" if b is None else round(b, 4), "–" if a is None else round(a, 4),
                     "–" if a is None or b is None else f"{a - b:+.4f}"])
    return pd.DataFrame(rows, columns=EVAL_COLUMNS)


# ---- status --------------------------------------------------------------------------------------

def _fmt_s(s) -> str:
    s = _num(s)
    if s is None:
        return "–"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def job_label(rec: dict) -> str:
    p = rec.get("params") or {}
    kind = rec.get("kind", "")
    bits = [KIND_LABELS.get(kind, kind), str(p.get("model", "?")), str(p.get("method", ""))]
    if kind == "grpo":
        bits.append(str(p.get("loss_type", "")))
    if kind in ("dpo", "grpo") and p.get("beta") is not None:
        bits.append(f"β {p['beta']:g}")
    bits.append(f"{p.get('max_steps', '?')} steps")
    return " · ".join(b for b in bits if b)


def status_markdown(rec: dict | None) -> str:
    """Latest step, loss, tokens/s and ETA; data; the registered model; an error."""
    if not rec:
        return "_Submit a run or pick one to follow it here._"
    pr = rec.get("preference") or {}
    lines = [f"**Job {rec['id']}** · {job_label(rec)} · {rec['state']} · stage: "
             f"{(rec.get('progress') or {}).get('stage', '')}"]
    last = pr.get("latest") or ((pr.get("history") or [None])[-1]) or {}
    if last:
        def num(k, f):
            v = _num(last.get(k))
            return "–" if v is None else format(v, f)
        eta = f" · ETA {_fmt_s(last.get('eta_s'))}" if rec["state"] == "running" and last.get("eta_s") else ""
        lines.append(f"step {last.get('step')}/{last.get('total')} · loss {num('loss', '.4f')} · "
                     f"{num('tokens_per_s', '.0f')} tokens/s · lr {num('lr', '.2e')}{eta}")
    d = pr.get("dataset") or pr.get("data")
    if d:
        lines.append(f"data: {d.get('train', '?')} training, {d.get('test', '?')} held-out examples"
                     + (f" from **{html.escape(str(d['file']))}**" if d.get("file") else ""))
    m = pr.get("metrics")
    if m and m.get("tokens_per_s"):
        lines.append(f"trained {m.get('steps')} steps in {_fmt_s(m.get('train_seconds'))} at "
                     f"{m['tokens_per_s']:.0f} tokens/s")
    if rec["state"] == "succeeded" and pr.get("model_name"):
        where = ("score responses with it below" if pr.get("kind") == "reward"
                 else "see what changed inside it below, or open it in Explore")
        lines.append(f"registered as **{html.escape(pr['model_name'])}**: {where}")
    if rec.get("error"):
        lines.append(f"⚠️ {html.escape(str(rec['error']))}")
    return "\n\n".join(lines)


# ---- what changed inside: per-token log pi / pi_ref -------------------------------------------------

def _colour(v: float, scale: float) -> str:
    t = max(-1.0, min(1.0, v / scale)) if scale > 0 else 0.0
    a = 0.08 + 0.72 * abs(t)
    return f"rgba(22,163,74,{a:.2f})" if t >= 0 else f"rgba(220,38,38,{a:.2f})"


def logratio_html(tokens: list[dict] | None) -> str:
    """Each completion token as a chip, green when training pushed it up (log π/π_ref > 0), red when
    down; the value under it and in the tooltip."""
    if not tokens:
        return ""
    scale = max((abs(t["logratio"]) for t in tokens), default=0.0) or 1.0
    chips = []
    for i, t in enumerate(tokens):
        shown = html.escape(t.get("display") or t.get("text") or "")
        tip = html.escape(f"#{i} {t.get('text', '')!r}: log π = {t['logp']:.4f}, log π_ref = {t['logp_ref']:.4f}, "
                          f"log π/π_ref = {t['logratio']:+.4f}")
        chips.append(f"<span class='pref-tok' title='{tip}' data-logratio='{t['logratio']:.6f}' "
                     f"style='display:inline-block;margin:2px;padding:2px 4px;border-radius:4px;"
                     f"background:{_colour(t['logratio'], scale)};font-family:monospace;text-align:center'>"
                     f"{shown or '&nbsp;'}<br><small>{t['logratio']:+.3f}</small></span>")
    return ("<div class='pref-logratio'>" + "".join(chips) + "</div><div style='font-size:85%;color:#6b7280'>"
            f"green: training made the token more likely (log π/π_ref &gt; 0), red: less likely; full colour at "
            f"|{scale:.3f}|</div>")


def logratio_headline(r: dict, check: dict, policy: str, reference: str) -> str:
    """The sum of the per-token values, the sequence log-ratio from separate forwards, and the check."""
    ok = check["max_abs_diff"] <= check["tolerance"]
    mark = "✓" if ok else "✗"
    return (f"**{html.escape(policy)}** vs **{html.escape(reference)}** on {len(r['tokens'])} completion tokens: "
            f"Σ_t log π/π_ref = **{r['total']:+.4f}** (log π(y|x) = {r['logp']:.4f}, log π_ref(y|x) = "
            f"{r['logp_ref']:.4f}).\n\n{mark} sum of per-token = sequence log-ratio (a plain transformers forward of "
            f"each model, {check['sequence_logratio']:+.4f}): max |diff| {check['max_abs_diff']:.2e} "
            f"(tolerance {check['tolerance']:.0e})" + ("" if ok else " — **the check failed**"))


def logratio_figure(tokens: list[dict] | None) -> go.Figure:
    if not tokens:
        return empty_figure("Pick a trained model, a prompt and a completion.", 260)
    ys = [t["logratio"] for t in tokens]
    labels = [f"{i}:{t.get('display') or t.get('text')}" for i, t in enumerate(tokens)]
    fig = go.Figure(go.Bar(x=list(range(len(ys))), y=ys, marker_color=[GREEN if y >= 0 else RED for y in ys],
                           customdata=labels, hovertemplate="%{customdata}<br>log π/π_ref %{y:+.4f}<extra></extra>"))
    fig.update_xaxes(tickmode="array", tickvals=list(range(len(ys))),
                     ticktext=[(t.get("display") or t.get("text") or "")[:8] for t in tokens], tickangle=-60)
    fig.update_yaxes(title_text="log π/π_ref", zeroline=True, zerolinecolor="#9ca3af")
    return _layout(fig, "per-token log π/π_ref of the completion", 300, showlegend=False)
