"""Head search (model_core/interp/head_search.py): the scores on constructed patterns whose answers are
known, and on the real default model against transformers' own attention weights
(output_attentions=True, eager attention)."""

from __future__ import annotations

import math

import pytest
import torch

from model_core.interp import head_search as HS


def _repeated(S: int = 6) -> list[int]:
    r = list(range(100, 100 + S))
    return [1] + r + r  # BOS, then r r


def test_a_previous_token_head_scores_zero_on_induction():
    ids = _repeated(6)
    T = len(ids)
    p = torch.zeros(1, T, T)
    p[0, 0, 0] = 1
    for i in range(1, T):
        p[0, i, i - 1] = 1
    s = HS.pattern_scores(p, ids)
    assert s["previous_token"].item() == 1.0 and s["induction"].item() == 0.0
    assert s["duplicate_token"].item() == 0.0 and s["entropy"].item() == pytest.approx(0.0, abs=1e-6)
    assert s["first_token"].item() == pytest.approx(1 / (T - 1))


def test_an_induction_head_scores_one_and_a_uniform_head_its_share():
    ids = _repeated(6)
    T, S = len(ids), 6
    p = torch.zeros(2, T, T)
    p[:, :, 0] = 1  # rows without a target look at the first token
    for i in range(S + 2, T):  # second copy from its second token: the token after the earlier occurrence
        p[0, i] = 0
        p[0, i, i - S + 1] = 1
    for i in range(T):
        p[1, i, : i + 1] = 1 / (i + 1)  # uniform over the causal window
    s = HS.pattern_scores(p, ids)
    # queries with an earlier occurrence: the second copy, i = S+1 .. T-1; the first of them (i = S+1)
    # has its target at S+2 > i, so only S-1 of the S queries can score
    assert s["induction"][0].item() == pytest.approx((S - 1) / S)
    uniform_dup = sum(1 / (i + 1) for i in range(S + 1, T)) / S
    assert s["duplicate_token"][1].item() == pytest.approx(uniform_dup)
    assert math.isnan(HS.pattern_scores(p, list(range(T)))["induction"][0].item())  # no repeated token


def test_induction_on_repeats_equals_transformers_attention_weights(default_lm_eager):
    lm = default_lm_eager
    S = 12
    got = HS.induction_on_repeats(lm, S, n=1, seed=5)  # [L, H]
    ids = HS.repeated_random(lm, S, seed=5)
    with torch.inference_mode():
        att = lm.model(input_ids=torch.tensor([ids]), output_attentions=True).attentions  # L x [1, H, T, T]
    off = len(ids) - 2 * S
    q = torch.arange(off + S + 1, len(ids))
    ref = torch.stack([a[0].float()[:, q, q - S + 1].mean(-1) for a in att])
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
    # SmolLM2 has induction heads: some head puts most of its attention on the induction target
    assert got.max() > 0.4, got.max()


def test_search_heads_on_texts(default_lm):
    texts = ["The cat sat on the mat. The cat sat on the mat again, and the dog watched the cat.",
             "short", "One two three four five six seven eight nine ten. One two three four five six."]
    seen = []
    out = HS.search_heads(default_lm, texts, n_prompts=4, max_tokens=64, repeat_length=8,
                          progress=lambda i, n: seen.append(i))
    L, H = default_lm.shape.n_layers, default_lm.shape.n_heads
    assert len(out["prompts"]) == 2 and seen == [1, 2]  # "short" has fewer than 8 tokens
    for m in HS.METRICS:
        assert len(out["metrics"][m]["mean"]) == L and len(out["metrics"][m]["mean"][0]) == H
        top = out["metrics"][m]["top"][0][0]
        assert sorted(top) == [0, 1]
    # the means are the prompts' own scores averaged
    ids = default_lm.tokenizer(texts[0])["input_ids"][:64]
    one = HS.prompt_scores(default_lm, ids)["previous_token"]
    ids2 = default_lm.tokenizer(texts[2])["input_ids"][:64]
    two = HS.prompt_scores(default_lm, ids2)["previous_token"]
    torch.testing.assert_close(torch.tensor(out["metrics"]["previous_token"]["mean"]), (one + two) / 2)
    with pytest.raises(HS.HeadSearchError, match="number of prompts"):
        HS.search_heads(default_lm, texts, n_prompts=0)
