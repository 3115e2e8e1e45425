"""model_core.interp.crosscoder on the tiny random Llama: the activations it trains on are
transformers' own hidden states; a crosscoder over a model and itself finds only shared latents
(r = 0.5 up to noise), each latent's two decoders, started as independent random directions, meeting; when the
tuned model's layer-0 MLP is replaced by four strong units, tuned-only latents appear along those
units' output directions; a saved crosscoder loads back equal; models of different widths are refused."""

from __future__ import annotations

import pytest
import torch

from model_core import load_model
from model_core.interp import crosscoder as C

TINY = "random-llama-tiny"
UNITS = 4  # MLP units of the changed model
# small and seeded: 64 latents, windows of 32 tokens, 4 per step; a few seconds a run on two CPU cores
RUN = {"max_tokens": 16_384, "num_latents": 64, "l1_coeff": 0.3, "lr": 3e-3, "batch_size": 4, "context": 32,
       "eval_tokens": 2048, "seed": 0}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The tiny model saved twice by transformers; in the second, layer 0's MLP keeps only UNITS
    units (gate = up, so each writes silu(z) z >= -0.28 along its own down_proj column), much
    stronger than the residual stream they add to. Returns (same, changed, the UNITS directions)."""
    lm = load_model(TINY)
    root = tmp_path_factory.mktemp("crosscoder")
    for name in ("same", "changed"):
        lm.model.save_pretrained(root / name)
        lm.tokenizer.save_pretrained(root / name)
    changed = load_model(str(root / "changed"))
    mlp = changed.model.model.layers[0].mlp
    d = lm.shape.d_model
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        gate = torch.zeros_like(mlp.gate_proj.weight)
        gate[:UNITS] = torch.randn(UNITS, d, generator=g) * 3 / d**0.5
        mlp.gate_proj.weight.copy_(gate)
        mlp.up_proj.weight.copy_(gate)
        v = torch.randn(d, UNITS, generator=g)
        v = v / v.norm(dim=0)  # [d, UNITS] unit columns
        down = torch.zeros_like(mlp.down_proj.weight)
        down[:, :UNITS] = v / _unit_spread(changed, mlp)  # each unit writes with spread 1 (the stream's ~0.2)
        mlp.down_proj.weight.copy_(down)
    return load_model(str(root / "same")), changed, v


def _unit_spread(lm, mlp) -> torch.Tensor:
    """[UNITS] the standard deviation of each unit's value (the down_proj input) over held-out text."""
    from model_core.interp.features_corpus import eval_windows

    got = {}
    h = mlp.down_proj.register_forward_hook(lambda m, i, o: got.update(hidden=i[0]))
    try:
        lm.model(input_ids=eval_windows(lm.tokenizer, "builtin", RUN["eval_tokens"], RUN["context"]))
    finally:
        h.remove()
    return got["hidden"][:, 1:, :UNITS].reshape(-1, UNITS).std(0)


