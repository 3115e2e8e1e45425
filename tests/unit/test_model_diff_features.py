"""model_core.interp.model_diff_features on a tiny random Llama and a random TopK autoencoder at layer 1's
resid_post: a model against itself changes nothing; a change above the hook layer leaves the statistics
bit-identical and one below it moves them; the statistics equal ones computed by hand from transformers'
own `output_hidden_states` (hidden_states[l + 1] is layer l's resid_post) through the autoencoder's
weights; a set of another width, another model, or no windows is refused in one sentence."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_core import load_model
from model_core.core.errors import SettingsError
from model_core.interp import model_diff_features as MF
from model_core.interp.features_sae import FeatureError, Features, new_sae

TINY = "random-llama-tiny"
LAYER = 1  # of 3: layer 0 lies below the hook, layer 2 above
LATENTS, K = 256, 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny model, and saved by transformers: unchanged, with layer 2's MLP output scaled (above the
    hook) and with layer 0's (below it)."""
    lm = load_model(TINY)
    root = tmp_path_factory.mktemp("diff-features")
    lm.model.save_pretrained(root / "same")
    lm.tokenizer.save_pretrained(root / "same")
    for name, layer in (("above", 2), ("below", 0)):
        hf = AutoModelForCausalLM.from_pretrained(root / "same", dtype=torch.float32)
        with torch.no_grad():
            hf.model.layers[layer].mlp.down_proj.weight.mul_(3.0)
        hf.save_pretrained(root / name)
        lm.tokenizer.save_pretrained(root / name)
    return lm, root, {name: load_model(str(root / name)) for name in ("same", "above", "below")}


@pytest.fixture(scope="module")
def feats(models, tmp_path_factory):
    lm = models[0]
    sae = new_sae(lm.shape.d_model, num_latents=LATENTS, k=K, seed=3)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # biases that are not 0, so the reference below must apply them
        sae.encoder.bias.copy_(0.05 * torch.randn(LATENTS, generator=g))
        sae.b_dec.copy_(0.05 * torch.randn(lm.shape.d_model, generator=g))
    path = tmp_path_factory.mktemp("set")
    (path / "labels.json").write_text(json.dumps([{"feature": i, "label": f"f{i}"} for i in range(LATENTS)]))
    return Features(sae=sae, model=lm.name, layer=LAYER, hook="resid_post", name="tiny-l1", path=path)


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 256, (5, 12), generator=torch.Generator().manual_seed(7))


def _stats(s: MF.FeatureShift) -> tuple:
    return s.freq_base, s.freq_tuned, s.mean_base, s.mean_tuned


def test_a_model_against_itself_changes_nothing(models, feats, windows):
    lm, _, m = models
    for tuned in (lm, m["same"]):
        s = MF.features_shift(lm, tuned, feats, windows, batch_size=2)
        assert s.freq_base == s.freq_tuned and s.mean_base == s.mean_tuned
        assert s.appeared == [] and s.vanished == [] and s.shifted == []
        assert s.firing_base == s.firing_tuned > 0 and s.positions == 5 * 11
        assert s.hook == "blocks.1.hook_resid_post" and s.to_dict()["features"] == "tiny-l1"


def test_a_change_above_the_hook_changes_nothing_and_one_below_moves_features(models, feats, windows):
    lm, _, m = models
    same = MF.features_shift(lm, m["same"], feats, windows, batch_size=2)
    above = MF.features_shift(lm, m["above"], feats, windows, batch_size=2)
    assert _stats(above) == _stats(same) and above.shifted == above.appeared == above.vanished == []
    below = MF.features_shift(lm, m["below"], feats, windows, batch_size=2, top=4)
    assert below.freq_base == same.freq_base and below.mean_base == same.mean_base  # the base reads the same
    assert below.mean_tuned != below.mean_base and len(below.shifted) == 4
    moved = [abs(r["mean_tuned"] - r["mean_base"]) for r in below.shifted]
    assert moved == sorted(moved, reverse=True) and moved[-1] > 0
    assert all(r["label"] == f"f{r['feature']}" for r in below.shifted + below.appeared + below.vanished)
    # batching changes nothing but the order of the sums
    one = MF.features_shift(lm, m["below"], feats, windows, batch_size=5, top=4)
    assert one.freq_tuned == below.freq_tuned
    assert torch.allclose(torch.tensor(one.mean_tuned), torch.tensor(below.mean_tuned), atol=1e-6)


def _by_hand(path, sae, windows) -> tuple[torch.Tensor, torch.Tensor]:
    """[M] frequency and mean activation over positions >= 1, from a fresh transformers model's
    hidden states and the autoencoder's weights: relu(W_enc (x - b_dec) + b_enc), its top k."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        x = hf(input_ids=windows, output_hidden_states=True).hidden_states[LAYER + 1][:, 1:]  # [N, W-1, d]
        pre = torch.relu((x - sae.b_dec) @ sae.encoder.weight.T + sae.encoder.bias)  # [N, W-1, M]
        top = torch.topk(pre, K, dim=-1)
        z = torch.zeros_like(pre).scatter_(-1, top.indices, top.values).reshape(-1, pre.shape[-1]).double()
    return (z > 0).double().mean(0), z.mean(0)


def test_the_statistics_equal_transformers_hidden_states_encoded_by_hand(models, feats, windows):
    lm, root, m = models
    s = MF.features_shift(lm, m["below"], feats, windows, batch_size=2, top=1000)
    fb, mb = _by_hand(root / "same", feats.sae, windows)
    ft, mt = _by_hand(root / "below", feats.sae, windows)
    for got, want in ((s.freq_base, fb), (s.freq_tuned, ft), (s.mean_base, mb), (s.mean_tuned, mt)):
        assert torch.allclose(torch.tensor(got, dtype=torch.float64), want, atol=1e-5, rtol=0)
    assert s.firing_base == int((fb > 0).sum()) and s.firing_tuned == int((ft > 0).sum())
    assert {r["feature"] for r in s.appeared} == set(((ft > 0) & (fb == 0)).nonzero()[:, 0].tolist())
    assert {r["feature"] for r in s.vanished} == set(((fb > 0) & (ft == 0)).nonzero()[:, 0].tolist())
    assert s.appeared or s.vanished  # a random set of 256 latents, 8 a position: some change sides
    freqs = [r["freq_tuned"] for r in s.appeared]
    assert freqs == sorted(freqs, reverse=True)


def _one_sentence(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg.endswith(".") and ". " not in msg and "\n" not in msg
    return msg


def test_a_set_of_another_width_model_or_no_windows_is_refused(models, feats, windows):
    lm, _, m = models
    narrow = Features(sae=new_sae(32, num_latents=64, k=4), model=lm.name, layer=LAYER, hook="resid_post")
    with pytest.raises(FeatureError) as e:
        MF.features_shift(lm, m["below"], narrow, windows)
    assert "width 32" in _one_sentence(e)
    other = Features(sae=feats.sae, model="smollm2-135m-instruct", layer=LAYER, hook="resid_post", name="x")
    with pytest.raises(FeatureError) as e:
        MF.features_shift(lm, m["below"], other, windows)
    assert "trained on smollm2-135m-instruct" in _one_sentence(e)
    with pytest.raises(SettingsError) as e:
        MF.features_shift(lm, m["below"], feats, windows[:0])
    assert "no windows" in _one_sentence(e)
