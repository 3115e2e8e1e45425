"""The Interventions tab in real headless Chromium against a live server on the real default model:
ablate heads (multiselect), then run the starter patching example and read the heatmap."""

import time

import pytest
from playwright.sync_api import sync_playwright

from tests.helpers.browser import launch_browser, plot_data, screenshot, wait_title, wait_until

pytestmark = pytest.mark.browser
HEADS = ["L0H1", "L3H2"]


def _pick(page, elem_id, option):
    """Gradio multiselect: type into its input to filter the options, then Enter takes the match.
    Focus leaves the box first, as a user's click elsewhere does: since gradio 6.31 a click into a box
    that kept focus after Escape does not open its list again."""
    box = page.locator(f"#{elem_id} input").first
    box.blur()
    box.click()
    box.fill(option)
    page.wait_for_selector(f'ul[role=listbox] li[role=option][aria-label="{option}"]', timeout=10_000)
    box.press("Enter")
    page.keyboard.press("Escape")


def test_interventions_in_the_browser(server):
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url)
        page.get_by_role("tab", name="Interventions").click()
        page.wait_for_selector("#iv-heads", state="visible", timeout=60_000)
        assert page.locator("#iv-clean textarea").input_value() == "The Eiffel Tower is in the city of"

        # ablation: two heads switched off on the clean prompt
        for h in HEADS:
            _pick(page, "iv-heads", h)
        chips = page.inner_text("#iv-heads")
        assert all(h in chips for h in HEADS), chips
        t0 = time.time()
        page.click("#iv-ablate")
        wait_title(page, "iv-ablate-bars", "L0H1")
        t_ablate = time.time() - t0
        clean, ablated = plot_data(page, "iv-ablate-bars")[:2]
        assert clean["x"] == ablated["x"] and len(clean["y"]) == 10
        assert all(0 <= p <= 1 for p in clean["y"] + ablated["y"])
        assert clean["y"] != ablated["y"]
        assert max(abs(a - b) for a, b in zip(clean["y"], ablated["y"])) > 1e-4
        assert "Paris" in "".join(clean["x"])
        lens = plot_data(page, "iv-ablate-lens")
        assert len(lens) == 2 and len(lens[0]["y"]) == len(lens[1]["y"]) >= 30
        summary = page.inner_text("#iv-ablate-summary")
        assert "clean" in summary and "ablated" in summary
        screenshot(page, "interventions-ablation")

        # patching: the starter pair, residual stream, layers x positions; the page samples the
        # progress text as it runs (issue 15 item 10: per layer of each batch, not "0.0%" until the end)
        page.evaluate("""() => { window.ivSeen = new Set(); window.ivTimer = setInterval(() => {
            for (const el of document.querySelectorAll('#iv-patch-plot [data-testid=status-tracker]')) {
              const m = el.textContent.match(/([\\d.]+)%/); if (m) window.ivSeen.add(+m[1]); } }, 20); }""")
        t0 = time.time()
        page.click("#iv-patch")
        wait_title(page, "iv-patch-plot", "residual stream", timeout=240)
        t_patch = time.time() - t0
        seen = sorted(page.evaluate("() => { clearInterval(window.ivTimer); return [...window.ivSeen]; }"))
        assert len([p for p in seen if 0 < p < 100]) >= 8, seen  # a batch is 113 patched runs: 3 batches here
        heat = plot_data(page, "iv-patch-plot")[0]
        z = heat["z"]
        assert len(z) == 30 and len(z[0]) >= 8
        last = z[-1][-1]
        assert last is not None and 0.8 < last < 1.2, last  # patching the last position at the last layer
        first_row_not_last = [v for v in z[0][:-1] if v is not None]
        assert max(abs(v) for v in z[0][:1]) < 0.2  # the first token ("The") is the same in both prompts
        assert first_row_not_last  # real numbers, not blanks
        summary = page.inner_text("#iv-patch-summary")
        assert "Strongest cell" in summary, summary
        assert not page.locator("#iv-job-box").is_visible()  # small sweep: no job offer
        screenshot(page, "interventions-patching")
        print(f"ablation {t_ablate:.1f} s, patching {t_patch:.1f} s, {len(seen)} progress values")

        # the results shown, as files (issue 15 item 6): the ablation and the patching grid
        page.click("#iv-export")
        sel = '#iv-export-files a[data-testid="download-link"]'
        wait_until(lambda: len(page.locator(sel).all()) == 3, 60, "ablation.csv, patching.csv and results.json")
        files = {a.get_attribute("href").rsplit("/", 1)[1]: page.request.get(a.get_attribute("href")).text()
                 for a in page.locator(sel).all()}
        patch_rows = files["patching.csv"].splitlines()
        assert patch_rows[0] == "layer,position,label,value,delta,normalized" and len(patch_rows) == 1 + 30 * len(z[0])
        assert abs(float(patch_rows[-1].rsplit(",", 1)[1]) - last) < 1e-6  # the heatmap's last cell
        assert files["ablation.csv"].splitlines()[0].startswith("table,token,clean_prob,ablated_prob")
        assert '"patching"' in files["results.json"] and '"ablation"' in files["results.json"]

        # a target typed without its leading space is named, and the spaced one offered (issue 15 item 10)
        box = page.locator("#iv-target textarea, #iv-target input").first
        box.fill("Paris")
        box.blur()
        wait_until(lambda: page.locator("#iv-space-note").is_visible(), 60, "the leading-space note")
        note = page.inner_text("#iv-space-note")
        assert "'Paris' became token" in note and "“␣Paris”" in note, note
        screenshot(page, "interventions-target-without-space")
        page.click("#iv-space-fix")
        wait_until(lambda: box.input_value() == " Paris", 30, "the spaced target")
        wait_until(lambda: not page.locator("#iv-space-note").is_visible(), 30, "the note to go")

        # the link carries the tab's prompts and choices: a teammate opening it sees them (issue 15 item 5)
        wait_until(lambda: "iv_heads=L0H1%2CL3H2" in page.url and "iv_target=+Paris" in page.url, 30, "the URL")
        other = browser.new_page(viewport={"width": 1400, "height": 1000})
        other.goto(page.url)
        other.wait_for_selector("#iv-heads", state="visible", timeout=60_000)
        wait_until(lambda: all(h in other.inner_text("#iv-heads") for h in HEADS), 60, "the linked heads")
        assert other.locator("#iv-target textarea, #iv-target input").first.input_value() == " Paris"
        assert other.locator("#iv-clean textarea").input_value() == "The Eiffel Tower is in the city of"
        screenshot(other, "interventions-from-link")
        browser.close()
