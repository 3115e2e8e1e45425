"""The Explore view in real headless Chromium against a live server on the real default model."""

import re

import pytest
from playwright.sync_api import sync_playwright

from tests.helpers.browser import (
    launch_browser,
    plot_data,
    plot_title,
    recorded_calls,
    screenshot,
    set_number,
    wait_title,
    wait_until,
)

pytestmark = pytest.mark.browser
PROMPT = "The animal didn't cross the street because it was too tired"


def test_explore_in_the_browser(server):
    # the server records its first buckets at start (model_core.serving.torchscript_replay), Explore's short
    # prompts among them: this run shows what a replayed forward gives
    wait_until(lambda: (recorded_calls(server.url) or {}).get("waiting") == 0, 300, "the server's recordings")
    traces_before = recorded_calls(server.url)["replays"].get("trace", 0)
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url)
        page.locator("#prompt textarea").fill(PROMPT)
        page.click("#run")
        for plot in ("head-grid", "head-big", "head-bars", "lens", "resid", "next-token", "neurons"):
            page.wait_for_selector(f"#{plot} .js-plotly-plot", timeout=120_000)
        wait_title(page, "head-grid", "Layer 0")
        assert recorded_calls(server.url)["replays"].get("trace", 0) > traces_before  # the replayed forward

        # real data: 9 heads of 12x12 attention rows summing to 1; 30 lens rows; a proper distribution
        grid = plot_data(page, "head-grid")
        assert len(grid) == 9 and len(grid[0]["z"]) == 12
        for row in grid[0]["z"]:
            assert abs(sum(row) - 1) < 1e-2
        lens = plot_data(page, "lens")[0]
        assert len(lens["y"]) == 30 and len(lens["text"][0]) == 12
        assert any(cell.strip() for row in lens["text"] for cell in row)
        resid = plot_data(page, "resid")[0]
        assert len(resid["z"]) == 31
        base, final = plot_data(page, "next-token")[:2]
        assert 0.05 < base["y"][0] <= 1 and base["y"] == sorted(base["y"], reverse=True)
        assert "tokens" in page.inner_text("#tokens") and "perplexity" in page.inner_text("#tokens")
        screenshot(page, "explore-run")

        # switch layer and head: only the views change (no new forward pass)
        set_number(page, "layer", 5)
        wait_title(page, "head-grid", "Layer 5")
        set_number(page, "head", 3)
        wait_title(page, "head-big", "Layer 5, head 3")
        assert plot_data(page, "head-grid")[0]["z"] != grid[0]["z"]

        # temperature changes the distribution shown after the settings
        set_number(page, "temperature", 2.5)
        wait_until(lambda: plot_data(page, "next-token")[1]["y"] != final["y"], 30, "the distribution to change")
        hot = plot_data(page, "next-token")[1]["y"]
        assert hot != final["y"] and hot[0] < final["y"][0]  # flatter: the top token loses mass
        screenshot(page, "explore-layer5-head3-t2.5")

        # the URL carries the view: a teammate opening it sees the same thing
        shared = page.url
        assert "layer=5" in shared and "head=3" in shared and "temperature=2.5" in shared
        other = browser.new_page(viewport={"width": 1400, "height": 1000})
        other.goto(shared)
        other.wait_for_selector("#head-big .js-plotly-plot", timeout=120_000)
        wait_title(other, "head-big", "Layer 5, head 3")
        assert other.locator("#prompt textarea").input_value() == PROMPT
        wait_until(lambda: plot_data(other, "next-token")[1:2] != [], 30, "the shared page's distribution")
        assert plot_data(other, "next-token")[1]["y"] == hot
        screenshot(other, "explore-shared-url")

        # bad input: a clear message, and the app keeps serving
        page.locator("#prompt textarea").fill("   ")
        page.click("#run")
        page.wait_for_selector("text=The prompt is empty", timeout=30_000)
        page.locator("#prompt textarea").fill("e\u0301 🦜 שלום \x07")
        page.click("#run")
        wait_until(lambda: "<0x07>" in page.inner_text("#tokens"), 60, "the odd-unicode tokens")
        assert "<0x07>" in page.inner_text("#tokens")
        assert plot_title(page, "head-grid").startswith("Layer 5")
        screenshot(page, "explore-odd-unicode")
        browser.close()


