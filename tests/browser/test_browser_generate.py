"""The Generate tab in real headless Chromium on the real default model: tokens stream in, a
clicked token opens its step, a changed setting regenerates differently."""

import re

import pytest
from playwright.sync_api import sync_playwright

from tests.helpers.browser import (
    ARTIFACTS,
    launch_browser,
    plot_data,
    plot_title,
    screenshot,
    set_number,
    wait_until,
)

pytestmark = pytest.mark.browser


def test_generate_in_the_browser(server):
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url)
        # the page's load fills the prompt from the URL: type after it, as a user would
        wait_until(lambda: "parameters" in page.inner_text("#model-info"), 60, "the page to load")
        page.locator("#prompt textarea").fill("Once upon a time, in a small village,")
        page.get_by_role("tab", name="Generate").click()
        # 100 tokens stream for several seconds: on a busy 2-core machine a browser or server stall of a
        # second or two coalesces the updates it spans (CI once saw 40 tokens arrive as one update)
        set_number(page, "gen-max-new", 100)
        out = page.locator("#gen-output textarea")
        # tokens stream: the page itself records every length the text takes (a sampler inside the
        # browser, so a slow Playwright round trip on a busy CI machine cannot miss them)
        page.evaluate("""() => { window.__lens = []; const ta = document.querySelector('#gen-output textarea');
            window.__sampler = setInterval(() => window.__lens.push(ta.value.length), 5); }""")
        page.click("#gen-generate")
        wait_until(lambda: "finished because" in page.inner_text("#gen-status"), 120, "the greedy generation")
        lengths = set(page.evaluate("() => { clearInterval(window.__sampler); return window.__lens; }"))
        final = out.input_value()
        # a handler that answered only at the end would show the empty box and then the whole text
        assert len(final) > 20 and [n for n in lengths if 0 < n < len(final)], lengths
        screenshot(page, "generate-greedy")

        # clicking a generated token shows that step's distribution
        page.locator("#gen-tokens .token").nth(2).click()
        wait_until(lambda: "Step 2" in plot_title(page, "gen-dist"), 90, "step 2 distribution")
        assert "rank" in plot_title(page, "gen-dist")

        # change a setting and regenerate: sampling at a high temperature gives another text (shorter from
        # here on, to keep the test quick: not a prefix of the greedy one)
        set_number(page, "gen-max-new", 30)
        set_number(page, "gen-temperature", 1.5)
        page.click("#gen-generate")
        wait_until(lambda: out.input_value() != final and "finished because" in page.inner_text("#gen-status"),
                   timeout=120, what="the sampled generation")
        assert out.input_value() and not final.startswith(out.input_value())
        screenshot(page, "generate-sampled")

        # a finished generation opens at step 0 with its attention: token labels, layer 0 on top
        # (Explore's convention), never empty axes
        wait_until(lambda: "Step 0" in plot_title(page, "gen-attention"), 90, "step 0's attention")
        att = plot_data(page, "gen-attention")[0]
        assert att["x"][0].startswith("0:") and "Once" in att["x"][0] and att["y"][0] == "L0"
        y_range = page.evaluate("() => document.querySelector('#gen-attention .js-plotly-plot')._fullLayout.yaxis.range")
        assert y_range[0] > y_range[1]  # drawn top down: the first layer is the top row

        # a bad top-k runs nothing and loses nothing: the message stands under top-k, the last
        # generation stays on screen (no "Error" badge anywhere)
        sampled, status = out.input_value(), page.inner_text("#gen-status")
        set_number(page, "gen-top-k", -3)
        page.click("#gen-generate")
        wait_until(lambda: page.locator("#gen-top-k-msg").is_visible()
                   and "top_k must be" in page.inner_text("#gen-top-k-msg"), 30, "the message beside top-k")
        wait_until(lambda: page.locator("#gen-timeline .js-plotly-plot").count() == 1, 30, "the timeline")
        assert out.input_value() == sampled and page.inner_text("#gen-status") == status
        assert page.locator(".error").count() == 0
        box = page.locator("#gen-top-k").bounding_box()
        msg = page.locator("#gen-top-k-msg").bounding_box()
        assert 0 <= msg["y"] - (box["y"] + box["height"]) < 40  # right under the control
        screenshot(page, "generate-bad-top-k")
        # fixed, the message goes and the generation runs
        set_number(page, "gen-top-k", 0)
        page.click("#gen-generate")
        wait_until(lambda: not page.locator("#gen-top-k-msg").is_visible(), 60, "the message to go")
        wait_until(lambda: "finished because" in page.inner_text("#gen-status") and "Step 0" in plot_title(
            page, "gen-attention"), 120, "the third generation")

        # the link: settings and the chosen step; a teammate opening it sees the same text and step
        text = out.input_value()
        page.locator("#gen-tokens .token").nth(3).click()
        wait_until(lambda: "Step 3" in plot_title(page, "gen-dist"), 90, "step 3 distribution")
        wait_until(lambda: "gen_step=3" in page.url, 10, "the step in the URL")
        link = page.url
        assert "tab=generate" in link and "gen_max=30" in link and "gen_t=1.5" in link and "prompt=Once" in link
        other = browser.new_page(viewport={"width": 1400, "height": 1000})
        other.goto(link)
        wait_until(lambda: "finished because" in other.inner_text("#gen-status"), 180, "the linked generation")
        wait_until(lambda: "Step 3" in plot_title(other, "gen-dist"), 90, "the linked step")
        assert other.locator("#gen-output textarea").input_value() == text
        assert other.locator("#gen-temperature input[type=number]").input_value() == "1.5"
        screenshot(other, "generate-from-link")
        browser.close()


