"""Pure views of the reward / DPO / GRPO / PPO jobs (tasks/preference_job.py): a job record (or the
per-token log-ratios of model_core.training.preference.token_logratios) in, a plotly Figure, a table or a
few lines of text out. No gradio, no model: app/tabs/finetune/preference_panel.py shows them.

Record schema read here: rec['preference'] = {kind, history: [{step, total, loss, tokens_per_s,
eta_s, ... per kind}], latest, groups: {step, groups: [{prompt, completions, rewards, advantages,
mean, std}]}, before, after, model_name, metrics}; rec['params'] holds the run's settings.
PPO adds samples: {step, samples: [{prompt, completion, score, tokens, kl, rewards, values, advantages,
returns}]} (the latest step's rollouts, token by token), samples_by_step at the end, reward_model, and
before/after = {n, mean_score, mean_reward, mean_length, examples: [{prompt, answer, completion, score,
reward}]}."""

from __future__ import annotations

import html
import math

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.shared import figure_style as style
from app.shared.figure_style import empty_figure

KIND_LABELS = {"reward": "reward model", "dpo": "DPO", "grpo": "GRPO", "ppo": "PPO (against a reward model)"}
BLUE, RED, GREEN, GREY, ORANGE = "#2563eb", "#dc2626", "#16a34a", "#6b7280", "#ea580c"
GROUP_COLUMNS = ["group", "prompt", "completion", "reward", "advantage"]
EVAL_COLUMNS = ["held-out", "before", "after", "change"]
PPO_EXAMPLE_COLUMNS = ["prompt", "answer", "before", "score before", "task before", "after", "score after",
                       "task after"]


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
    "ppo": ("reward-model score: mean (band: ± std over the batch)", "KL to the reference per sequence; β (right)",
            "policy loss and value loss", "clip fraction: policy ratio, value"),
}


def curves_figure(kind: str | None, history: list[dict] | None, beta: float | None = None) -> go.Figure:
    """Four small panels of the run's per-step rows, chosen by kind (see PANEL_TITLES)."""
    if kind not in PANEL_TITLES:
        return empty_figure("Submit a run or pick one to follow its curves.", 460)
    if not history:
        return empty_figure("No training step yet (loading the model and evaluating before training).", 460)
    if kind == "ppo":
        return _ppo_curves(history)
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
        _band(fig, _mean_std(history), "lo", "hi", 1, 2, "± std")
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


def _mean_std(history: list[dict]) -> list[dict]:
    """reward_mean ± reward_std per step (None where either is missing)."""
    out = []
    for r in history:
        m, sd = _num(r.get("reward_mean")), _num(r.get("reward_std"))
        ok = m is not None and sd is not None
        out.append({"step": r.get("step"), "lo": m - sd if ok else None, "hi": m + sd if ok else None})
    return out


def _ppo_curves(history: list[dict]) -> go.Figure:
    """Score of the reward model, KL with the β it was paid at, the two losses and the two clip fractions."""
    fig = make_subplots(rows=2, cols=2, subplot_titles=PANEL_TITLES["ppo"], vertical_spacing=0.2,
                        horizontal_spacing=0.12, specs=[[{}, {"secondary_y": True}], [{}, {}]])
    _band(fig, _mean_std(history), "lo", "hi", 1, 1, "± std")
    _line(fig, history, "reward_mean", "reward-model score", GREEN, 1, 1)
    _line(fig, history, "kl", "KL (nats / sequence)", RED, 1, 2)
    x, y = _series(history, "beta")
    if x:  # β is orders of magnitude below the KL: its own axis
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name="β", line=dict(color=GREY, dash="dot"),
                                 marker=dict(size=4)), row=1, col=2, secondary_y=True)
        fig.update_yaxes(title_text="β", rangemode="tozero", row=1, col=2, secondary_y=True)
    _line(fig, history, "policy_loss", "policy loss", BLUE, 2, 1)
    _line(fig, history, "value_loss", "value loss", ORANGE, 2, 1, dash="dash")
    _line(fig, history, "clip_fraction", "policy clip fraction", BLUE, 2, 2)
    _line(fig, history, "value_clip_fraction", "value clip fraction", ORANGE, 2, 2, dash="dash")
    fig.update_yaxes(range=[-0.05, 1.05], row=2, col=2)
    fig.update_xaxes(title_text="step", row=2)
    _integer_steps(fig, history)
    for ann in fig.layout.annotations:
        ann.font = dict(size=12)
    return _layout(fig, f"{KIND_LABELS['ppo']}: training curves", 560)


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