BURMESE = "မြန်မာနိုင်ငံသည် အရှေ့တောင်အာရှတွင် ရှိသည်။"


def test_every_script_and_bad_values_lose_nothing(server):
    """Issue 15 items 2 and 4: a Burmese prompt's strip shows Burmese letters, each above the byte
    tokens that spell it (not <0x..> chips); a link with ?layer=999 opens clamped with a notice; an
    empty prompt or a bad top-k says so beside its control and every view keeps what it showed."""
    from urllib.parse import quote

    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url + f"?prompt={quote(BURMESE)}&layer=999&head=4")
        page.wait_for_selector("#head-big .js-plotly-plot", timeout=120_000)
        wait_title(page, "head-big", "Layer 29, head 4")
        note = page.inner_text("#attn-note")
        assert "Layer 999 is outside" in note and "showing layer 29" in note, note
        assert page.locator("#layer input[type=number]").input_value() == "29"
        strip = page.inner_text("#tokens")
        assert "<0x" not in strip and "\ufffd" not in strip
        glyphs = page.locator("#tokens .glyph-text").all_inner_texts()
        # one per user-perceived character spelled by byte tokens: ma + medial ra is one, over 6 tokens
        assert "မ" in glyphs and glyphs[0] == "မြ" and len(glyphs) >= 20
        # every token keeps its own chip (with its byte values), under the character it helps spell
        n_tokens = int(page.inner_text("#tokens .token-legend").split(" tokens")[0])
        assert page.locator("#tokens [data-pos]").count() == n_tokens
        assert page.locator("#tokens .glyph").first.locator(".tok-part").count() == 6
        axis = plot_data(page, "head-bars")[0]["x"]  # position:token labels (the 123-token heatmaps are pooled)
        assert any("မ·1/3" in str(x) for x in axis) and not any("<0x" in str(x) for x in axis)
        screenshot(page, "explore-burmese-layer999")
        before = plot_data(page, "head-big")[0]["z"]

        # an empty prompt: the sentence under the prompt, every view as it was, no "Error" badge
        page.locator("#prompt textarea").fill("   ")
        page.click("#run")
        wait_until(lambda: page.locator("#explore-msg").is_visible()
                   and "empty" in page.inner_text("#explore-msg"), 30, "the message under the prompt")
        assert page.locator(".error").count() == 0
        assert plot_data(page, "head-big")[0]["z"] == before and "မ" in page.inner_text("#tokens")
        # a bad top-k: the sentence beside the settings, the distribution as it was
        dist = plot_data(page, "next-token")[1]["y"]
        set_number(page, "top-k", -3)
        wait_until(lambda: page.locator("#explore-sampling-msg").is_visible()
                   and "top_k" in page.inner_text("#explore-sampling-msg"), 30, "the message under top-k")
        assert plot_data(page, "next-token")[1]["y"] == dist and page.locator(".error").count() == 0
        screenshot(page, "explore-empty-prompt-bad-top-k")

        # a narrow phone screen: the Burmese strip wraps inside the page
        narrow = browser.new_page(viewport={"width": 420, "height": 900})
        narrow.goto(server.url + f"?prompt={quote(BURMESE)}")
        narrow.wait_for_selector("#tokens .glyph", timeout=120_000)
        assert narrow.evaluate("() => { const t = document.querySelector('#tokens .tokens');"
                               " return t.scrollWidth <= t.clientWidth + 1; }")
        screenshot(narrow, "explore-burmese-420")
        browser.close()


def _download(page, elem_id: str, name: str) -> bytes:
    """The bytes of the file `name` a gr.File output offers, fetched like the browser's link."""
    sel = f'#{elem_id} a[data-testid="download-link"]'
    wait_until(lambda: any(name in (a.get_attribute("href") or "") for a in page.locator(sel).all()), 60,
               f"{name} in #{elem_id}")
    href = next(a.get_attribute("href") for a in page.locator(sel).all() if name in a.get_attribute("href"))
    r = page.request.get(href)
    assert r.status == 200, (href, r.status)
    return r.body()


def _search(page) -> str:
    return page.evaluate("() => location.search")


