"""DoLa (model_core/interp/dola.py) on the real default model (CPU fp32), against:

- transformers 4.55.4's own DoLa (`generate(dola_layers=...)`, the last release with it in core;
  transformers 5 moved it to the Hub), run offline by bench/dola_reference.py into
  tests/data/dola_transformers4.json: token ids, the premature layer it picked at every step (read
  off its own call) and the contrasted scores' top tokens, three prompts x low / high;
- the published algorithm written out here by hand for a couple of steps, from lmscope's trace (each
  candidate's residual stream through the unembedding), in float64: the divergence to every
  candidate, its argmax, the plausibility mask, the argmax of the contrast;
- the candidate-layer rules of 4.x for other depths and untied models; the variant that reads the
  premature layers through the final norm against the logit lens (model_core/interp/lens.py);
- `lmscope generate --dola-layers` and its one-sentence refusals.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from model_core.core.errors import SettingsError
from model_core.core.prompts import encode_prompt
from model_core.interp.dola import candidate_layers, contrast, dola_greedy
from model_core.interp.trace import trace

REF = json.loads((Path(__file__).resolve().parents[1] / "data" / "dola_transformers4.json").read_text())
CASES = {c["name"]: c for c in REF["cases"]}


def test_reference_ran_this_model(default_lm):
    """4.55.4 loaded the same weights and the same prompt ids: its next-token log-probs after each
    prompt equal lmscope's model's."""
    assert REF["transformers"] == "4.55.4"
    for c in REF["cases"][::2]:
        assert c["prompt_ids"] == encode_prompt(default_lm, c["prompt"], chat=c["chat"])
        with torch.inference_mode():
            lp = torch.log_softmax(default_lm.model(torch.tensor([c["prompt_ids"]])).logits[0, -1].float(), -1)
        assert lp[c["prompt_top_ids"]].tolist() == pytest.approx(c["prompt_top_logprobs"], abs=1e-4)


@pytest.mark.parametrize("name", list(CASES))
def test_dola_equals_transformers4(default_lm, name):
    c = CASES[name]
    g = dola_greedy(default_lm, c["prompt_ids"], c["max_new_tokens"], c["dola_layers"])
    assert g.candidates == c["candidates"]
    assert g.token_ids == c["token_ids"]
    assert [s.premature_layer for s in g.steps] == [s["premature_layer"] for s in c["steps"]]
    for mine, ref in zip(g.steps, c["steps"]):
        kept = [(i, v) for i, v in zip(ref["top_ids"], ref["top_scores"]) if v != float("-inf")]
        assert [i for i, _ in mine.contrast_top] == [i for i, _ in kept]
        # scores of several hundred (the raw residual's lm_head logits are far from normalised): fp32 rel.
        assert [v for _, v in mine.contrast_top] == pytest.approx([v for _, v in kept], rel=1e-5, abs=1e-4)


@pytest.mark.parametrize("name", ["france-low", "chat-water-high"])
def test_dola_is_the_published_algorithm_by_hand(default_lm, name):
    c = CASES[name]
    lm, steps = default_lm, 2
    g = dola_greedy(lm, c["prompt_ids"], steps, c["dola_layers"])
    W = lm.model.get_output_embeddings().weight.double()  # [V, d]
    V = W.shape[0]
    ids = list(c["prompt_ids"])
    for step in g.steps:
        tr = trace(lm, token_ids=ids)
        # log-probabilities as log-softmax: the raw residual's logits span hundreds, so p itself underflows
        logp = torch.log_softmax(tr.logits()[-1].double(), -1)  # the final layer's next-token distribution
        logq = {layer: torch.log_softmax(tr[f"blocks.{layer}.hook_resid_pre"][-1].double() @ W.T, -1)
                for layer in c["candidates"]}  # each candidate's residual stream, unembedded (no final norm)
        p = logp.exp()
        js = {}
        for layer, lq in logq.items():
            m = (p + lq.exp()) / 2
            kl_m_p = (m * (m.log() - logp)).nan_to_num().sum()  # 0 log 0 = 0
            kl_m_q = (m * (m.log() - lq)).nan_to_num().sum()
            js[layer] = float(0.5 * (kl_m_p + kl_m_q) / V)
        premature = max(js, key=js.get)
        assert step.js == pytest.approx(js, rel=1e-3)
        assert step.premature_layer == premature
        keep = p >= 0.1 * p.max()
        scores = torch.where(keep, logp - logq[premature], torch.tensor(float("-inf"), dtype=torch.float64))
        assert step.token_id == int(scores.argmax())
        order = sorted(torch.nonzero(keep).flatten().tolist(), key=lambda i: -float(scores[i]))[:5]
        assert [i for i, _ in step.contrast_top] == order
        ids.append(step.token_id)
    assert g.token_ids == c["token_ids"][:steps]


def test_premature_norm_reads_layers_as_the_logit_lens_does(default_lm):
    """premature_norm=True: a premature layer's distribution is the logit lens's at that layer's input."""
    from model_core.interp.lens import logit_lens

    ids = CASES["france-high"]["prompt_ids"]
    g = dola_greedy(default_lm, ids, 2, "high", premature_norm=True)
    for k, step in enumerate(g.steps):
        lens = logit_lens(trace(default_lm, token_ids=ids + g.token_ids[:k]), positions=[-1],
                          layers=[step.premature_layer - 1], k=5)  # block L's input = block L-1's output
        assert [i for i, _ in step.premature_top] == lens.top_ids[0, 0].tolist()
        assert [p for _, p in step.premature_top] == pytest.approx(lens.top_probs[0, 0].tolist(), abs=1e-5)


