"""Steering vectors on the real default model (SmolLM2-135M-Instruct, CPU, fp32).

References: the direction against transformers' own `output_hidden_states` (hidden_states[L] is the
input of block L), the alpha = 0 and layer-isolation checks against the unsteered forward.
"""

from __future__ import annotations

import math

import pytest
import torch

from model_core.core.hook_names import act_name
from model_core.interp.steering import (
    SteeringError,
    SteeringPair,
    alpha_sweep,
    builtin_pairs,
    parse_alphas,
    parse_pairs,
    steering_edits,
    steering_vector,
    target_ids,
)
from model_core.interp.trace import trace

LAYER = 6


@pytest.fixture(scope="module")
def love(default_lm):
    return steering_vector(default_lm, builtin_pairs("love-hate"), LAYER)


def test_direction_is_the_mean_difference_of_transformers_hidden_states(default_lm, love):
    lm = default_lm
    diffs = []
    for pair in builtin_pairs("love-hate"):
        last = []
        for text in (pair.positive, pair.negative):
            ids = lm.tokenizer(text, return_tensors="pt").input_ids
            with torch.no_grad():
                hs = lm.model(input_ids=ids, output_hidden_states=True).hidden_states
            last.append(hs[LAYER][0, -1].float())  # the input of block LAYER, last token
        diffs.append(last[0] - last[1])
    by_hand = torch.stack(diffs).mean(0)
    assert love.vector.shape == (lm.shape.d_model,)
    torch.testing.assert_close(love.vector, by_hand, rtol=1e-5, atol=1e-5)
    assert love.norm > 1.0  # a real direction, not a zero vector


def test_alpha_zero_is_the_unsteered_run_bit_for_bit(default_lm, love):
    plain = trace(default_lm, "I think that you are")
    steered = trace(default_lm, "I think that you are", edits=steering_edits(default_lm, love, 0.0))
    assert torch.equal(plain.next_logits, steered.next_logits)


def test_layers_before_the_vector_are_untouched_and_the_layer_moves_by_alpha_v(default_lm, love):
    alpha = 4.0
    plain = trace(default_lm, "I think that you are")
    steered = trace(default_lm, "I think that you are", edits=steering_edits(default_lm, love, alpha))
    for l in range(LAYER):
        assert torch.equal(plain.resid_pre[l], steered.resid_pre[l]), l
        assert torch.equal(plain.attn_out[l], steered.attn_out[l]), l
        assert torch.equal(plain.mlp_out[l], steered.mlp_out[l]), l
    moved = steered.resid_pre[LAYER] - plain.resid_pre[LAYER]  # [T, d_model]
    torch.testing.assert_close(moved, (alpha * love.vector).expand_as(moved), rtol=1e-5, atol=1e-4)
    assert not torch.equal(plain.next_logits, steered.next_logits)


def test_from_position_leaves_earlier_positions_alone(default_lm, love):
    plain = trace(default_lm, "I think that you are")
    steered = trace(default_lm, "I think that you are", edits=steering_edits(default_lm, love, 8.0, from_position=3))
    assert torch.equal(plain.resid_pre[LAYER][:3], steered.resid_pre[LAYER][:3])
    assert not torch.equal(plain.resid_pre[LAYER][3:], steered.resid_pre[LAYER][3:])
    assert set(steering_edits(default_lm, love, 1.0)) == {act_name("resid_pre", LAYER)}


def test_sweep_kl_grows_with_alpha_and_the_love_direction_shifts_sentiment(default_lm, love):
    tok = default_lm.tokenizer

    def first_ids(words):
        return [tok(w, add_special_tokens=False).input_ids[0] for w in words]

    prompt = "Honestly, my neighbours are"
    kind = first_ids([" wonderful", " great", " lovely"])
    unkind = first_ids([" terrible", " horrible", " awful"])
    up = alpha_sweep(default_lm, prompt, love, [0, 2, 4], targets=kind)
    down = alpha_sweep(default_lm, prompt, love, [0, 4], targets=unkind)
    assert up[0].kl_from_unsteered == 0.0
    assert up[0].kl_from_unsteered < up[1].kl_from_unsteered < up[2].kl_from_unsteered
    # on-target shift, measured (about +1.5 and -2.3 nats at alpha 4 on this model)
    assert up[2].target_logprob > up[0].target_logprob + 0.5
    assert down[1].target_logprob < down[0].target_logprob - 0.5
    assert all(0 < p <= 1 for _, p in up[2].top_tokens)


@pytest.mark.parametrize("alpha", [math.nan, math.inf, -1e9, "x", None])
def test_absurd_alpha_is_one_sentence(default_lm, love, alpha):
    with pytest.raises(SteeringError, match="alpha must be"):
        steering_edits(default_lm, love, alpha)


def test_bad_layer_one_token_prompt_and_foreign_width_are_refused(default_lm, love):
    with pytest.raises(SteeringError, match="is one token"):
        steering_vector(default_lm, [SteeringPair("Love", "Hate")], LAYER)
    with pytest.raises(SteeringError, match="from 0 to 29"):
        steering_vector(default_lm, [SteeringPair("a", "b")], 30)
    from dataclasses import replace

    alien = replace(love, vector=torch.zeros(640))
    with pytest.raises(SteeringError, match="width 640"):
        steering_edits(default_lm, alien, 1.0)


