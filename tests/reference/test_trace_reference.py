"""The Trace checked against transformers itself (a reference no one here wrote).

References used:
- logits: the plain transformers forward (`model(input_ids).logits`);
- attention patterns: transformers' `output_attentions=True` with attn_implementation="eager";
- residual stream: transformers' `output_hidden_states=True` (hidden_states[l+1] is layer l's
  output for every layer but the last; the last entry is after the final norm);
- decomposition: the embedding plus every attn_out and mlp_out equals the last resid_post.
"""

import pytest
import torch

from conftest import DEFAULT, RANDOM_MODELS
from model_core import load_model, trace
from model_core.interp.lens import logit_lens
from tests.helpers.tolerance import assert_close_to_scale

PROMPT = "The animal didn't cross the street because it was too tired"


def _reference(name, ids):
    ref = load_model(name, attn_implementation="eager")
    with torch.inference_mode():
        return ref.model(torch.tensor([ids]), output_attentions=True, output_hidden_states=True)


@pytest.mark.parametrize("name", [DEFAULT, *RANDOM_MODELS])
def test_trace_equals_transformers(name):
    lm = load_model(name)
    _check_against_transformers(lm, trace(lm, PROMPT), name)


@pytest.mark.parametrize("name", [DEFAULT, "random-gemma3-tiny"])
def test_recorded_trace_equals_transformers(name, monkeypatch):
    """A CPU server's engine records Explore's forward per length bucket (model_core.serving.torchscript_replay):
    the replayed trace, padded to its bucket and cut back, meets the same references as the eager
    one (sliding-window layers included); the replay counter proves the recording ran."""
    from model_core.serving.cuda_prefill_graphs import CPU_LENGTHS
    from model_core.serving.engine import Engine

    lm = load_model(name)
    eng = Engine(lm, slots=2, max_len=128, record_steps=True)
    eng.ready.wait()
    try:
        monkeypatch.setitem(lm.meta, "engine", eng)
        n = len(trace(lm, PROMPT).token_ids)  # eager: not recorded yet (this asks for the recording)
        assert n < CPU_LENGTHS[-1] and n not in CPU_LENGTHS  # the recording pads the prompt
        assert eng._recorded.wait_recorded(300) and eng._recorded.stats()["buckets"] == 1, eng._recorded.stats()
        tr = trace(lm, PROMPT)
        assert eng._recorded.replays == {"trace": 1}
        _check_against_transformers(lm, tr, name)
    finally:
        eng.close()


def _check_against_transformers(lm, tr, name):
    out = _reference(name, tr.token_ids)
    L = lm.shape.n_layers
    torch.testing.assert_close(tr.logits(), out.logits[0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(tr.next_logits, out.logits[0, -1], atol=2e-4, rtol=1e-4)
    assert len(out.attentions) == L and len(out.hidden_states) == L + 1
    torch.testing.assert_close(tr["hook_embed"], out.hidden_states[0][0], atol=0, rtol=0)
    for l in range(L):
        pattern = tr[f"blocks.{l}.attn.hook_pattern"]
        assert pattern.shape == (lm.shape.n_heads, tr.n_tokens, tr.n_tokens)
        torch.testing.assert_close(pattern, out.attentions[l][0], atol=1e-5, rtol=1e-4)
        if l < L - 1:
            assert_close_to_scale(tr[f"blocks.{l}.hook_resid_post"], out.hidden_states[l + 1][0],
                                  msg=f"layer {l} resid_post")
    assert_close_to_scale(tr["ln_final.hook_normalized"], out.hidden_states[L][0], msg="ln_final")


@pytest.mark.parametrize("name", [DEFAULT, *RANDOM_MODELS])
def test_residual_stream_decomposes(name):
    lm = load_model(name)
    tr = trace(lm, PROMPT)
    total = tr.embed.clone()
    for l in range(lm.shape.n_layers):
        total = total + tr.attn_out[l] + tr.mlp_out[l]
    torch.testing.assert_close(total, tr.resid_post(lm.shape.n_layers - 1), atol=1e-3, rtol=1e-5)
    # and each block's pieces add up exactly as the model adds them
    for l in range(lm.shape.n_layers - 1):
        assert torch.equal(tr.resid_post(l), tr.resid_pre[l + 1])


@pytest.mark.parametrize("name", [DEFAULT, *RANDOM_MODELS])
def test_last_layer_logit_lens_is_the_model_output(name):
    lm = load_model(name)
    tr = trace(lm, PROMPT)
    lens = logit_lens(tr, k=3)
    probs = torch.softmax(tr.logits().float(), -1)
    top_p, top_i = probs.topk(3, dim=-1)
    assert torch.equal(lens.top_ids[-1], top_i)
    torch.testing.assert_close(lens.top_probs[-1], top_p, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", RANDOM_MODELS)
def test_mlp_post_equals_down_projection_input(name):
    """Reference: the input transformers feeds to the MLP's down projection, caught by a plain hook."""
    lm = load_model(name)
    tr = trace(lm, PROMPT)
    layer = 1
    mlp = lm.adapter.layers[layer].mlp
    down = mlp.down_proj if hasattr(mlp, "down_proj") else mlp.c_proj
    seen = {}
    h = down.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0][0].clone()))
    try:
        with torch.inference_mode():
            lm.model(torch.tensor([tr.token_ids]))
    finally:
        h.remove()
    torch.testing.assert_close(tr["blocks.1.mlp.hook_post"], seen["x"], atol=1e-5, rtol=1e-5)


def test_paris_on_the_default_model(default_lm):
    tr = trace(default_lm, "The capital of France is")
    top = int(torch.argmax(tr.next_logits))
    assert default_lm.tokenizer.decode([top]) == " Paris"
    assert [t["display"] for t in tr.tokens] == ["The", "␣capital", "␣of", "␣France", "␣is"]


def test_capture_can_be_limited_to_some_layers(default_lm):
    full = trace(default_lm, PROMPT)
    part = trace(default_lm, PROMPT, layers=[3, 7])
    assert part.captured_layers == [3, 7]
    assert part.captured_bytes() < full.captured_bytes() / 5
    torch.testing.assert_close(part.attention_pattern(7), full.attention_pattern(7))
    with pytest.raises(KeyError):
        part.attention_pattern(4)
