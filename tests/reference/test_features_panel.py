"""Explore's sparse-autoencoder panel on a small feature set trained here on the real default model
(model_core.interp.features, 512 tokens): the menu at the chosen token lists the features that fire there,
largest first, with the activation the autoencoder gives on the model's own captured activation;
a feature's page shows its activation on every position (equal to encoding that position's captured
activation by hand), its top contexts and its promoted tokens; bad values are one sentence."""

from __future__ import annotations

import pytest
import torch

from app.tabs.explore import features_panel as P
from app.tabs.explore import lens_filler
from app.tabs.explore import tab as explore_tab
from model_core.interp import features as F

PROMPT = "The capital of France is Paris, and the capital of Italy is"
SET = "tests-small-l6"  # tests/conftest.feature_set


@pytest.fixture(scope="module")
def trained(default_lm, feature_set):
    """The Explore state of PROMPT; the set is tests/conftest.feature_set (shared with the browser test)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(lens_filler.FILLER, "enabled", False)
    out = explore_tab.run_trace(default_lm.name, PROMPT, False, False, 0, 0, -1, "probability", 1.0, 0, 1.0, 0.0, 1.0)
    yield out[explore_tab.RUN_OUTPUT_NAMES.index("state")]
    mp.undo()


def test_features_at_the_chosen_token_and_a_feature_page(default_lm, trained):
    state = trained
    sets, msg = P.refresh_sets(state)
    assert SET in sets["choices"] and msg["visible"] is False
    quality, strip, menu, msg = P.on_prompt(state, SET, 5)
    assert "CE loss recovered" in quality and "blocks.6.hook_resid_post" in quality
    assert "features at token 5" in menu["label"] and menu["choices"]
    # the menu's activations are the autoencoder's on the model's own captured activation at position 5
    feats = F.load_features(SET)
    ids = default_lm.tokenizer(PROMPT)["input_ids"]
    x = F.capture(default_lm, feats.point(default_lm), torch.tensor([ids]))[0]  # [T, d]
    with torch.no_grad():
        pre = torch.relu(feats.sae.encoder(x[5] - feats.sae.b_dec))  # the library's encoder, by hand
    top = torch.topk(pre, feats.sae.cfg.k)
    want = [(int(i), float(v)) for v, i in zip(top.values, top.indices) if v > 0][:5]
    got = [(f, float(label.split("(")[1].split(")")[0])) for label, f in menu["choices"]]
    assert [f for f, _ in got] == [f for f, _ in want]
    assert [a for _, a in got] == pytest.approx([round(a, 2) for _, a in want], abs=0.006)
    f = menu["value"]
    title, contexts, acts, weights, hist, msg = P.open_feature(state, SET, f)
    assert f"Feature #{f}" in title and "Label (automatic)" in title and msg["visible"] is False
    # density and histogram: the counts the corpus scan kept for this feature (checked against the
    # encoder by hand in tests/reference/test_features.py), every bar of them drawn
    d = F.density(P.open_set(SET)[1], f)
    assert f"fires on **{d['density']:.3%}** of the {d['scanned']:,} tokens scanned" in title
    if d["fired"]:
        assert sum(hist.data[0].y) == d["fired"] and f"{d['fired']:,} of {d['scanned']:,}" in hist.layout.title.text
    else:
        assert "never fired" in str(hist.layout.annotations[0].text)
    assert acts.data[0].y[5] == pytest.approx(dict(want)[f], abs=1e-4)
    assert len(acts.data[0].y) == len(ids) and "promotes" in weights.layout.title.text
    assert acts.data[0].x[1] == "1:␣capital"  # token labels, byte-safe, as every other view
    # feature steering: ablating it moves the next-token distribution by the KL the page states,
    # recomputed here from the model's forward with the same clamp (model_core.interp.feature_steering)
    from model_core.interp.feature_steering import feature_edits
    from model_core.interp.interventions import last_logits

    fig, note, msg = P.clamp_feature(state, SET, f, 0)
    t = torch.tensor([ids])
    base = torch.log_softmax(last_logits(default_lm, t)[0].float(), -1)
    after = torch.log_softmax(last_logits(default_lm, t, feature_edits(default_lm, feats, f, 0.0))[0].float(), -1)
    kl = float((after.exp() * (after - base)).sum())
    assert f"{max(kl, 0.0):.4f} nats" in note and msg["visible"] is False
    assert "ablated (0)" in fig.layout.title.text and len(fig.data) == 2
    assert P.clamp_feature(state, SET, f, "inf")[-1]["visible"] is True
    # bad values: one sentence, nothing replaced
    for bad in ("abc", -1, 10**9):
        out = P.open_feature(state, SET, bad)
        assert out[0] == {"__type__": "update"} and out[-1]["visible"] is True
    out = P.on_prompt(state, "../../etc", 5)
    assert "Choose a feature set" in out[-1]["value"]
    assert P.on_prompt(state, None, 5) == tuple([{"__type__": "update"}] * 4) or \
        list(P.on_prompt(state, None, 5)) == [{"__type__": "update"}] * 4
