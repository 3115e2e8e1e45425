"""What a new user meets in the first minute (issue 37 items 1-4), in real headless Chromium against
a live server on the real default model: a first visit computes by itself, a link to a model the
server lacks says so, an over-long prompt gets a sentence under it and truncation works, and the
shared Run acts on the open tab."""

import re

import pytest
from playwright.sync_api import sync_playwright

from tests.helpers.browser import launch_browser, plot_data, screenshot, wait_until

pytestmark = pytest.mark.browser
# smollm2-135m-instruct's config.json: 30 layers, 9 query heads; the example prompt is 12 tokens (the
# same count tests/browser/test_browser_explore.py checks its attention rows against)
LAYERS, HEADS, EXAMPLE_TOKENS = 30, 9, 12
_PENDING = re.compile(r"\d+(\.\d+)?s\b")


def _slider_max(page, elem_id: str) -> str:
    return page.get_attribute(f"#{elem_id} input[type=range]", "max")


def _no_error_badges(page) -> bool:
    return page.get_by_text("Error", exact=True).count() == 0 and page.locator(".toast-body").count() == 0


def _first_visit(browser, url: str, width: int) -> None:
    page = browser.new_page(viewport={"width": width, "height": 900})
    page.goto(url)
    # no click: the example prompt's views arrive, and the sliders span this model and prompt
    wait_until(lambda: plot_data(page, "head-grid") != [], 120, "the first visit's attention")
    wait_until(lambda: _slider_max(page, "query") == str(EXAMPLE_TOKENS - 1), 30, "the query slider's range")
    assert _slider_max(page, "layer") == str(LAYERS - 1) and _slider_max(page, "head") == str(HEADS - 1)
    assert len(plot_data(page, "head-grid")) == HEADS and plot_data(page, "next-token") != []
    wait_until(lambda: f"{EXAMPLE_TOKENS} tokens" in page.inner_text("#prompt-count"), 30, "the token count")
    screenshot(page, f"first-visit-{width}")
    page.close()


def test_first_visit_computes_and_a_missing_model_says_so(server):
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        for width in (1440, 420):
            _first_visit(browser, server.url, width)

        # a link to a model the server does not have: a banner, nothing computed, the name out of the URL
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        page.goto(server.url + "?model=nope&prompt=Hello+there&layer=3")
        page.wait_for_selector("#model-banner", state="visible", timeout=120_000)
        assert "no model named 'nope'" in page.inner_text("#model-banner")
        wait_until(lambda: "model=nope" not in page.url, 30, "the URL to drop model=nope")
        wait_until(lambda: "parameters" in page.inner_text("#model-info"), 120, "the model line")
        # an event still in flight shows Gradio's timer ("0.1s") in the status; what it settles on counts
        wait_until(lambda: not _PENDING.search(page.inner_text("#explore-status")), 60, "the status to settle")
        assert page.inner_text("#explore-status").strip() == "" and plot_data(page, "head-grid") == []
        assert "nope" not in page.inner_text("#model-info")
        screenshot(page, "model-missing-banner")
        browser.close()


def test_long_prompt_sentence_under_it_and_truncate(server):
    words = "a quiet river runs past the old mill where seven herons wait for the morning fish".split()
    text = " ".join(words[i % len(words)] for i in range(4000))[:20_000]
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        page.goto(server.url)
        wait_until(lambda: plot_data(page, "head-grid") != [], 120, "the first visit's attention")
        page.locator("#prompt textarea").fill(text)
        # counted as they type, in characters
        wait_until(lambda: "20,000 characters" in page.inner_text("#prompt-count"), 10, "the character count")
        page.click("#run")
        page.wait_for_selector("#explore-msg", state="visible", timeout=60_000)
        msg = page.inner_text("#explore-msg")
        assert "20,000 characters" in msg and "16,384 characters" in msg and "LMSCOPE" not in msg, msg
        assert _no_error_badges(page)
        assert plot_data(page, "head-grid") != []  # the last good views stay

        # Truncate keeps the end, whatever stage would have refused it
        page.get_by_label("Truncate prompts over 1024 tokens (keep the end)").check()
        page.click("#run")
        wait_until(lambda: "1024 tokens" in page.inner_text("#explore-status"), 120, "the truncated run")
        assert len(plot_data(page, "head-big")[0]["y"]) > 60 and plot_data(page, "head-big")[0]["y"][-1] > 1000
        assert not page.locator("#explore-msg").is_visible() and _no_error_badges(page)
        wait_until(lambda: "truncated" in page.inner_text("#prompt-count"), 30, "the count to say truncated")
        screenshot(page, "long-prompt-truncated")
        browser.close()


def test_shared_run_acts_on_the_open_tab(server):
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        page.goto(server.url + "?tab=generate")
        page.wait_for_selector("#gen-generate", state="visible", timeout=120_000)
        page.locator("#prompt textarea").fill("The capital of France is")
        page.click("#run")
        wait_until(lambda: page.locator("#gen-output textarea").input_value().strip() != "", 120, "a generation")
        assert "The capital of France is" in page.url or "tab=generate" in page.url
        # Interventions has its own prompts: the shared prompt and Run are not shown there
        page.get_by_role("tab", name="Interventions").click()
        wait_until(lambda: not page.locator("#prompt-row").is_visible(), 10, "the shared prompt to hide")
        page.get_by_role("tab", name="Explore").click()
        wait_until(lambda: page.locator("#prompt-row").is_visible(), 10, "the shared prompt back")
        browser.close()