def test_malformed_pairs_file_is_reported_by_line_number():
    text = '{"positive": "good", "negative": "bad"}\nnot json\n\n{"positive": "x"}\n[1, 2]\n'
    with pytest.raises(SteeringError) as e:
        parse_pairs(text)
    msg = str(e.value)
    assert "line 2 is not JSON" in msg and "line 4 needs" in msg and "line 5 is not an object" in msg
    assert parse_pairs('{"positive": "good", "negative": "bad"}\n') == [SteeringPair("good", "bad")]
    with pytest.raises(SteeringError, match="no pairs"):
        parse_pairs("\n\n")


def test_steered_generation_alpha_zero_is_plain_generate_and_steering_follows_the_edited_forward(default_lm, love):
    from model_core.serving.generate import generate
    from model_core.serving.steered import steered_generation

    prompt = "Honestly, my neighbours are"
    plain = generate(default_lm, prompt, max_new_tokens=6)  # greedy; equals transformers' generate (test_generate)
    zero = steered_generation(default_lm, prompt, love, 0.0, max_new_tokens=6)
    assert zero.generation.token_ids == plain.token_ids
    steered = steered_generation(default_lm, prompt, love, 6.0, max_new_tokens=6)
    # each steered token is the argmax of a full forward with the same edit over the text so far
    ids = list(steered.generation.prompt_ids)
    for tok in steered.generation.token_ids:
        tr = trace(default_lm, token_ids=ids, edits=steering_edits(default_lm, love, 6.0))
        assert int(tr.next_logits.argmax()) == tok
        ids.append(tok)
    assert steered.generation.token_ids != plain.token_ids
    assert steered.base_perplexity > zero.base_perplexity > 1.0


def test_cli_steered_generation_json(tmp_path):
    import json
    import subprocess
    import sys

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"positive": "I love this", "negative": "I hate this"}\n'
                     '{"positive": "What a lovely day", "negative": "What a horrible day"}\n')
    r = subprocess.run([sys.executable, "-m", "app.server.cli", "generate", "Honestly, my neighbours are", "--steer-pairs",
                        str(pairs), "--steer-layer", str(LAYER), "--alpha", "6", "--max-new-tokens", "4", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert set(out) == {"runs", "steering"}  # the shape of every `generate --json`, steered or not
    assert out["steering"]["layer"] == LAYER and out["steering"]["n_pairs"] == 2
    assert [run["alpha"] for run in out["runs"]] == [0.0, 6.0]
    assert out["runs"][0]["token_ids"] != out["runs"][1]["token_ids"]
    bad = subprocess.run([sys.executable, "-m", "app.server.cli", "generate", "hi", "--steer-pairs", str(pairs),
                          "--alpha", "inf"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "alpha must be a finite number" in bad.stderr and "Traceback" not in bad.stderr


def test_sweep_generations_alpha_zero_is_plain_generate_and_perplexity_is_transformers_loss(default_lm, love):
    """Each sweep row's continuation: alpha 0 equals plain generate (the unsteered run, same seed);
    its perplexity under the unsteered model equals exp of transformers' own causal-LM loss with the
    prompt masked out (labels=-100), computed here from the model's forward with labels."""
    from model_core.serving.generate import generate

    lm, prompt = default_lm, "Honestly, my neighbours are"
    from model_core.serving.steered import alpha_sweep as generating_sweep

    rows = generating_sweep(lm, prompt, love, [0, 6], generate_options=dict(max_new_tokens=8, seed=3))
    plain = generate(lm, prompt, max_new_tokens=8, seed=3)
    assert rows[0].text == plain.text and rows[1].text != plain.text
    full = torch.tensor([list(plain.prompt_ids) + list(plain.token_ids)])
    labels = full.clone()
    labels[0, : len(plain.prompt_ids)] = -100
    with torch.inference_mode():
        loss = lm.model(input_ids=full, labels=labels).loss
    assert rows[0].base_perplexity == pytest.approx(math.exp(float(loss)), rel=1e-4)
    assert rows[1].base_perplexity > rows[0].base_perplexity  # the steered text reads as less likely


def test_alphas_and_targets_are_parsed_with_one_sentence(default_lm):
    assert parse_alphas("-8, -4 0;4, 8, 4") == [-8.0, -4.0, 0.0, 4.0, 8.0]
    for bad, msg in (("", "Give the alphas"), ("1,x", "must be a number"), ("nan", "finite"),
                     (",".join(["1"] * 17), "at most 16")):
        with pytest.raises(SteeringError, match=msg):
            parse_alphas(bad)
    tok = default_lm.tokenizer
    got = target_ids(default_lm, " wonderful ,great")
    assert got == [(" wonderful", tok(" wonderful", add_special_tokens=False).input_ids[0]),
                   (" great", tok(" great", add_special_tokens=False).input_ids[0])]
    assert target_ids(default_lm, "  ") == []
