"""Every sampling stage equals the transformers logits processor of the same name (reference),
on random logits and on the real model's logits."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from model_core import trace
from model_core.core.errors import SettingsError
from model_core.core.sampling import SamplingSettings, apply_sampling

SETTINGS = [
    SamplingSettings(),
    SamplingSettings(temperature=0.7, top_k=50),
    SamplingSettings(temperature=1.3, top_p=0.9),
    SamplingSettings(temperature=0.5, min_p=0.1),
    SamplingSettings(temperature=1.0, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.3),
    SamplingSettings(temperature=2.0, top_k=1),
    SamplingSettings(top_p=0.01),
]


def _reference_stages(logits, s, context):
    ids = torch.tensor([context])
    x = logits[None].clone()
    out = {}
    x = RepetitionPenaltyLogitsProcessor(s.repetition_penalty)(ids, x) if s.repetition_penalty != 1 else x
    out["repetition_penalty"] = x[0]
    x = TemperatureLogitsWarper(s.temperature)(ids, x) if s.temperature != 1 else x
    out["temperature"] = x[0]
    x = TopKLogitsWarper(s.top_k)(ids, x) if s.top_k > 0 else x
    out["top_k"] = x[0]
    x = TopPLogitsWarper(s.top_p)(ids, x) if s.top_p < 1 else x
    out["top_p"] = x[0]
    x = MinPLogitsWarper(s.min_p)(ids, x) if s.min_p > 0 else x
    out["min_p"] = x[0]
    return out


def _check(logits, context):
    for s in SETTINGS:
        res = apply_sampling(logits, s, context_ids=context)
        ref = _reference_stages(logits, s, context)
        for stage in res.stages[1:]:
            assert torch.equal(stage.logits, ref[stage.name]), (s, stage.name)
        torch.testing.assert_close(res.probs, torch.softmax(ref["min_p"], -1))
        assert abs(float(res.probs.sum()) - 1) < 1e-5


def test_stages_equal_transformers_processors_on_random_logits():
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = torch.randn(1000, generator=g) * 3
        context = torch.randint(0, 1000, (12,), generator=g).tolist()
        _check(logits, context)


def test_stages_equal_transformers_processors_on_real_logits(default_lm):
    tr = trace(default_lm, "The capital of France is the city of")
    _check(tr.next_logits.float(), tr.token_ids)


def test_filters_report_removed_tokens_and_mass():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    res = apply_sampling(logits, SamplingSettings(top_k=2))
    stage = {s.name: s for s in res.stages}["top_k"]
    assert stage.removed.tolist() == [False, False, True, True]
    assert abs(stage.kept_mass - 0.8) < 1e-6
    torch.testing.assert_close(res.probs, torch.tensor([0.625, 0.375, 0, 0]))


def test_greedy_and_seeded_sampling():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(500, generator=g)
    greedy = apply_sampling(logits, SamplingSettings(temperature=0))
    assert greedy.sample() == int(torch.argmax(logits))
    res = apply_sampling(logits, SamplingSettings(temperature=1.0))
    draws = [res.sample(seed=s) for s in range(20)]
    assert draws == [res.sample(seed=s) for s in range(20)]  # same seed, same token
    assert len(set(draws)) > 5  # and different seeds really draw differently


@pytest.mark.parametrize("bad", [
    dict(top_p=0), dict(top_p=1.5), dict(top_k=-1), dict(min_p=2), dict(temperature=float("nan")),
    dict(repetition_penalty=0), dict(top_k=2.5), dict(temperature="hot"),
])
def test_invalid_settings_are_refused_with_a_sentence(bad):
    with pytest.raises(SettingsError) as e:
        SamplingSettings.from_values(**bad)
    assert str(e.value).endswith(".") and len(str(e.value)) < 120
