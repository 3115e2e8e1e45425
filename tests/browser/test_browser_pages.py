"""Issue 15 items 5-7 and 9 in real headless Chromium against the live server on the real default
model: the trace tensors and Generate's steps downloaded from the page, a neuron and a head page
opened from Explore, an Anatomy link that reproduces the panels, and a 400 px phone screen where
plots stack and table headers stay on one line."""

from __future__ import annotations

import csv
import io
import time
from urllib.parse import quote

import pytest
import torch
from playwright.sync_api import sync_playwright

from tests.helpers.browser import (
    ARTIFACTS,
    launch_browser,
    plot_data,
    plot_title,
    screenshot,
    wait_title,
    wait_until,
)

pytestmark = pytest.mark.browser
PROMPT = "The capital of France is"


def _download(page, elem_id: str, name: str) -> bytes:
    """The bytes of the file `name` a gr.File output offers, fetched like the browser's link."""
    sel = f'#{elem_id} a[data-testid="download-link"]'
    wait_until(lambda: any(name in (a.get_attribute("href") or "") for a in page.locator(sel).all()), 60,
               f"{name} in #{elem_id}")
    href = next(a.get_attribute("href") for a in page.locator(sel).all() if name in a.get_attribute("href"))
    r = page.request.get(href)
    assert r.status == 200, (href, r.status)
    return r.body()


