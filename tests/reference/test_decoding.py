"""Search decoding (model_core/serving/search_decoding.py) against transformers on the real default model (CPU fp32).

- Beam search is transformers' generate; what lmscope reads back (every beam, its length-normalised score,
  its per-step log-probs) is checked against generate's own output and against a plain forward pass.
- Diverse beam search and contrastive search are lmscope's own code (transformers 5 moved them to the Hub):
  checked token for token against transformers 4.55.4's core implementation, run offline on the same
  model (tests/data/decoding_reference.json, tests/data/make_decoding_reference.py), and against the
  current transformers where the methods reduce to ones it still has (one group = beam search,
  alpha 0 = greedy).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model_core.core.errors import SettingsError
from model_core.interp.trace import encode_prompt
from model_core.serving.search_decoding import (
    DecodingSettings,
    contrastive_search,
    decode,
    decoding_to_json,
    group_beam_search,
    repetition,
    teacher_forced_logprobs,
)

REF = json.loads((Path(__file__).resolve().parents[1] / "data" / "decoding_reference.json").read_text())
CASES = {c["name"]: c for c in REF["cases"]}
CHAT_Q = "What is the capital of France? Answer in one word."


def _hf_beams(lm, ids, num_beams, max_new, length_penalty):
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = lm.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                                num_beams=num_beams, num_return_sequences=num_beams, length_penalty=length_penalty,
                                early_stopping=False, output_scores=True, return_dict_in_generate=True,
                                pad_token_id=2, eos_token_id=[2])
    n = (out.beam_indices >= 0).sum(1).tolist()
    return [row[len(ids):len(ids) + k].tolist() for row, k in zip(out.sequences, n)], out.sequences_scores.tolist()


def _strip(seq, length):
    return seq[:length]


def test_reference_ran_this_model(default_lm):
    """The 4.55 reference loaded the same weights (its RoPE base from rope_parameters): its next-token
    log-probs after each prompt equal lmscope's model's."""
    lm = default_lm
    for c in REF["cases"][:2]:
        with torch.inference_mode():
            lp = torch.log_softmax(lm.model(torch.tensor([c["prompt_ids"]])).logits[0, -1].float(), -1)
        assert c["prompt_ids"] == encode_prompt(lm, c["prompt"], chat=c["chat"])
        assert lp[c["prompt_top_ids"]].tolist() == pytest.approx(c["prompt_top_logprobs"], abs=1e-4)


def test_beam_search_is_transformers_generate(default_lm):
    """Every beam, in order, with generate's own length-normalised score; each beam's log-probability
    equals a plain forward pass over its text; length_penalty 0.5 makes the normalisation visible
    (score = sum log p / length ** 0.5, not the sum, not the mean)."""
    lm = default_lm
    s = DecodingSettings(method="beam", num_beams=4, max_new_tokens=9, length_penalty=0.5)
    d = decode(lm, CHAT_Q, s, chat=True, with_greedy=False)
    seqs, scores = _hf_beams(lm, d.prompt_ids, 4, 9, 0.5)
    assert [b.token_ids for b in d.beams] == seqs
    assert [b.score for b in d.beams] == pytest.approx(scores, abs=1e-5)
    assert any(b.eos for b in d.beams) and len({b.length for b in d.beams}) > 1  # EOS-ended beams are shorter
    for b in d.beams:
        assert b.score == pytest.approx(b.logprob / b.length ** 0.5, abs=1e-5)
        assert b.score != pytest.approx(b.logprob, abs=1e-3) and b.score != pytest.approx(b.logprob / b.length, abs=1e-3)
        assert b.teacher_forced_logprob == pytest.approx(b.logprob, abs=2e-3)
        assert b.step_scores[-1] == pytest.approx(b.logprob, abs=1e-4)
    # the hand-written group search with one group is beam search: same beams as transformers' own
    g = group_beam_search(lm, d.prompt_ids, DecodingSettings(method="diverse", num_beams=4, num_beam_groups=1,
                                                             max_new_tokens=9, length_penalty=0.5))
    assert [b.token_ids for b in g] == seqs
    assert [b.score for b in g] == pytest.approx(scores, abs=1e-5)


@pytest.mark.parametrize("name", ["group-plain", "group-chat-lp"])
def test_diverse_beam_search_equals_transformers_455(default_lm, name):
    """Group beam search with the Hamming diversity penalty: transformers 4.55.4's beams, order and scores."""
    c = CASES[name]
    beams = group_beam_search(default_lm, c["prompt_ids"], DecodingSettings(method="diverse", **c["settings"]))
    assert len(beams) == len(c["sequences"]) == c["settings"]["num_beams"]
    for b, seq, score in zip(beams, c["sequences"], c["sequences_scores"]):
        assert b.token_ids == _strip(seq, b.length)
        assert b.score == pytest.approx(score, abs=1e-4)
    # the penalty pushed each group off the earlier groups' first token; group 0 pays no penalty, so
    # its search score is the model's own log-probability
    firsts = {b.group: b.token_ids[0] for b in beams}
    assert len(firsts) == c["settings"]["num_beam_groups"] == len(set(firsts.values()))
    assert all(b.search_logprob == pytest.approx(b.logprob, abs=1e-4) for b in beams if b.group == 0)
    assert all(b.search_logprob <= b.logprob + 1e-4 for b in beams)