def test_contrast_masks_implausible_tokens():
    final = torch.log(torch.tensor([0.60, 0.30, 0.05, 0.05]))
    premature = torch.log(torch.tensor([0.70, 0.10, 0.10, 0.10]))
    s = contrast(final, premature)
    # 0.05 < 0.1 * 0.60: masked; the kept ones score log p_final - log p_premature
    assert s[2] == s[3] == float("-inf")
    assert s[:2].tolist() == pytest.approx([math.log(0.6 / 0.7), math.log(3.0)], rel=1e-5)
    assert int(s.argmax()) == 1  # the contrast prefers what the later layers added


@pytest.mark.parametrize("n, which, tied, want", [
    (30, "low", True, [2, 4, 6, 8, 10, 12, 14]),
    (30, "high", True, [15, 17, 19, 21, 23, 25, 27, 29]),
    (30, "low", False, [0, 2, 4, 6, 8, 10, 12, 14]),
    (48, "low", True, [2, 4, 6, 8, 10, 12, 14, 16, 18]),
    (48, "high", False, list(range(28, 48, 2))),
    (4, "low", True, [2]),  # the start is the middle: that one layer
    (2, "low", True, [1]),
    (2, "high", True, [1]),
    (1, "low", True, [0]),
])
def test_candidate_layers_follow_transformers4(n, which, tied, want):
    assert candidate_layers(n, which, tied) == want


def test_candidate_layers_refuse_other_names():
    with pytest.raises(SettingsError, match="'low' or 'high'"):
        candidate_layers(30, "middle", True)


def test_cli_reports_the_premature_layer_per_step(default_lm, capsys):
    from app.server.cli import main

    c = CASES["france-low"]
    assert main(["generate", c["prompt"], "--dola-layers", "low", "--max-new-tokens", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steering"] is None and len(out["runs"]) == 1
    run = out["runs"][0]
    assert run["token_ids"] == c["token_ids"][:6] and run["text"] == default_lm.tokenizer.decode(c["token_ids"][:6])
    assert run["dola"]["layers"] == "low" and run["dola"]["candidates"] == c["candidates"]
    steps = run["dola"]["steps"]
    assert [s["premature_layer"] for s in steps] == [s["premature_layer"] for s in c["steps"][:6]]
    assert all(set(s["js"]) == {str(x) for x in c["candidates"]} for s in steps)
    assert steps[0]["final_top"][0]["token"] == "␣Paris"


@pytest.mark.parametrize("args, says", [
    (["--dola-layers", "middle"], "takes low or high"),
    (["--dola-layers", "low", "--temperature", "0.7"], "greedy"),
    (["--dola-layers", "low", "--presence-penalty", "0.5"], "greedy"),
    (["--dola-layers", "high", "--num-beams", "2"], "does not combine"),
    (["--dola-layers", "high", "--penalty-alpha", "0.6"], "does not combine"),
    (["--dola-layers", "low", "--steer-pairs", "x.jsonl"], "does not combine"),
    (["--dola-layers", "low", "--prompt-lookup", "3"], "does not combine"),
    (["--dola-layers", "low", "--max-new-tokens", "0"], "at least 1"),
])
def test_bad_input_is_one_sentence_and_nothing_runs(args, says, capsys):
    from app.server.cli import main

    # a model that does not exist: had anything run, the error would say so instead
    assert main(["generate", "hi", "--model", "no-such-model-anywhere", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err
