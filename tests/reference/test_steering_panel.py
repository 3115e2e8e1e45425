"""The Generate tab's steering panel on the real default model: what its two buttons return, and
that a bad value is one sentence beside the buttons while every other output keeps what it shows."""

from __future__ import annotations

import numpy as np
import pytest

from app.tabs.generate import steering_panel as P

MODEL = "smollm2-135m-instruct"
PROMPT = "Honestly, my neighbours are"
GREEDY = (0.0, 0, 1.0, 0.0, 1.0, 0)  # temperature, top-k, top-p, min-p, repetition penalty, seed


def _pair(alpha=4.0, choice="love-hate", pairs_text="", layer=6, prompt=PROMPT, targets="wonderful, great, lovely"):
    return P.run_pair(MODEL, prompt, False, choice, pairs_text, layer, alpha, 0, targets, 12, *GREEDY)


def test_steered_beside_unsteered_with_the_on_target_shift():
    info, plain, steered, msg = _pair()
    assert msg["visible"] is False
    assert plain["label"].startswith("unsteered (α = 0)") and steered["label"].startswith("steered (α = 4)")
    assert plain["value"] != steered["value"]
    # the love direction raises the kind words' log-prob (about +1.5 nats at alpha 4 on this model)
    before, after = (float(x) for x in info.split("On-target score ")[1].split(" (")[0].split(" → "))
    assert after > before + 0.5
    assert "norm" in info and "5 pairs" in info


def test_alpha_zero_steers_nothing():
    info, plain, steered, _ = _pair(alpha=0)
    assert plain["value"] == steered["value"] and "0.000 nats" in info


@pytest.mark.parametrize("kw, needle", [
    (dict(alpha="nan"), "alpha must be a finite number"),
    (dict(layer=99), "layer must be a whole number from 0 to 29"),
    (dict(choice=P.MY_PAIRS, pairs_text='{"positive": "a b"}\nnot json'), "line 1 needs non-empty"),
    (dict(choice="<script>"), "Choose a pair set"),
    (dict(prompt="  "), "Type a prompt"),
])
def test_a_bad_value_is_one_sentence_and_keeps_the_last_result(kw, needle):
    out = _pair(**kw)
    assert all(o == {"__type__": "update"} for o in out[:3]), out[:3]  # gr.skip(): nothing replaced
    assert out[3]["visible"] is True and needle in out[3]["value"]


def test_sweep_plot_and_table_follow_alpha():
    info, fig, table, msg = P.run_sweep(MODEL, PROMPT, False, "love-hate", "", 6, "-4, 0, 4", 0, "wonderful", 8,
                                        *GREEDY)
    assert msg["visible"] is False and list(table["α"]) == [-4.0, 0.0, 4.0]
    assert table["KL from unsteered"][1] == 0.0 and (table["KL from unsteered"][[0, 2]] > 0).all()
    assert table["on-target log p"][2] > table["on-target log p"][1] > table["on-target log p"][0]
    kl = [t for t in fig.data if t.name.startswith("KL")][0]
    assert list(kl.x) == [-4.0, 0.0, 4.0] and np.allclose(kl.y, table["KL from unsteered"], atol=1e-4)
    assert len(fig.data) == 3  # KL, perplexity, on-target: every panel has its line


def test_explore_with_the_vector_shows_the_steered_model(monkeypatch):
    """Explore's 'Run with the vector': the stored trace is the steered forward (layer 6's input is
    the plain run's plus alpha * v, earlier layers bit-identical, both read from the model's own
    captured forward), the status says so, the next-token distribution moves, and a trace evicted
    from the cache is re-run with the same vector."""
    import torch

    from app.shared.trace_store import STORE
    from app.tabs.explore import lens_filler
    from app.tabs.explore import tab as explore_tab
    from app.tabs.explore.state import trace_for_state

    monkeypatch.setattr(lens_filler.FILLER, "enabled", False)
    names = explore_tab.RUN_OUTPUT_NAMES
    sampling = (1.0, 0, 1.0, 0.0, 1.0)
    plain = explore_tab.run_trace(MODEL, PROMPT, False, False, 0, 0, -1, "probability", *sampling)
    out = explore_tab.run_steered_trace(MODEL, PROMPT, False, False, 0, 0, -1, "probability", *sampling,
                                        "love-hate", "", 6, 4.0, 0)
    assert len(out) == len(names) + 1 and out[-1]["visible"] is False
    state = out[names.index("state")]
    assert state["steer"]["alpha"] == 4.0 and "steered: 4·v (love-hate, 5 pairs" in out[names.index("status")]
    a, b = trace_for_state(plain[names.index("state")]), trace_for_state(state)
    vec = P.vector_for(a.lm, P.pairs_from("love-hate", ""), 6, False).vector
    for layer in range(6):
        assert torch.equal(a.resid_pre[layer], b.resid_pre[layer])
    torch.testing.assert_close(b.resid_pre[6], a.resid_pre[6] + 4.0 * vec, rtol=0, atol=1e-4)
    assert not torch.allclose(a.next_logits, b.next_logits)
    # evicted: re-run from the state, with the vector
    STORE._items.pop(state["key"])
    again = trace_for_state(state)
    assert again is not b and torch.equal(again.next_logits, b.next_logits)
    # a bad alpha: one sentence beside the button, nothing else replaced
    bad = explore_tab.run_steered_trace(MODEL, PROMPT, False, False, 0, 0, -1, "probability", *sampling,
                                        "love-hate", "", 6, "inf", 0)
    assert all(o == {"__type__": "update"} for o in bad[:-1]) and "alpha must be" in bad[-1]["value"]