def test_beam_search_panel_in_the_browser(server):
    """The 'Beam search and contrastive search' accordion: beams drawn as a tree with their scores, the
    table with greedy beside, both check lines green; contrastive search shows each step's candidates."""
    from tests.helpers.browser import ARTIFACTS

    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url)
        wait_until(lambda: "parameters" in page.inner_text("#model-info"), 60, "the page to load")
        page.locator("#prompt textarea").fill("The best thing about living in the city is")
        page.get_by_role("tab", name="Generate").click()
        page.locator("#gen-beams > button.label-wrap").click()
        set_number(page, "gen-search-max", 12)
        page.click("#gen-search-btn")
        info = page.locator("#gen-search-info")
        wait_until(lambda: "transformers' own sequences_scores" in info.inner_text(), 180, "the beam search")
        text = info.inner_text()
        assert text.count("✓") == 2 and "✗" not in text and "Repeated 3-grams" in text, text
        tree = plot_data(page, "gen-search-tree")
        assert "4 beams from the prompt" in plot_title(page, "gen-search-tree")
        nodes = tree[1]
        # the prompt, then every beam's 12 tokens with shared prefixes drawn once: more than one beam's
        # worth, fewer than four
        assert 1 + 12 < len(nodes["x"]) < 1 + 4 * 12 and nodes["text"][0] == "prompt"
        rows = page.locator("#gen-search-table [role=grid] .virtual-row[role=row]")
        wait_until(lambda: rows.count() == 5, 30, "four beams and greedy in the table")
        assert "greedy" in rows.nth(4).inner_text()
        page.locator("#gen-beams").screenshot(path=str(ARTIFACTS / "generate-beams.png"))

        # diverse beam search: two groups of two; the groups start differently, the table says which is which
        page.locator("#gen-search-method label", has_text="diverse beam search").click()
        page.click("#gen-search-btn")
        wait_until(lambda: "diverse" in info.inner_text() and "processing" not in info.inner_text(), 180,
                   "the diverse beam search")
        wait_until(lambda: rows.count() == 5, 30, "four beams and greedy")
        groups = [rows.nth(i).locator("[role=gridcell]").nth(1).inner_text().strip() for i in range(4)]
        assert sorted(groups) == ["0", "0", "1", "1"], groups
        assert "✓" in info.inner_text() and "✗" not in info.inner_text()

        # contrastive search: one text, each step's top-k candidates, the chosen one outlined
        page.locator("#gen-search-method label", has_text="contrastive search").click()
        page.click("#gen-search-btn")
        wait_until(lambda: "contrastive" in info.inner_text() and "Contrastive search" in plot_title(
            page, "gen-search-cands"), 180, "the contrastive search")
        heat, chosen = plot_data(page, "gen-search-cands")
        assert len(heat["z"]) == 4 and len(heat["z"][0]) == 12 and len(chosen["x"]) == 12
        assert "✓" in info.inner_text() and "✗" not in info.inner_text()
        page.locator("#gen-beams").screenshot(path=str(ARTIFACTS / "generate-contrastive.png"))
        browser.close()


