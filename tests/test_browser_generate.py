"""The Generate tab in real headless Chromium on the real default model: tokens stream in, a
clicked token opens its step, a changed setting regenerates differently."""

import time

import pytest
from playwright.sync_api import sync_playwright

from browser import launch_browser, plot_title, screenshot, set_number, wait_until

pytestmark = pytest.mark.browser


def test_generate_in_the_browser(server):
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url)
        page.locator("#prompt textarea").fill("Once upon a time, in a small village,")
        page.get_by_role("tab", name="Generate").click()
        set_number(page, "gen-max-new", 40)
        out = page.locator("#gen-output textarea")
        page.click("#gen-generate")

        # tokens stream: the text grows through several intermediate lengths before it finishes
        lengths = set()
        deadline = time.time() + 120
        while time.time() < deadline:
            lengths.add(len(out.input_value()))
            if "finished because" in page.inner_text("#gen-status"):
                break
            time.sleep(0.03)
        final = out.input_value()
        assert "finished because" in page.inner_text("#gen-status")
        assert len(final) > 20 and len([n for n in lengths if 0 < n < len(final)]) >= 2, lengths
        screenshot(page, "generate-greedy")

        # clicking a generated token shows that step's distribution
        page.locator("#gen-tokens .token").nth(2).click()
        wait_until(lambda: "Step 2" in plot_title(page, "gen-dist"), 90, "step 2 distribution")
        assert "rank" in plot_title(page, "gen-dist")

        # change a setting and regenerate: sampling at a high temperature gives another text
        set_number(page, "gen-temperature", 1.5)
        page.click("#gen-generate")
        wait_until(lambda: out.input_value() != final and "finished because" in page.inner_text("#gen-status"),
                   timeout=120, what="the sampled generation")
        assert out.input_value() != final
        screenshot(page, "generate-sampled")
        browser.close()
