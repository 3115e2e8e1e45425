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
