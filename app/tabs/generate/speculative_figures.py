"""Figures of a speculative decoding run (pure functions of its JSON, model_core.serving.speculative
SpeculativeGeneration.to_json plus token labels): per target forward, the draft's proposals kept and
rejected and the target's own token; the generated tokens marked by who wrote them."""

from __future__ import annotations

import plotly.graph_objects as go

KEPT, REJECTED, OWN = "#16a34a", "#f87171", "#2563eb"
TOKEN_COLOURS = {"drafted, kept": "#bbf7d0", "the target's own": "#bfdbfe"}


def _hint(text: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=text, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font=dict(size=14))
    fig.update_layout(height=220, xaxis_visible=False, yaxis_visible=False, margin=dict(l=10, r=10, t=10, b=10))
    return fig


def steps_figure(run: dict | None, labels: list[str] | None = None) -> go.Figure:
    """One stacked bar per verify step (a target forward): proposals the target kept, those it
    rejected, and the one token it adds itself. `labels`: each generated token as text."""
    if not run or not run.get("steps"):
        return _hint("Press Decode: one bar per target forward, the draft's kept and rejected tokens")
    steps, labels = run["steps"], labels or []

    def text(i: int) -> str:
        return repr(labels[i]) if 0 <= i < len(labels) else "?"

    xs = list(range(1, len(steps) + 1))
    kept = [s["accepted"] for s in steps]
    rejected = [len(s["proposed"]) - s["accepted"] for s in steps]
    hover = []
    for s in steps:
        at, m = s["at"], s["accepted"]
        got = ", ".join(text(at + j) for j in range(m)) or "none"
        hover.append(f"forward at token {at}: {len(s['proposed'])} proposed, kept {m} ({got})"
                     f"<br>then the target's own {text(at + m)}")
    fig = go.Figure()
    fig.add_bar(x=xs, y=kept, name="draft, kept", marker_color=KEPT, hovertext=hover, hoverinfo="text")
    fig.add_bar(x=xs, y=rejected, name="draft, rejected", marker_color=REJECTED, hovertext=hover, hoverinfo="text")
    fig.add_bar(x=xs, y=[1] * len(steps), name="target's own", marker_color=OWN, hovertext=hover,
                hoverinfo="text")
    fig.update_layout(barmode="stack", height=300, title="Per target forward",
                      xaxis_title="target forward (after the prompt's)", yaxis_title="tokens",
                      legend=dict(orientation="h", y=1.0, yanchor="bottom", x=0), margin=dict(l=50, r=10, t=90, b=60))
    return fig


def token_marks(run: dict | None, labels: list[str]) -> list[tuple[str, str]]:
    """The generated tokens as (text, who wrote it): the first comes from the prompt's forward, then
    each step's kept proposals and the target's own token."""
    if not run:
        return []
    who = ["the target's own"] * len(labels)
    for s in run.get("steps") or []:
        for j in range(s["accepted"]):
            if s["at"] + j < len(who):
                who[s["at"] + j] = "drafted, kept"
    return list(zip(labels, who))