# ---- PPO's latest rollouts, token by token ---------------------------------------------------------

PPO_TOKEN_KEYS = ("rewards", "values", "advantages", "returns", "kl")


def ppo_samples(pr: dict | None) -> dict | None:
    """The latest step's rollouts: {step, samples}; a finished run's last entry of samples_by_step."""
    pr = pr or {}
    by_step = pr.get("samples_by_step")
    if isinstance(by_step, list) and by_step and isinstance(by_step[-1], dict):
        return by_step[-1]
    return pr.get("samples") if isinstance(pr.get("samples"), dict) else None


def _per_token(sample: dict, key: str, n: int) -> list[float | None]:
    vals = list(sample.get(key) or [])[:n]
    return [_num(v) for v in vals] + [None] * (n - len(vals))


def ppo_tokens_figure(samples: dict | None) -> go.Figure:
    """One row per rollout, one cell per completion token, coloured by its advantage (green: pushed up,
    red: pushed down); the token in the cell and, on hover, its reward, value, advantage, return and KL."""
    rows = [s for s in (samples or {}).get("samples") or [] if s.get("tokens")]
    if not rows:
        return empty_figure("PPO runs show their latest rollouts here, each token coloured by its advantage.", 260)
    width = max(len(s["tokens"]) for s in rows)
    z, text, custom, labels = [], [], [], []
    for i, s in enumerate(rows):
        n = len(s["tokens"])
        adv = _per_token(s, "advantages", n)
        z.append(adv + [None] * (width - n))
        text.append([str(t) for t in s["tokens"]] + [""] * (width - n))
        cols = [_per_token(s, k, n) for k in PPO_TOKEN_KEYS]
        cells = [[("–" if c[j] is None else f"{c[j]:+.4f}") for c in cols] + [str(s["tokens"][j])] for j in range(n)]
        custom.append(cells + [["", "", "", "", "", ""]] * (width - n))
        score = _num(s.get("score"))
        labels.append(f"#{i + 1} score {score:+.2f}" if score is not None else f"#{i + 1}")
    scale = max((abs(v) for r in z for v in r if v is not None), default=0.0) or 1.0
    fig = go.Figure(go.Heatmap(
        z=z, x=list(range(width)), y=labels, text=text, texttemplate="%{text}", textfont=dict(size=11),
        customdata=custom, zmin=-scale, zmax=scale, zmid=0,
        colorscale=[[0, RED], [0.5, "#f9fafb"], [1, GREEN]], colorbar=dict(title="advantage", thickness=12),
        hovertemplate=("token %{x} %{customdata[5]}<br>reward %{customdata[0]}<br>value %{customdata[1]}"
                       "<br>advantage %{customdata[2]}<br>return %{customdata[3]}<br>KL %{customdata[4]}"
                       "<extra>%{y}</extra>"), xgap=2, ygap=2))
    fig.update_xaxes(title_text="completion token", tickmode="linear", dtick=1 if width <= 24 else 4)
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, f"rollouts of step {(samples or {}).get('step', '?')}: tokens coloured by advantage",
                   max(220, 80 + 46 * len(rows)), showlegend=False)


def ppo_samples_caption(samples: dict | None) -> str:
    rows = (samples or {}).get("samples") or []
    if not rows:
        return "_PPO runs show their latest rollouts here, token by token._"
    return (f"Rollouts sampled at step **{samples.get('step')}** ({len(rows)} shown). Each token's reward is "
            "−β·KL to the reference, plus the reward model's score on the last token; the value head predicts the "
            "return, and the advantage (GAE, whitened) is how much better the token did than predicted: PPO pushes "
            "green tokens up and red ones down. Hover a token for its reward, value, advantage, return and KL.")