def test_cutoffs_in_the_link_the_stage_download_and_one_glyph_per_character(server):
    """A link's epsilon goes into its box and into the stage table, a bad eta is refused with a
    sentence under the settings (and leaves the URL); eta typed later travels in the URL; the stage
    table downloads as CSV; a family emoji and a flag each stand as one character over their tokens."""
    from urllib.parse import quote

    text = "A family 👨\u200d👩\u200d👧 under the 🇲🇲 flag, and the"
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url + f"?prompt={quote(text)}&epsilon=0.0005&eta=1.5")
        page.wait_for_selector("#head-big .js-plotly-plot", timeout=180_000)
        wait_until(lambda: "epsilon" in page.inner_text("#explore-stages"), 60, "the epsilon stage in the table")
        assert page.locator("#epsilon input").input_value() == "0.0005"
        assert page.locator("#eta input").input_value() == "0"
        wait_until(lambda: page.locator("#explore-sampling-msg").is_visible()
                   and "eta=1.5 was not used" in page.inner_text("#explore-sampling-msg"), 30, "the refused eta")
        # (location.search, read in the page: page.url is a cached value that a poll loop never refreshes)
        wait_until(lambda: "epsilon=0.0005" in _search(page) and not re.search(r"[?&]eta=", _search(page)), 30,
                   "the URL to keep epsilon and drop the refused eta")
        glyphs = page.locator("#tokens .glyph-text").all_inner_texts()
        # each glyph spans its tokens' text: the leading space (shown ␣) belongs to the first token
        fam = [i for i, g in enumerate(glyphs) if g.lstrip("␣") == "👨\u200d👩\u200d👧"]
        assert len(fam) == 1 and any(g.lstrip("␣") == "🇲🇲" for g in glyphs), glyphs
        family = page.locator("#tokens .glyph").nth(fam[0])
        assert family.locator(".tok-part").count() > 5  # five code points, many byte tokens, one character
        screenshot(page, "explore-cutoffs-link-emoji-flag")
        # eta typed in the box: the distribution gets its stage, the link carries it
        set_number(page, "eta", 0.001)
        wait_until(lambda: "eta=0.001" in _search(page), 30, "eta in the URL")
        wait_until(lambda: re.search(r"(^|\s)eta(\s|$)", page.inner_text("#explore-stages")), 30, "the eta stage")
        # the stage table as CSV: the rows shown
        page.click("#export-stages")
        rows = _download(page, "export-stages-files", "stages.csv").decode().splitlines()
        assert rows[0] == "stage,removed,mass_kept" and [r.split(",")[0] for r in rows[1:]][-2:] == ["epsilon", "eta"]
        browser.close()


# ---------------------------------------------------------------------- long prompts, linked views

def _xy(page, elem_id: str, x: float, y: float, axis: str = "") -> tuple[float, float]:
    """The viewport pixel of linear coordinates (x, y) in a plot (on a category axis: the index)."""
    page.evaluate("(id) => document.querySelector('#' + id + ' .js-plotly-plot').scrollIntoView({block: 'center'})",
                  elem_id)
    return page.evaluate("""([id, x, y, n]) => { const gd = document.querySelector('#' + id + ' .js-plotly-plot');
        const xa = gd._fullLayout['xaxis' + n], ya = gd._fullLayout['yaxis' + n], r = gd.getBoundingClientRect();
        return [r.left + xa._offset + xa.l2p(x), r.top + ya._offset + ya.l2p(y)]; }""", [elem_id, x, y, axis])


def _click_cell(page, elem_id: str, x: float, y: float, axis: str = "") -> None:
    """Point at a cell like a user (Plotly reports the cell under the pointer), then click it."""
    where = {}

    def pointing() -> bool:  # the plot may be redrawn meanwhile on a busy machine: aim again each time
        try:
            where["xy"] = px, py = _xy(page, elem_id, x, y, axis)
        except Exception:  # noqa: BLE001 - mid-redraw: no plot to aim at yet
            return False
        page.mouse.move(px - 4, py)
        page.mouse.move(px, py)
        return page.evaluate(
            "(id) => (document.querySelector('#' + id + ' .js-plotly-plot')._hoverdata || []).length > 0", elem_id)

    before = _sent(page)
    for attempt in range(3):  # a view arriving late redraws the plot under the pointer: the click is lost
        wait_until(pointing, 60, f"the pointer over a cell of {elem_id}")
        page.mouse.click(*where["xy"])
        try:
            wait_until(lambda: _sent(page) != before, 5, f"the click on {elem_id} to reach the server")
            return
        except AssertionError:
            if attempt == 2:
                raise


