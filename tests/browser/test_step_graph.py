"""Issue 42's "a graph per generated token" in real headless Chromium against the live server on the
real default model: a greedy generation in the Generate tab, one of its steps chosen, and that
step's attribution graph built under its sampling record on a transcoder set trained here
(tests/conftest.transcoder_set): the graph's prompt is the step's prefix and its target the token
the step chose, with its checks all ok. Junk from the browser is one sentence, never an error."""

from __future__ import annotations

import html
import math
import re

import pytest
from playwright.sync_api import sync_playwright

from tests.helpers.browser import ARTIFACTS, launch_browser, plot_data, plot_title, set_number, wait_until

pytestmark = pytest.mark.browser

MODEL = "smollm2-135m-instruct"


def _sentence(update) -> str:
    """The message a refused request shows (validation.show), failing when there is none."""
    assert isinstance(update, dict) and update.get("visible") is True, update
    return update["value"]


@pytest.mark.parametrize("state, step, want", [
    (None, 0, "Generate some text first"),
    ("not a dict", 0, "Generate some text first"),
    ({"model": MODEL, "ids": [1, 2], "steps": []}, 0, "Generate some text first"),
    ({"model": MODEL, "ids": [1, 2], "steps": [{"position": 1, "chosen": {"id": 2}}]}, 5, "from 0 to 0"),
    ({"model": MODEL, "ids": [1, 2], "steps": [{"position": 1, "chosen": {"id": 2}}]}, math.nan, "from 0 to 0"),
    ({"model": MODEL, "ids": [1, 2], "steps": [{"position": 1, "chosen": {"id": 2}}]}, 0.5, "from 0 to 0"),
    ({"model": MODEL, "ids": [1, 2], "steps": [{"position": 1, "chosen": {"id": 2}}]}, True, "from 0 to 0"),
    ({"model": MODEL, "ids": [1, 2], "steps": [{"position": 1, "chosen": {"id": 2}}]}, 10**12, "from 0 to 0"),
    # the record names another token than the text holds at its position: no graph toward it
    ({"model": MODEL, "ids": [1, 2], "steps": [{"position": 1, "chosen": {"id": 7}}]}, 0, "not at its place"),
    ({"model": MODEL, "ids": [1, 2], "steps": [{"position": 9, "chosen": {"id": 2}}]}, 0, "not at its place"),
    ({"model": MODEL, "ids": [1, 2], "steps": ["junk"]}, 0, "not at its place"),
    ({"model": "../no-such-model", "ids": [1, 2], "steps": [{"position": 1, "chosen": {"id": 2}}]}, 0,
     "no-such-model"),
])
def test_junk_is_one_sentence(state, step, want):
    import gradio as gr

    from app.tabs.generate.step_graph_panel import build_graph, refresh_sets

    out = build_graph(state, step, "tests-small-tc", 0.8, 0.98)
    assert all(o == gr.skip() for o in out[:3]) and want in _sentence(out[3]), out  # the views keep what they show
    assert not _sentence(out[3]).startswith("⚠️ '"), out  # a sentence, not a quoted exception
    if not isinstance(state, dict):
        menu, msg = refresh_sets(state)
        assert menu["choices"] == [] and "Generate some text first" in _sentence(msg)


def test_a_long_prefix_and_bad_thresholds_are_one_sentence(transcoder_set):
    from app.tabs.generate.step_graph_panel import build_graph

    state = {"model": MODEL, "ids": [504] * 71, "steps": [{"index": 0, "position": 70, "chosen": {"id": 504}}]}
    out = build_graph(state, 0, transcoder_set, 0.8, 0.98)
    assert "up to 64 tokens; this one has 70" in _sentence(out[3])
    for bad in (None, "x", 0, 2, math.inf, [1]):
        assert "'node threshold' must be a number" in _sentence(build_graph(state, 0, transcoder_set, bad, 0.98)[3])
    assert "Choose a transcoder set" in _sentence(build_graph(state, 0, "../../etc", 0.8, 0.98)[3])


def _chosen_id(page) -> int:
    """The chosen token's id as the step's distribution shows it (its bar is starred: "tok ★ ·id")."""
    names = plot_data(page, "gen-dist")[0]["y"]
    starred = [n for n in names if " ★ ·" in n]
    assert len(starred) == 1, names
    return int(starred[0].rsplit("·", 1)[1])


