"""lmscope's Gradio UI: layout in app/server/page.py, one module per tab (build(shared)), figures as pure
functions in app/tabs/*/*figures.py, laid out alike by app/shared/figure_style.py."""

import plotly.graph_objects as _go
import plotly.io as _pio

# One look for every figure: plotly_white, set as the default rather than passed to each figure
# (template= costs ~10 ms of validation apiece). Every new Figure validates a copy of the default
# template, and plotly_white styles 24 trace types; kept to the five the page draws (its layout
# whole), a Figure() costs 0.5 instead of 1.6 ms, which an H200 serving 32 users spent ~20% of the
# web process on. tests/unit/test_house_rules.py checks every trace type the app draws is kept.
TRACE_TYPES = ("bar", "heatmap", "histogram", "scatter", "scattergl")
_white = _pio.templates["plotly_white"]
_pio.templates["lmscope"] = _go.layout.Template(layout=_white.layout, data={t: _white.data[t] for t in TRACE_TYPES})
_pio.templates.default = "lmscope"
