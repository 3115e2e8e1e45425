"""Issue 37 items 8 and 11 in real headless Chromium against the live server on the real default model.

Item 8, a 420 px phone: the prompt on its own line above Run and (nearly) the full width, every tab
button in one row that scrolls sideways (Gradio 6 would fold four of the six into a "..." menu), the
next-token chart's legend no longer squeezing the plot into a third of its width, the logit lens's
cell text not running into the next cell. Item 11: a Burmese prompt's token chips drawn with the
Noto Sans Myanmar webfont that static/fonts.css declares and app/server/main.py serves, also with
sign-in on (fonts are public; no listing, no path outside static/fonts/).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from urllib.parse import quote

import pytest
from playwright.sync_api import sync_playwright

from tests.helpers.browser import launch_browser, screenshot, wait_until

pytestmark = pytest.mark.browser
PROMPT = "The capital of France is"
BURMESE = "မြန်မာဘာသာစကား 😀 is"  # "the Myanmar language", an emoji, an English word
FONT = "noto-sans-myanmar-myanmar-400-normal.woff2"


def _box(page, sel: str) -> list[float]:
    return page.evaluate("(s) => { const r = document.querySelector(s).getBoundingClientRect();"
                         " return [r.left, r.top, r.right, r.bottom]; }", sel)


def _drawn(page, elem_id: str, timeout: float = 180) -> None:
    wait_until(lambda: page.evaluate(
        "(id) => !!(document.querySelector('#' + id + ' .js-plotly-plot') || {})._fullData", elem_id),
        timeout, f"#{elem_id} drawn")


def _legend_fits(page) -> bool:
    """The next-token chart keeps at least 60 % of its width for the bars, and its legend (if shown)
    at most a third of its height. Before issue 37 the legend, placed beside the plot, left the bars
    130 of 354 px (measured at 420 px)."""
    return page.evaluate("""() => {
        const gd = document.querySelector('#next-token .js-plotly-plot'), fl = gd && gd._fullLayout;
        if (!fl) return false;
        const lg = gd.querySelector('.legend');
        const legendOk = !fl.showlegend || !lg || lg.getBoundingClientRect().height <= fl.height / 3;
        return legendOk && fl._size.w >= 0.6 * fl.width; }""")


def test_phone_prompt_tabs_legend_and_lens_text(server):
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 420, "height": 900})
        page.goto(server.url + f"?prompt={quote(PROMPT)}")
        _drawn(page, "next-token")
        # the prompt above Run, about as wide as the page's column (the tabs' width)
        prompt, run, tabs = _box(page, "#prompt"), _box(page, "#run"), _box(page, "#tabs")
        assert prompt[3] <= run[1] + 1, (prompt, run)
        assert prompt[2] - prompt[0] >= 0.9 * (tabs[2] - tabs[0]), (prompt, tabs)
        assert run[2] - run[0] >= 0.9 * (tabs[2] - tabs[0]), (run, tabs)
        # every tab in the tab row (the same labels, in order, as Gradio's own hidden copy of them), no
        # "More tabs" menu; the row is wider than the screen and scrolls
        row = page.evaluate("""() => {
            const list = document.querySelector('#tabs [role=tablist]');
            const menu = document.querySelector('#tabs .overflow-menu button');
            return {tabs: [...list.querySelectorAll('button[role=tab]')].map(b => b.textContent.trim()),
                    all: [...document.querySelectorAll('#tabs .tab-container.visually-hidden button')]
                           .map(b => b.textContent.trim()),
                    menu: !!menu && menu.getBoundingClientRect().width > 0,
                    scroll: [list.scrollWidth, list.clientWidth]}; }""")
        assert len(row["all"]) >= 6 and row["tabs"] == row["all"], row
        assert not row["menu"], row
        assert row["scroll"][0] > row["scroll"][1], row  # six tabs do not fit 356 px: the row scrolls
        # the legend out of the bars' way (narrow.js acts every 400 ms)
        wait_until(lambda: _legend_fits(page), 20, "the next-token legend to leave the bars 60 % of the width")
        # the logit lens (6 positions, so its cells carry their top token): no cell's text over another's
        _drawn(page, "lens")
        overlaps = """() => {
            const boxes = [...document.querySelectorAll('#lens .heatmaplayer text')]
                .filter(t => t.textContent.trim()).map(t => t.getBoundingClientRect());
            let n = 0;
            for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
                const a = boxes[i], b = boxes[j];
                if (a.left < b.right - 0.5 && b.left < a.right - 0.5 && a.top < b.bottom - 0.5 && b.top < a.bottom - 0.5) n++;
            }
            return n; }"""
        wait_until(lambda: page.evaluate(overlaps) == 0, 20, "lens cell text without overlaps")
        screenshot(page, "issue37-420-explore")
        # the last tab is reachable: scrolled to and opened from the row itself
        page.locator("#tabs [role=tablist] button[role=tab]").last.click()
        wait_until(lambda: page.evaluate(
            "() => document.querySelector('#tabs [role=tablist] button[role=tab]:last-child')"
            ".getAttribute('aria-selected') === 'true'"), 10, "the last tab open")
        # wide again: the legend where the figure put it
        page.set_viewport_size({"width": 1440, "height": 900})
        page.locator("#tabs [role=tablist] button[role=tab]").first.click()
        wait_until(lambda: page.evaluate(
            "() => ((document.querySelector('#next-token .js-plotly-plot').layout.legend || {}).x) === 0.3"),
            20, "the next-token legend back at x = 0.3 (app/tabs/explore/figures.py)")
        screenshot(page, "issue37-1440-explore")
        browser.close()


def test_burmese_prompt_renders_with_the_webfont(server):
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 420, "height": 900})
        page.goto(server.url + f"?prompt={quote(BURMESE)}")
        wait_until(lambda: page.evaluate("() => [...document.querySelectorAll('.tokens')]"
                                         ".some(e => /[\\u1000-\\u109f]/.test(e.textContent))"),
                   180, "token chips with Myanmar text")
        wait_until(lambda: page.evaluate("""() => [...document.fonts].some(
                       f => f.family.replace(/["']/g, '') === 'Noto Sans Myanmar' && f.status === 'loaded')"""),
                   30, "Noto Sans Myanmar loaded")
        assert page.evaluate("() => document.fonts.check('14px \"Noto Sans Myanmar\"', 'မြန်မာ')")
        # A combining vowel sign (U+102F) takes no width of its own in a real Myanmar font; drawn as
        # the .notdef box (this machine has no Myanmar font) it adds a box as wide as a letter's.
        widths = page.evaluate("""() => {
            const chip = document.querySelector('.tokens .tok');
            const w = (text, family) => { const s = document.createElement('span');
                s.style.font = getComputedStyle(chip).font; if (family) s.style.fontFamily = family;
                s.style.whiteSpace = 'pre'; s.textContent = text; chip.parentElement.appendChild(s);
                const r = s.getBoundingClientRect().width; s.remove(); return r; };
            return {family: getComputedStyle(chip).fontFamily,
                    letter: w('က'), withSign: w('ကု'), boxLetter: w('က', 'monospace'), boxSign: w('ကု', 'monospace'),
                    prompt: getComputedStyle(document.querySelector('#prompt textarea')).fontFamily}; }""")
        assert "Noto Sans Myanmar" in widths["family"] and "Noto Sans Myanmar" in widths["prompt"], widths
        assert widths["withSign"] - widths["letter"] < 0.3 * widths["letter"], widths
        screenshot(page, "issue37-420-burmese")
        page.set_viewport_size({"width": 1440, "height": 900})
        page.wait_for_timeout(500)  # a resize only; the screenshot is for the report, nothing asserted
        screenshot(page, "issue37-1440-burmese")
        browser.close()


def _status(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers.get("content-type", "")
    except urllib.error.HTTPError as e:
        return e.code, ""


def test_font_files_are_public_and_only_those(tmp_path):
    """With sign-in on, the page's fonts are served to anyone (the login page's CSS names them too);
    the folder is not listed and no other file is reachable through the route."""
    from app.server import auth
    from tests.helpers.browser import LiveServer

    users = tmp_path / "users.txt"
    auth.write_user(users, "alice", "alice-password", iterations=2000)
    s = LiveServer(extra_env={"LMSCOPE_AUTH": "users", "LMSCOPE_USERS_FILE": str(users),
                              "LMSCOPE_DATA_DIR": str(tmp_path / "data"), "REDIS_URL": "redis://127.0.0.1:1/0"})
    try:
        base = s.url + "static/fonts/"
        assert _status(base + FONT) == (200, "font/woff2")
        assert _status(base + "OFL.txt")[0] == 200
        for bad in ("", "..%2F..%2Fapp%2Fserver%2Fmain.py", "..%2Ffonts.css", "nope.woff2"):
            code, kind = _status(base + bad)
            assert code in (403, 404), (bad, code, kind)
    finally:
        s.stop()