def _shot(page, sel: str, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.locator(sel).screenshot(path=str(ARTIFACTS / f"{name}.png"))


def _click_bar(page, elem_id: str, index: int) -> None:
    """Point at bar `index` of a bar chart like a user, then click it."""
    page.evaluate("(id) => document.querySelector('#' + id + ' .js-plotly-plot').scrollIntoView({block: 'center'})",
                  elem_id)
    px, py = page.evaluate("""([id, i]) => { const gd = document.querySelector('#' + id + ' .js-plotly-plot');
        const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis, r = gd.getBoundingClientRect();
        return [r.left + xa._offset + xa.l2p(i), r.top + ya._offset + ya.l2p(gd._fullData[0].y[i] / 2)]; }""",
                           [elem_id, index])
    page.mouse.move(px - 3, py)
    page.mouse.move(px, py)
    wait_until(lambda: page.evaluate(
        "(id) => (document.querySelector('#' + id + ' .js-plotly-plot')._hoverdata || []).length > 0", elem_id),
        10, f"the pointer over a bar of {elem_id}")
    page.mouse.click(px, py)


def test_exports_unit_pages_and_anatomy_link(server, tmp_path):
    from model_core import load_trace

    t0 = time.time()
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url + f"?prompt={quote(PROMPT)}&layer=12&head=4")
        wait_title(page, "head-big", "Layer 12, head 4", timeout=180)

        # the trace itself as safetensors, loadable with one call (issue 15 item 6)
        page.click("#export-tensors")
        blob = _download(page, "export-tensors-file", ".safetensors")
        (tmp_path / "t.safetensors").write_bytes(blob)
        tr = load_trace(tmp_path / "t.safetensors")
        assert tr.model_name == "smollm2-135m-instruct" and tr.n_tokens == 5 and tr.captured_layers == list(range(30))
        assert tr.settings["layer"] == 12 and tr.settings["head"] == 4 and tr.settings["prompt"] == PROMPT
        assert tr["blocks.29.hook_resid_post"].shape == (5, 576) and tr["blocks.12.attn.hook_pattern"].shape == (9, 5, 5)
        assert torch.allclose(tr["blocks.12.attn.hook_pattern"].sum(-1), torch.ones(9, 5), atol=1e-5)
        print(f"tensors file {len(blob) / 1e6:.2f} MB")

        # a neuron opens its page from the bars of the strongest neurons (issue 15 item 9)
        first = plot_data(page, "neuron-bars")[0]["x"][0]  # "n<id>"
        _click_bar(page, "neuron-bars", 0)
        wait_until(lambda: f"Neuron L12N{first[1:]}" in page.inner_text("#unit-title"), 60, "the neuron page")
        assert page.locator("#unit-id textarea, #unit-id input").first.input_value() == f"L12N{first[1:]}"
        wait_title(page, "unit-weights", "promotes / suppresses")
        bars = plot_data(page, "unit-weights")[0]
        assert len(bars["y"]) == 20 and max(bars["x"][:10]) > 0 > min(bars["x"][10:])  # 10 promoted, 10 suppressed
        act = plot_data(page, "unit-activation")[0]
        assert len(act["y"]) == 5  # one bar per prompt token
        # no scan stored for this server yet: the page offers the background job instead of contexts
        assert page.locator("#unit-compute").is_visible() or "Top contexts:" in page.inner_text("#unit-contexts")
        _shot(page, "#unit-page", "unit-neuron")
        page.click("#unit-head")
        wait_until(lambda: "Head L12H4" in page.inner_text("#unit-title"), 60, "the head page")
        assert "attends to" in page.inner_text("#unit-ov") and "OV circuit" in plot_title(page, "unit-weights")
        _shot(page, "#unit-page", "unit-head")

        # Generate's steps as CSV + JSON: a link that generates 4 greedy tokens, then the download
        gen = browser.new_page(viewport={"width": 1400, "height": 1000})
        gen.goto(server.url + f"?tab=generate&prompt={quote(PROMPT)}&gen_max=4&gen_t=0")
        wait_until(lambda: "4 tokens, finished" in gen.inner_text("#gen-status"), 120, "the linked generation")
        gen.click("#gen-steps-export")
        rows = list(csv.DictReader(io.StringIO(_download(gen, "gen-steps-files", "steps.csv").decode())))
        assert [r["step"] for r in rows] == ["0", "1", "2", "3"] and rows[0]["rank"] == "1"  # greedy: rank 1
        assert 0 < float(rows[0]["prob"]) <= 1 and "Paris" in rows[0]["token"]
        assert b'"steps"' in _download(gen, "gen-steps-files", "generation.json")

        # an Anatomy link: the panels open and the controls set as the teammate had them (issue 15 item 5)
        an = browser.new_page(viewport={"width": 1400, "height": 1000})
        an.goto(server.url + f"?tab=anatomy&prompt={quote(PROMPT)}&an_run=1&an_open=mlp,norm,attention&an_mlp_layer=5"
                             f"&an_layer=3&an_head=2&an_norm=before%20MLP&an_top_k=7")
        wait_until(lambda: "layer 5:" in an.inner_text("#anatomy-mlp"), 180, "the linked MLP panel at layer 5")
        opened = an.evaluate("() => [...document.querySelectorAll('[id^=anatomy-] > .label-wrap, [id^=anatomy-] "
                             "> button.label-wrap')].filter(b => b.classList.contains('open')).map(b => b.parentElement.id)")
        assert set(opened) == {"anatomy-mlp", "anatomy-norm", "anatomy-attention"}, opened
        nums = an.locator("#anatomy-mlp input[type=number]").all()
        assert nums[0].input_value() == "5"
        wait_until(lambda: "Layer 3, head 2" in an.inner_text("#anatomy-attention"), 60, "the attention at L3 H2")
        screenshot(an, "anatomy-from-link")
        # and the page writes it back: a panel opened by the user joins the link
        an.locator("#anatomy-output > .label-wrap, #anatomy-output > button.label-wrap").first.click()
        wait_until(lambda: "an_open=mlp%2Cnorm%2Cattention%2Coutput" in an.url, 20, "the opened panel in the URL")
        browser.close()
    print(f"pages test {time.time() - t0:.1f} s")


def _line_height_ok(page, sel: str, text: str) -> bool:
    """The header `text` of a table under `sel` is laid out on one line (not broken letter by letter)."""
    return page.evaluate("""([sel, text]) => { const s = [...document.querySelectorAll(sel + ' th span.header')]
            .find(x => x.textContent.trim() === text && x.getBoundingClientRect().width > 0);
        if (!s) return null;
        return s.getBoundingClientRect().height <= 1.5 * parseFloat(getComputedStyle(s).lineHeight); }""", [sel, text])