def test_activations_are_transformers_hidden_states(pair):
    same, changed, _ = pair
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    for layer in (0, 1):
        hb, ht, _ = C.check_pair(same, changed, layer)
        x = C.paired_activations(same, changed, (hb, ht), ids)  # [2 * 11, 2, d]
        with torch.no_grad():
            ref = [m.model(input_ids=ids, output_hidden_states=True).hidden_states[layer + 1][:, 1:]
                   for m in (same, changed)]  # [2, 11, d] each, position 0 left out
        assert x.shape == (22, 2, same.shape.d_model)
        torch.testing.assert_close(x[:, 0], ref[0].reshape(-1, ref[0].shape[-1]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x[:, 1], ref[1].reshape(-1, ref[1].shape[-1]), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(x[:, 0], x[:, 1])  # the changed MLP shows at layer 1 too


def test_a_model_against_itself_has_only_shared_latents(pair):
    same, _, _ = pair
    cc, r = C.train_crosscoder(same, same, 0, **{**RUN, "max_tokens": 8192})
    fires = _live(cc, same, 0)
    assert int((~fires).sum()) == r.dead < r.num_latents // 4
    live = torch.tensor(r.r)[fires]
    assert r.counts["base_only"] == 0 and r.counts["tuned_only"] == 0
    assert r.counts["shared"] == len(live)
    assert float((live - 0.5).abs().max()) < 0.05
    # each latent's two decoders started as independent random directions (cosine ~0) and met
    cos = torch.nn.functional.cosine_similarity(cc.W_dec[:, 0], cc.W_dec[:, 1], dim=-1)[fires]
    assert float(cos.min()) > 0.9
    assert r.fve["base"] == pytest.approx(r.fve["tuned"], abs=1e-3) and r.fve["base"] > 0.5
    assert sum(r.histogram["counts"]) == len(live)
    assert r.memory["peak_rows"] <= r.memory["limit_rows"] == RUN["batch_size"] * RUN["context"]
    assert r.steps == 8192 // (RUN["batch_size"] * RUN["context"])


def test_a_strongly_changed_mlp_gives_tuned_only_latents_along_its_units(pair):
    same, changed, v = pair
    cc, r = C.train_crosscoder(same, changed, 0, **{**RUN, "max_tokens": 24_576})  # the L1 needs the steps
    rel = torch.tensor(r.r)
    assert r.counts["tuned_only"] >= UNITS and r.fve["tuned"] > 0.8
    cos = torch.nn.functional.normalize(cc.W_dec[:, 1], dim=-1) @ v  # [F, UNITS]: tuned decoders vs the units
    best = cos.max(0)
    # each changed unit's output direction is the tuned decoder of a latent, and that latent is tuned-only
    assert float(best.values.min()) > 0.95, best.values
    assert float(rel[best.indices].min()) > C.TUNED_ONLY, rel[best.indices]
    # the top tuned-only latents are reported with their contexts, most used first
    top = r.top["tuned_only"]
    assert top and all(t["r"] > C.TUNED_ONLY and t["contexts"] for t in top)
    assert [t["mass"] for t in top] == sorted((t["mass"] for t in top), reverse=True)
    acts = [c["activation"] for c in top[0]["contexts"]]
    assert acts == sorted(acts, reverse=True) and all(c["position"] > 0 for c in top[0]["contexts"])


def test_save_load_round_trip(pair, tmp_path):
    same, changed, _ = pair
    cc, r = C.train_crosscoder(same, changed, 1, **{**RUN, "max_tokens": 2048, "eval_tokens": 256})
    C.save(cc, tmp_path / "cc", {"base": r.base, "tuned": r.tuned, "layer": 1})
    back, cfg = C.load(tmp_path / "cc")
    assert cfg["layer"] == 1 and cfg["num_latents"] == 64 and cfg["d"] == same.shape.d_model
    for k, t in cc.state_dict().items():
        assert torch.equal(t, back.state_dict()[k]), k
    x = torch.randn(5, 2, same.shape.d_model, generator=torch.Generator().manual_seed(0))
    assert torch.equal(back.encode(x), cc.encode(x)) and torch.equal(C.relative_norms(back), C.relative_norms(cc))


def test_models_of_different_widths_are_refused(pair, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    same, _, _ = pair
    cfg = LlamaConfig(**{**same.model.config.to_dict(), "hidden_size": 32, "head_dim": 8})
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "narrow")
    same.tokenizer.save_pretrained(tmp_path / "narrow")
    narrow = load_model(str(tmp_path / "narrow"))
    with pytest.raises(C.CrosscoderError, match="width 64 and .* 32"):
        C.train_crosscoder(same, narrow, 0, **RUN)


def _live(cc, lm, layer: int) -> torch.Tensor:
    """[F] bool: whether each latent fires anywhere on the held-out windows the run scored."""
    from model_core.interp.features_corpus import eval_windows

    hb, ht, _ = C.check_pair(lm, lm, layer)
    w = eval_windows(lm.tokenizer, "builtin", RUN["eval_tokens"], RUN["context"])
    with torch.no_grad():
        x = C.paired_activations(lm, lm, (hb, ht), w) * cc.scales[None, :, None]
        return (cc.encode(x) > 0).any(0)