def _sent(page) -> str:
    """The last message the page's bridge sent for a click or a dragged box."""
    return page.evaluate("() => (document.querySelector('#explore-action textarea') || {}).value || ''")


def _value(page, elem_id: str) -> str:
    return page.locator(f"#{elem_id} input[type=number]").input_value()


def _z(page, elem_id: str, i: int = 0) -> list[list[float]]:
    return plot_data(page, elem_id)[i]["z"]


def _filled(z) -> float:
    """Share of cells with a value above zero (a blank view has none)."""
    flat = [v for row in z for v in row if v is not None]
    return sum(v > 0 for v in flat) / max(1, len(flat))


def test_long_prompt_whole_and_linked(server):
    """A 600-token prompt shows whole (pooled attention, lens over every position, no blank view);
    a token chip sets the query, an overview cell and a grid head open that head, a lens cell picks
    layer and position, a dragged box zooms to single cells, the scale and zoom travel in the link
    (an out-of-range zoom is clamped with a notice)."""
    words = "the quick brown fox jumps over a lazy dog while seven curious otters watch".split()
    prompt = " ".join(words[i % len(words)] for i in range(600))
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url)
        wait_until(lambda: "parameters" in page.inner_text("#model-info"), 120, "the page to load")
        page.locator("#prompt textarea").fill(prompt)
        page.click("#run")
        wait_title(page, "head-big", "queries 0-599", 180)
        assert "600 tokens" in page.inner_text("#explore-status")

        # the whole pattern, max-pooled (the caption says so), with real weights in it
        big = plot_data(page, "head-big")[0]
        assert len(big["z"]) >= 60 and len(big["z"][0]) >= 60 and isinstance(big["x"][0], (int, float))
        assert big["y"][-1] > 590 and max(max(r) for r in big["z"]) > 0.5 and _filled(big["z"]) > 0.3
        assert "max pooling" in plot_title(page, "head-big")
        grid = plot_data(page, "head-grid")
        assert len(grid) == 9 and all(len(t["z"]) >= 16 and _filled(t["z"]) > 0.3 for t in grid)
        # the lens over the whole prompt: 30 layers, sampled columns up to the last position, each filled
        lens = plot_data(page, "lens")[0]
        assert len(lens["z"]) == 30 and len(lens["z"][0]) >= 30 and lens["x"][-1] == 599
        assert _filled(lens["z"]) == 1 and all(t for row in lens["text"] for t in row)
        assert "one column per" in plot_title(page, "lens")
        for plot in ("resid", "neurons"):
            assert _filled([[abs(v) for v in r] for r in _z(page, plot)]) > 0.9, plot
        assert "pooled" in page.inner_text("#attn-note")
        screenshot(page, "explore-600-tokens")

        # a token chip sets the query (and is outlined); the views are not cropped by it
        page.locator('#tokens [data-pos="17"]').click()
        wait_until(lambda: _value(page, "query") == "17", 30, "the query to move to the clicked chip")
        wait_title(page, "head-bars", "Where “")
        assert page.locator('#tokens [data-pos="17"]').get_attribute("class").count("tok-query") == 1
        assert "queries 0-599" in plot_title(page, "head-big") and plot_data(page, "lens")[0]["x"][-1] == 599

        # the layer x head overview: a click opens that head, and its outline follows
        page.get_by_text("Find interesting heads").click()
        wait_until(lambda: plot_data(page, "head-overview") != [], 120, "the head overview")
        _click_cell(page, "head-overview", 4, 7)
        wait_until(lambda: (_value(page, "layer"), _value(page, "head")) == ("7", "4"), 30, "layer 7, head 4")
        wait_title(page, "head-big", "Layer 7, head 4")
        shape = page.evaluate("() => document.querySelector('#head-overview .js-plotly-plot').layout.shapes[0]")
        assert (shape["x0"], shape["y0"]) == (3.5, 6.5)
        # a head of the grid opens that head
        _click_cell(page, "head-grid", 300, 300, "3")
        wait_until(lambda: _value(page, "head") == "2", 30, "head 2 from the grid")
        wait_title(page, "head-big", "Layer 7, head 2")
        # a lens cell: its layer and its position
        col = plot_data(page, "lens")[0]["x"][30]
        _click_cell(page, "lens", col, 20)
        wait_until(lambda: (_value(page, "layer"), _value(page, "query")) == ("20", str(col)), 30, "layer 20 at the cell")
        wait_title(page, "head-big", "Layer 20, head 2")

        # a box dragged on the chosen head zooms to single cells with token labels; the lens follows
        x0, y0 = _xy(page, "head-big", 480, 500)
        x1, y1 = _xy(page, "head-big", 540, 540)
        page.mouse.move(x0, y0)
        page.mouse.down()
        page.mouse.move((x0 + x1) / 2, (y0 + y1) / 2, steps=4)
        page.mouse.move(x1, y1, steps=4)
        page.mouse.up()
        wait_title(page, "head-big", "every cell shown", 30)
        zoom = page.locator("#zoom textarea, #zoom input").first.input_value()
        q0, q1 = (int(v) for v in zoom.split(",")[0].split("-"))
        k0, k1 = (int(v) for v in zoom.split(",")[1].split("-"))
        assert abs(q0 - 500) <= 2 and abs(q1 - 540) <= 2 and abs(k0 - 480) <= 2 and abs(k1 - 540) <= 2, zoom
        big = plot_data(page, "head-big")[0]
        assert big["y"][0].startswith(f"{q0}:") and len(big["y"]) == q1 - q0 + 1 and len(big["x"]) == k1 - k0 + 1
        wait_title(page, "lens", f"positions {q0}-{q1}, every position", 60)
        assert len(plot_data(page, "lens")[0]["text"][0]) == q1 - q0 + 1
        # columns not computed yet are blank and said so; the chained event fills them all in
        wait_until(lambda: "computing" not in plot_title(page, "lens"), 120, "the lens to be filled in")
        assert all(v is not None for row in _z(page, "lens") for v in row)

        # the log scale; the link carries scale and zoom
        page.get_by_label("log").check()
        wait_title(page, "head-big", "log scale")
        wait_until(lambda: "scale=log" in page.url and "zoom=" in page.url, 60, "the URL to carry scale and zoom")
        screenshot(page, "explore-600-zoomed-log")
        other = browser.new_page(viewport={"width": 1400, "height": 1000})
        other.goto(page.url)
        wait_title(other, "head-big", f"queries {q0}-{q1} × keys {k0}-{k1}", 180)
        assert "log scale" in plot_title(other, "head-big") and "Layer 20, head 2" in plot_title(other, "head-big")
        # a link whose zoom lies partly outside the prompt opens clamped, and says so
        other.goto(re.sub(r"&zoom=[^&]*", "", page.url) + "&zoom=590-900")
        wait_title(other, "head-big", "queries 590-599", 180)
        assert "clamped" in other.inner_text("#attn-note")
        screenshot(other, "explore-600-link-clamped")

        # double-click on the chosen head: the whole prompt again
        px, py = _xy(page, "head-big", 5, 5)
        page.mouse.dblclick(px, py)
        wait_title(page, "head-big", "queries 0-599", 180)  # every view of the whole prompt again, as at the start
        assert page.locator("#zoom textarea, #zoom input").first.input_value() == ""
        # a message that arrives while the last one's event runs is not lost: a click, then 50 ms
        # later a zoom, as a double-click sends them (the zoom was dropped when its event was "once")
        page.evaluate("""async () => {
            const box = document.querySelector('#explore-action textarea, #explore-action input');
            const send = (msg) => { box.value = JSON.stringify(msg);
                box.dispatchEvent(new Event('input', {bubbles: true}));
                box.dispatchEvent(new KeyboardEvent('keypress', {key: 'x', bubbles: true})); };
            send({kind: 'query', pos: 300, n: 1001});
            await new Promise((r) => setTimeout(r, 50));
            send({kind: 'zoom', rows: [0, 9], cols: [0, 9], n: 1002});
        }""")
        wait_title(page, "head-big", "queries 0-9 ", 180)
        browser.close()
