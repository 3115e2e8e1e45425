"""The Explore view in real headless Chromium against a live server on the real default model."""


import pytest
from playwright.sync_api import sync_playwright

from browser import launch_browser, plot_data, plot_title, screenshot, set_number, wait_title, wait_until

pytestmark = pytest.mark.browser
PROMPT = "The animal didn't cross the street because it was too tired"


def test_explore_in_the_browser(server):
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url)
        page.locator("#prompt textarea").fill(PROMPT)
        page.click("#run")
        for plot in ("head-grid", "head-big", "head-bars", "lens", "resid", "next-token", "neurons"):
            page.wait_for_selector(f"#{plot} .js-plotly-plot", timeout=120_000)
        wait_title(page, "head-grid", "Layer 0")

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
        assert "မ" in glyphs and len(glyphs) >= 30  # one per Burmese letter spelled by byte tokens
        # every token keeps its own chip (with its byte values), under the letter it helps spell
        n_tokens = int(page.inner_text("#tokens .token-legend").split(" tokens")[0])
        assert page.locator("#tokens [data-pos]").count() == n_tokens
        assert page.locator("#tokens .glyph").first.locator(".tok-part").count() == 3
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
