"""One look for every figure of the page: the title, the default margins and the grey sentence an
empty figure shows instead of bare axes. The figure modules (app/tabs/*/figures.py and their
siblings) lay their figures out through `layout` and say "nothing to show yet" with `empty_figure`
(or `with_message` on a figure of their own); the template, plotly_white kept to the trace types
the page draws, is the default app/__init__.py sets once. No gradio, no model: plotly only."""

from __future__ import annotations

import plotly.graph_objects as go

TITLE_FONT = dict(size=14)
MARGIN = dict(l=50, r=20, t=40, b=40)  # room for the axis labels and a one-line title
MESSAGE_FONT = dict(size=13, color="#6b7280")


def title(text: str) -> dict:
    """A figure title as every figure shows it: left-aligned, 14 px."""
    return dict(text=text, x=0.01, font=TITLE_FONT)


def layout(fig: go.Figure, title_text: str, height: int, margin: dict | None = None, **kw) -> go.Figure:
    """Title, height and margins (MARGIN unless given) and any other layout setting, in one update."""
    fig.update_layout(title=title(title_text), height=height, margin=margin or MARGIN, **kw)
    return fig


def with_message(fig: go.Figure, message: str) -> go.Figure:
    """The figure says why it is empty (a centred grey sentence) instead of showing bare axes."""
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font=MESSAGE_FONT)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def empty_figure(message: str, height: int = 300, fig: go.Figure | None = None, **layout_kw) -> go.Figure:
    """A figure with nothing but `message` (on `fig`, else a new one), laid out by `layout` with no title."""
    return layout(with_message(fig if fig is not None else go.Figure(), message), "", height, **layout_kw)
