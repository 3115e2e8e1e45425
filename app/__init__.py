"""lmscope's Gradio UI: layout in app/server/page.py, one module per tab (build(shared)), figures as pure
functions in app/tabs/*/*figures.py, laid out alike by app/shared/figure_style.py."""

import plotly.io as _pio

# One look for every figure. Set as the default rather than per figure: passing template= to each
# figure costs ~10 ms of validation apiece, a default is applied only when serialised.
_pio.templates.default = "plotly_white"
