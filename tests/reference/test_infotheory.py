"""Entropy, cross-entropy, KL and MFU (model_core/interp/infotheory.py) on the real default model, against
transformers' own loss, torch's kl_div and Categorical entropy, and the SFT code's MFU."""

import math

import pytest
import torch
import torch.nn.functional as F

from model_core.core.errors import SettingsError
from model_core.interp import infotheory as I
from model_core.interp.trace import encode_prompt

PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def ids(default_lm):
    return encode_prompt(default_lm, PROMPT)


def test_cross_entropy_is_the_models_loss(default_lm, ids):
    ce = I.prompt_cross_entropy(default_lm, ids)
    assert ce["n"] == len(ids) - 1 and len(ce["surprisal"]) == ce["n"]
    assert ce["nats"] == pytest.approx(ce["transformers_loss"], abs=1e-5)
    # and against a loss computed by torch's cross_entropy from a separate plain forward
    with torch.inference_mode():
        logits = default_lm.model(torch.tensor([ids])).logits[0].float()
    ref = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    assert ce["nats"] == pytest.approx(float(ref), abs=1e-5)
    assert ce["perplexity"] == pytest.approx(math.exp(float(ref)), rel=1e-5)
    assert ce["bits"] == pytest.approx(ce["nats"] / math.log(2))
    # shifting the targets by one (a classic off-by-one) is far from the loss
    off = F.cross_entropy(logits[:-2], torch.tensor(ids[1:-1]).roll(1))
    assert abs(float(off) - ce["transformers_loss"]) > 0.5


def test_entropy_and_kl_against_torch(default_lm, ids):
    logits = I.next_logits(default_lm, ids)
    h = I.entropy_of(logits)
    # references in float64 like ours: in fp32 two summation orders of 49,152 terms differ by ~1e-5
    ref = torch.distributions.Categorical(logits=logits.double()).entropy()
    assert h["nats"] == pytest.approx(float(ref), abs=1e-9)
    c = I.compare_distributions(default_lm, ids, temperature=2.0)
    lp, lq = torch.log_softmax(logits.double(), -1), torch.log_softmax(logits.double() / 2.0, -1)
    assert c["kl_pq"] == pytest.approx(float(F.kl_div(lq, lp, log_target=True, reduction="sum")), abs=1e-9)
    assert c["kl_qp"] == pytest.approx(float(F.kl_div(lp, lq, log_target=True, reduction="sum")), abs=1e-9)
    assert c["ce_pq"] == pytest.approx(c["h_p"] + c["kl_pq"], abs=1e-4)
    assert c["kl_pq"] > 0.1 and abs(c["kl_pq"] - c["kl_qp"]) > 0.1  # not symmetric
    assert c["p_entropy"]["nats"] == pytest.approx(h["nats"]) and c["q_entropy"]["nats"] > h["nats"]
    same = I.kl_divergence(logits, logits)
    assert same["kl_pq"] == pytest.approx(0.0, abs=1e-6)
    # KL of a model with itself as "another model" is 0 too
    assert I.compare_distributions(default_lm, ids, other=default_lm)["kl_pq"] == pytest.approx(0.0, abs=1e-6)


def test_kl_needs_one_vocabulary():
    with pytest.raises(SettingsError, match="vocabular"):
        I.kl_divergence(torch.zeros(10), torch.zeros(12))
    with pytest.raises(SettingsError, match="temperature"):
        I.check_temperature(0)


def test_mfu_arithmetic_and_jobs():
    from model_core.training.sft import mfu as sft_mfu

    r = I.mfu(134_515_008, 1000.0, 989e12, "training")
    assert r["mfu"] == pytest.approx(sft_mfu(134_515_008, 1000.0, 989e12))
    assert r["flops_per_token"] == 6 * 134_515_008
    assert I.mfu(1e9, 100.0, 1e12, "inference")["mfu"] == pytest.approx(0.2)
    assert I.PEAKS[I.DEFAULT_PEAK] == 989e12
    with pytest.raises(SettingsError):
        I.mfu(0, 10, 1e12)
    rec = {"id": "abc123456789", "kind": "sft", "state": "succeeded", "params": {"model": "smollm2-135m-instruct"},
           "sft": {"metrics": {"tokens_per_s": 812.5, "tokens_seen": 1000, "training_flops": 6 * 134_515_008 * 1000}}}
    (j,) = I.job_throughputs([rec, {"id": "x", "kind": "tokenizer"}])
    assert j["tokens_per_s"] == 812.5 and j["n_params"] == pytest.approx(134_515_008)


def test_panel_checks_turn_red_when_corrupted(default_lm, monkeypatch):
    """The Anatomy panel's check lines: hand cross-entropy vs transformers' loss, hand KL vs kl_div; a
    corrupted hand computation (targets shifted by one; KL terms with a wrong sign) shows MISMATCH."""
    from app.tabs.anatomy import tab as anatomy_tab

    ok, _, _ = anatomy_tab.info_panel("smollm2-135m-instruct", PROMPT, False, 2.0, None)
    assert ok.count("✓ check") == 3 and "MISMATCH" not in ok
    real_ce, real_kl = I.prompt_cross_entropy, I.kl_divergence

    def shifted(lm, ids):
        out = real_ce(lm, ids)
        out["nats"] = real_ce(lm, ids[1:] + ids[:1])["nats"]  # the wrong targets
        return out

    def flipped(p, q):
        out = real_kl(p, q)
        out["kl_pq"] = -out["kl_pq"]
        return out

    monkeypatch.setattr(I, "prompt_cross_entropy", shifted)
    monkeypatch.setattr(I, "kl_divergence", flipped)
    bad, _, _ = anatomy_tab.info_panel("smollm2-135m-instruct", PROMPT, False, 2.0, None)
    assert bad.count("MISMATCH") == 2 and bad.count("✓ check") == 1
