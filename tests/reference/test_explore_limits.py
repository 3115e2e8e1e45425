"""The Explore tab's Run on the real default model: a one-token prompt gives valid sliders, and the
server's prompt cap is said under the prompt while every view keeps what it showed."""

import gradio as gr

from app.tabs.explore import tab as explore_tab


def test_one_token_prompt_gives_valid_sliders(default_lm):
    out = explore_tab.run_trace(default_lm.name, "Hi", False, False, 0, 0, -1, "probability", 1.0, 0, 1.0, 0.0, 1.0)
    query = out[5]
    assert query["maximum"] >= 1 and query["value"] == 0


def test_prompt_cap_comes_from_the_server_setting(default_lm, monkeypatch):
    monkeypatch.setenv("LMSCOPE_MAX_PROMPT_TOKENS", "8")
    out = explore_tab.run_trace(default_lm.name, "one two three four five six seven eight nine ten", False, False,
                                0, 0, -1, "probability", 1.0, 0, 1.0, 0.0, 1.0)
    # the sentence stands under the prompt and every view keeps what it showed (issue 15 item 4)
    msg = out[explore_tab.RUN_OUTPUT_NAMES.index("prompt_msg")]
    assert msg["visible"] and "limit is 8" in msg["value"]
    assert all(v == gr.skip() for v in out[:6])