def test_contrastive_search_equals_transformers_455(default_lm):
    c = CASES["contrastive-plain"]
    beam, cands = contrastive_search(default_lm, c["prompt_ids"], DecodingSettings(method="contrastive",
                                                                                   **c["settings"]))
    assert beam.token_ids == c["sequences"][0]
    assert [[x["id"] for x in step] for step in cands] == c["step_top_ids"]
    # the chosen candidate has the best score = (1 - a) p - a max cos, and not always the most likely token
    a = c["settings"]["penalty_alpha"]
    for step in cands:
        for x in step:
            assert x["score"] == pytest.approx((1 - a) * x["prob"] - a * x["max_cos"], abs=1e-6)
        assert max(step, key=lambda x: x["score"])["chosen"]
    assert any(not step[0]["chosen"] for step in cands)


def test_contrastive_alpha_zero_is_greedy(default_lm):
    ids = CASES["contrastive-chat"]["prompt_ids"]
    d = decode(default_lm, token_ids=ids, settings=DecodingSettings(method="contrastive", penalty_alpha=0.0,
                                                                    top_k=3, max_new_tokens=8), check=False)
    assert d.best.token_ids == d.greedy.token_ids


def test_repetition_share():
    assert repetition([1, 2, 3, 1, 2, 3, 1, 2, 3], 3) == pytest.approx(4 / 7)
    assert repetition([1, 2, 3, 4, 5], 3) == 0.0
    assert repetition([7, 7], 3) == 0.0
    assert repetition([5, 5, 5, 5], 2) == pytest.approx(2 / 3)


def test_teacher_forcing_scores_the_text(default_lm):
    lm = default_lm
    ids = encode_prompt(lm, "The capital of France is")
    paris = lm.tokenizer(" Paris", add_special_tokens=False)["input_ids"]
    (lp,) = teacher_forced_logprobs(lm, ids, [paris])
    with torch.inference_mode():
        ref = torch.log_softmax(lm.model(torch.tensor([ids])).logits[0, -1].float(), -1)[paris[0]]
    assert lp[0] == pytest.approx(float(ref), abs=1e-5) and lp[0] > -1.0


@pytest.mark.parametrize("kw,msg", [
    (dict(method="diverse", num_beams=4, num_beam_groups=3), "equal groups"),
    (dict(method="beam", num_beams=1), "num beams"),
    (dict(method="beam", num_beams=40), "num beams"),
    (dict(method="contrastive", penalty_alpha=1.5), "penalty alpha"),
    (dict(method="nucleus"), "decoding method"),
    (dict(method="beam", max_new_tokens=0), "max new tokens"),
])
def test_settings_are_one_sentence(kw, msg):
    with pytest.raises(SettingsError, match=msg):
        DecodingSettings.from_values(**kw)


def test_cli_generate_beams_json(default_lm, capsys):
    from app.server.cli import main

    assert main(["generate", CHAT_Q, "--chat", "--num-beams", "2", "--max-new-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"runs", "steering"} and out["steering"] is None and len(out["runs"]) == 1
    out = out["runs"][0]
    seqs, scores = _hf_beams(default_lm, out["prompt_token_ids"], 2, 4, 1.0)
    assert out["method"] == "beam" and out["token_ids"] == seqs[0]
    assert [b["token_ids"] for b in out["beams"]] == seqs
    assert [b["score"] for b in out["beams"]] == pytest.approx(scores, abs=1e-5)
    assert out["transformers_sequences_scores"] == pytest.approx(scores, abs=1e-6)
    assert all({"logprob", "step_logprobs", "repetition", "text"} <= set(b) for b in out["beams"])
    assert main(["generate", "x", "--num-beams", "3", "--penalty-alpha", "0.5"]) == 2
    assert "Pick one search" in capsys.readouterr().err


def test_json_of_contrastive_has_candidates(default_lm):
    d = decode(default_lm, "Hello", DecodingSettings(method="contrastive", top_k=3, max_new_tokens=2),
               with_greedy=False)
    j = decoding_to_json(default_lm, d)
    assert len(j["candidates"]) == len(j["token_ids"]) and all(len(s) == 3 for s in j["candidates"])
    assert j["beams"][0]["teacher_forced_logprob"] == pytest.approx(j["beams"][0]["logprob"], abs=2e-3)


def test_panel_checks_turn_red_when_corrupted(default_lm):
    """The panel's two check lines compare with the model's own forward and transformers' scores; a beam
    whose log p or score is off shows ✗."""
    import copy

    from app.tabs.generate.decoding_panel import summary

    d = decode(default_lm, "Hello", DecodingSettings(method="beam", num_beams=2, max_new_tokens=3), with_greedy=False)
    j = decoding_to_json(default_lm, d)
    good = summary(j)
    assert good.count("✓") == 2 and "✗" not in good
    bad = copy.deepcopy(j)
    bad["beams"][1]["logprob"] += 0.5  # the search's bookkeeping off by half a nat
    bad["beams"][0]["score"] *= 1.01  # a score that is not transformers' own
    out = summary(bad)
    assert out.count("✗") == 2 and "✓" not in out