def test_narrow_screen_stacks_plots_and_keeps_headers(server):
    """At 400 px (issue 15 item 7): side-by-side plots one above the other, titles within their plot,
    table headers on one line (the table scrolls sideways)."""
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 400, "height": 900})
        page.goto(server.url + f"?prompt={quote(PROMPT)}")
        wait_title(page, "head-big", "head 0", timeout=180)

        def box(i):
            return page.evaluate("(id) => { const r = document.querySelector('#' + id).getBoundingClientRect();"
                                 " return [r.left, r.top, r.right, r.bottom]; }", i)
        for a, b in (("head-big", "head-bars"), ("lens-target", "contrib"), ("neurons", "neuron-bars")):
            ba, bb = box(a), box(b)
            assert bb[1] >= ba[3] - 1 and abs(ba[0] - bb[0]) < 2, (a, ba, b, bb)  # stacked, same column
            assert ba[2] - ba[0] > 300  # each takes the width
        # titles fit their plot (wrapped onto more lines, not clipped at the edge)
        wait_until(lambda: page.evaluate("""() => ['head-grid', 'head-big', 'head-bars', 'lens'].every(id => {
            const gd = document.querySelector('#' + id + ' .js-plotly-plot'), t = gd && gd.querySelector('.gtitle');
            return t && t.getBoundingClientRect().right <= gd.getBoundingClientRect().right + 1; })"""),
                   20, "plot titles within their plots")
        screenshot(page, "narrow-400-explore")
        # wide again: each figure gets back the titles it was drawn with (shortened ones included)
        notes = """() => { const gd = document.querySelector('#head-grid .js-plotly-plot');
                          return (gd.layout.annotations || []).map(a => a.text); }"""
        narrow_notes = page.evaluate(notes)
        changed = page.evaluate("() => [...document.querySelectorAll('.js-plotly-plot')].filter(g => g.lmscopeWas).length")
        assert changed > 0 and not any("head " in n for n in narrow_notes), narrow_notes  # "▶ h3", not "▶ head 3 · kv 1"
        page.set_viewport_size({"width": 1400, "height": 1000})
        wait_until(lambda: page.evaluate("() => [...document.querySelectorAll('.js-plotly-plot')].every(g => !g.lmscopeWas)")
                   and any("head " in n for n in page.evaluate(notes)), 20, "the wide titles back")
        assert len(page.evaluate(notes)) == len(narrow_notes)
        page.set_viewport_size({"width": 400, "height": 900})
        page.goto(server.url + "?tab=jobs")
        page.wait_for_selector("#job-table th", state="attached", timeout=60_000)
        wait_until(lambda: _line_height_ok(page, "#job-table", "progress") is not None, 30, "the jobs table header")
        assert _line_height_ok(page, "#job-table", "progress") and _line_height_ok(page, "#job-table", "state")
        screenshot(page, "narrow-400-jobs")
        browser.close()


def test_a_feature_page_opens_from_a_token(server, feature_set):
    """Issue 19: a sparse-autoencoder feature set trained here (tests/conftest.feature_set: 512 tokens
    of the built-in corpus at layer 6, in the server's own data folder), read in Explore: a click on a token
    chip moves the query and the features menu follows it; the feature opens on its page with its label, top corpus
    contexts (the activating token marked), its activation on the prompt and its promoted tokens."""
    name = feature_set
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url)
        wait_until(lambda: "parameters" in page.inner_text("#model-info"), 120, "the page to load")
        page.locator("#prompt textarea").fill("The capital of France is Paris, and the capital of Italy is")
        page.click("#run")
        wait_until(lambda: "traced in" in page.inner_text("#explore-status"), 180, "the trace")
        page.locator("#features > button.label-wrap").click()
        page.click("#features-refresh")
        wait_until(lambda: name in page.locator("#features-set input").input_value(), 60, "the set chosen")
        page.click("#features-show")
        wait_until(lambda: "CE loss recovered" in page.inner_text("#features-quality"), 120, "the set's quality")
        page.locator('#tokens [data-pos="6"]').click()  # ","
        wait_until(lambda: "features at token 6" in page.inner_text("#features"), 60, "the menu at token 6")
        page.locator("#features-here input").click()
        page.keyboard.press("ArrowDown")
        page.keyboard.press("Enter")
        wait_until(lambda: page.locator("#features-number input").input_value() not in ("", "0"), 30,
                   "the feature number from the menu")
        feature = page.locator("#features-number input").input_value()
        page.click("#features-open")
        wait_until(lambda: f"Feature #{feature} of {name}" in page.inner_text("#features-title"), 120,
                   "the feature page")
        assert "Label (automatic)" in page.inner_text("#features-title")
        assert page.locator("#features-contexts b").count() >= 1  # activating tokens marked
        acts = plot_data(page, "features-acts")[0]
        assert acts["x"][6].startswith("6:") and acts["y"][6] > 0  # it fires on the clicked token
        assert "promotes" in plot_title(page, "features-weights")
        assert "tokens scanned" in page.inner_text("#features-title")  # how often it fires over the corpus
        assert "over the corpus" in plot_title(page, "features-hist") or \
            "never fired" in page.inner_text("#features-hist")
        _shot(page, "#features", "explore-feature-page")
        browser.close()
