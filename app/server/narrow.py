"""The page on a narrow screen (issue 15 item 7, issue 37 item 8): what CSS alone cannot do for Plotly figures.

static/lmscope.css stacks side-by-side plots below 900 px; there a plot is about 340 px wide at a
400 px window, and Plotly neither wraps a long title nor makes room for long tick labels. NARROW_JS
(static/js/narrow.js, a js-only load event installed by app/server/page.py) checks the drawn plots
every 400 ms while the window is narrower than 900 px and, once per figure Gradio draws:
- wraps a title that runs past the plot's width onto more lines (each line that is one styled span,
  such as a <sub> caption, keeps its style) and grows the top margin to hold them;
- turns on automargin for every axis, so tick labels such as "12:␣capital" are not cut;
- shortens subplot titles that overlap (the head grid's "▶ head 3 · kv 1" becomes "▶ h3"), and wraps a
  lone message (an empty chart's hint) that is wider than the plot;
- moves a legend that crowds its plot (Plotly shrinks the plot to make room for one placed beside it:
  the next-token chart kept 130 of 354 px for its bars at 420 px) into a row above the plot, and turns
  it off if that row is still over a quarter of the figure's height (hover names each series);
- makes the text in heatmap cells (the logit lens's top tokens) smaller where it would run into the
  next cell, down to 7 px, else leaves it to the cell's hover.
It also scrolls the selected tab into view in the tab row, which on a narrow screen scrolls sideways
instead of folding tabs into Gradio's "..." menu (static/lmscope.css; issue 37 item 8).
Once the window is wide again, every figure it changed gets its own titles, sizes, margin, legend and cell text back
(unless Gradio drew that plot anew meanwhile).
"""

from app.shared.page_js import page_js

NARROW_JS = page_js("narrow")  # static/js/narrow.js