def test_steered_generation_in_the_browser(server):
    """The 'Steering vector' accordion: the love-hate vector at layer 6, steered beside unsteered with
    the same seed, the on-target shift in words; a bad alpha is a sentence beside the buttons and the
    two texts stay; the alpha sweep draws its three panels."""
    from tests.helpers.browser import ARTIFACTS

    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url)
        wait_until(lambda: "parameters" in page.inner_text("#model-info"), 60, "the page to load")
        page.locator("#prompt textarea").fill("Honestly, my neighbours are")
        page.get_by_role("tab", name="Generate").click()
        page.locator("#gen-steer > button.label-wrap").click()
        set_number(page, "gen-steer-max-new", 10)
        page.click("#gen-steer-btn")
        info = page.locator("#gen-steer-info")
        wait_until(lambda: "On-target score" in info.inner_text(), 180, "the steered generation")
        plain = page.locator("#gen-steer-plain textarea").input_value()
        steered = page.locator("#gen-steer-steered textarea").input_value()
        assert plain and steered and plain != steered
        before, after = (float(x) for x in info.inner_text().split("On-target score ")[1].split(" (")[0].split(" → "))
        assert after > before  # the love direction makes 'wonderful, great, lovely' likelier
        page.locator("#gen-steer").screenshot(path=str(ARTIFACTS / "generate-steered.png"))

        page.locator("#gen-steer-alpha input").fill("1e9")
        page.click("#gen-steer-btn")
        wait_until(lambda: page.locator("#gen-steer-msg").is_visible(), 30, "the message under the buttons")
        assert "alpha must be a finite number" in page.inner_text("#gen-steer-msg")
        assert page.locator("#gen-steer-steered textarea").input_value() == steered
        assert page.locator(".error").count() == 0

        page.locator("#gen-steer-alphas input, #gen-steer-alphas textarea").first.fill("-4, 0, 4")
        page.click("#gen-steer-sweep-btn")
        wait_until(lambda: "Steering vector at layer 6" in plot_title(page, "gen-steer-sweep"), 180, "the sweep")
        assert not page.locator("#gen-steer-msg").is_visible()
        panels = plot_data(page, "gen-steer-sweep")
        assert len(panels) == 3 and all(list(p["x"]) == [-4, 0, 4] for p in panels)
        screenshot(page, "generate-steering-sweep")

        # Explore with the same vector: every view is the steered model's, and the status says so
        page.get_by_role("tab", name="Explore").click()
        page.locator("#explore-steer > button.label-wrap").click()
        page.click("#explore-steer-btn")
        wait_until(lambda: "steered: 4·v (love-hate" in page.inner_text("#explore-status"), 180, "the steered trace")
        wait_until(lambda: "Logit lens" in plot_title(page, "lens"), 60, "the steered lens")
        screenshot(page, "explore-steered")
        browser.close()


