"""The page on a narrow screen (issue 15 item 7): what CSS alone cannot do for Plotly figures.

static/lmscope.css stacks side-by-side plots below 900 px; there a plot is about 340 px wide at a
400 px window, and Plotly neither wraps a long title nor makes room for long tick labels. NARROW_JS
(static/js/narrow.js, a js-only load event installed by app/server/page.py) checks the drawn plots
every 400 ms while the window is narrower than 900 px and, once per figure Gradio draws:
- wraps a title that runs past the plot's width onto more lines (each line that is one styled span,
  such as a <sub> caption, keeps its style) and grows the top margin to hold them;
- turns on automargin for every axis, so tick labels such as "12:␣capital" are not cut;
- shortens subplot titles that overlap (the head grid's "▶ head 3 · kv 1" becomes "▶ h3"), and wraps a
  lone message (an empty chart's hint) that is wider than the plot.
Once the window is wide again, every figure it changed gets its own titles, sizes and margin back
(unless Gradio drew that plot anew meanwhile).
"""

from app.shared.page_js import page_js

NARROW_JS = page_js("narrow")  # static/js/narrow.js
