"""Generate's "Clamp a feature" panel (app/tabs/generate/feature_clamp_panel.py) on the real default model with the
session's small feature set (tests/conftest.feature_set).

References: `generate` without edits for the run as it is (same seed, greedy); for the clamped run, a
greedy loop written here that re-runs the whole sequence through the model's own forward with the
clamp each step (no cache, so a decode step's one-position edit in our generation is checked against
the edit applied to every position of a full forward); the next-token KL recomputed from
`last_logits` with and without the clamp."""

from __future__ import annotations

import pytest
import torch

from app.tabs.generate import feature_clamp_panel as P
from model_core.interp import features as F
from model_core.interp.feature_steering import feature_edits
from model_core.interp.interventions import last_logits
from model_core.serving.generate import generate

SET = "tests-small-l6"
PROMPT = "The capital of France is Paris, and the capital of Italy is"
GREEDY = [0.0, 0, 1.0, 0.0, 1.0, 0]  # temperature, top-k, top-p, min-p, repetition penalty, seed
N_NEW = 6


def _greedy_with_clamp(lm, feats, f, value, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, each from a full forward of the whole sequence with the clamp."""
    out = list(ids)
    for _ in range(n):
        logits = last_logits(lm, torch.tensor([out]), feature_edits(lm, feats, f, value))[0]
        out.append(int(logits.argmax()))
    return out[len(ids):]


def test_clamped_generation_next_to_the_plain_one(default_lm, feature_set):
    lm = default_lm
    sets, msg = P.refresh_sets(lm.name)
    assert SET in sets["choices"] and msg["visible"] is False
    feats = F.load_features(SET)
    ids = lm.tokenizer(PROMPT)["input_ids"]
    # the feature firing hardest at the prompt's last position, written in with a large value
    x = F.capture(lm, feats.point(lm), torch.tensor([ids]))[0]  # [T, d]
    acts, idx = F._encode(feats.sae, x[-1:])
    f, value = int(idx[0, acts[0].argmax()]), 60.0

    info, plain, clamped, msg = P.run_clamped(lm.name, PROMPT, False, SET, f, value, 1, N_NEW, *GREEDY)
    assert msg["visible"] is False, msg
    want_plain = generate(lm, PROMPT, max_new_tokens=N_NEW, seed=0)  # settings default: greedy
    assert plain["value"] == lm.tokenizer.decode(want_plain.token_ids)
    want = _greedy_with_clamp(lm, feats, f, value, ids, N_NEW)
    assert clamped["value"] == lm.tokenizer.decode(want)
    assert want != want_plain.token_ids  # the clamp changes the text, or this checks nothing
    t = torch.tensor([ids])
    base = torch.log_softmax(last_logits(lm, t)[0].float(), -1)
    after = torch.log_softmax(last_logits(lm, t, feature_edits(lm, feats, f, value))[0].float(), -1)
    kl = float((after.exp() * (after - base)).sum())
    assert f"**{kl:.4f} nats**" in info and f"#{f}" in info and "clamped to 60" in info

    # ablating it (0) is a different run, named as such
    info0, _, clamped0, _ = P.run_clamped(lm.name, PROMPT, False, SET, f, 0, 1, N_NEW, *GREEDY)
    assert "ablated (0)" in info0 and clamped0["value"] == lm.tokenizer.decode(
        _greedy_with_clamp(lm, feats, f, 0.0, ids, N_NEW))


@pytest.mark.parametrize("change, says", [
    ({"model_name": "random-llama-tiny"}, "trained on"),
    ({"feature": 10**6}, "feature number"),
    ({"feature": "x"}, "feature number"),
    ({"value": float("nan")}, "finite number"),
    ({"value": 1e9}, "finite number"),
    ({"set_name": "../../etc"}, "Choose a feature set"),
    ({"prompt": "  "}, "prompt"),
    ({"max_new": 0}, "new tokens"),
])
def test_bad_values_are_one_sentence(default_lm, feature_set, change, says):
    args = dict(model_name=default_lm.name, prompt=PROMPT, chat=False, set_name=SET, feature=3, value=5.0,
                from_pos=1, max_new=2)
    assert set(change) <= set(args)
    args.update(change)
    out = P.run_clamped(*args.values(), *GREEDY)
    assert out[:3] == tuple([{"__type__": "update"}] * 3) or list(out[:3]) == [{"__type__": "update"}] * 3
    assert out[-1]["visible"] is True and says in out[-1]["value"], out[-1]
    assert "\n" not in out[-1]["value"].strip()
