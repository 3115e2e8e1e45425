"""Epsilon and eta cutoffs in the sampling explainer equal transformers' EpsilonLogitsWarper and
EtaLogitsWarper, after the other stages in generate's order (temperature, top-k, top-p, min-p, epsilon, eta)."""

import pytest
import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from model_core.core.errors import SettingsError
from model_core.core.sampling import SamplingSettings, apply_sampling

CASES = [
    (SamplingSettings(), 3e-4, 0.0),
    (SamplingSettings(), 0.0, 3e-4),
    (SamplingSettings(temperature=0.7), 1e-3, 2e-3),
    (SamplingSettings(temperature=1.3, top_k=200, top_p=0.95, min_p=0.01), 2e-4, 1e-3),
    (SamplingSettings(), 0.9, 0.0),  # epsilon above every probability: the most likely token stays
    (SamplingSettings(), 0.0, 0.9),
]


def _reference(logits, s, eps, eta):
    ids = torch.zeros((1, 1), dtype=torch.long)
    x = logits[None].clone()
    for on, proc in ((s.temperature != 1, lambda: TemperatureLogitsWarper(s.temperature)),
                     (s.top_k > 0, lambda: TopKLogitsWarper(s.top_k)), (s.top_p < 1, lambda: TopPLogitsWarper(s.top_p)),
                     (s.min_p > 0, lambda: MinPLogitsWarper(s.min_p)), (eps > 0, lambda: EpsilonLogitsWarper(eps)),
                     (eta > 0, lambda: EtaLogitsWarper(eta))):
        if on:
            x = proc()(ids, x)
    return x[0]


def _check(logits):
    for s, eps, eta in CASES:
        res = apply_sampling(logits, s, epsilon=eps, eta=eta)
        ref = _reference(logits, s, eps, eta)
        assert torch.equal(res.final_logits, ref), (s, eps, eta)
        names = [st.name for st in res.stages]
        assert ("epsilon" in names) == (eps > 0) and ("eta" in names) == (eta > 0)
        assert int(torch.isfinite(res.final_logits).sum()) >= 1
        if eta > 0:
            entering = res.stages[names.index("eta") - 1].logits
            h = -(torch.softmax(entering, -1) * torch.log_softmax(entering, -1)).nan_to_num().sum()
            assert res.eta_threshold == pytest.approx(min(eta, eta ** 0.5 * float(torch.exp(-h))), rel=1e-4)
            kept = torch.isfinite(res.stages[-1].logits)
            p = torch.softmax(entering, -1)
            assert bool((p[kept] >= res.eta_threshold).all()) or int(kept.sum()) == 1


def test_cutoffs_equal_transformers_on_random_logits():
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        _check(torch.randn(5000, generator=g) * 2.5)


def test_cutoffs_equal_transformers_on_the_model(default_lm):
    with torch.inference_mode():
        ids = default_lm.tokenizer("The capital of France is", return_tensors="pt").input_ids
        logits = default_lm.model(ids).logits[0, -1].float()
    _check(logits)
    res = apply_sampling(logits, SamplingSettings(), epsilon=3e-4)
    eps_stage = res.stages[-1]
    assert eps_stage.name == "epsilon" and 0 < eps_stage.kept_mass < 1 and eps_stage.n_removed > 40000


@pytest.mark.parametrize("kw", [dict(epsilon=1.0), dict(eta=-0.1), dict(epsilon="x"), dict(eta=float("nan"))])
def test_bad_cutoffs_are_one_sentence(kw):
    with pytest.raises(SettingsError, match="epsilon|eta"):
        apply_sampling(torch.zeros(10), SamplingSettings(), **kw)
