"""Explore's epsilon / eta cutoffs in the page URL (issue 15 item 5): a link's values go into their
boxes, a value the explainer cannot use is refused with one sentence (the cutoff stays off), and
after the link's own run the distribution is drawn with the cutoffs (real trace, random-weight
model; the reference is model_core.core.sampling.apply_sampling on the trace's own next-token logits)."""

from __future__ import annotations

import pytest

from app.tabs.explore import tab as explore_tab
from model_core.core.sampling import SamplingSettings, apply_sampling

MODEL = "random-llama-tiny"


@pytest.mark.parametrize("q, values, said", [
    ({}, {}, ""),
    ({"epsilon": "0.0003"}, {"epsilon": 0.0003}, ""),
    ({"epsilon": "0.001", "eta": "0.02"}, {"epsilon": 0.001, "eta": 0.02}, ""),
    ({"eta": "1.5"}, {"eta": 0}, "eta=1.5 was not used"),
    ({"epsilon": "-0.1", "eta": "0.01"}, {"epsilon": 0, "eta": 0.01}, "epsilon=-0.1 was not used"),
    ({"epsilon": "abc"}, {"epsilon": 0}, "epsilon=abc was not used"),
    ({"eta": "nan"}, {"eta": 0}, "eta=nan was not used"),
    ({"epsilon": "0"}, {"epsilon": 0.0}, ""),
])
def test_a_links_cutoffs_are_read_and_bad_ones_refused(q, values, said):
    got, note = explore_tab.cutoffs_from_query(q)
    assert got == values
    if said:
        assert said in note and note.endswith("is off.") and ("probability below 1" in note or "number" in note)
    else:
        assert note == ""


def test_after_a_run_the_cutoffs_apply_and_a_refused_value_is_said():
    out = explore_tab.run_trace(MODEL, "the quick brown fox jumps", False, False, 0, 0, -1, "probability",
                                1.0, 0, 1.0, 0.0, 1.0)
    state = out[0]
    tr = explore_tab.trace_for_state(state)
    # nothing on, nothing refused: nothing to redraw
    assert all(isinstance(v, type(explore_tab.gr.skip())) for v in
               explore_tab.cutoffs_after_run(state, 1.0, 0, 1.0, 0.0, 1.0, 0, 0, "")[:3])
    eps = float(tr.next_logits.float().softmax(-1).median())  # about half the vocabulary lies below it
    fig, rows, msg, note = explore_tab.cutoffs_after_run(state, 1.0, 0, 1.0, 0.0, 1.0, eps, 0, "")
    ref = apply_sampling(tr.next_logits, SamplingSettings(), context_ids=tr.token_ids, epsilon=eps)
    eps = next(r for r in rows if r[0] == "epsilon")
    assert eps[1] == next(s.n_removed for s in ref.stages if s.name == "epsilon") > 0
    assert note == "" and not msg.get("visible", False)
    # a link's refused value is said once the run has drawn, then forgotten
    _, note_text = explore_tab.cutoffs_from_query({"eta": "1.5"})
    _, _, msg, note = explore_tab.cutoffs_after_run(state, 1.0, 0, 1.0, 0.0, 1.0, eps, 0, note_text)
    assert msg["visible"] and "eta=1.5 was not used" in msg["value"] and note == ""
    # before any run there is nothing to draw (the run calls again)
    assert all(isinstance(v, type(explore_tab.gr.skip())) for v in
               explore_tab.cutoffs_after_run({}, 1.0, 0, 1.0, 0.0, 1.0, 0.002, 0, note_text))