# ---- held-out before / after -------------------------------------------------------------------

EVAL_KEYS = {
    "dpo": [("logp_accuracy", "log-prob accuracy: log π(chosen) > log π(rejected)"),
            ("logp_margin", "log-prob margin (mean)"), ("accuracy", "implicit-reward accuracy"),
            ("margin", "implicit-reward margin β·Δ")],
    "reward": [("accuracy", "accuracy: score(chosen) > score(rejected)"), ("margin", "score margin (mean)"),
               ("score_chosen", "mean score of chosen"), ("score_rejected", "mean score of rejected")],
    "grpo": [("mean_reward", "mean verifiable reward (greedy)"), ("mean_length", "mean completion length")],
    "ppo": [("mean_score", "reward-model score (greedy, mean): what PPO maximises"),
            ("mean_reward", "task score: verifiable reward (greedy, mean)"),
            ("mean_length", "mean completion length")],
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


def ppo_examples_table(before: dict | None, after: dict | None) -> pd.DataFrame:
    """Held-out prompts side by side: the greedy answer before and after, each with the reward model's
    score and the task score (matched by prompt, in the order evaluated)."""
    b_ex = list((before or {}).get("examples") or [])
    a_by = {}
    for e in (after or {}).get("examples") or []:
        a_by.setdefault(e.get("prompt"), e)
    prompts = [e.get("prompt") for e in b_ex] + [p for p in a_by if p not in {e.get("prompt") for e in b_ex}]
    b_by = {e.get("prompt"): e for e in b_ex}

    def r(v):
        v = _num(v)
        return "–" if v is None else round(v, 3)

    rows = []
    for p in prompts:
        b, a = b_by.get(p) or {}, a_by.get(p) or {}
        rows.append([p, b.get("answer", a.get("answer", "")), b.get("completion", "–"), r(b.get("score")),
                     r(b.get("reward")), a.get("completion", "–"), r(a.get("score")), r(a.get("reward"))])
    return pd.DataFrame(rows, columns=PPO_EXAMPLE_COLUMNS)


def ppo_gaming_note(before: dict | None, after: dict | None) -> str:
    """One sentence: did the reward-model score and the task score move together?"""
    sb, sa = _num((before or {}).get("mean_score")), _num((after or {}).get("mean_score"))
    tb, ta = _num((before or {}).get("mean_reward")), _num((after or {}).get("mean_reward"))
    if None in (sb, sa, tb, ta):
        return ("_PPO maximises the reward model's score, not the task: the held-out table puts the two side by side "
                "once the run has evaluated after training._")
    ds, dt = sa - sb, ta - tb
    if ds > 0 and dt < 0:
        verdict = ("while the task score **fell**: the policy learned to please the reward model rather than to "
                   "solve the task (reward hacking).")
    elif ds > 0 and abs(dt) < 1e-9:
        verdict = "while the task score did not move: the gain is the reward model's, not the task's."
    elif ds > 0:
        verdict = "and the task score rose too: here the reward model and the task agree."
    else:
        verdict = "and the task score moved by the amount shown: PPO did not raise what it optimises."
    return (f"**Reward-model score {sb:.3f} → {sa:.3f} ({ds:+.3f}), task score {tb:.3f} → {ta:.3f} ({dt:+.3f})** "
            + verdict)


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
    if kind == "ppo" and p.get("reward_model"):
        bits.append(f"RM {p['reward_model']}")
    if kind in ("dpo", "grpo", "ppo") and p.get("beta") is not None:
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
        what = (f"score {num('reward_mean', '+.3f')} · KL {num('kl', '.3f')} · β {num('beta', '.3g')} · policy loss "
                f"{num('policy_loss', '.4f')}" if rec.get("kind") == "ppo" else f"loss {num('loss', '.4f')}")
        lines.append(f"step {last.get('step')}/{last.get('total')} · {what} · "
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
    rm = pr.get("reward_model") or (rec.get("params") or {}).get("reward_model")
    if rec.get("kind") == "ppo" and rm:
        lines.append(f"reward model: **{html.escape(str(rm))}**")
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
