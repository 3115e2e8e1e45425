"""Issue 37 items 5, 10 and 12 in real headless Chromium against the session's live server on the real
default model: the logit lens keeps its words on a 41-position prompt (cell text drawn, a strip of
the chosen layer's words, a cell's top 10 on click); "where the chosen token looks" stops at the
query with an axis scaled to the data; a click on a head's cell in the attribution heatmap fills the
ablation's head list."""

import json
from urllib.parse import quote

import pytest
from playwright.sync_api import sync_playwright

from tests.helpers.browser import (
    ARTIFACTS,
    launch_browser,
    plot_data,
    recorded_calls,
    set_number,
    wait_title,
    wait_until,
)

pytestmark = pytest.mark.browser
# 41 tokens with SmolLM2's tokenizer (the page's legend says so; asserted below)
LONG = ("The quick brown fox jumps over the lazy dog. Then the dog wakes up and chases the fox across the green field, "
        "until both of them are tired and sleep under the old oak tree by the river")


def _layout(page, elem_id: str) -> dict:
    return json.loads(page.evaluate(
        """(id) => { const el = document.querySelector('#' + id + ' .js-plotly-plot');
                     return JSON.stringify(el && el.layout ? {x: el.layout.xaxis, y: el.layout.yaxis,
                                                              title: el.layout.title} : {}); }""", elem_id))


def _drawn_words(page) -> list[str]:
    """The lens cells' words as drawn in the SVG (the heatmap's text layer, not the tick labels)."""
    return page.evaluate("""() => [...document.querySelectorAll('#lens .js-plotly-plot g.heatmap-label text')]
                                   .map(t => t.textContent).filter(s => s.trim() !== '')""")


def _click_cell(page, elem_id: str, x, y) -> None:
    """A real mouse click on the centre of the heatmap cell at data coordinates (x, y)."""
    px, py = page.evaluate(
        """([id, x, y]) => { const gd = document.querySelector('#' + id + ' .js-plotly-plot');
               gd.scrollIntoView({block: 'center'});
               const fl = gd._fullLayout, r = gd.getBoundingClientRect();
               const xa = fl.xaxis, ya = fl.yaxis;
               return [r.left + xa._offset + xa.d2p(x), r.top + ya._offset + ya.d2p(y)]; }""", [elem_id, x, y])
    page.mouse.click(px, py)


def _lens_shot(page, name: str) -> None:
    """The lens, its top-10 box and its word strip, in one picture (artifacts/screenshots)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.locator("#lens").scroll_into_view_if_needed()
    a = page.locator("#lens").bounding_box()
    b = page.locator("#lens-strip").bounding_box()
    c = page.locator("#lens-topk").bounding_box()
    dy = page.evaluate("() => window.scrollY")  # bounding boxes are in the viewport, the clip in the page
    top = min(a["y"], c["y"]) + dy
    bottom = max(b["y"] + b["height"], c["y"] + c["height"]) + dy
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True,
                    clip={"x": 0, "y": top, "width": page.viewport_size["width"], "height": bottom - top})


def test_lens_words_strip_topk_and_bars(server):
    # the session's server records its CPU calls at start; a run waits for them (as in test_browser_explore)
    wait_until(lambda: (recorded_calls(server.url) or {}).get("waiting") == 0, 300, "the server's recordings")
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        page.goto(server.url + "?prompt=" + quote(LONG))  # a link runs its prompt by itself
        wait_until(lambda: "41 tokens" in page.inner_text("#tokens"), 120, "the 41-token strip")
        page.wait_for_selector("#lens .js-plotly-plot", timeout=60_000)
        wait_title(page, "lens", "positions 0-40, every position")

        # item 5: the cells keep their words at 41 positions (before: colour only past 32), cut to a cell
        wait_until(lambda: len(_drawn_words(page)) >= 41, 30, "words drawn in the lens cells")
        words = _drawn_words(page)
        assert any(len(w) >= 2 for w in words), words[:20]
        text = plot_data(page, "lens")[0]["text"]
        assert len(text) == 30 and len(text[0]) == 41

        # ... a strip of the chosen layer's (0 after a run) top token per position, readable words
        wait_until(lambda: page.locator("#lens-strip .lens-chip").count() == 41, 30, "the 41-word strip")
        assert "Layer 0's top guess" in page.inner_text("#lens-strip")
        set_number(page, "layer", 29)
        wait_until(lambda: "Layer 29's top guess" in page.inner_text("#lens-strip"), 30, "the strip at layer 29")
        last = page.locator("#lens-strip .lens-chip .lens-out").all_inner_texts()
        assert len(last) == 41 and sum(1 for w in last if w.strip()) >= 35

        # ... and a click on a cell shows that layer and position's top 10
        _click_cell(page, "lens", plot_data(page, "lens")[0]["x"][20], "L12")
        try:
            wait_until(lambda: "Layer 12, after position 20" in page.inner_text("#lens-topk"), 30, "the cell's top 10")
        except AssertionError as e:
            raise AssertionError(f"{e}; it shows {page.inner_text('#lens-topk')[:80]!r}") from None
        rows = page.locator("#lens-topk table.lens-topk tbody tr")
        assert rows.count() == 10
        probs = [float(rows.nth(i).locator("td.p").inner_text()) for i in range(10)]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.001
        _lens_shot(page, "lens-41-positions-1440")

        # item 10: the bars stop at the query and their axis fits the data (before: 0-1 over every key)
        set_number(page, "query", 20)
        wait_until(lambda: len(plot_data(page, "head-bars")[0]["x"]) == 21, 30, "bars over keys 0-20")
        bars = plot_data(page, "head-bars")[0]
        lay = _layout(page, "head-bars")
        assert bars["x"][-1].startswith("20:")
        assert lay["x"]["range"] == [-0.5, 20.5]
        top = max(bars["y"])
        assert lay["y"]["range"][0] == 0 and lay["y"]["range"][1] == pytest.approx(min(1.0, top * 1.12), rel=1e-3)

        # at 420 px the cells are too narrow for words: colour only, and the strip wraps its words
        page.set_viewport_size({"width": 420, "height": 900})
        wait_until(lambda: _drawn_words(page) == [], 30, "the narrow lens to drop its cell words")
        assert page.locator("#lens-strip .lens-chip").count() == 41
        _lens_shot(page, "lens-41-positions-420")
        browser.close()


def test_attribution_cell_fills_the_ablation(server):
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        page.goto(server.url + "?tab=interventions")
        page.wait_for_selector("#iv-attr", timeout=60_000)
        page.click("#iv-attr")
        page.wait_for_selector("#iv-attr-heads .js-plotly-plot", timeout=120_000)
        wait_until(lambda: len(plot_data(page, "iv-attr-heads")[:1]) == 1, 30, "the attribution heatmap")
        page.locator("#iv-attr-heads").scroll_into_view_if_needed()
        _click_cell(page, "iv-attr-heads", 2, 3)  # column 2 = head 2, row 3 = layer 3
        wait_until(lambda: "L3H2" in page.inner_text("#iv-heads"), 30, "L3H2 in the ablation's heads")
        page.click("#iv-ablate")
        wait_until(lambda: "L3H2" in page.inner_text("#iv-ablate-summary"), 60, "the ablation of L3H2")
        browser.close()
