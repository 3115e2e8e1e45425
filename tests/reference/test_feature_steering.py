"""Feature steering (model_core/interp/feature_steering.py) on the real default model: clamping a feature
of a sparse autoencoder at layer 6's output. The arithmetic is checked for any autoencoder weights,
so this uses a freshly initialised eai-sparsify SparseCoder (training one is test_features.py's job).

References: the model's own forward without edits (clamping a feature to its own activation changes
nothing), transformers' output_hidden_states (blocks before the edit point are bit-identical, the
edited block input equals x + (v - a) d by hand, with a computed from the encoder's weights)."""

from __future__ import annotations

import pytest
import torch

from model_core.core.hooks import Recorder, instrument, recording
from model_core.interp import features as F
from model_core.interp.feature_steering import feature_activation, feature_edits

LAYER = 6
PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def feats(default_lm):
    sae = F.new_sae(default_lm.shape.d_model, num_latents=1152, k=16, seed=3, device=default_lm.device)
    with torch.no_grad():
        sae.encoder.bias.add_(0.05)  # some features above zero on ordinary text
    return F.Features(sae=sae, model=default_lm.name, layer=LAYER, hook="resid_post", name="fresh")


def _forward(lm, ids, edits=None):
    instrument(lm.adapter)
    with torch.no_grad(), recording(Recorder(capture=False, edits=dict(edits or {}))):
        out = lm.model(input_ids=ids, use_cache=False, output_hidden_states=True)
    return out.logits[0], out.hidden_states


def test_clamping_a_feature_moves_only_along_its_decoder_row(default_lm, feats):
    lm = default_lm
    ids = torch.tensor([lm.tokenizer(PROMPT)["input_ids"]])
    logits, hs = _forward(lm, ids)
    x = hs[LAYER + 1][0]  # [T, d]: block LAYER's output, what the autoencoder reads
    # the feature firing hardest at the last position, by hand from the encoder's weights
    W, b = feats.sae.encoder.weight.detach(), feats.sae.encoder.bias.detach()
    pre = torch.relu((x - feats.sae.b_dec.detach()) @ W.T + b)  # [T, M]
    top = torch.topk(pre, feats.sae.cfg.k, dim=-1)
    a_hand = torch.zeros_like(pre).scatter_(-1, top.indices, top.values)
    f = int(a_hand[-1].argmax())
    assert a_hand[-1, f] > 0
    torch.testing.assert_close(feature_activation(feats, x, f), a_hand[:, f], rtol=1e-4, atol=1e-5)

    # its own activation at the last position: nothing changes
    own = feature_edits(lm, feats, f, float(a_hand[-1, f]), from_position=ids.shape[1] - 1)
    logits_own, _ = _forward(lm, ids, own)
    torch.testing.assert_close(logits_own, logits, rtol=1e-4, atol=1e-4)

    # clamped to 20 from position 1: earlier blocks bit-identical, the next block's input moved by
    # (20 - a) d (read as the edit hands it on)
    [(name, clamp_fn)] = feature_edits(lm, feats, f, 20.0).items()
    assert name == f"blocks.{LAYER + 1}.hook_resid_pre"
    seen = []

    def watched(n, v):
        seen.append(clamp_fn(n, v))
        return seen[-1]
    logits_c, hs_c = _forward(lm, ids, {name: watched})
    for layer in range(LAYER + 2):  # embeddings .. block LAYER's output
        assert torch.equal(hs_c[layer], hs[layer]), layer
    d_f = feats.sae.W_dec.detach()[f]
    want = x.clone()
    want[1:] += (20.0 - a_hand[1:, f])[:, None] * d_f
    torch.testing.assert_close(seen[0][0], want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits_c[-1], logits[-1], atol=1e-3)
    # ablation (0) changes the distribution where the feature fired
    logits_0, _ = _forward(lm, ids, feature_edits(lm, feats, f, 0.0))
    assert not torch.allclose(logits_0[-1], logits[-1], atol=1e-4)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e9, "x", None])
def test_absurd_values_and_features_are_one_sentence(default_lm, feats, value):
    with pytest.raises(F.FeatureError, match="clamp value must be"):
        feature_edits(default_lm, feats, 0, value)
    with pytest.raises(F.FeatureError, match="outside this set"):
        feature_edits(default_lm, feats, 5000, 1.0)