def test_presence_and_frequency_penalties_in_the_browser(server):
    """The penalties set on the page change the greedy text exactly as the formula, written out by
    hand over transformers' own logits, predicts (tests/helpers/penalty_reference.py), and a link
    carries them: the teammate who opens it gets the same text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import DEFAULT
    from model_core.core.registry import REGISTRY, convert_gguf
    from tests.helpers.penalty_reference import hand_greedy

    prompt, n, presence, frequency = "I like cats. I like cats. I like cats. I like", 16, 0.5, 1.25
    path = convert_gguf(REGISTRY[DEFAULT])
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok(prompt)["input_ids"]
    plain = tok.decode(hand_greedy(hf, ids, n, 0.0, 0.0))
    want = tok.decode(hand_greedy(hf, ids, n, presence, frequency))
    assert want != plain  # the penalties change this greedy text, so the page cannot pass by ignoring them
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url)
        wait_until(lambda: "parameters" in page.inner_text("#model-info"), 60, "the page to load")
        page.locator("#prompt textarea").fill(prompt)
        page.get_by_role("tab", name="Generate").click()
        set_number(page, "gen-max-new", n)
        set_number(page, "gen-presence", presence)
        set_number(page, "gen-frequency", frequency)
        out = page.locator("#gen-output textarea")
        page.click("#gen-generate")
        wait_until(lambda: "finished because" in page.inner_text("#gen-status"), 120, "the penalised generation")
        assert out.input_value() == want, (out.input_value(), want, plain)
        wait_until(lambda: "gen_pres=0.5" in page.url and "gen_freq=1.25" in page.url, 30, "the penalties in the URL")
        screenshot(page, "generate-penalties")
        other = browser.new_page(viewport={"width": 1400, "height": 1000})
        other.goto(page.url)
        wait_until(lambda: "finished because" in other.inner_text("#gen-status"), 180, "the linked generation")
        assert other.locator("#gen-output textarea").input_value() == want
        assert other.locator("#gen-frequency input[type=number]").input_value() == "1.25"
        browser.close()


@pytest.mark.parametrize("width", [1440, 420])
def test_speculative_decoding_panel_in_the_browser(server, width):
    """The Speculative decoding accordion on the real default model: prompt lookup's tokens, shown by
    who wrote them, are transformers' own greedy tokens; the page's check against plain greedy says
    so; a cut draft with a bad layer count is one sentence beside the last result, which stays."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import DEFAULT
    from model_core.core.registry import REGISTRY, convert_gguf
    from model_core.core.tokenization import describe_tokens

    prompt, n = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n", 24
    path = convert_gguf(REGISTRY[DEFAULT])
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok(prompt)["input_ids"]
    with torch.inference_mode():
        want_ids = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    want = tok.decode(want_ids)
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": width, "height": 900})
        page.goto(server.url)
        wait_until(lambda: "parameters" in page.inner_text("#model-info"), 60, "the page to load")
        page.locator("#prompt textarea").fill(prompt)
        page.get_by_role("tab", name="Generate").click()
        page.locator("#gen-spec").get_by_text("Speculative decoding").first.click()
        set_number(page, "gen-spec-max", n, held=True)
        page.click("#gen-spec-btn")
        info = page.locator("#gen-spec-info")
        wait_until(lambda: "target forwards" in info.inner_text(), 120, "the speculative run")
        text = info.inner_text()
        assert "✓ the same tokens as plain greedy" in text, text
        chips = page.locator("#gen-spec-tokens .token")
        shown = [chips.nth(i).inner_text().strip() for i in range(chips.count())]
        # each chip is its token as every view shows one (byte-safe, "glyph·k/n" for a piece of a character)
        assert shown == [r["display"].strip() for r in describe_tokens(tok, want_ids)], (shown, want)
        kept = page.locator("#gen-spec-tokens").inner_text().count("drafted, kept")
        assert kept >= 1  # the legend names it
        m = re.search(r"kept (\d+)", text)
        assert m and int(m.group(1)) > 0, text  # the model kept 1 of 26 proposals when this was written
        wait_until(lambda: len(plot_data(page, "gen-spec-steps")) == 3, 30, "the steps chart")
        traces = plot_data(page, "gen-spec-steps")
        names = page.evaluate("() => document.querySelector('#gen-spec-steps .js-plotly-plot')._fullData.map(t => t.name)")
        assert names == ["draft, kept", "draft, rejected", "target's own"]
        assert sum(traces[0]["y"]) == int(m.group(1))
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.locator("#gen-spec").screenshot(path=str(ARTIFACTS / f"generate-speculative-{width}.png"))
        # a bad setting: one sentence where the result was; the tokens stay
        page.locator("#gen-spec-draft").get_by_text("this model's first layers").click()
        set_number(page, "gen-spec-layers", 0)
        page.click("#gen-spec-btn")
        wait_until(lambda: "from 1 to 29" in info.inner_text(), 60, "the sentence about the layers")
        assert page.locator("#gen-spec-tokens .token").count() == chips.count()
        assert page.locator(".error").count() == 0
        browser.close()


def test_dola_panel_in_the_browser(server):
    """The DoLa accordion on the real default model: the layer each token was contrasted with, as the
    page draws it, is transformers 4.55.4's own choice (tests/data/dola_transformers4.json), and the
    text beside plain greedy's is that run's text."""
    import json

    from transformers import AutoTokenizer

    from conftest import DEFAULT
    from model_core.core.registry import REGISTRY, convert_gguf
    from tests.helpers.browser import ROOT

    case = next(c for c in json.loads((ROOT / "tests/data/dola_transformers4.json").read_text())["cases"]
                if c["prompt"] == "The capital of France is" and c["dola_layers"] == "high" and not c["chat"])
    tok = AutoTokenizer.from_pretrained(convert_gguf(REGISTRY[DEFAULT]))
    want_text = tok.decode(case["token_ids"], skip_special_tokens=True)
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        page.goto(server.url)
        wait_until(lambda: "parameters" in page.inner_text("#model-info"), 60, "the page to load")
        page.locator("#prompt textarea").fill(case["prompt"])
        page.get_by_role("tab", name="Generate").click()
        page.locator("#gen-dola").get_by_text("DoLa: decoding by contrasting layers").first.click()
        page.locator("#gen-dola-layers").get_by_text("high").click()
        set_number(page, "gen-dola-max", case["max_new_tokens"])
        page.click("#gen-dola-btn")
        wait_until(lambda: "DoLa (high layers" in page.inner_text("#gen-dola-info"), 120, "the DoLa run")
        wait_until(lambda: len(plot_data(page, "gen-dola-plot")) == 2, 30, "the divergence chart")
        stars = plot_data(page, "gen-dola-plot")[1]["y"]
        assert stars == [f"L{s['premature_layer']}" for s in case["steps"]][:len(stars)] and len(stars) >= 8
        cell = page.locator("#gen-dola-info td").first.inner_text()
        assert cell.replace("↵ ", "\n").strip() == want_text.strip(), (cell, want_text)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.locator("#gen-dola").screenshot(path=str(ARTIFACTS / "generate-dola-1440.png"))
        browser.close()
