"""The Generate tab's steering panel on the real default model: what its two buttons return, and
that a bad value is one sentence beside the buttons while every other output keeps what it shows."""

from __future__ import annotations

import numpy as np
import pytest

from app import steering_panel as P

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
