"""Explore's head-search panel on a real search result (model_core.interp.head_search on the tiny random
model): the map shows the chosen metric's means with the spread and top prompt on hover, a typed
head lists its top prompts best first, and opening it hands the prompt, layer and head to the run;
a bad head is one sentence and runs nothing."""

from __future__ import annotations

import numpy as np

from app.tabs.explore import head_search_panel as P
from model_core import load_model
from model_core.interp import head_search as HS

TEXTS = ["the cat sat on the mat and the cat sat on the mat again today",
         "one two three four five six seven eight one two three four five six",
         "a b c d e f g h i j k l m n o p a b c d e f g h"]


def _result():
    lm = load_model("random-llama-tiny")
    return {"job": "j1", "data": HS.search_heads(lm, TEXTS, n_prompts=3, max_tokens=32, repeat_length=6)}


def test_the_map_follows_the_metric_and_says_the_spread():
    r = _result()
    d = r["data"]
    fig = P.figure(r, "previous-token")
    z = np.asarray(fig.data[0].z, dtype=float)
    np.testing.assert_allclose(z, np.array(d["metrics"]["previous_token"]["mean"], float), rtol=1e-6)
    assert "spread over prompts" in fig.data[0].hovertemplate and "mean over 3 corpus prompts" in fig.layout.title.text
    fig = P.figure(r, "induction (repeated random tokens)")
    np.testing.assert_allclose(np.asarray(fig.data[0].z, dtype=float), np.array(d["induction_repeated"]), rtol=1e-6)
    assert "repeated random tokens" in fig.layout.title.text
    assert "No head search" in P.figure(None, "previous-token").layout.annotations[0].text


def test_a_typed_head_opens_on_its_best_prompt():
    r = _result()
    top = r["data"]["metrics"]["previous_token"]["top"][1][2]
    update, msg = P.pick_head(r, "previous-token", "L1H2")
    assert [i for _, i in update["choices"]] == top and update["value"] == top[0] and msg["visible"] is False
    prompt, layer, head, msg, go = P.open_head(r, "previous-token", " l1h2 ", None)
    assert (prompt, layer, head, go) == (r["data"]["prompts"][top[0]]["text"], 1, 2, True)
    prompt, *_ = P.open_head(r, "previous-token", "L1H2", top[-1])  # the chosen one of its top prompts
    assert prompt == r["data"]["prompts"][top[-1]]["text"]
    for bad in ("L99H0", "five", "../../etc"):
        out = P.open_head(r, "previous-token", bad, None)
        assert out[-1] is False and out[3]["visible"] is True and out[0] == {"__type__": "update"}
    # a run chained after a refused open runs nothing
    ran = []
    gate = P.run_if(lambda *a, request=None: ran.append(a) or ["ran"], 2)
    assert gate(False, "x") == [{"__type__": "update"}] * 2 and not ran
    assert gate(True, "x") == ["ran"] and ran == [("x",)]