def test_the_graph_of_a_generated_step(server, transcoder_set):
    with sync_playwright() as pw:
        browser = launch_browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url)
        wait_until(lambda: "parameters" in page.inner_text("#model-info"), 120, "the page to load")
        page.locator("#prompt textarea").fill("The quick brown fox jumps over the")
        page.get_by_role("tab", name="Generate").click()
        set_number(page, "gen-max-new", 4, held=True)
        page.click("#gen-generate")
        wait_until(lambda: "finished because" in page.inner_text("#gen-status"), 180, "the greedy generation")
        prompt_len = int(re.search(r"prompt: (\d+) tokens", page.inner_text("#gen-status")).group(1))

        page.locator("#gen-tokens .token").nth(1).click()
        wait_until(lambda: "Step 1" in plot_title(page, "gen-dist"), 90, "step 1's distribution")
        # what the page shows for the step: its token, that token's probability and its id
        m = re.search(r"chose (.+) \(p = ([0-9.]+), rank", plot_title(page, "gen-dist"))
        label, shown_p = m.group(1).strip(), m.group(2)
        chosen_id = _chosen_id(page)

        page.locator("#gen-graph > button.label-wrap").click()
        page.click("#gen-graph-build")  # before a set is chosen: a sentence, nothing breaks
        wait_until(lambda: "Choose a transcoder set" in page.inner_text("#gen-graph-msg"), 60, "the sentence")
        page.click("#gen-graph-refresh")
        wait_until(lambda: transcoder_set in page.locator("#gen-graph-set input").input_value(), 60, "the set")
        # every node kept: a set trained on 2,048 tokens leaves most influence to error nodes
        page.locator("#gen-graph-node-threshold input").fill("1")
        page.click("#gen-graph-build")
        summary = page.locator("#gen-graph-summary")
        wait_until(lambda: "checks:" in summary.inner_text(), 300, "the step's graph")
        assert not page.locator("#gen-graph-msg").is_visible()
        text = summary.inner_text()
        assert "all ok" in text, text
        assert f"Step 1: the graph of its {prompt_len + 1}-token prefix" in text, text
        s = re.search(r"chose, (.+) \(id (\d+), (.+)\): p = ([0-9.]+) in the graph's forward, ([0-9.]+) in the "
                      r"step's record", text)
        assert s, text
        # the graph's target is the token the step chose, as the page shows it
        assert s.group(1).strip() == label and int(s.group(2)) == chosen_id, (text, label, chosen_id)
        # the graph's forward of the prefix gives the token the probability the generation gave it
        # (an off-by-one prefix would not)
        assert s.group(5) == shown_p and abs(float(s.group(4)) - float(shown_p)) <= 0.002, text
        checks = page.inner_text("#gen-graph-checks")
        for check in ("logit", "completeness", "pre_activations"):
            assert check in checks
        assert "FAIL" not in checks

        target = s.group(3)  # the graph's own decode of its target, repr'd
        title = plot_title(page, "gen-graph-plot")
        assert title.startswith(f"Attribution graph toward {target} (p={s.group(4)}"), (title, target)
        logit = page.evaluate("""() => { const gd = document.querySelector('#gen-graph-plot .js-plotly-plot');
            const t = gd.data.find(d => d.name === 'logit');
            return t ? [t.customdata, [].concat(t.hovertext || [], t.text || []).join(' ')] : null; }""")
        assert logit and logit[0] == ["logit"] and html.escape(target) in logit[1], logit  # its hover names it
        ticks = page.evaluate("() => document.querySelector('#gen-graph-plot .js-plotly-plot').layout.xaxis.ticktext")
        assert len(ticks) == prompt_len + 1, ticks  # one column per prefix token

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.locator("#gen-dist").scroll_into_view_if_needed()
        top, bottom = page.locator("#gen-dist").bounding_box(), page.locator("#gen-graph").bounding_box()
        y = top["y"] + page.evaluate("() => window.scrollY")
        page.screenshot(path=str(ARTIFACTS / "step-graph.png"), full_page=True,
                        clip={"x": 0, "y": y, "width": 1400, "height": bottom["y"] + bottom["height"] - top["y"]})
        browser.close()


def test_a_model_with_no_set_is_told_the_command_for_it(monkeypatch, tmp_path):
    """No set trained for the model: the refresh and the build both name the command, for this model."""
    from app.tabs.generate.step_graph_panel import build_graph, refresh_sets

    monkeypatch.setenv("LMSCOPE_DATA_DIR", str(tmp_path))  # a data folder with no sets in it
    state = {"model": "random-llama-tiny", "ids": [1, 2, 3], "steps": [{"index": 0, "position": 2, "chosen": {"id": 3}}]}
    command = "`lmscope jobs submit transcoders --model random-llama-tiny --wait`"
    menu, msg = refresh_sets(state)
    assert menu["choices"] == [] and command in _sentence(msg), msg
    out = build_graph(state, 0, None, 0.8, 0.98)
    assert "No transcoder set for random-llama-tiny yet" in _sentence(out[3]) and command in _sentence(out[3]), out
